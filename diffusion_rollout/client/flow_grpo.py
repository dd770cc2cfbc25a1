"""flow_grpo's SD3 ``pipeline_with_logprob``, answered by a rollout server.

    # from flow_grpo.diffusers_patch.sd3_pipeline_with_logprob import pipeline_with_logprob
    from diffusion_rollout.client.flow_grpo import pipeline_with_logprob

    images, latents, log_probs = pipeline_with_logprob(client, prompt=prompts, output_type="pt", ...)

Design decisions:

- **A client replaces ``self``.** flow_grpo's function is a pipeline method body that takes the
  diffusers pipeline first; here the pipeline lives in the server, so the first argument is a
  :class:`~diffusion_rollout.client.RolloutClient`. The other arguments keep flow_grpo's names and
  defaults, and the result its layout: ``images``, ``all_latents`` (``T + 1`` tensors ``[B, C, h, w]``:
  the latent entering each step, then the final one) and ``all_log_probs`` (``T`` tensors ``[B]``),
  prompt-major like diffusers. A training script switches by changing one import and passing a client.
- **The same step math.** The stochastic steps are ``sde`` with ``noise_level`` as ``rollout_noise_level`` and
  the ``gaussian`` log-prob form, which is flow_grpo's ``sde_step_with_logprob`` (math.md), scored on
  the stored next latent: what flow_grpo's trainer recomputes from ``latents[:, j + 1]``.
  ``noise_level=0`` (flow_grpo's evaluation call) runs every step as ODE with log-probs exactly 0
  (flow_grpo's own would not be finite). ``sigmas`` mean what they mean to diffusers: the scheduler's
  shift is applied to them (``sigmas_are_shifted=False``).
- **Flow-GRPO-Fast windows.** ``sde_window=(start, stop)`` (or ``rollout_sde_step_indices``) makes only
  those steps stochastic; the others run ODE with log-prob 0. The layout stays the full ``T`` steps
  (Fast's pipeline returns only the window: slice ``[start:stop + 1]`` and ``[start:stop]``).
- **The server encodes the prompt.** ``prompt`` is required. ``prompt_embeds`` and the other
  embeddings, which flow_grpo's script passes for its own training step, are accepted alongside it
  and ignored (the server's text encoders hold the same weights); embeddings alone are refused.
- **Refused, not ignored**, because the server cannot honour them: ``latents``, ``callback_on_step_end``,
  ``joint_attention_kwargs``, ``clip_skip``, ``skip_guidance_layers``, ``prompt_2``/``prompt_3`` and
  their negatives. ``return_dict``, ``skip_layer_guidance_scale`` (without layers) and
  ``callback_on_step_end_tensor_inputs`` (without a callback) change nothing in flow_grpo either.
- **The trainer's scheduler.** flow_grpo's pipeline call also set ``pipeline.scheduler``'s timesteps,
  which its training step reads; after the switch call ``pipeline.scheduler.set_timesteps(T)`` in the
  trainer (the server's default schedule is the pipeline's own), or read the schedule the server used
  from ``return_outputs`` (``dit_trajectory.timesteps`` / ``sigmas``).
- **Seeds.** A generator gives its ``initial_seed()`` (one generator: ``seed + k`` for output ``k``; a
  list: one per output) and its device. Unlike flow_grpo, where the generator seeds only ``x_T``, a
  seed fixes a whole sample here (``x_T`` and step noise), so a rollout can be repeated; equal seeds in
  one call would give identical samples and are refused. Without a generator the server picks.
- ``extra_fields`` are further ``generate`` fields (e.g. ``rollout_return_denoising_env=True`` for
  replay, ``initial_noise_seed`` for groups sharing ``x_T``); ``return_outputs=True`` appends the
  :class:`~diffusion_rollout.client.RolloutOutput` list (same order) as a fourth element. Not exported
  from ``diffusion_rollout.client``: it is a compatibility shim, imported by its module path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from diffusion_rollout.client.results import RolloutOutput
from diffusion_rollout.client.sync_client import RolloutClient

__all__ = ["pipeline_with_logprob"]


def _seeds(generator: Any, total: int) -> tuple[list[int] | None, str | None]:
    """The per-image seeds and the generator device of diffusers' ``generator`` argument."""
    if generator is None:
        return None, None
    gens = list(generator) if isinstance(generator, (list, tuple)) else [generator]
    if len(gens) == 1:
        seeds = [gens[0].initial_seed() + k for k in range(total)]
    elif len(gens) == total:
        seeds = [g.initial_seed() for g in gens]
    else:
        raise ValueError(f"got {len(gens)} generators for {total} images: pass one, or one per image")
    if len(set(seeds)) != len(seeds):
        raise ValueError(
            "generator: seeds repeat within one call; a seed fixes a whole sample here (x_T and step "
            "noise), so those samples would be identical. For a group sharing x_T pass the prompt once "
            "with num_images_per_prompt=G and extra_fields={'initial_noise_seed': s}"
        )
    devices = {g.device.type for g in gens}
    if len(devices) != 1:
        raise ValueError(f"generator: all generators must be on one device, got {sorted(devices)}")
    return seeds, devices.pop()


def _images(outs: list[RolloutOutput], output_type: str) -> Any:
    images = torch.stack([o.generated_output for o in outs])  # type: ignore[misc]
    if output_type in ("pt", "latent"):
        return images
    arrays = images.permute(0, 2, 3, 1).float().numpy()
    if output_type == "np":
        return arrays
    from PIL import Image

    return [Image.fromarray((a * 255).round().astype("uint8")) for a in arrays]


def pipeline_with_logprob(
    client: RolloutClient,
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
    *,
    sde_window: tuple[int, int] | None = None,
    rollout_sde_step_indices: Sequence[int] | None = None,
    extra_fields: Mapping[str, Any] | None = None,
    return_outputs: bool = False,
) -> tuple[Any, ...]:
    """``(images, all_latents, all_log_probs)`` of one batch, generated by the server behind ``client``.

    ``images``: ``[B, 3, H, W]`` floats in [0, 1] (``"pt"``), ``[B, H, W, 3]`` (``"np"``), PIL images
    (``"pil"``) or the final latents (``"latent"``); ``B = len(prompts) * num_images_per_prompt``.
    """
    if not isinstance(client, RolloutClient):
        raise TypeError(
            f"the first argument is a RolloutClient (the server holds the pipeline), not {type(client).__name__}"
        )
    refused = {
        "prompt_2": prompt_2,
        "prompt_3": prompt_3,
        "negative_prompt_2": negative_prompt_2,
        "negative_prompt_3": negative_prompt_3,
        "latents": latents,
        "joint_attention_kwargs": joint_attention_kwargs,
        "clip_skip": clip_skip,
        "callback_on_step_end": callback_on_step_end,
        "skip_guidance_layers": skip_guidance_layers,
    }
    for name, value in refused.items():
        if value is not None:
            raise ValueError(f"{name} is not supported: the rollout server cannot honour it")
    if prompt is None:
        given = "prompt_embeds" if prompt_embeds is not None else "nothing"
        raise ValueError(f"prompt is required (got {given}): the server encodes the prompt text itself")
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if prompt_embeds is not None and prompt_embeds.shape[0] != len(prompts):
        raise ValueError(f"prompt_embeds has {prompt_embeds.shape[0]} rows for {len(prompts)} prompts")
    negatives = (
        list(negative_prompt)
        if isinstance(negative_prompt, (list, tuple))
        else [negative_prompt] * len(prompts)
    )
    if len(negatives) != len(prompts):
        raise ValueError(f"negative_prompt has {len(negatives)} entries for {len(prompts)} prompts")
    if output_type not in ("pil", "pt", "np", "latent"):
        raise ValueError(f"output_type must be 'pil', 'pt', 'np' or 'latent', not {output_type!r}")
    if sde_window is not None:
        if rollout_sde_step_indices is not None:
            raise ValueError("pass sde_window or rollout_sde_step_indices, not both")
        rollout_sde_step_indices = range(*sde_window)
    if rollout_sde_step_indices is not None:
        rollout_sde_step_indices = list(rollout_sde_step_indices)

    n = num_images_per_prompt
    seeds, generator_device = _seeds(generator, len(prompts) * n)
    stochastic = noise_level != 0 and rollout_sde_step_indices != []
    fields: dict[str, Any] = {
        "num_outputs_per_prompt": n,
        "generator_device": generator_device,
        "width": width,
        "height": height,
        "num_inference_steps": num_inference_steps,
        "guidance_scale": guidance_scale,
        "max_sequence_length": max_sequence_length,
        "rollout_sde_type": "sde" if stochastic else "ode",
        "rollout_noise_level": noise_level,
        "rollout_log_prob_form": "gaussian" if stochastic else "no_const",
        "rollout_sde_step_indices": rollout_sde_step_indices,
        "rollout_return_dit_trajectory": True,
        "sigmas": sigmas,
        "sigmas_are_shifted": False if sigmas is not None else None,
        "output_dtype": "float32",
        "return_generated_output": output_type != "latent",
    }
    clash = set(extra_fields or ()) & {k for k, v in fields.items() if v is not None}
    if clash:
        raise ValueError(f"extra_fields {sorted(clash)} are set from this function's own arguments")
    fields = {"rollout_debug_mode": False, **fields, **(extra_fields or {})}
    items = []
    for i, (p, neg) in enumerate(zip(prompts, negatives, strict=True)):
        item = {"prompt": p, "negative_prompt": neg, "seeds": seeds[i * n : (i + 1) * n] if seeds else None}
        items.append({k: v for k, v in item.items() if v is not None})
    outs = [o for group in client.generate_many(items, **fields) for o in group]

    trajectories = [o.dit_trajectory for o in outs]
    steps = trajectories[0].num_steps  # type: ignore[union-attr]
    all_latents = [torch.stack([t.latent(i) for t in trajectories]) for i in range(steps + 1)]  # type: ignore[union-attr]
    all_log_probs = [torch.stack([o.rollout_log_probs[i] for o in outs]) for i in range(steps)]  # type: ignore[index]
    result = (_images(outs, output_type), all_latents, all_log_probs)
    return (*result, outs) if return_outputs else result
