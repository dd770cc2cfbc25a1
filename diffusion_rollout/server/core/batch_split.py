"""A finished pipeline call split into one ``SampleResult`` per output.

Runs on the worker right after the call, so it only *queues* work: every tensor an output carries is
handed to the ``HostCopier`` (a compact host copy, landed when the results thread waits for it), and
the NaN/Inf checks stay on the device as one flag per output (no sync here). Per output: the decoded
image (uint8 on request), and for a rollout its log-probs, the debug tensors, the trajectory (in the
dtype the pipeline stored its latents in: lossless) and the conditioning the transformer saw.
Jointly denoised streams (LTX-2) carry each stream's own tensors under ``streams``.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch

from diffusion_rollout.server.core.params import SampleResult
from diffusion_rollout.server.core.result_copy import HostCopier


def _debug_tensors(view: dict[str, Any], copier: HostCopier) -> dict[str, Any]:
    debug = {
        "rollout_variance_noises": copier.copy(view["variance_noises"]),
        "rollout_prev_sample_means": copier.copy(view["prev_sample_means"]),
        "rollout_noise_std_devs": copier.copy(view["noise_std_devs"]),
        "rollout_model_outputs": copier.copy(view["model_outputs"]),
    }
    if "streams" in view:
        debug["streams"] = {
            name: {
                "rollout_variance_noises": copier.copy(v["variance_noises"]),
                "rollout_prev_sample_means": copier.copy(v["prev_sample_means"]),
                "rollout_model_outputs": copier.copy(v["model_outputs"]),
            }
            for name, v in view["streams"].items()
        }
    return debug


def _trajectory(view: dict[str, Any], schedule: tuple, state, copier: HostCopier) -> dict[str, Any]:
    traj = {
        "latents": copier.copy(view["trajectory_latents"]),
        "timesteps": schedule[0],
        "sigmas": schedule[1],
        "latent_step_indices": list(state.latent_step_indices),
    }
    if "streams" in view:
        traj["streams"] = {
            name: {
                "latents": copier.copy(v["trajectory_latents"]),
                "log_probs": copier.copy(v["log_probs"].float()),
            }
            for name, v in view["streams"].items()
        }
    return traj


def _conditioning(enc: dict[str, Any], p, copier: HostCopier) -> dict[str, Any]:
    """The encodings a request's outputs were conditioned on, as they asked: positives with
    ``return_prompt_embeds``, ``negative_*`` with ``return_negative_prompt_embeds`` (present only
    where the call uses CFG). One row each, shared by the request's outputs."""
    out = {}
    for name, value in enc.items():
        negative = name.startswith("negative_")
        if value is None or not (p.return_negative_prompt_embeds if negative else p.return_prompt_embeds):
            continue
        out[name] = copier.copy_tree(value)
    return out


def split_batch(
    adapter, plans, state, recorder, images, call, copier: HostCopier,
    *, version: Any, elapsed: float, peak: float | None, exact: bool, device: str,
    encodings: list[dict[str, Any]] | None = None,
) -> tuple[list[SampleResult], torch.Tensor]:  # fmt: skip
    """The batch's outputs, their tensors being copied to the host by ``copier``, and a ``[B]``
    bool tensor (host, valid after ``copier.wait()``) flagging NaN/Inf per output."""
    a = adapter
    batch = sum(len(pl.seeds) for pl in plans)
    T = call.num_inference_steps
    env_rows = None
    if (
        any(pl.params.rollout and pl.params.return_denoising_env for pl in plans)
        and recorder.first_step_calls
    ):
        env_rows = a.split_env(recorder.first_step_calls, batch, call, recorder.timestep_dtype)
    # What the transformer was handed at each step, on its own scale (Qwen-Image and FLUX take
    # t / 1000, Z-Image (1000 - t) / 1000): only replay needs it, through the env's timestep_map.
    model_timesteps = recorder.timestep_tensor(T)[:T] if recorder.timesteps else None
    experts = recorder.expert_list(T) if a.has_experts() and recorder.experts else None
    out: list[SampleResult] = []
    flags: list[torch.Tensor] = []
    batch_id = uuid.uuid4().hex
    flag_device = images.device if images is not None else torch.device(device)
    schedule = None
    timestep_map = None
    if state is not None and state.sigmas is not None:
        # The scheduler's timesteps (those handed to step(), 0..num_train_timesteps), as SGLang
        # reports them for every family: trainers derive sigmas = timesteps / 1000 from them.
        schedule = (copier.copy(state.timesteps.float()), copier.copy(state.sigmas.float()))
        if model_timesteps is not None:
            steps = state.timesteps.shape[0] - 1  # the loop steps that ran (T, or fewer with a strength)
            timestep_map = {
                "timesteps": copier.copy(state.timesteps[:steps].float()),
                "model_timesteps": copier.copy(model_timesteps[:steps]),
            }
    row = 0
    for plan_index, pl in enumerate(plans):
        p = pl.params
        conditioning = None
        if encodings is not None and (p.return_prompt_embeds or p.return_negative_prompt_embeds):
            conditioning = _conditioning(encodings[plan_index], p, copier)
        for seed in pl.seeds:
            img = images[row] if images is not None else None
            bad = torch.zeros((), dtype=torch.bool, device=flag_device)
            if img is not None:
                img = img.detach()
                bad = ~torch.isfinite(img).all().to(flag_device)
                if p.output_dtype == "uint8" and p.return_generated_output:
                    img = a.to_uint8(img)
                img = copier.copy(img.float() if img.dtype != torch.uint8 else img)
            log_probs = debug = env = traj = sde_steps = None
            if p.rollout and state is not None:
                view = state.per_sample(row)
                log_probs = copier.copy(view["log_probs"].float())
                # A NaN log-prob poisons a policy-gradient loss as surely as a NaN image.
                bad = bad | ~torch.isfinite(view["log_probs"]).all().to(flag_device)
                sde_steps = list(state.sde_step_indices)
                if p.settings.debug:
                    debug = _debug_tensors(view, copier)
                if p.return_dit_trajectory:
                    traj = _trajectory(view, schedule, state, copier)
                if p.return_denoising_env and env_rows is not None:
                    env = copier.copy_tree(env_rows[row])
                    if timestep_map is not None:
                        env["timestep_map"] = timestep_map
                    if experts is not None:
                        env["expert_per_step"] = experts
            out.append(
                SampleResult(
                    request_id=p.request_id,
                    prompt=p.prompt,
                    seed=seed,
                    weight_version=version,
                    generated_output=img,
                    rollout_log_probs=log_probs,
                    rollout_debug_tensors=debug,
                    denoising_env=env,
                    dit_trajectory=traj,
                    sde_step_indices=sde_steps,
                    expert_per_step=experts,
                    inference_time_s=elapsed,
                    peak_memory_mb=peak,
                    batch_id=batch_id,
                    batch_index=row,
                    batch_size=batch,
                    exact=exact,
                    conditioning=conditioning,
                )
            )
            flags.append(bad)
            row += 1
    return out, copier.copy(torch.stack(flags))
