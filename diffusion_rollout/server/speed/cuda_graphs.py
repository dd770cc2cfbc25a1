"""CUDA-graph replay of the eager denoiser, one graph per input-shape bucket (``--cuda-graphs``).

A denoiser forward at batch 1-4 is launch-bound on a modern GPU: hundreds of small kernels whose
launch latency exceeds their run time. Replaying the forward as a captured CUDA graph removes that
latency without changing a single kernel, so the result is the eager result bit for bit.

Design decisions:

- **Same kernels as eager.** The graph records the module's own eager ``forward`` (no compile, no
  fusion); inputs are copied into static buffers before each replay and the output is cloned out
  after it, so nothing but the launch mechanism changes. The ODE regression gate and the replay
  ratio test (``tests/server/speed/test_cuda_graphs.py``, GPU only) check this with ``torch.equal``.
- **One bucket per call signature.** The key is the shape, dtype, stride and device of every tensor
  argument plus the value of every other argument (a scale baked into the graph must be part of its
  key). The first call of a new key runs eager (which also creates the cuBLAS handles before any
  capture) and returns that eager result; the graph is captured right after and replayed from the
  second call on. An argument of a type the key cannot describe, or a forward that cannot be
  captured (a host sync inside it), runs eager: correctness never depends on capture succeeding.
- **Bounded memory.** At most ``max_buckets`` graphs per server; further shapes run eager (counted as
  ``eager_calls``). All graphs share one memory pool: safe because replays are sequential on the
  worker thread and every output is cloned before the next replay. ``report()`` (``/server_info``)
  lists the buckets and the memory the captures reserved.
- **Graphs read the weights' memory, not their values.** In-place weight updates are therefore seen
  by the next replay, but anything that replaces parameters or adds modules (LoRA, memory release and
  resume) would leave a graph pointing at stale memory: the engine calls ``invalidate()`` whenever
  the weight version changes or memory is resumed, and the next call captures afresh.
- **Only inside the engine's pipeline calls** (``engaged()``, a per-thread switch): any other call of
  the same module (a stock pipeline sharing it, a trainer's in-process replay, autograd) runs eager.
  The engine does not engage graphs for a call with a feature cache: caches branch on values at run
  time, which a graph would freeze.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

_UNKEYABLE = object()


def _key_of(obj: Any) -> Any:
    """A hashable description of an argument, or ``_UNKEYABLE``."""
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), obj.dtype, tuple(obj.stride()), str(obj.device))
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        parts = tuple(_key_of(v) for v in obj)
        return _UNKEYABLE if any(p is _UNKEYABLE for p in parts) else (type(obj).__name__, parts)
    if isinstance(obj, dict):
        parts = tuple((k, _key_of(v)) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0])))
        return _UNKEYABLE if any(p is _UNKEYABLE for _, p in parts) else ("dict", parts)
    return _UNKEYABLE


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a nested argument structure, in a fixed order (the key's order)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    if isinstance(obj, dict):
        return [t for _, v in sorted(obj.items(), key=lambda kv: str(kv[0])) for t in _tensors(v)]
    return []


def _clone_structure(obj: Any) -> Any:
    """The same structure with every tensor cloned (static buffers of a capture)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, list):
        return [_clone_structure(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone_structure(v) for v in obj)
    if isinstance(obj, dict):
        items = {k: _clone_structure(v) for k, v in obj.items()}
        # diffusers' output classes (return_dict=True) are dict subclasses built from keywords.
        return items if type(obj) is dict else type(obj)(**items)
    return obj


def _describe(key: Any) -> str:
    """Shapes of the tensor arguments of a key, for the report (``[2,16,64,64] bf16``...)."""
    shapes = []

    def walk(k: Any) -> None:
        if isinstance(k, tuple) and k and k[0] == "T":
            shapes.append(f"{list(k[1])} {str(k[2]).replace('torch.', '')}")
        elif isinstance(k, tuple):
            for v in k:
                walk(v)

    walk(key)
    return "; ".join(shapes)


@dataclass
class _Bucket:
    graph: torch.cuda.CUDAGraph
    static_inputs: list[torch.Tensor]
    static_output: Any
    module: str
    description: str
    reserved_mib: float
    replays: int = 0


@dataclass
class _Stats:
    captures: int = 0
    capture_failures: int = 0
    eager_calls: int = 0
    replays: int = 0
    invalidations: int = 0
    failed_keys: set = field(default_factory=set)


class CudaGraphRunner:
    """Installs graph replay on the given denoisers' ``forward``; see the module docstring."""

    def __init__(self, modules: dict[str, torch.nn.Module], *, max_buckets: int = 8) -> None:
        if not torch.cuda.is_available():
            raise ValueError("cuda_graphs needs a CUDA device; this process has none")
        self.max_buckets = max_buckets
        self._modules = modules
        self._buckets: OrderedDict[tuple, _Bucket] = OrderedDict()
        self._stats = _Stats()
        self._pool = torch.cuda.graph_pool_handle()
        self._engaged = threading.local()
        self._originals: dict[str, Any] = {}
        for name, module in modules.items():
            self._install(name, module)

    # ------------------------------------------------------------------ installation
    def _install(self, name: str, module: torch.nn.Module) -> None:
        eager = module.forward  # the bound class method: what every replay reproduces
        self._originals[name] = eager

        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._call(name, module, eager, args, kwargs)

        # An instance attribute shadows the class's forward; nn.Module.__call__ still runs the
        # module's hooks (the rollout recorder's pre-hooks see the real inputs) and then this.
        module.forward = forward

    def uninstall(self) -> None:
        for module in self._modules.values():
            if "forward" in module.__dict__:
                del module.forward
        self.invalidate()

    # ------------------------------------------------------------------ control
    @contextlib.contextmanager
    def engaged(self) -> Iterator[None]:
        """Replay graphs for this thread's forwards inside this block (eager everywhere else)."""
        previous = getattr(self._engaged, "on", False)
        self._engaged.on = True
        try:
            yield
        finally:
            self._engaged.on = previous

    def invalidate(self) -> None:
        """Drop every captured graph (weights replaced, modules changed, memory moved)."""
        if self._buckets:
            self._stats.invalidations += 1
            logger.info("cuda graphs: dropping %d captured bucket(s)", len(self._buckets))
        self._buckets.clear()
        self._stats.failed_keys.clear()
        self._pool = torch.cuda.graph_pool_handle()

    def report(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "max_buckets": self.max_buckets,
            "captured": len(self._buckets),
            "captures": self._stats.captures,
            "capture_failures": self._stats.capture_failures,
            "replays": self._stats.replays,
            "eager_calls": self._stats.eager_calls,
            "invalidations": self._stats.invalidations,
            "reserved_mib": round(sum(b.reserved_mib for b in self._buckets.values()), 1),
            "buckets": [
                {
                    "module": b.module,
                    "inputs": b.description,
                    "replays": b.replays,
                    "reserved_mib": b.reserved_mib,
                }
                for b in self._buckets.values()
            ],
        }

    # ------------------------------------------------------------------ the call
    def _call(self, name: str, module: torch.nn.Module, eager, args: tuple, kwargs: dict) -> Any:
        if not getattr(self._engaged, "on", False) or torch.is_grad_enabled():
            # Training-mode calls (autograd) are never graphed: the graph holds no autograd tape.
            self._stats.eager_calls += 1
            return eager(*args, **kwargs)
        inputs = (args, kwargs)
        parts = _key_of(inputs)
        tensors = _tensors(inputs)
        if parts is _UNKEYABLE or any(t.device.type != "cuda" for t in tensors):
            self._stats.eager_calls += 1
            return eager(*args, **kwargs)
        key = (name, parts)
        bucket = self._buckets.get(key)
        if bucket is not None:
            return self._replay(bucket, tensors)
        if key in self._stats.failed_keys or len(self._buckets) >= self.max_buckets:
            self._stats.eager_calls += 1
            return eager(*args, **kwargs)
        return self._capture(key, name, eager, args, kwargs)

    def _replay(self, bucket: _Bucket, tensors: list[torch.Tensor]) -> Any:
        for static, value in zip(bucket.static_inputs, tensors, strict=True):
            if static.data_ptr() != value.data_ptr():
                static.copy_(value)
        bucket.graph.replay()
        bucket.replays += 1
        self._stats.replays += 1
        # The static output is overwritten by the next replay (CFG calls the model twice per step):
        # hand out a copy.
        return _clone_structure(bucket.static_output)

    def _capture(self, key: tuple, name: str, eager, args: tuple, kwargs: dict) -> Any:
        # This call's own result, computed eagerly on the usual stream (exactly what eager would
        # return); it also creates the cuBLAS/cuDNN handles, which must not happen inside a capture.
        out = eager(*args, **kwargs)
        static_args, static_kwargs = _clone_structure(args), _clone_structure(kwargs)
        reserved = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: other threads (HTTP uploads into pinned buffers, the results thread) may
            # keep making CUDA calls while this thread captures.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                static_out = eager(*static_args, **static_kwargs)
        except Exception as exc:  # a host sync or unsupported op inside forward: stay eager
            self._stats.capture_failures += 1
            self._stats.failed_keys.add(key)
            logger.warning("cuda graphs: %s cannot be captured for %s (%s); it runs eager", name, key, exc)
            torch.cuda.synchronize()
            return out
        reserved_mib = (torch.cuda.memory_reserved() - reserved) / 2**20
        bucket = _Bucket(
            graph=graph,
            static_inputs=_tensors((static_args, static_kwargs)),
            static_output=static_out,
            module=name,
            description=_describe(key[1]),
            reserved_mib=round(reserved_mib, 1),
        )
        self._buckets[key] = bucket
        self._stats.captures += 1
        logger.info(
            "cuda graphs: captured %s bucket %d/%d (%s), %.1f MiB",
            name,
            len(self._buckets),
            self.max_buckets,
            bucket.description,
            reserved_mib,
        )
        return out
