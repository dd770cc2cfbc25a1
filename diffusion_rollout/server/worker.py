"""One worker thread that owns the pipeline, fed by a bounded job queue.

Design decisions:
- Everything that touches the pipeline (generation batches, weight updates, memory moves) runs on
  this one thread, in queue order. A weight update therefore lands between batches, never under a
  running denoising loop, and a request queued after an update sees the new weights.
- Generation jobs that share a batch key and sit next to each other at the head of the queue are
  taken together (up to ``max_batch_samples``); an admin job is a barrier that batching never
  crosses, so no batch mixes weight versions.
- While paused, generation jobs wait in the queue but admin jobs still run (a trainer pauses,
  pushes weights, continues).
- Jobs carry a ``concurrent.futures.Future``; a cancelled future (client gone, timeout) is dropped
  before it runs.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from diffusion_rollout.errors import QueueFullError, ServiceUnavailableError

logger = logging.getLogger(__name__)


@dataclass
class Job:
    """A unit of work for the worker. ``batch_key`` is None for admin jobs."""

    payload: Any
    batch_key: Hashable | None
    samples: int = 1
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    enqueued_at: float = field(default_factory=time.monotonic)
    request_id: str = "-"

    @property
    def is_admin(self) -> bool:
        return self.batch_key is None


class Worker:
    """Runs ``run_batch(list[Job])`` for generation and ``job.payload()`` for admin jobs."""

    def __init__(
        self,
        run_batch: Callable[[list[Job]], None],
        *,
        max_queue_depth: int,
        max_batch_samples: int,
        batch_wait_s: float = 0.0,
        name: str = "rollout-worker",
    ) -> None:
        self._run_batch = run_batch
        self.max_queue_depth = max_queue_depth
        self.max_batch_samples = max_batch_samples
        self.batch_wait_s = batch_wait_s
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._paused = False
        self._stopping = False
        self._busy = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.batches_run = 0

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        self._thread.start()

    def stop(self, grace_s: float = 0.0) -> None:
        """Refuse new work, let queued and running work finish within ``grace_s``, then fail the rest."""
        deadline = time.monotonic() + grace_s
        with self._cond:
            self._stopping = True
            self._paused = False
            self._cond.notify_all()
        while time.monotonic() < deadline:
            with self._cond:
                if not self._queue and not self._busy:
                    break
            time.sleep(0.01)
        with self._cond:
            leftover = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for job in leftover:
            if not job.future.done():
                job.future.set_exception(ServiceUnavailableError("server is shutting down"))
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)

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
        return self._busy

    # ------------------------------------------------------------------ submit
    def submit(self, job: Job) -> concurrent.futures.Future:
        with self._cond:
            if self._stopping:
                raise ServiceUnavailableError("server is shutting down")
            if not job.is_admin and len(self._queue) >= self.max_queue_depth:
                raise QueueFullError(
                    f"queue full ({self.max_queue_depth} requests waiting, limit max_queue_depth)",
                    retry_after=1.0,
                )
            self._queue.append(job)
            self._cond.notify_all()
        return job.future

    # ------------------------------------------------------------------ loop
    def _take(self) -> list[Job] | None:
        """Pick the next job(s) under the lock; None when stopping with nothing left."""
        with self._cond:
            while True:
                self._drop_cancelled()
                if self._queue:
                    if not self._paused:
                        break
                    if any(j.is_admin for j in self._queue):
                        break
                elif self._stopping:
                    return None
                self._cond.wait(timeout=0.5)
            if self._paused:
                job = next(j for j in self._queue if j.is_admin)
                self._queue.remove(job)
                self._busy = True
                return [job]
            head = self._queue.popleft()
            self._busy = True
            if head.is_admin:
                return [head]
            batch = [head]
            self._extend_batch(batch)
        if self.batch_wait_s > 0 and sum(j.samples for j in batch) < self.max_batch_samples:
            time.sleep(self.batch_wait_s)
            with self._cond:
                self._extend_batch(batch)
        return batch

    def _extend_batch(self, batch: list[Job]) -> None:
        # Only contiguous compatible jobs: batching never reorders work across an admin job.
        total = sum(j.samples for j in batch)
        while self._queue:
            nxt = self._queue[0]
            if nxt.future.cancelled():
                self._queue.popleft()
                continue
            if (
                nxt.is_admin
                or nxt.batch_key != batch[0].batch_key
                or total + nxt.samples > self.max_batch_samples
            ):
                break
            batch.append(self._queue.popleft())
            total += nxt.samples

    def _drop_cancelled(self) -> None:
        if any(j.future.cancelled() for j in self._queue):
            self._queue = collections.deque(j for j in self._queue if not j.future.cancelled())

    def _loop(self) -> None:
        while True:
            jobs = self._take()
            if jobs is None:
                return
            try:
                live = [j for j in jobs if j.future.set_running_or_notify_cancel()]
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
                        self._run_batch(live)
                        self.batches_run += 1
                    except Exception as exc:  # one failing batch fails only its own requests
                        logger.exception("batch of %d request(s) failed", len(live))
                        for j in live:
                            if not j.future.done():
                                j.future.set_exception(exc)
            finally:
                with self._cond:
                    self._busy = False
