"""The README's first command: ``diffusion-rollout serve`` on the demo model, as a real process."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from diffusion_rollout.testing import free_port


@pytest.fixture(scope="module")
def served_demo(tmp_path_factory):
    """Start ``diffusion-rollout serve`` (no --model) on a free loopback port; stop it after."""
    port = free_port()
    cache = tmp_path_factory.mktemp("demo-cache")
    env = dict(os.environ, DIFFUSION_ROLLOUT_CACHE=str(cache), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        # --upload-port 0: the direct weight-upload listener on a free port (advertised, then used).
        [
            sys.executable,
            "-m",
            "diffusion_rollout.entrypoints.cli",
            "serve",
            "--port",
            str(port),
            "--upload-port",
            "0",
        ],
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
    base, _proc, cache = served_demo
    assert httpx.get(base + "/health", timeout=5).json() == {"status": "ok", "state": "ready"}
    info = httpx.get(base + "/model_info", timeout=5).json()
    assert info["family"] == "sd3"
    assert info["model_path"].startswith(str(cache))
    r = httpx.get(base + "/health", headers={"X-Request-Id": "abc123"}, timeout=5)
    assert r.headers["x-request-id"] == "abc123"
    # The upload listener of the real process answers like the main port (here: a body that is no
    # safetensors file).
    upload_port = info["weight_upload_port"]
    assert isinstance(upload_port, int) and f":{upload_port}" != base[base.rindex(":") :]
    r = httpx.post(f"http://127.0.0.1:{upload_port}/update_weights", content=b"garbage", timeout=30)
    main = httpx.post(base + "/update_weights", content=b"garbage", timeout=30)
    assert r.status_code == main.status_code == 400 and r.json() == main.json(), r.text


def _readme_example() -> tuple[str, dict, str]:
    """The README's example request: URL path, JSON body and the Python summary one-liner."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = text.split("```bash\ncurl", 1)[1].split("```", 1)[0]
    url = re.search(r"http://127\.0\.0\.1:30000(/\S+)", block).group(1)
    data = re.search(r"-d '(.*?)'", block, re.S).group(1)
    summary = re.search(r"python3 -c '(.*?)'\s*$", block, re.S).group(1)
    return url, json.loads(data), summary


def test_readme_example_request_succeeds(served_demo):
    base, _, _ = served_demo
    path, payload, summary = _readme_example()
    r = httpx.post(base + path, json=payload, headers={"Accept": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out[0]["generated_output"]["shape"] == [3, 32, 32]
    assert out[0]["rollout_log_probs"]["shape"] == [payload["num_inference_steps"]]
    # the README's one-liner runs on the response as printed
    done = subprocess.run(
        [sys.executable, "-c", summary], input=r.text, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0 and "rollout_log_probs" in done.stdout, done.stderr


def test_serve_stops_cleanly_on_sigint(served_demo):
    base, proc, _ = served_demo
    upload_port = httpx.get(base + "/model_info", timeout=5).json()["weight_upload_port"]
    # An idle connection to the upload listener (its thread blocked in a read) must not hold the exit.
    with socket.create_connection(("127.0.0.1", upload_port), timeout=5):
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "RANDOM demo model" in out
    assert f"weight-upload listener on port {upload_port} stopped" in out


def _serve_until_exit(
    args: list[str], env_extra: dict | None = None, timeout: float = 90
) -> tuple[int, str, float]:
    """Run ``diffusion-rollout serve ARGS`` on a free port; return (exit code, stderr, seconds)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", **(env_extra or {}))
    cmd = [sys.executable, "-m", "diffusion_rollout.entrypoints.cli", "serve", "--port", str(free_port())]
    t0 = time.monotonic()
    done = subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stderr, time.monotonic() - t0


def _last_line(stderr: str) -> str:
    return [line for line in stderr.splitlines() if line.strip()][-1]


@pytest.mark.parametrize(
    "model_kind, extra, reason",
    [
        ("missing", [], "does-not-exist"),
        ("not_a_pipeline", [], "model_index.json"),
        ("tiny_sd3", ["--attention-backend", "no-such-backend"], "no-such-backend"),
        # With replicas, a replica that cannot load fails the start (as vLLM and TGI do).
        (
            "not_a_pipeline",
            ["--replicas", "2", "--device", "cpu", "--gpus-per-replica", "0"],
            "model_index.json",
        ),
    ],
)
def test_serve_exits_nonzero_with_one_line_reason_when_the_model_cannot_load(
    tiny_model_path, tmp_path, model_kind, extra, reason
):
    if model_kind == "missing":
        model = tmp_path / "does-not-exist"
    elif model_kind == "not_a_pipeline":
        model = tmp_path / "just-a-folder"
        model.mkdir()
        (model / "README.md").write_text("not a diffusers pipeline")
    else:
        model = tiny_model_path("sd3")
    code, stderr, seconds = _serve_until_exit(["--model", str(model), *extra])
    assert code != 0, stderr[-3000:]
    last = _last_line(stderr)
    assert last.startswith("diffusion-rollout serve: the model failed to load: "), stderr[-3000:]
    assert reason in last, last
    assert "Traceback" not in stderr, stderr[-3000:]
    assert seconds < 60


def test_parsing_serve_leaves_the_tiny_builders_unimported():
    """The tiny builders import every family's diffusers classes: seconds before `serve` starts
    (issue #43). Only make-tiny-model imports them, and it still names the families it knows."""
    code = (
        "import sys\n"
        "from diffusion_rollout.entrypoints.cli import build_parser\n"
        "args = build_parser().parse_args(['serve', '--port', '1234'])\n"
        "print(args.port, 'diffusion_rollout.models.tiny' in sys.modules, 'diffusers' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["1234", "False", "False"], out.stdout + out.stderr
    wrong = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffusion_rollout.entrypoints.cli",
            "make-tiny-model",
            "--family",
            "nope",
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert wrong.returncode == 2
    assert "invalid choice: 'nope'" in wrong.stderr and "wan2.2-ti2v-i2v" in wrong.stderr


def test_serve_names_a_start_up_slowed_by_missing_python_byte_code(tmp_path, monkeypatch):
    """An image that ships no byte code and sets PYTHONDONTWRITEBYTECODE recompiled the server's imports
    at every start (about 10 s on an H100 host, RESULTS fast-start-bytecode): serve says so, with the
    fix, and says nothing once the byte code is there or may be written."""
    import py_compile

    from diffusion_rollout.entrypoints.cli import missing_bytecode

    pkg = tmp_path / "slowpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    why = missing_bytecode("slowpkg")
    assert why is not None and "PYTHONPYCACHEPREFIX" in why and "slowpkg" in why
    assert "slowpkg" not in sys.modules  # the check imports nothing
    py_compile.compile(str(pkg / "__init__.py"))  # what pip's install-time byte-compile writes
    assert missing_bytecode("slowpkg") is None
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    (pkg / "__pycache__").rename(tmp_path / "gone")
    assert missing_bytecode("slowpkg") is None  # the first start writes it


def test_serve_warns_of_a_byte_code_folder_another_user_can_write(tmp_path, monkeypatch):
    from diffusion_rollout.entrypoints.cli import untrusted_pycache_prefix

    prefix = tmp_path / "pyc"
    prefix.mkdir(mode=0o700)
    monkeypatch.setattr(sys, "pycache_prefix", str(prefix))
    assert untrusted_pycache_prefix() is None
    prefix.chmod(0o777)
    why = untrusted_pycache_prefix()
    assert why is not None and f"PYTHONPYCACHEPREFIX={prefix}" in why and "writable by group or others" in why


def test_sglang_fixture_style_launch_gets_its_first_requests_answered(tiny_model_path):
    """SGLang's diffusion test fixture (``test/server/test_server_utils.py``, used by
    ``test_update_weights_from_disk.py`` at commit 07cc6791) starts the server, reads its output
    until uvicorn's "Application startup complete." and then sends its tests' requests at once;
    Relax's ``_wait_healthy`` (``diffusion_engine.py`` at 0a91dd1d) polls ``GET /health`` until 200
    and then generates. Here both moments come before the model has loaded; the requests sent then
    are held until it serves and answered, not refused with 503."""
    model = str(tiny_model_path("sd3"))
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "diffusion_rollout.entrypoints.cli", "serve", "--model", model]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--device", "cpu", "--dtype", "float32"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    seen = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(seen)[-3000:]
            seen.append(line)
            if "Application startup complete." in line:
                break
        # Keep reading, so the server never blocks on a full pipe.
        threading.Thread(target=lambda: seen.extend(proc.stdout), daemon=True).start()
        health = httpx.get(base + "/health", timeout=5)
        assert health.status_code == 200  # Relax's _wait_healthy is satisfied here
        update = httpx.post(
            base + "/update_weights_from_disk", json={"model_path": model, "flush_cache": True}, timeout=120
        )
        assert update.status_code == 200 and update.json().get("success", False), update.text
        body = {
            "prompt": "a cat",
            "seed": 1,
            "width": 32,
            "height": 32,
            "num_inference_steps": 2,
            "rollout": False,
        }
        assert httpx.post(base + "/rollout/generate", json=body, timeout=120).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
