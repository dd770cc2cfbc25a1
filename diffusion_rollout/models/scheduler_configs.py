"""The scheduler configurations that the real checkpoints ship, per family.

The tiny zoo and the GPU benchmarks both build their scheduler from these, so a test exercises the
same timestep shifting a real checkpoint does (the RL math depends on the sigma ladder, not on the
weights). Values are those of each checkpoint's ``scheduler/scheduler_config.json``; the keys that
equal the diffusers defaults are still written out where the real file has them, so the saved tiny
config reads like the real one.

Sources (looked up November 2026 in public mirrors of the checkpoints and in projects that copy
the files; the hub itself is not reachable from here):

- ``sd3``: ``{"shift": 3.0}``, as in mirrors of stable-diffusion-3-medium-diffusers; SD3.5 medium and
  large ship the same file.
- ``flux``: FLUX.1-dev (mirrors duplicated from black-forest-labs/FLUX.1-dev): dynamic shifting,
  ``shift`` 3.0, base/max shift 0.5/1.15 over 256..4096 image tokens.
- ``qwenimage``: Qwen/Qwen-Image, as copied by ai-toolkit, SimpleTuner and others: exponential
  dynamic shifting, base/max shift 0.5/0.9 over 256..8192 tokens, ``shift_terminal`` 0.02 (the ladder
  is stretched so its last sigma is 0.02).
- ``wan``: Wan-AI/Wan2.1-T2V-*-Diffusers (``model_index.json`` names ``UniPCMultistepScheduler``; the
  config as in the Wan2.1 diffusers folders and diffusers' Wan docs): UniPC bh2, order 2, flow
  sigmas, ``flow_shift`` 3.0 (the 480p value; diffusers suggests 5.0 for 720p).
- ``wan2.2``: Wan-AI/Wan2.2-T2V-A14B-Diffusers: the same UniPC config with ``flow_shift`` 3.0, and
  ``boundary_ratio`` 0.875 in ``model_index.json`` (Wan2.2's ``wan_t2v_A14B.py``: boundary 0.875).
  The original Wan2.2 code samples with shift 12.0; the diffusers folder ships 3.0, and that is what
  ``from_pretrained`` users get.
- ``flux2-klein``: black-forest-labs/FLUX.2-klein-4B (as mirrored by projects that fetch its
  ``scheduler_config.json``): flow-match Euler with dynamic shifting; ``Flux2KleinPipeline`` passes
  its own empirical ``mu``.
- ``zimage``: Tongyi-MAI/Z-Image-Turbo: flow-match Euler, ``shift`` 3.0, no dynamic shifting.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from diffusers.schedulers.scheduling_utils import SchedulerMixin

__all__ = [
    "HUNYUANVIDEO15_480P_GUIDANCE",
    "REAL_SCHEDULER_CONFIGS",
    "WAN22_A14B_BOUNDARY_RATIO",
    "make_real_scheduler",
]

_SD35 = {"num_train_timesteps": 1000, "shift": 3.0}

_FLUX1_DEV = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}

_QWEN_IMAGE = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

_WAN_UNIPC = {
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995,
    "final_sigmas_type": "zero",
    "flow_shift": 3.0,
    "lower_order_final": True,
    "num_train_timesteps": 1000,
    "predict_x0": True,
    "prediction_type": "flow_prediction",
    "rescale_betas_zero_snr": False,
    "sample_max_value": 1.0,
    "solver_order": 2,
    "solver_p": None,
    "solver_type": "bh2",
    "steps_offset": 0,
    "thresholding": False,
    "timestep_spacing": "linspace",
    "trained_betas": None,
    "use_beta_sigmas": False,
    "use_exponential_sigmas": False,
    "use_flow_sigmas": True,
    "use_karras_sigmas": False,
}

# FLUX.2's diffusers folders: flow-match Euler with dynamic shifting; the klein pipeline computes
# its own ``mu`` (an empirical fit of image tokens and steps), so only the switch matters.
_FLUX2 = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}

# Tongyi-MAI/Z-Image-Turbo: a static shift of 3.0, no dynamic shifting (the pipeline's mu is ignored).
_ZIMAGE = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}

# HunyuanVideo-1.5 480p text-to-video (the diffusers folders made by diffusers'
# scripts/convert_hunyuan_video1_5_to_diffusers.py): flow-match Euler with a fixed shift of 5.0
# (720p: 9.0), and a ClassifierFreeGuidance guider at 6.0 (the distilled variants: 1.0).
_HUNYUANVIDEO15_480P = {"num_train_timesteps": 1000, "shift": 5.0}
HUNYUANVIDEO15_480P_GUIDANCE = 6.0

# Lightricks/LTX-2 (diffusers' scripts/convert_ltx2_to_diffusers.py, the non-distilled pipeline):
# dynamic shifting with base/max shift 0.95/2.05 over 1024..4096 video tokens, stretched so the last
# sigma is 0.1.
_LTX2 = {
    "base_image_seq_len": 1024,
    "base_shift": 0.95,
    "max_image_seq_len": 4096,
    "max_shift": 2.05,
    "num_train_timesteps": 1000,
    "shift_terminal": 0.1,
    "use_dynamic_shifting": True,
}

#: family -> (scheduler class, its real config). Read-only; copy before changing.
REAL_SCHEDULER_CONFIGS: MappingProxyType[str, tuple[type[SchedulerMixin], MappingProxyType[str, Any]]] = (
    MappingProxyType(
        {
            "sd3": (FlowMatchEulerDiscreteScheduler, MappingProxyType(_SD35)),
            "flux": (FlowMatchEulerDiscreteScheduler, MappingProxyType(_FLUX1_DEV)),
            "qwenimage": (FlowMatchEulerDiscreteScheduler, MappingProxyType(_QWEN_IMAGE)),
            "wan": (UniPCMultistepScheduler, MappingProxyType(_WAN_UNIPC)),
            "wan2.2": (UniPCMultistepScheduler, MappingProxyType(_WAN_UNIPC)),
            "flux2-klein": (FlowMatchEulerDiscreteScheduler, MappingProxyType(_FLUX2)),
            "zimage": (FlowMatchEulerDiscreteScheduler, MappingProxyType(_ZIMAGE)),
            "hunyuanvideo15": (FlowMatchEulerDiscreteScheduler, MappingProxyType(_HUNYUANVIDEO15_480P)),
            "ltx2": (FlowMatchEulerDiscreteScheduler, MappingProxyType(_LTX2)),
        }
    )
)

#: Wan2.2-T2V-A14B switches from ``transformer`` (high noise) to ``transformer_2`` at t < 875.
WAN22_A14B_BOUNDARY_RATIO = 0.875


def make_real_scheduler(family: str) -> SchedulerMixin:
    """A fresh scheduler of ``family``'s class with its real checkpoint's configuration."""
    try:
        scheduler_cls, config = REAL_SCHEDULER_CONFIGS[family]
    except KeyError:
        raise ValueError(
            f"unknown family {family!r}; expected one of {sorted(REAL_SCHEDULER_CONFIGS)}"
        ) from None
    # Lists in the config must not be shared with the scheduler instance (it may mutate them).
    return scheduler_cls.from_config({k: list(v) if isinstance(v, list) else v for k, v in config.items()})
