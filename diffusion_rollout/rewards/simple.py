"""Rewards that need no model: DDPO's JPEG compressibility and a brightness control task.

The JPEG task needs no model and no download, and a random-weight architecture can move it (smoother
images compress better), which makes it the recipes' default."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Protocol

import torch


class Reward(Protocol):
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor: ...


def _frames(images: torch.Tensor) -> torch.Tensor:
    """``[N, F, 3, H, W]`` uint8 from images ``[N, 3, H, W]`` or videos ``[N, 3, F, H, W]``."""
    if images.dtype != torch.uint8:
        raise TypeError(f"rewards take uint8 images (output_dtype='uint8'), got {images.dtype}")
    if images.ndim == 4:
        return images.unsqueeze(1)
    if images.ndim == 5:
        return images.permute(0, 2, 1, 3, 4)
    raise ValueError(f"expected [N, 3, H, W] or [N, 3, F, H, W], got shape {tuple(images.shape)}")


def _jpeg_kb(frame: torch.Tensor, quality: int) -> float:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame.permute(1, 2, 0).contiguous().numpy()).save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


def jpeg_compressibility(quality: int = 95) -> Reward:
    """Minus the JPEG size in kB at ``quality`` (per-frame mean for videos): DDPO's compressibility."""

    def reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        frames = _frames(images)
        sizes = [[_jpeg_kb(f, quality) for f in sample] for sample in frames]
        return -torch.tensor([sum(s) / len(s) for s in sizes], dtype=torch.float32)

    return reward


def jpeg_incompressibility(quality: int = 95) -> Reward:
    """The JPEG size in kB (DDPO's incompressibility): the inverse task."""
    compress = jpeg_compressibility(quality)

    def reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return -compress(images, prompts)

    return reward


def brightness(target: float = 0.8) -> Reward:
    """Minus the squared distance of the mean pixel value (in [0, 1]) to ``target``: a simple control task."""

    def reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        mean = _frames(images).float().div(255.0).mean(dim=(1, 2, 3, 4))
        return -((mean - float(target)) ** 2)

    return reward


def model_placement(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """Where a reward model runs: ``device`` (default: this process's CUDA device, under torchrun the
    rank's own, else the CPU) in ``dtype`` (default: bfloat16 on CUDA, float32 on a CPU)."""
    if device is None:
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    where = torch.device(device)
    if dtype is None:
        return where, torch.bfloat16 if where.type == "cuda" else torch.float32
    return where, getattr(torch, str(dtype))


def first_frames(images: torch.Tensor, prompts: Sequence[str], who: str) -> torch.Tensor:
    """uint8 ``[N, 3, H, W]``: each image, or a video's first frame (what a model reward scores),
    checked against one prompt per sample."""
    frames = _frames(images)[:, 0]
    if len(prompts) != frames.shape[0]:
        raise ValueError(f"{who}: {frames.shape[0]} images but {len(prompts)} prompts")
    return frames

