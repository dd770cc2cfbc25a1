"""Harness for starting servers in tests, examples and benchmarks: a free port, a CLI server
started and waited for until ready, a stop that takes its whole process group with it, and an app
served by uvicorn in a thread of this process.

One copy, so that readiness, logs and shutdown behave the same wherever a server is started. It
imports nothing of the package above its own layer: it runs ``serve`` as a subprocess, and the
in-thread server is built by the caller (``entrypoints.http_server.make_server`` or a plain
``uvicorn.Server``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (another process may still take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_cli_server(
    cmd: Sequence[str],
    log: Path,
    url: str,
    timeout_s: float,
    *,
    new_session: bool = False,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start ``serve`` (``cmd``, its output into ``log``) and wait until ``url``'s ``/model_info`` says
    ready. A server that exits, or is not ready within ``timeout_s``, raises ``SystemExit`` with the
    end of its log. ``new_session``: its own process group, so :func:`stop_session` stops it and
    whatever it started (Ray replicas). ``env``: variables added to this process's (keys, say)."""
    import httpx

    full_env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(env or {}))
    proc = subprocess.Popen(
        list(cmd), stdout=log.open("w"), stderr=subprocess.STDOUT, env=full_env, start_new_session=new_session
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/model_info", timeout=2).json().get("status") == "ready":
                return proc
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    if new_session:
        stop_session(proc)
    else:
        proc.kill()
    raise SystemExit(f"server did not become ready in {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


def stop_session(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> int:
    """Stop a process started with ``start_new_session=True`` and everything it started (a CLI
    server's replicas, a recipe's server): ``sig`` to its process group, SIGKILL after ``timeout_s``."""
    if proc.poll() is not None:
        return proc.returncode
    os.killpg(proc.pid, sig)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


@contextlib.contextmanager
def serve_in_thread(
    server: Any, *, name: str = "uvicorn", start_timeout_s: float = 30.0, stop_timeout_s: float = 30.0
) -> Iterator[None]:
    """Run ``server`` (a ``uvicorn.Server``) in a daemon thread until the block ends; the block starts
    once it listens. In a thread, not a process: the caller keeps the engine within reach (tests
    that hook the pipeline, benchmarks that time stock pipelines on the same weights). It is stopped as
    uvicorn stops on a signal (``should_exit``), so the app's shutdown, and the engine's drain, run."""
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"uvicorn did not start within {start_timeout_s:.0f} s")
        time.sleep(0.01)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(stop_timeout_s)
