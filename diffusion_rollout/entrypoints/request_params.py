"""A validated rollout request turned into the engine's parameters.

The request model itself is pure data (``protocol/requests.py``, shared with the client); what needs
the server's types lives here: one ``GenerateParams`` per prompt group (:func:`group_params`), the
feature cache's ``FeatureCacheSettings``, and the checks that are made while converting (finite
``sigmas``, base64 ``image_data``, the rewards' names and metadata), each a 400 naming the field.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

from diffusion_rollout.errors import RequestError
from diffusion_rollout.protocol.requests import EMBEDDING_FIELDS, GenerateRequest
from diffusion_rollout.scheduler_mixins import RolloutSettings
from diffusion_rollout.server.core.params import GenerateParams
from diffusion_rollout.server.speed.options import FeatureCacheSettings


def group_params(req: GenerateRequest, request_id: str) -> list[GenerateParams]:
    """One ``GenerateParams`` per prompt group: one for a text ``prompt``; for a list, group
    ``j`` holds ``num_outputs_per_prompt`` (``k``) outputs of ``prompt[j]``, in order. The
    per-output lists (``seeds``, ``denoise_seeds``, ``initial_noise_group_ids``) and an
    ``initial_noise`` of ``P * k`` rows are cut into the groups' slices; output ``n = j * k + i``
    uses the seed ``seed + n`` (as one request of ``P * k`` outputs would), while ``seed`` stays
    the base that ``denoise_seeds`` derive step noise from."""
    if not isinstance(req.prompt, list):
        return [to_params(req, request_id)]
    k = req.num_outputs_per_prompt or 1
    total = len(req.prompt) * k
    if req.prompt_embeds is not None:
        raise RequestError("send a list prompt or prompt_embeds, not both", field="prompt")

    def part(name: str, values, j: int):
        if values is None:
            return None
        if len(values) == total:
            return values[j * k : (j + 1) * k]
        if name != "seeds" and len(values) == 1:
            return values
        raise RequestError(
            f"{name} has {len(values)} entries; with {len(req.prompt)} prompts of "
            f"num_outputs_per_prompt={k} send {total} (one per output, in prompt order)",
            field=name,
        )

    noise = req.initial_noise
    if noise is not None and noise.ndim >= 1 and noise.shape[0] == total and total > 1:
        noise_rows = [noise[j * k : (j + 1) * k] for j in range(len(req.prompt))]
    else:
        noise_rows = [noise] * len(req.prompt)
    meta = req.reward_metadata
    if isinstance(meta, list) and len(meta) != len(req.prompt):
        raise RequestError(
            f"reward_metadata has {len(meta)} entries for {len(req.prompt)} prompts: send one object "
            "per prompt, in order (or one object for all)",
            field="reward_metadata",
        )
    groups = []
    for j, text in enumerate(req.prompt):
        seeds = part("seeds", req.seeds, j)
        if seeds is None and req.seed is not None:
            seeds = [req.seed + j * k + i for i in range(k)]
        sub = req.model_copy(
            update={
                "prompt": text,
                "seeds": seeds,
                "denoise_seeds": part("denoise_seeds", req.denoise_seeds, j),
                "initial_noise_group_ids": part(
                    "initial_noise_group_ids", req.initial_noise_group_ids, j
                ),
                "initial_noise": noise_rows[j],
                "reward_metadata": meta[j] if isinstance(meta, list) else meta,
            }
        )
        groups.append(to_params(sub, request_id))
    return groups

def to_params(req: GenerateRequest, request_id: str) -> GenerateParams:
    if isinstance(req.prompt, list):
        raise RequestError("a list prompt is several requests: use group_params", field="prompt")
    for name in ("sigmas", "timesteps"):
        vals = getattr(req, name)
        if vals is not None and not all(math.isfinite(v) for v in vals):
            raise RequestError(f"{name} must be finite", field=name)
    image_data = _image_bytes(req.image_data) if req.image_data else None
    form = req.rollout_log_prob_form or ("no_const" if req.rollout_log_prob_no_const else "gaussian")
    settings = RolloutSettings(
        kind=req.rollout_sde_type,
        eta=float(req.rollout_noise_level),
        log_prob_form=form,
        sde_step_indices=tuple(req.rollout_sde_step_indices)
        if req.rollout_sde_step_indices is not None
        else None,
        return_step_indices=tuple(req.rollout_return_step_indices)
        if req.rollout_return_step_indices is not None
        else None,
        debug=req.rollout_debug_mode,
        ode_solver=req.rollout_ode_solver,
    )
    embeds = {name: getattr(req, name) for name in EMBEDDING_FIELDS if getattr(req, name) is not None}
    return GenerateParams(
        prompt=req.prompt if req.prompt is not None else "",
        embeds=embeds or None,
        negative_prompt=req.negative_prompt,
        seed=req.seed,
        seeds=req.seeds,
        initial_noise_seed=req.initial_noise_seed,
        initial_noise_group_ids=_keys(req.initial_noise_group_ids),
        initial_noise_latent_shape=req.initial_noise_latent_shape,
        denoise_seeds=_keys(req.denoise_seeds),
        initial_noise=req.initial_noise,
        generator_device=req.generator_device,
        width=req.width,
        height=req.height,
        num_inference_steps=req.num_inference_steps,
        num_outputs_per_prompt=req.num_outputs_per_prompt or 1,
        guidance_scale=req.guidance_scale,
        true_cfg_scale=req.true_cfg_scale,
        guidance_scale_2=req.guidance_scale_2,
        num_frames=req.num_frames,
        fps=req.fps,
        max_sequence_length=req.max_sequence_length,
        rollout=req.rollout,
        settings=settings,
        return_denoising_env=req.rollout_return_denoising_env,
        return_dit_trajectory=req.rollout_return_dit_trajectory,
        return_generated_output=req.return_generated_output,
        return_prompt_embeds=req.return_prompt_embeds,
        return_negative_prompt_embeds=req.return_negative_prompt_embeds,
        output_dtype=req.rollout_video_dtype or req.output_dtype,
        sigmas=req.sigmas,
        timesteps=req.timesteps,
        sigmas_are_shifted=req.sigmas_are_shifted,
        flow_shift=req.flow_shift,
        feature_cache=FeatureCacheSettings(**req.feature_cache.model_dump()) if req.feature_cache is not None else None,
        allow_inexact=req.allow_inexact,
        share_prefix=req.rollout_share_prefix,
        outside_window_stride=req.rollout_outside_window_stride,
        branch=tuple((b.step, b.factor) for b in req.rollout_branch) if req.rollout_branch else None,
        image_path=[req.image_path] if isinstance(req.image_path, str) else req.image_path or None,
        image_data=image_data,
        min_weight_version=req.min_weight_version,
        min_weight_version_wait=req.min_weight_version_wait,
        rewards=_rewards(req),
        reward_metadata=_reward_metadata(req),
        return_output=req.return_output,
        request_id=request_id,
    )

def _rewards(req: GenerateRequest) -> tuple[str, ...]:
    names = tuple(req.rewards or ())
    if len(set(names)) != len(names):
        raise RequestError(f"rewards: a name is given twice in {list(names)}", field="rewards")
    if names and not req.return_generated_output:
        raise RequestError(
            "rewards are scored on the decoded output, and return_generated_output=false asks for "
            "latents instead; send return_output=false to leave the pixels out of the answer",
            field="return_generated_output",
        )
    return names

def _reward_metadata(req: GenerateRequest) -> dict[str, Any] | None:
    meta = req.reward_metadata
    if meta is None:
        return None
    if not req.rewards:
        raise RequestError("reward_metadata is given, but no rewards are asked for", field="reward_metadata")
    if isinstance(meta, dict):
        return meta
    if len(meta) != 1:
        raise RequestError(
            f"reward_metadata has {len(meta)} entries for one prompt: send one object",
            field="reward_metadata",
        )
    return meta[0]


def _keys(values: list[str | int] | None) -> list[str] | None:
    # The recipes hash str(key): a JSON 5 and "5" are the same key, as in the trainers' patches.
    return None if values is None else [str(v) for v in values]


def _image_bytes(items: list[str | bytes]) -> list[bytes]:
    """``image_data`` entries as file bytes: raw bytes as sent, text as base64 (optionally a data URI)."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, bytes):
            out.append(item)
            continue
        text = item.split(",", 1)[1] if item.startswith("data:") else item
        try:
            out.append(base64.b64decode(text, validate=True))
        except (binascii.Error, ValueError):
            raise RequestError(f"image_data[{i}]: not valid base64", field="image_data") from None
    return out
