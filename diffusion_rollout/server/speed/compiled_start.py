"""A compiled engine's start: its compile cache, its warm-up before ready, the shapes it warmed.

Design decisions:

- The engine holds one :class:`CompiledStart` and calls it at six points: ``load`` (open the keyed
  cache before anything compiles, and start inductor's compile workers, ``server/speed/compile_workers.py``,
  so that they come up while the weights load), ``start`` (wait for the workers, warm up, then mark
  the graphs compiled so far as the baseline for recompiles), ``after_ready`` (a restart's save of
  new precompiled blocks, put off until the server is idle: server/speed/idle_save.py), each pipeline call (a shape the warm-up did not cover is logged once),
  each finished compiled call (its shape is remembered in the cache for the next start's warm-up),
  and the reports (``/server_info``, ``/health``, ``/metrics``). The how of each lives in
  ``server/speed/warmup.py``, ``server/speed/compile_cache.py`` and ``server/speed/served_shapes.py``; this module only
  keeps their state together, so the engine stays about batches.
- An engine that does not compile never fills it: every report is None and nothing is imported
  beyond those two modules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from diffusion_rollout.server.speed.compile_cache import CompileCache, cache_key
from diffusion_rollout.server.speed.compile_workers import CompileWorkers
from diffusion_rollout.server.speed.idle_save import run_when_idle
from diffusion_rollout.server.speed.precompiled_blocks import FOLDER, PrecompiledBlocks
from diffusion_rollout.server.speed.served_shapes import ServedShapes
from diffusion_rollout.server.speed.warmup import (
    Shape,
    Warmup,
    parse_shapes,
    run_warmup,
    shape_key,
    warmup_batches,
)

if TYPE_CHECKING:
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.server.core.engine import Engine

logger = logging.getLogger(__name__)


class CompiledStart:
    """The warm-up, the compile cache and the warmed shapes of one engine."""

    def __init__(self) -> None:
        self.warmup: Warmup | None = None
        self.cache: CompileCache | None = None
        self.warmed: set[tuple] = set()
        self.workers: CompileWorkers | None = None
        self.precompiled: PrecompiledBlocks | None = None
        self.served: ServedShapes | None = None  # the shapes file of a trusted cache (served_shapes.py)

    def open_cache(
        self, config: ServerConfig, model_path: str | None, device: str, dtype: torch.dtype
    ) -> None:
        """Open and activate the keyed compile-cache folder, unless it is off or already open."""
        root = config.resolved_compile_cache()
        if root is None or self.cache is not None:
            return
        key, facts = cache_key(
            model_path=model_path,
            device=device,
            dtype=dtype,
            quantize=config.quantize,
            attention_backend=config.attention_backend,
        )
        self.cache = CompileCache(Path(root), key, facts)
        self.cache.activate()
        if self.cache.trusted:
            self.served = ServedShapes(self.cache.folder)

    def start_workers(self) -> None:
        """Start inductor's compile workers now (after the cache folder is set: they inherit it)."""
        if self.workers is None:
            self.workers = CompileWorkers()
            self.workers.start()

    def warm_up(self, engine: Engine, on_warming: Callable[[], None]) -> None:
        """Compile for the expected request shapes (``on_warming`` first, when there are any), save
        the cache, and take the graphs compiled so far as the baseline for recompiles."""
        shapes = self._shapes(engine)
        self.warmup = Warmup(
            shapes=shapes,
            batches=warmup_batches(engine.config.max_batch_size),
            estimate_s=self.cache.last_warmup_s() if self.cache is not None else None,
        )
        self._attach_precompiled(engine)
        if not shapes:
            if self.precompiled is not None:
                self.precompiled.stop_capture()
            self.warmup.state = "off"
            logger.info("warm-up off (warmup_shapes=none): each new shape compiles on its first request")
        else:
            on_warming()
            if self.workers is not None:
                self.warmup.begin()  # the wait is part of the warm-up's seconds and of /health's progress
                cached = self.cache.loaded_artifacts if self.cache is not None else 0
                if cached:  # a restart: the kernels come from the cache, a wait would only add seconds
                    self.workers.skip_wait(f"the compile cache had {cached} artifacts for this key")
                else:  # else every kernel compiles in-process, serially (compile_workers.py)
                    self.workers.wait()
            self.warmed = run_warmup(engine, self.warmup, _profile(engine))
            if self.warmup.skipped and self.served is not None:  # remembered shapes that failed to warm
                failed = {skip["shape"] for skip in self.warmup.skipped}
                self.served.forget([s for s in shapes if str(s) in failed])
            if self.precompiled is not None and self.precompiled.captured() and self.precompiled.loaded:
                self.precompiled.hold_capture()  # a restart: saved once idle after ready (idle_save.py)
            elif self.precompiled is not None and self.precompiled.captured():
                self.warmup.stage = "saving precompiled blocks for the next start"
                self.precompiled.save()  # the next start loads them: its warm-up traces none
                self.warmup.stage = None
            elif self.precompiled is not None:
                self.precompiled.stop_capture()  # every kind of call the warm-up made had its artifact
            if self.cache is not None:
                self.cache.save(self.warmup.seconds)
        stats = engine.loaded.speed.compile_stats
        if stats is not None:
            stats.graphs_at_ready = stats.graphs

    def after_ready(self, engine: Engine) -> None:
        """A save the warm-up put off runs once the server is idle (server/speed/idle_save.py)."""
        blocks = self.precompiled
        if blocks is None or not blocks.save_pending:
            return

        def save() -> None:
            if blocks.save_pending:  # a weight change may have dropped it while it was queued
                blocks.save()
                if self.cache is not None:
                    self.cache.save(self.warmup.seconds)  # with what the save compiled

        run_when_idle(
            engine, save, lambda: blocks.save_pending, "precompiled blocks: saving for the next start"
        )

    def _shapes(self, engine: Engine) -> list[Shape]:
        """What the warm-up compiles: ``--warmup-shapes`` when given (``none``: nothing); else the
        model's default size, then the shapes earlier starts on this cache key served
        (server/speed/served_shapes.py), unless ``--no-warmup-remembered-shapes``."""
        shapes = parse_shapes(engine.config.warmup_shapes)
        remembered = self.served.load() if self.served is not None else []
        if shapes is not None:
            if remembered:
                logger.info(
                    "warm-up: --warmup-shapes given, so the %d shape(s) remembered in %s are not warmed",
                    len(remembered), self.served.path,
                )  # fmt: skip
            return shapes
        height, width = engine.adapter.default_size()
        shapes = [Shape(width, height)]
        if not remembered:
            return shapes
        if not engine.config.warmup_remembered_shapes:
            logger.info(
                "warm-up: %d shape(s) remembered in %s, not warmed (--no-warmup-remembered-shapes)",
                len(remembered), self.served.path,
            )  # fmt: skip
            return shapes
        extra = [s for s in remembered if s not in shapes]
        if extra:
            logger.info(
                "warm-up: also the %d shape(s) earlier starts served, remembered in %s: %s "
                "(--no-warmup-remembered-shapes turns this off; --warmup-shapes replaces it)",
                len(extra), self.served.path, ", ".join(map(str, extra)),
            )  # fmt: skip
        return shapes + extra

    def _attach_precompiled(self, engine: Engine) -> None:
        """With a compile cache: route the compiled blocks through the precompiled artifacts, loading
        those an earlier start saved (server/speed/precompiled_blocks.py)."""
        if self.cache is None or not self.cache.trusted or not engine.config.precompile_blocks:
            return  # a refused cache: nothing is loaded from it or saved into it (compile_cache.py)
        if self.precompiled is not None:
            return
        from diffusion_rollout.server.core.loader import denoisers, repeated_blocks

        self.precompiled = PrecompiledBlocks(self.cache.folder / FOLDER)
        for model in denoisers(engine.loaded.pipe).values():
            self.precompiled.attach(repeated_blocks(model))
        self.precompiled.load()

    def weights_changed(self) -> None:
        """The weights or modules changed: the precompiled blocks are off from now on."""
        if self.precompiled is not None:
            self.precompiled.turn_off("the weights or modules changed")

    def note_new_shape(self, call: Any) -> None:
        """A shape the warm-up did not cover compiles now, in the foreground (server/speed/warmup.py)."""
        shape = shape_key(call)
        if shape in self.warmed:
            return
        self.warmed.add(shape)
        frames = f"x{call.num_frames}" if call.num_frames else ""
        logger.info(
            "first request at %dx%d%s (max_sequence_length=%s), which the warm-up did not cover: "
            "compiling now, the request waits (add the size to --warmup-shapes to compile it before ready)",
            call.width, call.height, frames, call.max_sequence_length,
        )  # fmt: skip

    def note_served(self, call: Any) -> None:
        """A compiled call of a ready server finished: its shape is remembered for the next start."""
        if self.served is not None:
            self.served.served(shape_key(call))

    # ------------------------------------------------------------------ reports
    def describe_warming(self) -> str:
        """The 503 message while warming."""
        return self.warmup.describe() if self.warmup is not None else "compiling before serving"

    def warmup_report(self) -> dict[str, Any] | None:
        """The warm-up's progress (``/health``), or None when this server does not compile."""
        return self.warmup.report() if self.warmup is not None else None

    def add_to(self, compile_info: dict[str, Any]) -> None:
        """Add the warm-up and the cache to ``/server_info``'s ``speed.compile``."""
        compile_info["warmup"] = self.warmup_report()
        compile_info["cache"] = self.cache.report() if self.cache is not None else None
        compile_info["workers"] = self.workers.report() if self.workers is not None else None
        compile_info["precompiled"] = self.precompiled.report() if self.precompiled is not None else None
        compile_info["served_shapes"] = self.served.report() if self.served is not None else None

    def metrics(self, stats: Any) -> dict[str, float] | None:
        """The compile series of ``/metrics`` from the blocks' ``CompileStats`` (None: no compile)."""
        if stats is None:
            return None
        out = {"graphs": stats.graphs, "seconds": stats.seconds, "recompiles": stats.recompiles}
        if self.warmup is not None:
            out["warmup_seconds"] = self.warmup.elapsed()
            out["warmed_shapes"] = len(self.warmup.shapes) if self.warmup.state == "done" else 0
        return out


def _profile(engine: Engine) -> Any:
    """``--warmup-profile``'s recorder for this warm-up, or None (unset: nothing imported or made)."""
    folder = engine.config.warmup_profile
    if folder is None:
        return None
    from diffusion_rollout.server.speed.warmup_profile import WarmupProfile

    return WarmupProfile(
        Path(folder),
        engine.config.warmup_profile_interval_s,
        engine.worker.thread_ids,
        cprofile=engine.config.warmup_profile_cprofile,
    )
