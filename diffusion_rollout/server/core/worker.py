"""The worker threads that own the pipeline, fed by a bounded job queue.

Design decisions:
- Everything that touches the pipeline (generation batches, weight updates, memory moves) runs on
  the worker's lane threads, in queue order: one lane by default, ``lanes`` batches in flight at
  once with ``pipeline_lanes`` (each lane runs whole batches; the engine gives every lane its own
  pipeline object and stream). An admin job is exclusive: it starts only once every lane is idle,
  and no lane starts a batch while it runs. A weight update therefore lands between batches, never
  under a running denoising loop, and a request queued after an update sees the new weights.
- Generation jobs that share a batch key and sit next to each other at the head of the queue are
  taken together (up to ``max_batch_samples`` samples and ``max_batch_pixels`` output pixels); an
  admin job is a barrier that batching never crosses, so no batch mixes weight versions. The pixel
  cap exists for video: 4 requests of 2 videos (Wan 2.1, 480x832x17) sent at once ran as one call
  of 8 on an H200, so no answer left before the last video was decoded and the whole 276 MB went
  out after the GPU had finished (0.975x the stock pipeline running the 4 batches back to back).
- While paused, generation jobs wait in the queue but admin jobs still run (a trainer pauses,
  pushes weights, continues).
- Jobs carry a ``concurrent.futures.Future``; a cancelled future (client gone, timeout) is dropped
  before it runs (``dropped_cancelled`` counts them). ``abort`` drops queued jobs by request (a
  trainer's ``/abort_request``) and fails their futures with the error it is given. A running batch cannot be interrupted
  mid-loop: a request cancelled while its batch runs still occupies its slot until the batch ends.
- A failed batch's exception keeps the frames of the failed call alive through its traceback, and
  with them the call's tensors (activations, latents, recordings): the worker clears those frames
  before ``on_batch_error`` runs, so device memory can actually be returned (CUDA OOM recovery).
- While a batch runs, the worker thread's log lines carry the batch's request ids.
- ``batch_hook`` (None but while a compiled server's warm-up is profiled, server/speed/warmup_profile.py)
  gives a context to run a batch in, on the lane's own thread: what must run there (cProfile sees only
  the thread it is enabled on) goes through it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from diffusion_rollout.errors import NotReadyError, QueueFullError
from diffusion_rollout.logging_utils import request_id_var

logger = logging.getLogger(__name__)


@dataclass
class Job:
    """A unit of work for the worker. ``batch_key`` is None for admin jobs."""

    payload: Any
    batch_key: Hashable | None
    samples: int = 1
    pixels: int = 0  # output pixels (frames counted) the job adds to a call
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    enqueued_at: float = field(default_factory=time.monotonic)
    request_id: str = "-"

    @property
    def is_admin(self) -> bool:
        return self.batch_key is None


class Worker:
    """Runs ``run_batch(list[Job])`` for generation and ``job.payload()`` for admin jobs, on
    ``lanes`` threads (``lane_index()`` tells a callee which lane it runs on)."""

    def __init__(
        self,
        run_batch: Callable[[list[Job]], None],
        *,
        max_queue_depth: int,
        max_batch_samples: int,
        max_batch_pixels: int | None = None,
        batch_wait_s: float = 0.0,
        name: str = "rollout-worker",
        on_batch_error: Callable[[BaseException, list[Job]], None] | None = None,
        lanes: int = 1,
    ) -> None:
        if lanes < 1:
            raise ValueError(f"lanes must be at least 1, got {lanes}")
        self._run_batch = run_batch
        self._on_batch_error = on_batch_error
        self.max_queue_depth = max_queue_depth
        self.max_batch_samples = max_batch_samples
        self.max_batch_pixels = max_batch_pixels
        self.batch_wait_s = batch_wait_s
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._paused = False
        self._stopping = False
        self._admin_running = False
        # The jobs of the batches in flight, per lane (for abort).
        self._running: dict[int, list[Job]] = {}
        self._local = threading.local()
        self.lanes = lanes
        self._threads = [
            threading.Thread(
                target=self._loop, args=(i,), name=name if lanes == 1 else f"{name}-{i}", daemon=True
            )
            for i in range(lanes)
        ]
        self.batches_run = 0
        self.batches_per_lane = [0] * lanes
        self.dropped_cancelled = 0
        # A context to run each generation batch in, on its lane's thread (module doc); None: none.
        self.batch_hook: Callable[[list[Job]], contextlib.AbstractContextManager[Any]] | None = None

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        for t in self._threads:
            t.start()

    def thread_ids(self) -> list[int]:
        """The lane threads' idents (those started)."""
        return [t.ident for t in self._threads if t.ident is not None]

    def lane_index(self) -> int:
        """The lane the calling thread runs (0 outside the worker's threads)."""
        return getattr(self._local, "lane", 0)

    def stop(self, grace_s: float = 0.0) -> None:
        """Refuse new work, let queued and running work finish within ``grace_s``, then fail the rest."""
        deadline = time.monotonic() + grace_s
        with self._cond:
            self._stopping = True
            self._paused = False
            self._cond.notify_all()
        while time.monotonic() < deadline:
            with self._cond:
                if not self._queue and not self._busy_lanes():
                    break
            time.sleep(0.01)
        with self._cond:
            leftover = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for job in leftover:
            if not job.future.done():
                job.future.set_exception(NotReadyError("server is shutting down", state="stopping"))
        for t in self._threads:
            if t.ident is not None:  # never started when the model failed to load
                t.join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return self._busy_lanes() > 0

    def _busy_lanes(self) -> int:
        # Lanes running a batch, plus the one running an admin job (call under the lock).
        return len(self._running) + self._admin_running

    # ------------------------------------------------------------------ submit
    def submit(self, job: Job) -> concurrent.futures.Future:
        with self._cond:
            if self._stopping:
                raise NotReadyError("server is shutting down", state="stopping")
            if not job.is_admin and len(self._queue) >= self.max_queue_depth:
                raise QueueFullError(
                    f"queue full ({self.max_queue_depth} requests waiting, limit max_queue_depth)",
                    retry_after=1.0,
                )
            self._queue.append(job)
            self._cond.notify_all()
        return job.future

    def abort(self, match: Callable[[Job], bool], error: Callable[[Job], BaseException]) -> tuple[int, int]:
        """Drop the queued generation jobs ``match`` selects, failing each with ``error(job)``.

        A matching job whose batch is already running is left to finish (a denoising loop cannot
        be cut short without its batch mates). Returns (dropped, still running).
        """
        with self._cond:
            dropped = [j for j in self._queue if not j.is_admin and match(j)]
            if dropped:
                ids = {id(j) for j in dropped}
                self._queue = collections.deque(j for j in self._queue if id(j) not in ids)
            running = sum(1 for batch in self._running.values() for j in batch if not j.is_admin and match(j))
        for job in dropped:
            if not job.future.done():
                job.future.set_exception(error(job))
        return len(dropped), running

    # ------------------------------------------------------------------ loop
    def _take(self, lane: int) -> list[Job] | None:
        """Pick the next job(s) under the lock; None when stopping with nothing left.

        An admin job waits until no lane runs anything, and nothing starts while it runs; batches
        never start past an admin job at the head of the queue (queue order is kept)."""
        with self._cond:
            while True:
                self._drop_cancelled()
                if self._queue and not self._admin_running:
                    admin = (
                        next((j for j in self._queue if j.is_admin), None)
                        if self._paused
                        else (self._queue[0] if self._queue[0].is_admin else None)
                    )
                    if admin is not None and self._busy_lanes() == 0:
                        self._queue.remove(admin)
                        self._admin_running = True
                        return [admin]
                    if admin is None and not self._paused:
                        break
                elif not self._queue and self._stopping:
                    return None
                self._cond.wait(timeout=0.5)
            head = self._queue.popleft()
            batch = [head]
            # Taken from the queue under the lock: from here on abort sees these jobs as running
            # (the same list object, so jobs added after the batch wait count too).
            self._running[lane] = batch
            self._extend_batch(batch)
        if self.batch_wait_s > 0 and not self._full(batch):
            time.sleep(self.batch_wait_s)
            with self._cond:
                self._extend_batch(batch)
        return batch

    def _full(self, batch: list[Job]) -> bool:
        return sum(j.samples for j in batch) >= self.max_batch_samples or (
            self.max_batch_pixels is not None and sum(j.pixels for j in batch) >= self.max_batch_pixels
        )

    def _extend_batch(self, batch: list[Job]) -> None:
        # Only contiguous compatible jobs: batching never reorders work across an admin job.
        total = sum(j.samples for j in batch)
        pixels = sum(j.pixels for j in batch)
        cap = self.max_batch_pixels
        while self._queue:
            nxt = self._queue[0]
            if nxt.future.cancelled():
                self._queue.popleft()
                self.dropped_cancelled += 1
                continue
            if (
                nxt.is_admin
                or nxt.batch_key != batch[0].batch_key
                or total + nxt.samples > self.max_batch_samples
                or (cap is not None and pixels + nxt.pixels > cap)
            ):
                break
            batch.append(self._queue.popleft())
            total += nxt.samples
            pixels += nxt.pixels

    def _drop_cancelled(self) -> None:
        if any(j.future.cancelled() for j in self._queue):
            kept = collections.deque(j for j in self._queue if not j.future.cancelled())
            self.dropped_cancelled += len(self._queue) - len(kept)
            self._queue = kept

    def _loop(self, lane: int) -> None:
        self._local.lane = lane
        while True:
            jobs = self._take(lane)
            if jobs is None:
                return
            token = request_id_var.set(",".join(j.request_id for j in jobs))
            try:
                live = [j for j in jobs if j.future.set_running_or_notify_cancel()]
                self.dropped_cancelled += len(jobs) - len(live)
                if not live:
                    continue
                if live[0].is_admin:
                    job = live[0]
                    try:
                        job.future.set_result(job.payload())
                    except Exception as exc:  # an admin failure must not kill the worker
                        job.future.set_exception(exc)
                else:
                    try:
                        hook = self.batch_hook
                        with hook(live) if hook is not None else contextlib.nullcontext():
                            self._run_batch(live)
                        with self._cond:  # lanes finish concurrently
                            self.batches_run += 1
                            self.batches_per_lane[lane] += 1
                    except Exception as exc:  # one failing batch fails only its own requests
                        logger.exception("batch of %d request(s) failed", len(live))
                        _clear_frames(exc)
                        # The hook first: what it records (metrics, a failed engine's status) is then
                        # in place when the callers see the error.
                        if self._on_batch_error is not None:
                            try:
                                self._on_batch_error(exc, live)
                            except Exception:  # the hook must not kill the worker either
                                logger.exception("on_batch_error hook failed")
                        for j in live:
                            if not j.future.done():
                                j.future.set_exception(exc)
            finally:
                request_id_var.reset(token)
                with self._cond:
                    if jobs and jobs[0].is_admin:
                        self._admin_running = False
                    self._running.pop(lane, None)
                    self._cond.notify_all()


def _clear_frames(exc: BaseException) -> None:
    """Drop the locals of every finished frame in ``exc``'s chain (tracebacks stay printable)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
