"""Trainer-side replay of one denoising step from a rollout's ``denoising_env``.

``replay_model_output`` calls the trainer's transformer exactly as the server's pipeline did for one
step (same kwargs, same timestep dtype, the family's guidance rule and, for batched CFG, the same
``[uncond; cond]`` batch layout), so with the same weights, device, dtype and batch shape it
reproduces the model output the server used bit for bit. ``replay_log_prob`` then scores the
recorded transition with the one shared ``transition`` function, so the PPO ratio is exactly 1
on-policy. Both work under autograd.

Guidance rules (``env["guidance"]["rule"]``):
- ``none``: one conditional call.
- ``cfg_batched`` (SD3): one call on ``[x; x]`` with ``[neg; pos]`` kwargs, ``u + s * (c - u)``.
- ``true_cfg`` (FLUX, Wan): a conditional call, then an unconditional one, ``neg + s * (pos - neg)``
  with ``s`` the ``true_cfg_scale`` when the env carries one (FLUX), else ``guidance_scale`` (Wan).
- ``norm_rescale`` (Qwen-Image): ``true_cfg``, then rescaled to the conditional branch's norm over
  the last dim.
- ``cfg_batched_cond_first`` (Z-Image): one call on ``[x; x]`` with ``[pos; neg]`` kwargs, combined
  in float32 as ``pos + s * (pos - neg)``.

How the model is called (``env["model_call"]``, absent for the transformers that take
``hidden_states=`` and ``timestep=`` tensors): ``latent_arg`` and ``timestep_arg`` name the two
inputs, ``latent_layout="frame_list"`` means the model takes a list of per-sample ``[C, 1, H, W]``
tensors and returns one (replay stacks the outputs in float32 and drops the frame axis, as the
pipeline does), and ``negate=true`` means the pipeline hands the scheduler the negated prediction.

Channel-concatenated model input (HunyuanVideo 1.5): ``env["model_input_concat"]`` holds channels
the pipeline concatenates after the latent (dim 1) before every model call; replay does the same.

Jointly denoised streams (LTX-2): :func:`replay_stream_model_outputs` calls the transformer once on
every stream's latent and returns each stream's guided velocity (rule ``ltx2_cfg_x0``: CFG combined in
x0 space with the step's sigma); score each stream with :func:`replay_log_prob` and combine them with
``joint_log_prob`` for the response's ``rollout_log_probs``.

Two experts (Wan 2.2): ``env["expert_per_step"][step]`` names the module that ran the step; steps of
``transformer_2`` use ``guidance["guidance_scale_2"]``.

Image-conditioned families: ``env["latent_condition"]`` (``{latents, dim, slice_output}``) is appended
to the latent on ``dim`` before every call, and with ``slice_output`` each branch's output is cut
back to the latent's extent on that axis (server/families/image_cond.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from diffusion_rollout.scheduler_mixins import TransitionResult, transition


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


def _move(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_move(v, device) for v in obj]
    return obj


def stack_envs(envs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One env for a batch of samples: per-sample kwargs concatenated, shared ones kept."""
    first = envs[0]
    batch_keys = set(first.get("batch_kwargs", ()))

    def merge(branch: str) -> dict[str, Any] | None:
        if first.get(branch) is None:
            return None
        out = {}
        for k, v in first[branch].items():
            if k in batch_keys and isinstance(v, torch.Tensor):
                out[k] = torch.cat([e[branch][k] for e in envs], dim=0)
            elif k in batch_keys and isinstance(v, list):
                out[k] = [x for e in envs for x in e[branch][k]]
            else:
                out[k] = v
        return out

    stacked = dict(first)
    if first.get("model_input_concat") is not None:
        stacked["model_input_concat"] = torch.cat([e["model_input_concat"] for e in envs], dim=0)
    stacked["pos_cond_kwargs"] = merge("pos_cond_kwargs")
    stacked["neg_cond_kwargs"] = merge("neg_cond_kwargs")
    if first.get("latent_first_frame") is not None:
        stacked["latent_first_frame"] = {
            **first["latent_first_frame"],
            "latents": torch.cat([e["latent_first_frame"]["latents"] for e in envs], dim=0),
        }
    if first.get("latent_condition") is not None:
        stacked["latent_condition"] = {
            **first["latent_condition"],
            "latents": torch.cat([e["latent_condition"]["latents"] for e in envs], dim=0),
        }
    return stacked


def _concat(first: Any, second: Any) -> Any:
    """Two per-sample batches as one: tensors along dim 0, lists of per-sample tensors joined."""
    if isinstance(first, list):
        return [*first, *second]
    return torch.cat([first, second], dim=0)


def _expert_for(env: Mapping[str, Any], step: int | None, transformers: Mapping[str, torch.nn.Module]):
    experts = env.get("expert_per_step")
    if experts and step is not None:
        return transformers[experts[step]], experts[step]
    return transformers["transformer"], "transformer"


def _scale_for(guidance: Mapping[str, Any], expert: str) -> float:
    if expert == "transformer_2" and guidance.get("guidance_scale_2") is not None:
        return float(guidance["guidance_scale_2"])
    rule = guidance["rule"]
    if rule in ("true_cfg", "norm_rescale") and guidance.get("true_cfg_scale") is not None:
        return float(guidance["true_cfg_scale"])
    return float(guidance.get("guidance_scale", 1.0))


def model_timestep(
    env: Mapping[str, Any], timestep: float | torch.Tensor, step: int | None = None
) -> torch.Tensor:
    """The timestep the pipeline handed the transformer at the step whose scheduler timestep is
    ``timestep`` (``dit_trajectory.timesteps[step]``).

    The trajectory reports the scheduler's timesteps (0..1000) for every family, as SGLang does; some
    pipelines hand the model another scale (Qwen-Image and FLUX ``t / 1000``, Z-Image
    ``(1000 - t) / 1000``). ``env["timestep_map"]`` carries the values the model got, bit for bit,
    beside the scheduler's: the step is ``step`` when given, else the one whose scheduler timestep
    equals ``timestep``. An env without the map (built by hand) takes ``timestep`` as it is.
    """
    t = timestep if isinstance(timestep, torch.Tensor) else torch.tensor(float(timestep))
    tmap = env.get("timestep_map")
    if tmap is None:
        return t
    model = tmap["model_timesteps"]
    if step is None:
        hits = (tmap["timesteps"].float() == t.float().reshape(()).cpu()).nonzero()
        if hits.numel() == 0:
            raise ValueError(
                f"timestep {float(t)} is not one of this rollout's model steps "
                "(pass dit_trajectory.timesteps[step], or step=)"
            )
        step = int(hits[0])
    if not 0 <= step < model.shape[-1]:
        raise ValueError(f"step {step} is outside this rollout's {model.shape[-1]} model steps")
    return model.reshape(-1)[step]


def replay_model_output(
    transformer: torch.nn.Module | Mapping[str, torch.nn.Module],
    latents: torch.Tensor,
    timestep: float | torch.Tensor,
    env: Mapping[str, Any],
    *,
    step: int | None = None,
) -> torch.Tensor:
    """The guided model output for ``latents`` ([B, ...], the trajectory entry of ``step``).

    ``transformer`` is the module (or ``{"transformer": ..., "transformer_2": ...}`` for two-expert
    models, where ``step`` selects the expert recorded in ``env["expert_per_step"]``); ``timestep``
    is ``dit_trajectory.timesteps[step]`` (the model's own value comes from the env's
    ``timestep_map``, see :func:`model_timestep`); ``env`` is one sample's ``denoising_env`` or
    :func:`stack_envs` of several.
    """
    if env.get("streams"):
        raise ValueError(
            f"this denoising_env is of a model that denoises the streams {env['streams']} jointly: replay "
            "its steps with replay_stream_model_outputs"
        )
    transformers = transformer if isinstance(transformer, Mapping) else {"transformer": transformer}
    module, expert = _expert_for(env, step, transformers)
    device = latents.device
    guidance = env["guidance"]
    rule = guidance["rule"]
    t_dtype = _dtype(env.get("timestep_dtype", "torch.float32"))
    t_value = model_timestep(env, timestep, step)
    image = _move(env.get("image_kwargs") or {}, device)
    pos = _move(env["pos_cond_kwargs"], device)
    neg = _move(env.get("neg_cond_kwargs"), device)
    b = latents.shape[0]

    # Per-token timesteps (Wan 2.2 TI2V's expand_timesteps): the pipeline passed [B, tokens].
    tokens = env.get("timestep_tokens")
    if env.get("model_input_dtype"):
        # Pipelines that keep float32 latents (Wan, Z-Image) cast the model input; same cast here.
        latents = latents.to(_dtype(env["model_input_dtype"]))
    concat = env.get("model_input_concat")
    if concat is not None:
        latents = torch.cat([latents, concat.to(device=device, dtype=latents.dtype)], dim=1)
    conv = env.get("model_call") or {}
    latent_arg = conv.get("latent_arg", "hidden_states")
    timestep_arg = conv.get("timestep_arg", "timestep")
    frame_list = conv.get("latent_layout") == "frame_list"

    # Image-conditioned families (Kontext, Qwen-Image-Edit, Wan I2V): the model input is x_t with
    # the image latents concatenated, and token-concatenating ones cut the output back to x_t's part.
    condition = env.get("latent_condition")
    cond_latents = _move(condition["latents"], device) if condition is not None else None
    # Wan 2.2 TI2V image-to-video: the image's latent replaces the first latent frame, whose tokens
    # run at timestep 0.
    first_frame = env.get("latent_first_frame")
    first_latents = _move(first_frame["latents"], device) if first_frame is not None else None

    def call(x: torch.Tensor, kwargs: Mapping[str, Any]) -> torch.Tensor:
        t = t_value.to(device=device, dtype=t_dtype).reshape(())
        t = t.expand(x.shape[0]) if tokens is None else t.expand(x.shape[0], int(tokens))
        if first_latents is not None:
            t = t.clone()
            t[:, : int(first_frame["zero_timestep_tokens"])] = 0
            f = first_latents.to(x.dtype).expand(x.shape[0], -1, -1, -1, -1)
            x = torch.cat([f, x[:, :, 1:]], dim=2)
        if cond_latents is not None:
            dim = int(condition["dim"])
            c = cond_latents.to(x.dtype)
            if c.shape[0] != x.shape[0]:  # batched CFG doubles x: the same condition for both halves
                c = c.repeat(x.shape[0] // c.shape[0], *([1] * (c.ndim - 1)))
            x_in = torch.cat([x, c], dim=dim)
        else:
            x_in = x
        inputs = {latent_arg: list(x_in.unsqueeze(2).unbind(0)) if frame_list else x_in, timestep_arg: t}
        out = module(**inputs, **image, **kwargs, return_dict=False)[0]
        out = torch.stack([o.float() for o in out]).squeeze(2) if frame_list else out
        if cond_latents is not None and condition.get("slice_output"):
            out = out.narrow(dim, 0, x.shape[dim])
        return out

    def finish(v: torch.Tensor) -> torch.Tensor:
        return -v if conv.get("negate") else v

    if rule == "none" or neg is None:
        return finish(call(latents, pos))
    scale = _scale_for(guidance, expert)
    if rule == "cfg_batched_cond_first":
        keys = set(env.get("batch_kwargs", ()))
        both = {k: (_concat(v, neg[k]) if k in keys else v) for k, v in pos.items()}
        out = call(torch.cat([latents, latents], dim=0), both).float()
        cond, uncond = out[:b], out[b:]
        return finish(cond + scale * (cond - uncond))
    if rule == "cfg_batched":
        keys = set(env.get("batch_kwargs", ()))
        both = {k: (torch.cat([neg[k], v], dim=0) if k in keys else v) for k, v in pos.items()}
        out = call(torch.cat([latents, latents], dim=0), both)
        uncond, cond = out[:b], out[b:]
        return finish(uncond + scale * (cond - uncond))
    if rule in ("true_cfg", "norm_rescale"):
        cond = call(latents, pos)
        uncond = call(latents, neg)
        comb = uncond + scale * (cond - uncond)
        if rule == "norm_rescale":
            cond_norm = torch.norm(cond, dim=-1, keepdim=True)
            comb_norm = torch.norm(comb, dim=-1, keepdim=True)
            comb = comb * (cond_norm / comb_norm)
        return finish(comb)
    raise ValueError(f"unknown guidance rule {rule!r}")


def replay_log_prob(
    kind: str,
    latents: torch.Tensor,
    model_output: torch.Tensor,
    next_latents: torch.Tensor,
    sigmas: torch.Tensor,
    step: int,
    *,
    eta: float,
    log_prob_form: str = "gaussian",
) -> TransitionResult:
    """Score the recorded transition of ``step`` with the shared transition function.

    ``sigmas`` is ``dit_trajectory.sigmas`` ([T+1]); ``sigma_max`` follows docs/math.md (its second
    entry), so the value is the server's bit for bit given the same model output.
    """
    sigmas = sigmas.to(torch.float32)
    return transition(
        kind,
        latents,
        model_output,
        sigmas[step],
        sigmas[step + 1],
        eta=eta,
        sigma_max=sigmas[min(1, len(sigmas) - 1)],
        next_sample=next_latents,
        log_prob_form=log_prob_form,
    )


def replay_stream_model_outputs(
    transformer: torch.nn.Module,
    latents: Mapping[str, torch.Tensor],
    timestep: float | torch.Tensor,
    sigma: float | torch.Tensor,
    env: Mapping[str, Any],
) -> dict[str, torch.Tensor]:
    """Each stream's guided velocity for one step of a jointly denoised model (LTX-2).

    ``latents`` maps the stream names of ``env["streams"]`` to their trajectory entries of the step
    (``dit_trajectory.latents`` for the first, ``dit_trajectory.streams[name].latents`` for all);
    ``timestep`` and ``sigma`` are ``dit_trajectory.timesteps[step]`` and ``.sigmas[step]``. The
    arithmetic is the pipeline's, in its order: one call on ``[uncond; cond]`` rows, float32
    outputs, ``x0 = x - v * sigma`` per branch, ``x0_c + (s - 1) * (x0_c - x0_u)`` (the guidance
    terms the server turns off add exact zeros), back to ``(x - x0) / sigma``.
    """
    names = list(env["streams"])
    guidance = env["guidance"]
    rule = guidance["rule"]
    if rule not in ("ltx2_cfg_x0", "none"):
        raise ValueError(f"replay_stream_model_outputs does not replay guidance rule {rule!r}")
    first = latents[names[0]]
    device = first.device
    in_dtype = _dtype(env.get("model_input_dtype", "torch.float32"))
    t_dtype = _dtype(env.get("timestep_dtype", "torch.float32"))
    image = _move(env.get("image_kwargs") or {}, device)
    pos = _move(env["pos_cond_kwargs"], device)
    neg = _move(env.get("neg_cond_kwargs"), device)
    cfg = rule == "ltx2_cfg_x0" and neg is not None
    keys = set(env.get("batch_kwargs", ()))
    kwargs = {k: (torch.cat([neg[k], v], dim=0) if k in keys else v) for k, v in pos.items()} if cfg else pos
    inputs = [latents[n] for n in names]
    if cfg:
        inputs = [torch.cat([x, x], dim=0) for x in inputs]
    t_value = model_timestep(env, timestep)
    t = t_value.to(device=device, dtype=t_dtype).reshape(()).expand(inputs[0].shape[0])
    video_out, audio_out = transformer(
        hidden_states=inputs[0].to(in_dtype),
        audio_hidden_states=inputs[1].to(in_dtype),
        timestep=t,
        sigma=t,
        **image,
        **kwargs,
        return_dict=False,
    )
    s = (sigma if isinstance(sigma, torch.Tensor) else torch.tensor(float(sigma))).to(device, torch.float32)
    scales = [
        float(guidance["guidance_scale"]),
        float(guidance.get("audio_guidance_scale", guidance["guidance_scale"])),
    ]
    out: dict[str, torch.Tensor] = {}
    for name, x, pred, scale in zip(
        names, (latents[n] for n in names), (video_out, audio_out), scales, strict=True
    ):
        pred = pred.float()
        if cfg:
            uncond, cond = pred.chunk(2)
            cond = x - cond * s
            uncond = x - uncond * s
            guided = cond + (scale - 1) * (cond - uncond) + 0 + 0
        else:
            guided = (x - pred * s) + 0 + 0 + 0
        out[name] = (x - guided) / s
    return out
