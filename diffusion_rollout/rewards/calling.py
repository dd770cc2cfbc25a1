"""How a reward is called, the same way in the trainer and on the server.

A reward is a callable ``reward(images, prompts) -> [N] float32`` (``rewards/simple.py``'s
``Reward``). Three optional parts, each detected on the object, so a plain function stays valid:

- **metadata**: a reward whose signature takes ``metadata`` (or ``**kwargs``) gets one dict per
  sample (an OCR target text, a GenEval spec), as the request sent it;
- **extras**: after a call, a reward may hold ``last_extras``, one dict per sample (a judge's
  reading); they travel with the score;
- **group-wise**: a reward with ``groupwise = True`` is called once per group (the outputs of one
  prompt), for pairwise or groupwise preference models.

:func:`score` is the one place that calls a reward. A value that is not finite is a failure of
that sample, named, never replaced by a number.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Scores:
    """One reward's outcome for N samples: a value or an error for each, and its extras."""

    values: list[float | None]
    errors: list[str | None]
    extras: list[dict[str, Any] | None]

    @classmethod
    def failed(cls, n: int, reason: str) -> Scores:
        return cls([None] * n, [reason] * n, [None] * n)


def is_groupwise(reward: object) -> bool:
    return bool(getattr(reward, "groupwise", False))


def takes_metadata(reward: object) -> bool:
    try:
        params = inspect.signature(reward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "metadata" or p.kind is p.VAR_KEYWORD for p in params)


def call_reward(
    reward: Any,
    images: torch.Tensor,
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]] | None = None,
) -> torch.Tensor:
    """``reward(images, prompts[, metadata=])`` as ``[N]`` float32 on the CPU; a wrong shape raises."""
    n = images.shape[0]
    if takes_metadata(reward):
        out = reward(images, list(prompts), metadata=[dict(m) for m in metadata or [{}] * n])
    else:
        out = reward(images, list(prompts))
    values = torch.as_tensor(out).detach().to("cpu", torch.float32).reshape(-1)
    if values.numel() != n:
        raise ValueError(f"returned {values.numel()} values for {n} samples")
    return values


def score(
    reward: Any,
    images: torch.Tensor,
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]] | None = None,
    *,
    reraise: tuple[type[BaseException], ...] = (),
) -> Scores:
    """Call ``reward`` once on all of ``images``: a raise fails every sample (with its reason), a
    non-finite value fails its sample. Exceptions of the ``reraise`` types propagate (the server
    retries a call that ran out of GPU memory in halves)."""
    n = images.shape[0]
    try:
        values = call_reward(reward, images, prompts, metadata)
    except reraise:
        raise
    except Exception as exc:  # a reward is user code: its failure is reported, never fatal
        return Scores.failed(n, f"raised {type(exc).__name__}: {exc}")
    extras = getattr(reward, "last_extras", None)
    extras = list(extras) if isinstance(extras, Sequence) and len(extras) == n else [None] * n
    out: list[float | None] = []
    errors: list[str | None] = []
    for v in values.tolist():
        ok = math.isfinite(v)
        out.append(v if ok else None)
        errors.append(None if ok else f"returned a non-finite value ({v})")
    return Scores(out, errors, extras)
