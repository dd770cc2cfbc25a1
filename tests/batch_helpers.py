"""Sending requests so that the worker takes them as one batch, for the tests of batching."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from tests.reliability_helpers import wait_until


def generate_together(srv, reqs: Sequence[dict], *, queue_timeout: float = 30.0) -> list:
    """Pause ``srv``'s worker, send each request from its own thread, each once the one before is
    queued (at most ``queue_timeout`` in all), resume: the worker finds them queued together, in order. Returns each request's
    outputs, in order (None for a request that did not return within 60 s)."""
    worker = srv.engine.worker
    results: list = [None] * len(reqs)

    def send(i: int) -> None:
        results[i] = srv.generate(reqs[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(reqs))]
    worker.pause()
    try:
        deadline = time.monotonic() + queue_timeout
        base = worker.depth
        for i, t in enumerate(threads):
            t.start()
            # One at a time, so the queue holds them in the order given (tests that check how
            # queued requests are grouped into calls depend on it).
            while worker.depth < base + i + 1 and time.monotonic() < deadline:
                time.sleep(0.005)
    finally:  # a failure while queueing must not leave the worker (and the teardown) hanging
        worker.resume()
    for t in threads:
        t.join(60)
    return results


def settled_batches(worker, timeout_s: float = 30.0) -> int:
    """``worker.batches_run`` once nothing is queued or running. A request's answer comes back
    before its batch is counted (the count follows the call), so a count read right after an answer
    can miss that answer's own batch."""
    wait_until(lambda: not worker.busy and not worker.depth, timeout_s, "the worker to settle")
    return worker.batches_run
