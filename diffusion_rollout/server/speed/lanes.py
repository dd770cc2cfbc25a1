"""Pipeline lanes: several pipeline calls in flight at once (``pipeline_lanes``, default 1).

Why: one pipeline call at a time leaves the GPU idle between kernels (each launch waits on the
Python that issues it) and during a call's host-side work. A second call on its own thread and CUDA
stream fills those gaps with its kernels. On an H200 the stock SD3.5-medium pipeline running a
Flow-GRPO iteration's four batches of 16 on two lanes was 1.031x faster than back to back, and every
batch's images were bit-identical (``benchmarks/speed_options.py --phases grpo_lanes``).

Design decisions:

- **Lane 0 is the loaded pipeline itself**, so one lane is exactly the single-worker engine. Every
  other lane is a shallow copy of the pipeline object (``copy.copy``): its modules, the weights, are
  the *same* objects (an update, a LoRA or a memory move reaches every lane at once, and memory is
  not doubled), while every other component (schedulers, tokenizers, guiders, processors) is a deep
  copy. A pipeline call keeps its per-call state on the pipeline object and its scheduler, and a
  fast tokenizer must not be used by two threads at once ("Already borrowed").
- **Each lane has its own family adapter** bound to its own pipeline, with its own copies of the
  stock and rollout schedulers (copied in one ``deepcopy`` so the pipeline's scheduler stays the same
  object as the one it was, e.g. the rollout scheduler), so a family that swaps schedulers for a
  call swaps them on its own lane only.
- **Each lane has its own CUDA stream** (lanes > 1; one lane keeps the default stream), lane 0's at
  the highest priority so the lanes' batches finish staggered rather than together. Kernels do
  not depend on what runs beside them, so every call computes the same bits as on one lane; only
  the interleaving differs. Tensors one lane hands to another (cached prompt encodings) are made
  complete before they are shared and marked used by the consuming stream (``share_tensors``), so
  neither a read of unfinished data nor a reuse of freed memory can happen.
- **Only the denoisers run concurrently.** Other modules may keep per-call state on themselves
  (Wan's VAE caches features of earlier frames on the module while it decodes frame by frame), so
  with lanes > 1 every shared module other than the denoisers takes a per-module lock around its
  ``encode``/``decode``/``forward``: one lane at a time issues its kernels (which still overlap the
  other lane's denoising on the GPU). The test suite compares every family's two-lane outputs with
  one lane's, bit for bit.
- **Built once, at load.** Weight updates, LoRA and memory moves change the shared modules in
  place (nothing in the server replaces a module object), so every lane sees them as they land.
- Speed options that keep state on a shared module (CUDA graphs' static buffers, compiled blocks,
  feature-cache hooks, context-parallel ranks) cannot run two calls at once: the config refuses
  them with lanes > 1, and a ``feature_cache`` request gets a 400.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_rollout.server.core.loader import LoadedPipeline, denoisers
from diffusion_rollout.server.families import FamilyAdapter, adapter_for

_GUARDED_METHODS = ("encode", "decode", "forward")
_LOCK_ATTR = "_diffusion_rollout_lane_lock"


@dataclass
class Lane:
    index: int
    loaded: LoadedPipeline
    adapter: FamilyAdapter
    stream: Any = None  # torch.cuda.Stream on CUDA with lanes > 1

    @property
    def pipe(self) -> Any:
        return self.loaded.pipe


def _modules(pipe: Any) -> dict[str, Any]:
    return {n: c for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)}


def twin_of(pipe: Any, memo: dict[int, Any] | None = None) -> Any:
    """A pipeline object of its own over ``pipe``'s modules: every other component is a deep copy
    (made through ``memo``, so objects copied with the same memo keep their identities)."""
    memo = {} if memo is None else memo
    twin = copy.copy(pipe)
    for name, component in pipe.components.items():
        if component is not None and not isinstance(component, torch.nn.Module):
            # Plain attribute assignment: the class and so the pipeline's config stay the same.
            object.__setattr__(twin, name, copy.deepcopy(component, memo))
    return twin


def twin_pipeline(loaded: LoadedPipeline) -> LoadedPipeline:
    """``loaded`` with a pipeline object of its own: the same modules, copies of everything else."""
    memo: dict[int, Any] = {}
    twin = twin_of(loaded.pipe, memo)
    # The loaded schedulers through the same memo: the twin's scheduler is the copy of whichever
    # of them the pipeline holds, so identity checks (``pipe.scheduler is rollout``) still hold.
    stock = copy.deepcopy(loaded.stock_scheduler, memo)
    rollout = copy.deepcopy(loaded.rollout_scheduler, memo)
    return dataclasses.replace(loaded, pipe=twin, stock_scheduler=stock, rollout_scheduler=rollout)


def guard_shared_modules(pipe: Any) -> None:
    """Give every non-denoiser module of ``pipe`` a lock around its entry points (idempotent)."""
    skip = {id(m) for m in denoisers(pipe).values()}
    for module in _modules(pipe).values():
        if id(module) in skip or getattr(module, _LOCK_ATTR, None) is not None:
            continue
        lock = threading.RLock()  # re-entrant: a VAE's forward calls its own encode and decode
        object.__setattr__(module, _LOCK_ATTR, lock)
        for name in _GUARDED_METHODS:
            method = getattr(module, name, None)
            if callable(method):
                # An instance attribute shadows the class's method for every caller of the module.
                object.__setattr__(module, name, _locked(method, lock))


def _locked(method, lock):
    @functools.wraps(method)
    def call(*args, **kwargs):
        with lock:
            return method(*args, **kwargs)

    return call


def make_lane(index: int, base: LoadedPipeline, adapter: FamilyAdapter, device: str, lanes: int) -> Lane:
    """Lane ``index`` of ``lanes``: lane 0 is ``base`` with ``adapter``; others are twins."""
    if lanes > 1:
        guard_shared_modules(base.pipe)
    stream = None
    if lanes > 1 and device.startswith("cuda"):
        # Lane 0 first on the GPU, the others in its gaps: the lanes' batches then end one after
        # another, not together, so the last batch's response tail (copies, encoding, transfer, the
        # client's decode) is one response long and the others' overlap the denoising still running.
        # (Lower numbers are higher priorities; torch maps them into the device's range.)
        stream = torch.cuda.Stream(device=device, priority=-1 if index == 0 else 0)
    if index == 0:
        return Lane(0, base, adapter, stream)
    loaded = twin_pipeline(base)
    own = adapter_for(loaded.pipe)
    own.setup_schedulers(loaded)
    return Lane(index, loaded, own, stream)


@contextlib.contextmanager
def on_lane_stream(lane: Lane) -> Iterator[None]:
    """Run the block's kernels on the lane's stream (a no-op without one)."""
    if lane.stream is None:
        yield
        return
    with torch.cuda.stream(lane.stream):
        yield


def finish_before_sharing(value: Any) -> Any:
    """Wait for the kernels that produced ``value`` (on this thread's stream) before another lane
    may read it; returns ``value``."""
    if next(_cuda_tensors(value), None) is not None:
        torch.cuda.current_stream().synchronize()
    return value


def share_tensors(value: Any) -> None:
    """Mark every CUDA tensor in ``value`` as used by this thread's stream, so the allocator does not
    hand its memory to another stream while this lane's queued kernels may still read it."""
    for t in _cuda_tensors(value):
        t.record_stream(torch.cuda.current_stream(t.device))


def _cuda_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The CUDA tensors of a nested dict/list/tuple structure."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _cuda_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _cuda_tensors(v)
