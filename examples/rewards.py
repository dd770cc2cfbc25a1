"""Rewards for the training recipes, as plug-ins.

A reward is any callable ``reward(images, prompts) -> torch.Tensor``:

- ``images``: ``uint8`` ``[N, 3, H, W]`` (images) or ``[N, 3, F, H, W]`` (videos), on the CPU, as the
  server returns them with ``output_dtype="uint8"`` (``round(x * 255)`` of the pipeline's [0, 1]
  output);
- ``prompts``: the ``N`` prompts, one per sample;
- returns ``[N]`` float32 rewards (higher is better).

The recipes take ``--reward SPEC``: a built-in name below, or ``package.module:callable`` /
``path/to/file.py:callable`` for your own (PickScore, HPS, OCR...). A spec that names a class or a
factory is called once with no arguments if the object it names is not itself a reward (so
``my_rewards:PickScore`` can load its model in ``__init__``); ``SPEC?key=value&...`` passes keyword
arguments to that call (``jpeg_compressibility?quality=80``).

Design decisions:

- **JPEG compressibility is DDPO's task**: minus the size in kB of the image saved as JPEG at a fixed
  quality (Pillow, quality 95 by default, no subsampling options beyond Pillow's defaults), the
  mean over frames for a video. It needs no model and no download, and a random-weight architecture
  can move it (smoother images compress better), which makes it the default.
- **The images arrive as bytes**, not floats: rewards are scored on exactly what a user would save,
  and the server's uint8 answer is a quarter of the float32 one.
- Rewards run in the trainer's process on the CPU; the recipes time them as their own phase.
- **A spec is code.** Anything but a built-in name imports a module and calls what it names, in the
  trainer's process and as its user (``subprocess:Popen?args=...`` would run a command), from the
  command line or from ``--config``'s ``reward:`` alike. So only ``module:callable`` or
  ``file.py:callable`` spelled out is taken (a bare unknown name is an error, never a guess), and
  :func:`load_reward` logs once what it imported, from where, with which arguments.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import io
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import parse_qsl

import torch

logger = logging.getLogger("examples.rewards")

__all__ = [
    "BUILTIN_REWARDS",
    "Reward",
    "brightness",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "load_reward",
]


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


BUILTIN_REWARDS: dict[str, Callable[..., Reward]] = {
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
    "brightness": brightness,
}


def _coerce(value: str) -> object:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def _import_object(target: str) -> tuple[object, str]:
    """The object ``module:attr`` or ``file.py:attr`` names, and the file it came from."""
    where, _, attr = target.rpartition(":")
    if not where or not attr:
        raise ValueError(
            f"reward {target!r}: expected a built-in name {sorted(BUILTIN_REWARDS)} or 'module:callable'"
        )
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"reward {target!r}: no file {path}")
        spec = importlib.util.spec_from_file_location(f"user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    try:
        return getattr(module, attr), str(getattr(module, "__file__", None) or module.__name__)
    except AttributeError:
        raise ValueError(f"reward {target!r}: {where} has no attribute {attr!r}") from None


def load_reward(spec: str) -> Reward:
    """The reward a ``--reward`` spec names (see the module docstring)."""
    name, _, query = spec.partition("?")
    kwargs = {k: _coerce(v) for k, v in parse_qsl(query, strict_parsing=bool(query))}
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name](**kwargs)
    obj, origin = _import_object(name)
    logger.info(
        "reward %r: imported %s from %s%s; it runs in this process as this user (a reward spec is code)",
        spec, name, origin,
        f" and called with {kwargs}" if kwargs else "",
    )  # fmt: skip
    # A class or a factory (no positional parameters) is instantiated; a reward function is used as is.
    if inspect.isclass(obj) or kwargs or _takes_no_arguments(obj):
        obj = obj(**kwargs)
    if not callable(obj):
        raise ValueError(f"reward {spec!r} is not callable")
    return obj


def _takes_no_arguments(obj: object) -> bool:
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_KEYWORD,) for p in params)
