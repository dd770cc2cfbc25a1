"""Sending requests so that the worker takes them as one batch, for the tests of batching."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence


def generate_together(srv, reqs: Sequence[dict], *, queue_timeout: float = 30.0) -> list:
    """Pause ``srv``'s worker, send each request from its own thread, wait until all are queued (at
    most ``queue_timeout``), resume: the worker finds them queued together. Returns each request's
    outputs, in order (None for a request that did not return within 60 s)."""
    worker = srv.engine.worker
    results: list = [None] * len(reqs)

    def send(i: int) -> None:
        results[i] = srv.generate(reqs[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(reqs))]
    worker.pause()
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + queue_timeout
        while worker.depth < len(reqs) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:  # a failure while queueing must not leave the worker (and the teardown) hanging
        worker.resume()
    for t in threads:
        t.join(60)
    return results
