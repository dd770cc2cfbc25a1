"""Compiled before ready: the warm-up of a ``--compile`` server.

Design decisions:

- **One compile for every batch size.** Each compiled block marks dimension 0 of its tensor inputs
  dynamic (``torch._dynamo.maybe_mark_dynamic``) before Dynamo sees them, so the graph compiled for
  batch 2 serves every batch of 2 or more. Dynamo specialises a dimension of size 1, so a block
  called with batch 1 (no CFG, one output) compiles once more. The warm-up therefore runs, for each
  shape, a call of ``min(2, max_batch_size)`` outputs and one of 1: every batch size up to
  ``max_batch_size`` (and beyond) then runs without compiling.
- **Through the real path.** Warm-up calls are ordinary plans put on the worker (prompt encoding,
  rollout scheduler, the pipeline call as requests make it), one denoising step each and latents
  only. Requests are refused (503, state ``warming``) until the warm-up ends.
- **Progress.** ``/health`` shows ``warmup``: shapes done / total, seconds so far, and an estimate
  (the last warm-up's seconds from the compile cache, else the mean of the calls done so far); each
  call is logged.
- **Counted by the compiler itself.** The blocks compile through a backend that wraps inductor's and
  counts every graph it is handed, and the seconds spent in it (:class:`CompileStats`): per engine,
  unlike Dynamo's process-wide counters. A graph compiled after the warm-up is a recompile
  (``/server_info`` ``speed.compile.recompiles``, ``/metrics``
  ``diffusion_rollout_compile_recompiles_total``); a cache hit still counts as a graph (Dynamo traces
  it, inductor loads it). The FX-graph and AOTAutograd cache hits and misses during the warm-up are
  read from ``torch._dynamo.utils.counters`` (process-wide, but nothing else compiles while a server
  warms up).
- **A request for a shape not warmed up** compiles in the foreground: it is answered once the
  compile is done (minutes for a large model on a GPU), and it is logged with the flag that would
  have warmed it. Running it eagerly instead would give it other numerics than the compiled requests
  next to it; a trainer that sends new sizes should list them in ``--warmup-shapes``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from diffusion_rollout.server.core.engine import Engine
    from diffusion_rollout.server.speed.warmup_profile import WarmupProfile

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- compiling blocks
class CompileStats:
    """Graphs the blocks' backend compiled and the seconds it took (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.graphs = 0
        self.seconds = 0.0
        self.graphs_at_ready: int | None = None  # set when the warm-up ends

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        """A ``torch.compile`` backend: inductor, counted."""
        from torch._inductor.compile_fx import compile_fx

        t0 = time.perf_counter()
        try:
            return compile_fx(gm, example_inputs)
        finally:
            with self._lock:
                self.graphs += 1
                self.seconds += time.perf_counter() - t0

    @property
    def recompiles(self) -> int:
        """Graphs compiled after the warm-up ended (0 before it ends)."""
        return 0 if self.graphs_at_ready is None else self.graphs - self.graphs_at_ready

    def report(self) -> dict[str, Any]:
        return {
            "graphs_compiled": self.graphs,
            "compile_s": round(self.seconds, 3),
            "recompiles": self.recompiles,
        }


def compile_block(block: torch.nn.Module, stats: CompileStats) -> None:
    """Regional ``torch.compile`` of one block, its inputs' batch dimension marked dynamic."""
    block.compile(backend=stats.backend)
    compiled = block._compiled_call_impl  # what nn.Module.__call__ runs once compile() is set

    def call(*args: Any, **kwargs: Any) -> Any:
        # Outside the compiled frame (Dynamo cannot trace the marking itself).
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(value, 0)
        return compiled(*args, **kwargs)

    block._compiled_call_impl = call


# --------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Shape:
    width: int
    height: int
    frames: int | None = None
    max_sequence_length: int | None = None  # None: the model's default text length
    # Read from the compile cache's served_shapes.json (server/speed/served_shapes.py): its warm-up may fail
    # without failing the start. Not part of the shape's identity.
    remembered: bool = field(default=False, compare=False)

    def __str__(self) -> str:
        text = f" (max_sequence_length={self.max_sequence_length})" if self.max_sequence_length else ""
        return f"{self.width}x{self.height}" + (f"x{self.frames}" if self.frames else "") + text


def parse_shapes(text: str | None) -> list[Shape] | None:
    """``"512x512,1024x768x33"`` -> shapes; None for unset (the model's default); [] for ``none``."""
    if text is None or not text.strip():
        return None
    if text.strip().lower() == "none":
        return []
    shapes = []
    for part in text.split(","):
        dims = part.strip().lower().split("x")
        if len(dims) not in (2, 3) or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise ValueError(
                f"warmup_shapes: {part.strip()!r} is not WIDTHxHEIGHT or WIDTHxHEIGHTxFRAMES (e.g. 512x512)"
            )
        nums = [int(d) for d in dims]
        shapes.append(Shape(nums[0], nums[1], nums[2] if len(nums) == 3 else None))
    return shapes


def shape_key(call: Any) -> tuple:
    """What of a pipeline call sets the blocks' input shapes, batch aside: size, frames, text length."""
    return (call.width, call.height, call.num_frames, call.max_sequence_length)


def warmup_batches(max_batch_size: int) -> list[int]:
    """Outputs per warm-up call: the dynamic-batch graph first, then batch 1 (module doc)."""
    return [2, 1] if max_batch_size >= 2 else [1]


# --------------------------------------------------------------------------- progress
@dataclass
class Warmup:
    """The warm-up's plan and progress (what ``/health`` and ``/server_info`` show)."""

    shapes: list[Shape]
    batches: list[int]
    estimate_s: float | None = None  # the last warm-up's seconds (compile cache), if known
    state: str = "pending"  # pending, warming, done, off
    done: int = 0
    started_at: float | None = None
    seconds: float | None = None  # when done
    # Cache lookups during the warm-up: {"fx_graph": (hits, misses), "aot_autograd": (hits, misses)}.
    cache: dict[str, tuple[int, int]] = field(default_factory=dict)
    calls: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)  # remembered shapes whose warm-up failed
    phases: dict[str, float] = field(default_factory=dict)  # seconds per compile phase (_PHASES)
    profile: dict[str, Any] | None = None  # --warmup-profile's files (server/speed/warmup_profile.py); None: off
    stage: str | None = None  # after the calls, before ready: "saving precompiled blocks"

    @property
    def total(self) -> int:
        return len(self.shapes) * len(self.batches)

    def begin(self) -> None:
        """Warming from now on; the clock starts once (a wait for compile workers counts in it)."""
        self.state = "warming"
        if self.started_at is None:
            self.started_at = time.monotonic()

    def elapsed(self) -> float:
        if self.seconds is not None:
            return self.seconds
        return 0.0 if self.started_at is None else time.monotonic() - self.started_at

    def remaining_s(self) -> float | None:
        elapsed = self.elapsed()
        guesses = []
        if self.estimate_s is not None:
            guesses.append(max(0.0, self.estimate_s - elapsed))
        if self.done:  # the first call of a shape compiles, the rest are quick: an upper bound
            guesses.append(elapsed / self.done * (self.total - self.done))
        return min(guesses) if guesses else None

    def report(self) -> dict[str, Any]:
        remaining = self.remaining_s() if self.state == "warming" else None
        return {
            "state": self.state,
            "done": self.done,
            "total": self.total,
            "shapes": [str(s) for s in self.shapes],
            "batch_sizes": self.batches,
            "elapsed_s": round(self.elapsed(), 3),
            "estimate_remaining_s": None if remaining is None else round(remaining, 1),
            **{f"{kind}_cache_hits": hm[0] for kind, hm in self.cache.items()},
            **{f"{kind}_cache_misses": hm[1] for kind, hm in self.cache.items()},
            "remembered_shapes": [str(s) for s in self.shapes if s.remembered],
            "calls": self.calls,
            **({"skipped": self.skipped} if self.skipped else {}),
            "phases": self.phases,
            **({"stage": self.stage} if self.stage is not None else {}),
            **({"profile": self.profile} if self.profile is not None else {}),
        }

    def describe(self) -> str:
        """The 503 message while warming."""
        if self.stage is not None:
            return (
                f"compiling for the expected request shapes before serving: {self.done}/{self.total} "
                f"warm-up calls done in {self.elapsed():.0f} s; now {self.stage}"
            )
        left = self.remaining_s()
        about = f", about {left:.0f} s left" if left is not None else ""
        return (
            f"compiling for the expected request shapes before serving: {self.done}/{self.total} "
            f"warm-up calls done, {self.elapsed():.0f} s so far{about}"
        )


def _cache_counts() -> dict[str, tuple[int, int]]:
    """Inductor's FX-graph cache and AOTAutograd's cache: (hits, misses) so far in this process."""
    from torch._dynamo.utils import counters

    return {
        "fx_graph": (counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]),
        "aot_autograd": (
            counters["aot_autograd"]["autograd_cache_hit"],
            counters["aot_autograd"]["autograd_cache_miss"],
        ),
    }


# Dynamo's own timers (``torch._dynamo.utils.compile_times``) for the phases that split a warm-up:
# all of Dynamo's compile (``_compile.compile_inner``) = tracing the bytecode + the backend (AOTAutograd
# and inductor, or their caches) + guards; ``async_compile.wait`` is inductor waiting for its kernels.
# What the warm-up spends outside ``_compile.compile_inner`` is running: the first launches, Triton's
# runtime autotuning, the eager parts of the pipeline.
_PHASES = {
    "_compile.compile_inner": "dynamo_total_s",
    "bytecode_tracing": "dynamo_tracing_s",
    "OutputGraph.call_user_compiler": "backend_s",
    "create_aot_dispatcher_function": "aot_autograd_s",
    "fx_codegen_and_compile": "inductor_codegen_s",
    "async_compile.wait": "kernel_compile_wait_s",
    "build_guards": "guards_s",
}


def _compile_phases() -> dict[str, float]:
    """Seconds so far in this process per phase of ``_PHASES`` (0 for a phase not entered)."""
    from torch._dynamo.utils import compile_times

    try:
        names, values = compile_times(repr="csv", aggregate=True)  # type: ignore[misc]
    except Exception:  # a private API: its shape may change between torch versions
        return {}
    seconds = dict(zip(names, values, strict=False))
    return {key: float(seconds.get(name, 0.0)) for name, key in _PHASES.items()}


def run_warmup(engine: Engine, warmup: Warmup, profile: WarmupProfile | None = None) -> set[tuple]:
    """Compile the blocks for every warm-up shape and batch (on the caller's thread, through the
    engine's worker), updating ``warmup`` as it goes; returns the ``(width, height, frames)`` of the
    calls it made. With ``profile`` (``--warmup-profile``), each call runs under cProfile on the
    worker thread and the worker's stack is sampled until the warm-up ends (server/speed/warmup_profile.py)."""
    counts0, phases0 = _cache_counts(), _compile_phases()
    warmup.begin()
    if profile is None:
        return _warm_shapes(engine, warmup, None, counts0, phases0)
    profile.start()
    warmup.profile = profile.report()
    engine.worker.batch_hook = profile.around_call
    try:
        return _warm_shapes(engine, warmup, profile, counts0, phases0)
    finally:
        engine.worker.batch_hook = None
        profile.stop()
        warmup.profile = profile.report()


def _warm_shapes(
    engine: Engine,
    warmup: Warmup,
    profile: WarmupProfile | None,
    counts0: dict[str, tuple[int, int]],
    phases0: dict[str, float],
) -> set[tuple]:
    from diffusion_rollout.server.core.params import GenerateParams

    a = engine.adapter
    est = f"; the last one took {warmup.estimate_s:.0f} s" if warmup.estimate_s is not None else ""
    logger.info(
        "warm-up: compiling for %d shape(s) (%s) x batch %s before serving%s",
        len(warmup.shapes), ", ".join(map(str, warmup.shapes)), warmup.batches, est,
    )  # fmt: skip
    stats = engine.loaded.speed.compile_stats
    warmed: set[tuple] = set()
    for shape in warmup.shapes:
        for n in warmup.batches:
            params = GenerateParams(
                prompt="warm-up",
                seed=0,
                width=shape.width,
                height=shape.height,
                num_inference_steps=1,
                num_outputs_per_prompt=n,
                rollout=False,
                return_generated_output=False,
                request_id=f"warmup-{str(shape).replace(' ', '')}-b{n}",
            )
            if shape.max_sequence_length is not None:
                params.max_sequence_length = shape.max_sequence_length
            if a.is_video:
                params.num_frames = shape.frames or a.request_frames()
            if a.image_inputs:
                from diffusion_rollout.server.core.images import probe_image_png

                params.image_data = [probe_image_png(min(shape.width, shape.height))]
            graphs0, t0 = stats.graphs if stats else 0, time.perf_counter()
            try:
                plan = engine.plan(params)
                engine.worker.submit(plan.job(params.request_id)).result()
            except Exception as exc:
                if not shape.remembered:
                    raise
                # A shape an earlier start served may not fit this one (other limits, less memory).
                why = f"{type(exc).__name__}: {str(exc)[:300]}"
                warmup.skipped.append({"shape": str(shape), "error": why})
                warmup.done += len(warmup.batches) - warmup.batches.index(n)
                logger.warning("warm-up: skipping the remembered shape %s (%s); it is forgotten", shape, why)
                break
            warmed.add(shape_key(plan.call))
            seconds = time.perf_counter() - t0
            if profile is not None:  # written here, after the call is timed
                profile.write_pending()
                warmup.profile = profile.report()
            warmup.done += 1
            graphs = (stats.graphs if stats else 0) - graphs0
            warmup.calls.append(
                {"shape": str(shape), "batch": n, "seconds": round(seconds, 3), "graphs": graphs}
            )
            left = warmup.remaining_s()
            logger.info(
                "warm-up %d/%d: %s batch %d in %.1f s (%d graph(s) compiled; %.1f s so far%s)",
                warmup.done, warmup.total, shape, n, seconds, graphs, warmup.elapsed(),
                f", about {left:.0f} s left" if left is not None else "",
            )  # fmt: skip
    warmup.cache = {
        kind: (hits - counts0[kind][0], misses - counts0[kind][1])
        for kind, (hits, misses) in _cache_counts().items()
    }
    warmup.seconds = time.monotonic() - warmup.started_at
    phases = {k: round(v - phases0.get(k, 0.0), 3) for k, v in _compile_phases().items()}
    if phases:
        phases["outside_dynamo_s"] = round(warmup.seconds - phases["dynamo_total_s"], 3)
    warmup.phases = phases
    warmup.state = "done"
    logger.info(
        "warm-up done in %.1f s: %d graph(s) compiled; cache hits/misses: %s; seconds by phase: %s",
        warmup.seconds, stats.graphs if stats else 0,
        ", ".join(f"{kind} {h}/{m}" for kind, (h, m) in warmup.cache.items()),
        ", ".join(f"{k} {v:.1f}" for k, v in phases.items()) or "unknown",
    )  # fmt: skip
    return warmed
