"""Inductor's compile workers, started with the load and ready before the warm-up compiles.

Why: inductor compiles a graph's Triton kernels in its worker pool only if the pool *is already up*
when the kernels are generated (``AsyncCompile.use_process_pool()`` checks that a first job has
finished). A server that compiles right after loading finds the pool still starting, so every kernel
is compiled later, one after another, on the worker thread, the first time it runs, with each of its
autotuning configs. The warm-up's stack samples on an H100 (SD3.5-medium, FP8 + compile, an empty
cache) showed exactly that: Dynamo and inductor took 36 s, then 345 s went to Triton compiling and
ptxas runs under ``CachingAutotuner.benchmark_one_config``, serially.

Design decisions:

- **Start with the load, wait before the warm-up.** :meth:`CompileWorkers.start` creates the pool and
  submits the readiness job as soon as the compile cache is open, so the workers (each a Python that
  imports torch) start while the weights load; :meth:`CompileWorkers.wait` blocks the warm-up until
  they answer, at most ``timeout_s``. A pool that does not come up in time is logged and the warm-up
  goes on: inductor then compiles in-process, as before, slower but correct.
- **No wait on a warm cache.** When the compile cache loaded artifacts for this key, the warm-up
  starts at once (:meth:`CompileWorkers.skip_wait`): its graphs come from the cache and compile no
  kernel, so the wait only added seconds (7.4 of a 45.7-s warm start on an H100). The pool goes on
  starting, and inductor uses it once it is up for anything the cache lacks.
- **Inductor decides the count.** ``torch._inductor.config.compile_threads`` (``TORCHINDUCTOR_COMPILE_THREADS``);
  with one thread, or in a daemonic process where inductor allows no pool, nothing starts and the
  report says why.
- **Reported** under ``/server_info`` ``speed.compile.workers``: the count, whether they were ready
  before the first compile, and the seconds the warm-up waited for them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0  # what a cold pool of 32 workers may take on a busy host


class CompileWorkers:
    """Inductor's compile worker pool for one compiled engine."""

    def __init__(self) -> None:
        self.workers = 1
        self.started = False
        self.ready = False
        self.wait_s: float | None = None
        self.why_not: str | None = None
        self.no_wait: str | None = None  # why the warm-up did not wait for the workers
        self._t0: float | None = None

    def start(self) -> None:
        """Create the pool and start its workers in the background (returns at once)."""
        if self.started:
            return
        try:  # private inductor API: a torch without it must not stop the load
            from torch._inductor import async_compile
            from torch._inductor.async_compile import AsyncCompile

            self.workers = int(async_compile.get_compile_threads())
        except Exception as exc:
            self.why_not = f"inductor's compile-thread count is not readable here: {exc!r}"
            logger.warning("inductor compile workers not started (%s): kernels compile in-process", exc)
            return
        if self.workers <= 1:
            self.why_not = "one compile thread (torch._inductor.config.compile_threads)"
            return
        # Private and newer than some torch versions: absent means no such restriction.
        if not getattr(async_compile, "_process_pool_allowed", lambda: True)():
            self.why_not = "inductor allows no worker pool in a daemonic process"
            return
        self._t0 = time.perf_counter()
        try:
            AsyncCompile.warm_pool()
            AsyncCompile.use_process_pool()  # submits the readiness job: the workers start now
        except Exception as exc:  # the warm-up still runs, compiling in-process
            self.why_not = f"pool did not start: {exc}"
            logger.warning("inductor compile workers did not start (%s): kernels compile in-process", exc)
            return
        self.started = True
        logger.info("inductor compile workers: %d starting beside the load", self.workers)

    def wait(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Block until the workers answer (at most ``timeout_s``), before anything compiles."""
        if not self.started or self.ready:
            return
        from torch._inductor.async_compile import AsyncCompile

        t0 = time.perf_counter()
        try:
            # use_process_pool() is inductor's own test: true once the readiness job has finished.
            while not (ready := AsyncCompile.use_process_pool()) and time.perf_counter() - t0 < timeout_s:
                time.sleep(0.05)
            self.ready = bool(ready)
            if not self.ready:
                self.why_not = f"not ready after {timeout_s:.0f} s"
        except Exception as exc:
            self.why_not = f"failed while starting: {exc!r}"
        if not self.ready:
            logger.warning("inductor compile workers %s: kernels compile in-process", self.why_not)
        self.wait_s = time.perf_counter() - t0
        if self.ready:
            logger.info(
                "inductor compile workers ready: %d, %.1f s after they started (the warm-up waited %.1f s)",
                self.workers, time.perf_counter() - (self._t0 or t0), self.wait_s,
            )  # fmt: skip

    def skip_wait(self, why: str) -> None:
        """Let the warm-up start without waiting for the workers, for ``why`` (reported)."""
        if self.started and not self.ready:
            self.no_wait = why
            logger.info("inductor compile workers: the warm-up does not wait for them (%s)", why)

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"workers": self.workers, "ready": self.ready}
        if self.no_wait is not None:
            out["no_wait"] = self.no_wait
        if self.wait_s is not None:
            out["wait_s"] = round(self.wait_s, 3)
        if self.why_not is not None:
            out["why_not"] = self.why_not
        return out
