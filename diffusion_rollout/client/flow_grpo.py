"""flow_grpo's SD3 ``pipeline_with_logprob``, answered by a rollout server.

    # from flow_grpo.diffusers_patch.sd3_pipeline_with_logprob import pipeline_with_logprob
    from diffusion_rollout.client.flow_grpo import pipeline_with_logprob
    from diffusion_rollout.client.served_pipeline import ServedPipeline

    pipeline = ServedPipeline(pipeline, RolloutClient(url))      # once, after the LoRA is added
    images, latents, log_probs = pipeline_with_logprob(pipeline, prompt_embeds=..., ...)  # unchanged

Design decisions:

- **Two first arguments.** A :class:`~diffusion_rollout.client.served_pipeline.ServedPipeline` (the
  trainer's own pipeline, wrapped): flow_grpo's script runs unchanged; before the call the server is
  brought to the trainer's weights, after it the trainer's scheduler holds the schedule the server
  used and the results are on the pipeline's device in flow_grpo's dtypes (``x_T`` in the
  embeddings' dtype, later latents and log-probs in float32). Or a
  :class:`~diffusion_rollout.client.RolloutClient` (the earlier form): results stay on the CPU in the
  server's dtype, and the trainer sets its own scheduler. The other arguments keep flow_grpo's
  names and defaults, and the result its layout: ``images``, ``all_latents`` (``T + 1`` tensors
  ``[B, C, h, w]``: the latent entering each step, then the final one) and ``all_log_probs`` (``T``
  tensors ``[B]``), prompt-major like diffusers.
- **Embeddings are the conditioning** (what train_sd3 passes: ``prompt_embeds``,
  ``pooled_prompt_embeds`` and the negatives, encoded with its own 128 T5 tokens): they travel to
  the server (msgpack, cast to the server's dtype; rows that repeat a prompt travel once, as one
  request of several outputs) and are used as the stock pipeline uses them, so the trainer's
  recomputation conditions on exactly what sampling did. The negatives are needed with CFG (``guidance_scale > 1``) and dropped without it (the stock pipeline
  ignores them then). ``prompt`` text still works (the server encodes it, ``max_sequence_length``
  tokens); text and embeddings together are refused, as diffusers refuses them.
- **The same step math.** The stochastic steps are ``sde`` with ``noise_level`` as
  ``rollout_noise_level`` and the ``gaussian`` log-prob form, which is flow_grpo's
  ``sde_step_with_logprob`` (docs/math.md), scored on the stored next latent: what flow_grpo's trainer
  recomputes from ``latents[:, j + 1]``. ``noise_level=0`` or ``deterministic=True`` (flow_grpo's
  evaluation calls) run every step as ODE with log-probs exactly 0 (flow_grpo's own would not be
  finite, or not be used). ``sigmas`` mean what they mean to diffusers: the scheduler's shift is
  applied to them (``sigmas_are_shifted=False``).
- **Flow-GRPO-Fast windows.** ``sde_window=(start, stop)`` (or ``rollout_sde_step_indices``) makes only
  those steps stochastic; the others run ODE with log-prob 0. The layout stays the full ``T`` steps
  (Fast's pipeline returns only the window: slice ``[start:stop + 1]`` and ``[start:stop]``).
- **Seeds** (``client/flow_grpo_seeds.py``): a seed that occurs once fixes its image's ``x_T`` and
  step noise (one generator: ``seed + k`` for image ``k``); a seed that repeats (flow_grpo's
  ``same_latent``) gives those images one shared ``x_T`` and their own step noise. Without a
  generator the server picks seeds and returns them.
- **Refused, not ignored**, because the server cannot honour them: ``latents``, ``callback_on_step_end``,
  ``joint_attention_kwargs``, ``clip_skip``, ``skip_guidance_layers``, ``prompt_2``/``prompt_3`` and
  their negatives, a ``solver`` other than ``"flow"``, a ``model_type`` other than ``"sd3"``, and any
  argument this function does not know (named in the error, never a ``TypeError``).
  ``return_dict``, ``skip_layer_guidance_scale`` (without layers) and
  ``callback_on_step_end_tensor_inputs`` (without a callback) change nothing in flow_grpo either.
- ``extra_fields`` are further ``generate`` fields (e.g. ``rollout_return_denoising_env=True`` for
  replay); ``return_outputs=True`` appends the :class:`~diffusion_rollout.client.RolloutOutput` list
  (same order) as a fourth element. Not exported from ``diffusion_rollout.client``: it is a
  compatibility shim, imported by its module path.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from diffusion_rollout.client.flow_grpo_seeds import generator_seeds, plan_requests
from diffusion_rollout.client.results import RolloutOutput
from diffusion_rollout.client.served_pipeline import ServedPipeline
from diffusion_rollout.client.sync_client import RolloutClient

__all__ = ["RolloutClient", "ServedPipeline", "pipeline_with_logprob", "sample"]

EMBEDDING_NAMES = (
    "prompt_embeds",
    "pooled_prompt_embeds",
    "negative_prompt_embeds",
    "negative_pooled_prompt_embeds",
)


def served_target(pipeline: Any) -> tuple[RolloutClient, ServedPipeline | None]:
    if isinstance(pipeline, ServedPipeline):
        return pipeline.client, pipeline
    if isinstance(pipeline, RolloutClient):
        return pipeline, None
    raise TypeError(
        "the first argument is the trainer's pipeline wrapped as ServedPipeline(pipeline, client), or a "
        f"RolloutClient; not {type(pipeline).__name__}"
    )


def refuse(
    values: Mapping[str, Any], unknown: Mapping[str, Any], *, allowed: Mapping[str, tuple[tuple, str]]
) -> None:
    """``ValueError`` naming the first argument the server cannot honour, and what to do instead."""
    for name in unknown:
        hint = "pass sde_window=(start, stop)" if "window" in name else "leave it out"
        raise ValueError(
            f"{name} is not supported by the served pipeline_with_logprob (the rollout server cannot honour "
            f"it): {hint}"
        )
    for name, value in values.items():
        if name in allowed:
            values_ok, what_to_do = allowed[name]
            if value not in values_ok:
                raise ValueError(f"{name}={value!r} is not supported: {what_to_do}")
        elif value is not None:
            raise ValueError(f"{name} is not supported: the rollout server cannot honour it")


def rows_of(name: str, tensor: torch.Tensor | None, rows: int) -> list[torch.Tensor | None]:
    """One ``[1, ...]`` slice per prompt row (a single row is shared by all)."""
    if tensor is None:
        return [None] * rows
    if tensor.shape[0] not in (1, rows):
        raise ValueError(f"{name} has {tensor.shape[0]} rows for {rows} prompts")
    return [tensor[i : i + 1] if tensor.shape[0] == rows else tensor[:1] for i in range(rows)]


def conditioning_rows(
    served: ServedPipeline | None, embeds: Mapping[str, torch.Tensor | None], rows: int
) -> list[dict[str, torch.Tensor]]:
    """Per prompt row, the embeddings a request carries: in the server's dtype on the CPU."""
    cast = served.to_server if served is not None else (lambda t: t.detach().cpu())
    sliced = {name: rows_of(name, t, rows) for name, t in embeds.items() if t is not None}
    return [{name: cast(parts[i]) for name, parts in sliced.items()} for i in range(rows)]


def _identity(cond: Mapping[str, Any]) -> tuple:
    """What makes two rows' conditioning the same: texts, or the tensors' dtype, shape and bytes."""
    parts = []
    for name, value in sorted(cond.items()):
        if isinstance(value, torch.Tensor):
            raw = value.contiguous().view(torch.uint8).numpy().tobytes()
            value = (str(value.dtype), tuple(value.shape), hashlib.sha256(raw).hexdigest())
        parts.append((name, value))
    return tuple(parts)


def images_of(outs: list[RolloutOutput], output_type: str) -> Any:
    images = torch.stack([o.generated_output for o in outs])  # type: ignore[misc]
    if output_type in ("pt", "latent"):
        return images
    arrays = images.permute(0, 2, 3, 1).float().numpy()
    if output_type == "np":
        return arrays
    from PIL import Image

    return [Image.fromarray((a * 255).round().astype("uint8")) for a in arrays]


def step_fields(
    noise_level: float, deterministic: bool, sde_window, rollout_sde_step_indices
) -> dict[str, Any]:
    """The step kinds of flow_grpo's call: ``sde`` with the gaussian log-prob, or ODE throughout."""
    if sde_window is not None:
        if rollout_sde_step_indices is not None:
            raise ValueError("pass sde_window or rollout_sde_step_indices, not both")
        rollout_sde_step_indices = range(*sde_window)
    if rollout_sde_step_indices is not None:
        rollout_sde_step_indices = list(rollout_sde_step_indices)
    stochastic = noise_level != 0 and not deterministic and rollout_sde_step_indices != []
    return {
        "rollout_sde_type": "sde" if stochastic else "ode",
        "rollout_noise_level": noise_level,
        "rollout_log_prob_form": "gaussian" if stochastic else "no_const",
        "rollout_sde_step_indices": rollout_sde_step_indices if stochastic else None,
        "rollout_return_dit_trajectory": True,
    }


def sample(
    pipeline: ServedPipeline | RolloutClient,
    conditioning: list[dict[str, Any]],
    *,
    per_row: int,
    generator: Any,
    fields: dict[str, Any],
    extra_fields: Mapping[str, Any] | None,
    output_type: str,
    x_t_dtype: torch.dtype | None,
    return_outputs: bool,
) -> tuple[Any, ...]:
    """One sampling call of flow_grpo's shape (SD3 and FLUX): requests per prompt row, answers in
    flow_grpo's layout; with a :class:`ServedPipeline`, weights synced first and results handed
    over as flow_grpo's function returns them."""
    client, served = served_target(pipeline)
    if output_type not in ("pil", "pt", "np", "latent"):
        raise ValueError(f"output_type must be 'pil', 'pt', 'np' or 'latent', not {output_type!r}")
    rows = len(conditioning)
    seeds, generator_device = generator_seeds(generator, rows * per_row)
    plan = plan_requests([_identity(cond) for cond in conditioning], seeds, per_row)
    items = [{**conditioning[row], **request} for row, request, _ in plan]
    fields = {
        **fields,
        "generator_device": generator_device,
        "output_dtype": "float32",
        "return_generated_output": output_type != "latent",
    }
    taken = {k for k, v in fields.items() if v is not None} | {k for item in items for k in item}
    clash = set(extra_fields or ()) & taken
    if clash:
        raise ValueError(f"extra_fields {sorted(clash)} are set from this function's own arguments")
    fields = {"rollout_debug_mode": False, **fields, **(extra_fields or {})}
    if served is not None:
        served.sync_weights()
    answers = client.generate_many(items, **fields)
    outs: list[RolloutOutput] = [None] * (rows * per_row)  # type: ignore[list-item]
    for (_, _, places), group in zip(plan, answers, strict=True):
        for place, out in zip(places, group, strict=True):
            outs[place] = out

    trajectories = [o.dit_trajectory for o in outs]
    steps = trajectories[0].num_steps  # type: ignore[union-attr]
    all_latents = [torch.stack([t.latent(i) for t in trajectories]) for i in range(steps + 1)]  # type: ignore[union-attr]
    all_log_probs = [torch.stack([o.rollout_log_probs[i] for o in outs]) for i in range(steps)]  # type: ignore[index]
    images = images_of(outs, output_type)
    if served is not None:
        served.adopt_schedule(trajectories[0].sigmas)  # type: ignore[union-attr]
        images, all_latents, all_log_probs = served.to_trainer(
            images, all_latents, all_log_probs, x_t_dtype or torch.float32
        )
    result = (images, all_latents, all_log_probs)
    return (*result, outs) if return_outputs else result


def pipeline_with_logprob(
    pipeline: ServedPipeline | RolloutClient,
    prompt: str | list[str] | None = None,
    prompt_2: str | list[str] | None = None,
    prompt_3: str | list[str] | None = None,
    height: int | None = None,
    width: int | None = None,
    num_inference_steps: int = 28,
    sigmas: Sequence[float] | None = None,
    guidance_scale: float = 7.0,
    negative_prompt: str | list[str] | None = None,
    negative_prompt_2: str | list[str] | None = None,
    negative_prompt_3: str | list[str] | None = None,
    num_images_per_prompt: int = 1,
    generator: torch.Generator | list[torch.Generator] | None = None,
    latents: torch.Tensor | None = None,
    prompt_embeds: torch.Tensor | None = None,
    negative_prompt_embeds: torch.Tensor | None = None,
    pooled_prompt_embeds: torch.Tensor | None = None,
    negative_pooled_prompt_embeds: torch.Tensor | None = None,
    output_type: str = "pil",
    return_dict: bool = True,
    joint_attention_kwargs: Mapping[str, Any] | None = None,
    clip_skip: int | None = None,
    callback_on_step_end: Any = None,
    callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
    max_sequence_length: int = 256,
    skip_guidance_layers: Sequence[int] | None = None,
    skip_layer_guidance_scale: float = 2.8,
    noise_level: float = 0.7,
    deterministic: bool = False,
    solver: str = "flow",
    model_type: str | None = "sd3",
    *,
    sde_window: tuple[int, int] | None = None,
    rollout_sde_step_indices: Sequence[int] | None = None,
    extra_fields: Mapping[str, Any] | None = None,
    return_outputs: bool = False,
    **unknown: Any,
) -> tuple[Any, ...]:
    """``(images, all_latents, all_log_probs)`` of one batch, generated by the server.

    ``images``: ``[B, 3, H, W]`` floats in [0, 1] (``"pt"``), ``[B, H, W, 3]`` (``"np"``), PIL images
    (``"pil"``) or the final latents (``"latent"``); ``B = rows * num_images_per_prompt``, rows being
    the prompts or the rows of ``prompt_embeds``.
    """
    _, served = served_target(pipeline)
    refuse(
        {
            "prompt_2": prompt_2,
            "prompt_3": prompt_3,
            "negative_prompt_2": negative_prompt_2,
            "negative_prompt_3": negative_prompt_3,
            "latents": latents,
            "joint_attention_kwargs": joint_attention_kwargs,
            "clip_skip": clip_skip,
            "callback_on_step_end": callback_on_step_end,
            "skip_guidance_layers": skip_guidance_layers,
            "solver": solver,
            "model_type": model_type,
        },
        unknown,
        allowed={
            "solver": (("flow",), "the server runs flow_grpo's 'flow' SDE step; for other step kinds use "
                       "RolloutClient.generate(rollout_sde_type=...)"),
            "model_type": (("sd3", None), "this is the SD3 function; for FLUX import pipeline_with_logprob "
                           "from diffusion_rollout.client.flow_grpo_flux"),
        },
    )  # fmt: skip
    fields: dict[str, Any] = {
        "width": width,
        "height": height,
        "num_inference_steps": num_inference_steps,
        "guidance_scale": guidance_scale,
        "sigmas": sigmas,
        "sigmas_are_shifted": False if sigmas is not None else None,
        **step_fields(noise_level, deterministic, sde_window, rollout_sde_step_indices),
    }
    if prompt is not None and prompt_embeds is not None:
        raise ValueError("pass prompt or prompt_embeds, not both (diffusers refuses both too)")
    if prompt_embeds is not None:
        conditioning = _sd3_embeddings(
            served, prompt_embeds, pooled_prompt_embeds, negative_prompt_embeds,
            negative_pooled_prompt_embeds, negative_prompt, cfg=guidance_scale > 1,
        )  # fmt: skip
        x_t_dtype = prompt_embeds.dtype  # flow_grpo's prepare_latents draws in the embeddings' dtype
    else:
        conditioning, x_t_dtype = text_conditioning(
            prompt, negative_prompt, max_sequence_length, served, fields
        )
    return sample(
        pipeline, conditioning, per_row=num_images_per_prompt, generator=generator, fields=fields,
        extra_fields=extra_fields, output_type=output_type, x_t_dtype=x_t_dtype, return_outputs=return_outputs,
    )  # fmt: skip


def text_conditioning(
    prompt: str | list[str] | None, negative_prompt: Any, max_sequence_length: int, served: Any, fields: dict
) -> tuple[list[dict[str, Any]], torch.dtype | None]:
    """Text for the server to encode (no embeddings were given): the rows and the ``x_T`` dtype, the
    pipeline's own; ``fields`` gets the encoder's token count."""
    if prompt is None:
        raise ValueError("prompt or prompt_embeds is required")
    fields["max_sequence_length"] = max_sequence_length
    return text_rows(prompt, negative_prompt), (served.transformer.dtype if served is not None else None)


def text_rows(prompt: str | list[str], negative_prompt: str | list[str] | None) -> list[dict[str, Any]]:
    """One conditioning row per prompt (the server encodes the text), with its negative if any."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    negatives = (
        list(negative_prompt)
        if isinstance(negative_prompt, (list, tuple))
        else [negative_prompt] * len(prompts)
    )
    if len(negatives) != len(prompts):
        raise ValueError(f"negative_prompt has {len(negatives)} entries for {len(prompts)} prompts")
    rows = [{"prompt": p, "negative_prompt": n} for p, n in zip(prompts, negatives, strict=True)]
    return [{k: v for k, v in row.items() if v is not None} for row in rows]


def _sd3_embeddings(served, pe, ppe, npe, nppe, negative_prompt, *, cfg: bool) -> list[dict[str, Any]]:
    if ppe is None:
        raise ValueError("pooled_prompt_embeds is required with prompt_embeds (as in diffusers)")
    if negative_prompt is not None:
        raise ValueError("negative_prompt text with prompt_embeds: pass negative_prompt_embeds instead")
    if cfg and (npe is None or nppe is None):
        raise ValueError(
            "negative_prompt_embeds and negative_pooled_prompt_embeds are required with prompt_embeds when "
            "guidance_scale > 1: encode the negative prompt ('' in flow_grpo) with the pipeline's encode_prompt"
        )
    negatives = {"negative_prompt_embeds": npe, "negative_pooled_prompt_embeds": nppe} if cfg else {}
    embeds = {"prompt_embeds": pe, "pooled_prompt_embeds": ppe, **negatives}
    return conditioning_rows(served, embeds, pe.shape[0])
