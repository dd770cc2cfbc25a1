"""Fields that real trainers send and that have no effect here: accepted, logged once, reported.

The server's promise is that a trainer switches to it by changing a URL, so a request that SGLang's
diffusion server (or the patches of it that Relax and UniRL ship) accepts must not be refused. Most
of their fields mean something here and are ordinary protocol fields. The ones below only steer
SGLang's own machinery (output files, profiling, its trajectory flags, its sequence-parallel frame
rounding) or are per-model constants this server takes from the checkpoint: they are accepted,
have no effect, are logged once per process, and every response names them in ``ignored_fields``.
A field that no SGLang version knows is still a 422, so a typo is never silently ignored.

Where the lists come from (facts from the public sources): SGLang's ``SamplingParams``
(``python/sglang/multimodal_gen/configs/sample/sampling_params.py``), which ``/rollout/generate``
fills from ``extra_sampling_params``; UniRL's SGLang patches (``request.py``: ``init_same_noise``,
``return_file_paths_only``; its ``return_prompt_embeds`` and ``return_negative_prompt_embeds`` are
served, protocol fields); and the memory bodies of SGLang's diffusion ``io_struct.py``
(``cpu_backup_tags``) and Relax's client (``resume_memory_occupation {weights_only}``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel

logger = logging.getLogger(__name__)

# SGLang SamplingParams / patch fields with no effect on this server, with the reason.
NOOP_SAMPLING_FIELDS: Mapping[str, str] = {
    "data_type": "inferred from the model family",
    "request_id": "ids come from rid or X-Request-Id",
    "prompt_path": "prompts travel in the request",
    "output_path": "outputs are returned, never saved",
    "output_file_name": "outputs are returned, never saved",
    "save_output": "outputs are returned, never saved",
    "return_file_paths_only": "outputs are returned, never saved",
    "return_frames": "the output is always returned",
    "return_trajectory_latents": "use rollout_return_dit_trajectory",
    "return_trajectory_decoded": "decoded trajectories are not produced",
    "init_same_noise": "use initial_noise_group_ids or initial_noise_seed",
    "num_frames_round_down": "one device: no sequence-parallel frame rounding",
    "adjust_frames": "one device: no sequence-parallel frame rounding",
    "height_not_provided": "SGLang-internal bookkeeping",
    "width_not_provided": "SGLang-internal bookkeeping",
    "supported_resolutions": "sizes are checked against the family and the limits",
    "no_override_protected_fields": "SGLang-internal bookkeeping",
    "guidance_rescale": "not part of the flow-matching pipelines served here",
    "boundary_ratio": "the two-expert switch point is the checkpoint's",
    "enable_teacache": "no caching of transformer outputs (it would change the numbers)",
    "profile": "no per-request profiler",
    "num_profiled_timesteps": "no per-request profiler",
    "profile_all_stages": "no per-request profiler",
    "perf_dump_path": "no per-request profiler",
    "debug": "use rollout_debug_mode",
}

# Relax's patch reads initial_noise_latent_shape only together with the group ids.
_RECIPE_SHAPE, _RECIPE_IDS = "initial_noise_latent_shape", "initial_noise_group_ids"

_logged: set[tuple[str, str]] = set()
_lock = threading.Lock()


def log_ignored_once(endpoint: str, fields: Iterable[str]) -> None:
    """Log each (endpoint, field) the first time it is ignored in this process."""
    for name in fields:
        key = (endpoint, name)
        with _lock:
            if key in _logged:
                continue
            _logged.add(key)
        logger.info("%s: field %r accepted but has no effect on this server (logged once)", endpoint, name)


def split_noop_sampling_fields(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A generate body without its no-effect fields (top level and in extra_sampling_params),
    and their names (``extra_sampling_params.<name>`` for those that came in there)."""
    ignored: list[str] = []
    out = {k: v for k, v in data.items() if k not in NOOP_SAMPLING_FIELDS}
    ignored += [k for k in data if k in NOOP_SAMPLING_FIELDS]
    extra = data.get("extra_sampling_params")
    if isinstance(extra, dict):
        out["extra_sampling_params"] = {k: v for k, v in extra.items() if k not in NOOP_SAMPLING_FIELDS}
        ignored += [f"extra_sampling_params.{k}" for k in extra if k in NOOP_SAMPLING_FIELDS]
    extra_out = out.get("extra_sampling_params") if isinstance(extra, dict) else None
    has_ids = out.get(_RECIPE_IDS) is not None or (extra_out or {}).get(_RECIPE_IDS) is not None
    if not has_ids:
        if out.get(_RECIPE_SHAPE) is not None:
            del out[_RECIPE_SHAPE]
            ignored.append(_RECIPE_SHAPE)
        if extra_out and extra_out.get(_RECIPE_SHAPE) is not None:
            del extra_out[_RECIPE_SHAPE]
            ignored.append(f"extra_sampling_params.{_RECIPE_SHAPE}")
    return out, sorted(ignored)


def set_noop_fields(body: BaseModel, names: Iterable[str]) -> list[str]:
    """Which of ``names`` (fields with no effect here) the client actually sent in ``body``."""
    return sorted(n for n in names if n in body.model_fields_set)


def with_ignored(result: dict[str, Any], endpoint: str, ignored: list[str]) -> dict[str, Any]:
    """``result`` plus ``ignored_fields`` when some were sent (and logged once)."""
    if ignored:
        log_ignored_once(endpoint, ignored)
        result = {**result, "ignored_fields": ignored}
    return result
