"""Helpers for the reliability tests: a real uvicorn server in a thread, log capture, waiting.

The real server is needed where the ASGI test client cannot stand in: a client that disconnects
(closes its socket) mid-request, chunked uploads, and uvicorn's own graceful shutdown. It binds
127.0.0.1 on a free port and is stopped (``should_exit``) when the ``with`` block ends.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

from diffusion_rollout.entrypoints.http_server import DrainingServer, make_server
from diffusion_rollout.testing import free_port, serve_in_thread

BASE = {"prompt": "a red cat", "width": 32, "height": 32, "num_inference_steps": 4, "max_sequence_length": 16}


def body(**kw) -> dict:
    return {**BASE, "seed": 7, **kw}


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


@contextlib.contextmanager
def live_server(served, *, stop_timeout: float = 30.0) -> Iterator[tuple[str, DrainingServer]]:
    """``served.app`` behind uvicorn on 127.0.0.1:<free port>; yields (base URL, server)."""
    config = served.config.model_copy(update={"host": "127.0.0.1", "port": free_port()})
    server = make_server(served.app, config)
    with serve_in_thread(server, name="test-uvicorn", stop_timeout_s=stop_timeout):
        yield f"http://127.0.0.1:{config.port}", server


def slow_transformer(served, seconds: float):
    """Every transformer call sleeps ``seconds``: a rollout long enough to overlap something."""
    return served.engine.pipe.transformer.register_forward_pre_hook(lambda *_: time.sleep(seconds))


class LogCollector(logging.Handler):
    """Collects every record of the package logger (which does not propagate once configured)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._records_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._records_lock:
            self.records.append(record)

    def text(self) -> str:
        fmt = logging.Formatter("%(levelname)s %(name)s %(message)s")
        with self._records_lock:
            lines = []
            for r in self.records:
                line = fmt.format(r)
                lines.append(f"[{getattr(r, 'request_id', '-')}] {line}")
            return "\n".join(lines)


@contextlib.contextmanager
def collect_logs(level: int = logging.DEBUG) -> Iterator[LogCollector]:
    from diffusion_rollout.logging_utils import request_id_var

    class _Rid(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            record.request_id = request_id_var.get()
            return True

    logger = logging.getLogger("diffusion_rollout")
    handler = LogCollector()
    handler.addFilter(_Rid())
    old = logger.level
    logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


# A small deterministic rollout (ODE) whose answer shows which weights the server holds.
PROBE = {
    "prompt": "a red cube on a table",
    "seed": 11,
    "width": 32,
    "height": 32,
    "max_sequence_length": 16,
    "num_inference_steps": 2,
    "rollout_sde_type": "ode",
    "rollout_log_prob_no_const": True,
}
