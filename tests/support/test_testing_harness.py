"""The one harness that tests, examples and benchmarks start servers with (diffusion_rollout/testing.py).

A plain ASGI app stands in for the rollout app: what is checked is the harness (a port, readiness,
the stop running the app's shutdown, the failures it reports), not the server.
"""

from __future__ import annotations

import socket
import sys

import httpx
import pytest
import uvicorn

from diffusion_rollout.testing import free_port, serve_in_thread, start_cli_server, stop_session


def _app(events: list[str]):
    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                events.append(message["type"])
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def _server(app, port: int) -> uvicorn.Server:
    return uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )


def test_serve_in_thread_answers_inside_the_block_and_shuts_the_app_down_after_it():
    events: list[str] = []
    port = free_port()
    server = _server(_app(events), port)
    with serve_in_thread(server, name="test-harness"):
        assert httpx.get(f"http://127.0.0.1:{port}/").text == "ok"  # listening as the block starts
    assert events == ["lifespan.startup", "lifespan.shutdown"]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/", timeout=2)


def test_serve_in_thread_raises_when_uvicorn_cannot_start():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = _server(_app([]), taken.getsockname()[1])
        with pytest.raises(RuntimeError, match="did not start"), serve_in_thread(server, start_timeout_s=10):
            pytest.fail("the block ran without a server")


def test_start_cli_server_reports_a_server_that_exits_with_the_end_of_its_log(tmp_path):
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    with pytest.raises(SystemExit, match=r"exited with 3:\n.*no model here"):
        start_cli_server(cmd, log, f"http://127.0.0.1:{free_port()}", timeout_s=30)


def test_start_cli_server_stops_a_server_that_is_never_ready_and_all_it_started(tmp_path):
    log = tmp_path / "serve.log"
    # A "server" that starts a child and never answers: both must be gone after the timeout.
    script = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('child', child.pid, flush=True); time.sleep(60)"
    )
    with pytest.raises(SystemExit, match="did not become ready in 2 s"):
        start_cli_server(
            [sys.executable, "-c", script], log, f"http://127.0.0.1:{free_port()}", 2, new_session=True
        )
    child = int(log.read_text().split()[1])
    _wait_gone(child)


def _wait_gone(pid: int) -> None:
    import os
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:
            with open(f"/proc/{pid}/stat") as f:  # a zombie (reaped by init later) is gone too
                if f.read().split()[2] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    pytest.fail(f"process {pid} still runs")


def test_stop_session_returns_the_exit_code_of_a_process_that_already_ended(tmp_path):
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"], start_new_session=True)
    proc.wait()
    assert stop_session(proc) == 5
