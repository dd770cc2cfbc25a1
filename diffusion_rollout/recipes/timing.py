"""Seconds per phase of an iteration on one timeline, and the device memory in use.

:class:`Phases` times the phases of an iteration (rollout, reward, replay with backward, push) with a
device synchronise at each boundary, and samples the GPU's memory in use by every process
(``torch.cuda.mem_get_info``) besides the trainer's own peak. Every span is on the recipe's clock
(:func:`clock`), so the sync/async timeline figure can lay iterations side by side.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

# The origin of every recorded span (``Phases.spans``): seconds since the recipe's process started.
CLOCK_ORIGIN = time.perf_counter()


def clock(t: float | None = None) -> float:
    """``t`` (a ``time.perf_counter()`` value; default now) on the recipe's timeline, in seconds."""
    return round((time.perf_counter() if t is None else t) - CLOCK_ORIGIN, 4)


class Phases:
    """Seconds per phase of one iteration, synchronised with the device; GPU memory in use sampled.

    ``spans`` keeps when each phase ran (``clock()`` seconds), for the sync/async timeline figure.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []
        self.device_used_max_gb = 0.0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            self.device_used_max_gb = max(self.device_used_max_gb, (total - free) / 2**30)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            t1 = time.perf_counter()
            self.seconds[name] = self.seconds.get(name, 0.0) + t1 - t0
            self.spans.append((name, clock(t0), clock(t1)))

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"{k}_s": round(v, 4) for k, v in self.seconds.items()}
        out["spans"] = [list(span) for span in self.spans]
        if self.device.type == "cuda":
            out["trainer_peak_gb"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
            out["device_used_max_gb"] = round(self.device_used_max_gb, 3)
        return out
