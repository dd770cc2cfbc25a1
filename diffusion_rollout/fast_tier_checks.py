"""Whether the fast tier's options can run on this machine: the GPU and the packages they need.

Below the server on purpose: the typed config checks these at validation (a clear error at start-up,
before a model is read), and the server's FP8 and FA4 code (``server/speed/fast_tier.py``) uses the same
names. ``check_hardware=False`` checks only the device's name, for a Ray front whose replicas load
on GPUs the front cannot see.
"""

from __future__ import annotations

import importlib.util

import torch

FP8 = "fp8"
FA4 = "fa4"
FP8_MIN_CAPABILITY = (8, 9)  # torchao's float8 kernels: Ada, Hopper and newer
FA4_MIN_CAPABILITY = (9, 0)  # FlashAttention-4: Hopper and Blackwell
FP8_INSTALL = "pip install 'diffusion-rollout[fast]' (or pip install torchao)"
FA4_INSTALL = "pip install flash-attn-4"


def _cuda_reason(option: str, device: str, minimum: tuple[int, int], check_hardware: bool) -> str | None:
    if not device.startswith("cuda"):
        return f"{option} needs a CUDA GPU (compute capability >= {minimum[0]}.{minimum[1]}); this server runs on {device!r}"
    if not check_hardware:
        return None
    if not torch.cuda.is_available():
        return f"{option} needs a CUDA GPU (compute capability >= {minimum[0]}.{minimum[1]}); torch sees none here"
    cc = torch.cuda.get_device_capability(torch.device(device))
    if tuple(cc) < minimum:
        name = torch.cuda.get_device_name(torch.device(device))
        return (
            f"{option} needs a GPU of compute capability >= {minimum[0]}.{minimum[1]}; "
            f"{device} is {name} ({cc[0]}.{cc[1]})"
        )
    return None


def _missing(option: str, module: str, install: str) -> str | None:
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    return None if found else f"{option} needs the {module} package, which is not installed: {install}"


def unsupported_reason(
    *, quantize: str | None, attention_backend: str | None, device: str, check_hardware: bool = True
) -> str | None:
    """Why the fast-tier options asked for cannot run here (one line), or None.

    ``check_hardware=False`` checks only the device name (a Ray front whose replicas load elsewhere;
    each replica's loader checks the rest)."""
    if quantize is not None:
        reason = _cuda_reason(f"quantize={quantize}", device, FP8_MIN_CAPABILITY, check_hardware)
        if reason is None and check_hardware:
            reason = _missing(f"quantize={quantize}", "torchao", FP8_INSTALL)
        if reason:
            return reason
    if is_fa4(attention_backend):
        reason = _cuda_reason("attention_backend=fa4", device, FA4_MIN_CAPABILITY, check_hardware)
        if reason is None and check_hardware:
            reason = _missing("attention_backend=fa4", "flash_attn.cute", FA4_INSTALL)
        if reason:
            return reason
    return None


def is_fa4(attention_backend: str | None) -> bool:
    return attention_backend is not None and attention_backend.lower() == FA4
