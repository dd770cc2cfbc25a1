"""How the benchmarks measure: synchronised clocks, medians and spreads, CUDA memory peaks, a time
budget, and where a weight push's time goes.

Timing is wall clock around a synchronised region (``torch.cuda.synchronize`` before each clock
read), after a warm-up, as the median of *interleaved* repeats (stock, server, stock, server...), so
both sides see the same clocks and caches; speed claims are ratios from one run. The spread of the
repeats is reported beside the median so a reader can tell a difference from noise.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    """``fn()`` and its wall time, the device synchronised before both clock reads."""
    sync(device)
    t0 = time.perf_counter()
    value = fn()
    sync(device)
    return value, time.perf_counter() - t0


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def spread(xs: Iterable[float]) -> float:
    """(max - min) / median of repeats: the noise a difference must beat."""
    xs = list(xs)
    if len(xs) < 2:
        return 0.0
    m = statistics.median(xs)
    return (max(xs) - min(xs)) / m if m else 0.0


def reset_peak(device: str) -> None:
    """Start counting the peak of CUDA memory allocated from here (nothing off CUDA)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    """The CUDA memory allocated at the most since ``reset_peak``, GiB; None off CUDA."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


class Deadline:
    """A time budget shared by the phases of one run; a phase that would overrun is skipped."""

    def __init__(self, budget_s: float | None) -> None:
        self.budget_s = budget_s
        self.start = time.monotonic()

    def left(self) -> float:
        if self.budget_s is None:
            return float("inf")
        return self.budget_s - (time.monotonic() - self.start)

    def allows(self, estimate_s: float) -> bool:
        return self.left() >= estimate_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start


@contextlib.contextmanager
def push_phases() -> Any:
    """Where a ``push_weights`` call's time goes, from the trainer's side: patches the upload module
    for the duration and fills the yielded dict with ``parts_s`` (from the call to the start of the
    commit), ``commit_s``, ``hash_wait_s`` (after the commit, waiting for the trainer's own
    hashes) and ``check_s`` (the server's tensor checker). Timing only: nothing else changes."""
    from diffusion_rollout.client.weights import upload

    marks: dict[str, float] = {}
    real_check = upload._check_manifest

    def check(*args: Any, **kwargs: Any) -> Any:
        marks["check_start"] = time.perf_counter()
        try:
            return real_check(*args, **kwargs)
        finally:
            marks["check_end"] = time.perf_counter()

    real_push = upload.push_weights

    def push(client, *args: Any, **kwargs: Any) -> Any:
        real_update = client.update_weights

        def update(*a: Any, **kw: Any) -> Any:
            if kw.get("final"):
                marks["commit_start"] = time.perf_counter()
            try:
                return real_update(*a, **kw)
            finally:
                if kw.get("final"):
                    marks["commit_end"] = time.perf_counter()

        client.update_weights = update
        marks.clear()
        marks["start"] = time.perf_counter()
        try:
            return real_push(client, *args, **kwargs)
        finally:
            marks["end"] = time.perf_counter()
            del client.update_weights
            out.clear()
            if "commit_start" in marks:
                out["parts_s"] = marks["commit_start"] - marks["start"]
                out["commit_s"] = marks["commit_end"] - marks["commit_start"]
                after = marks.get("check_start", marks["end"])
                out["hash_wait_s"] = after - marks["commit_end"]
                out["check_s"] = marks.get("check_end", after) - after

    out: dict[str, float] = {}
    upload._check_manifest = check
    try:
        yield push, out
    finally:
        upload._check_manifest = real_check
