"""The README's first command: ``diffusion-rollout serve`` on the demo model, as a real process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served_demo(tmp_path_factory):
    """Start ``diffusion-rollout serve`` (no --model) on a free loopback port; stop it after."""
    port = _free_port()
    cache = tmp_path_factory.mktemp("demo-cache")
    env = dict(os.environ, DIFFUSION_ROLLOUT_CACHE=str(cache), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffusion_rollout.entrypoints.cli", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    ready = False
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(base + "/model_info", timeout=2).json().get("status") == "ready":
                ready = True
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    if not ready:
        proc.kill()
        out = proc.communicate(timeout=10)[0]
        pytest.fail(f"server did not become ready:\n{out[-4000:]}")
    yield base, proc, cache
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_serve_demo_answers_health_and_model_info(served_demo):
    base, proc, cache = served_demo
    assert httpx.get(base + "/health", timeout=5).json() == {"status": "ok"}
    info = httpx.get(base + "/model_info", timeout=5).json()
    assert info["family"] == "sd3"
    assert info["model_path"].startswith(str(cache))
    r = httpx.get(base + "/health", headers={"X-Request-Id": "abc123"}, timeout=5)
    assert r.headers["x-request-id"] == "abc123"


def test_serve_stops_cleanly_on_sigint(served_demo):
    base, proc, _ = served_demo
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "RANDOM demo model" in out
