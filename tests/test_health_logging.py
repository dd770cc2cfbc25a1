"""Readiness probes log like an operator wants: expected states (loading, paused, released) once at
info when they begin, never as ERROR, however often a probe asks; a real failure stays an error.

Through the real app (lifespan loading thread included) on the tiny SD3 model; the load is held
open with an event so the probes provably land while the model loads.
"""

from __future__ import annotations

import logging
import threading
import time

from fastapi.testclient import TestClient

from diffusion_rollout.config import ServerConfig
from diffusion_rollout.entrypoints.app import create_app
from diffusion_rollout.server.engine import Engine

LOGGER = "diffusion_rollout"


def _records(caplog, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == level and r.name.startswith(LOGGER)]


def _info_lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in _records(caplog, logging.INFO) if text in r.getMessage()]


def test_probes_during_loading_pause_and_release_log_once_per_state(tiny_model_path, caplog):
    config = ServerConfig(model=str(tiny_model_path("sd3")), device="cpu", dtype="float32")
    engine = Engine(config)
    release_load = threading.Event()
    real_load = engine.load

    def held_load() -> None:
        assert release_load.wait(60)
        real_load()

    engine.load = held_load
    app = create_app(config, engine=engine)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with TestClient(app) as client:
        try:
            for _ in range(25):
                r = client.get("/health_generate")
                assert r.status_code == 503 and r.json()["error"]["message"] == "not ready: loading", r.text
                r = client.post("/rollout/generate", json={"prompt": "a cat", "num_inference_steps": 1})
                assert r.status_code == 503, r.text
            assert _records(caplog, logging.ERROR) == []
            # One line for the state, whichever endpoint met it first; the rest are debug.
            assert len([m for m in _info_lines(caplog, "not serving generation") if "(loading)" in m]) == 1
            assert (
                len([r for r in _records(caplog, logging.DEBUG) if "still not serving" in r.getMessage()])
                >= 40
            )
        finally:
            release_load.set()
        deadline = time.monotonic() + 60
        while engine.status == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.status == "ready"
        assert client.get("/health_generate").status_code == 200
        assert len(_info_lines(caplog, "serving generation again")) == 1

        for pause, resume, message in (
            ("/pause_generation", "/continue_generation", "generation is paused"),
            ("/release_memory_occupation", "/resume_memory_occupation", "not ready: released"),
        ):
            assert client.post(pause).status_code == 200
            for _ in range(20):
                r = client.get("/health_generate")
                assert r.status_code == 503 and r.json()["error"]["message"] == message, r.text
            assert len([m for m in _info_lines(caplog, "not serving generation") if message in m]) == 1
            assert client.post(resume).status_code == 200
            assert client.get("/health_generate").status_code == 200
        assert len(_info_lines(caplog, "serving generation again")) == 3
        assert _records(caplog, logging.ERROR) == []
    engine.stop(grace_s=5)


def test_a_failure_inside_generation_is_still_an_error(fresh_server, caplog):
    s = fresh_server("sd3")

    def broken(*args, **kwargs):
        raise RuntimeError("the transformer broke")

    s.engine.loaded.pipe.transformer.forward = broken
    caplog.set_level(logging.INFO, logger=LOGGER)
    r = s.client.post("/rollout/generate", json={"prompt": "a cat", "num_inference_steps": 1})
    assert r.status_code == 500 and "the transformer broke" in r.json()["error"]["message"]
    assert any("the transformer broke" in r.getMessage() for r in _records(caplog, logging.ERROR))


def test_a_request_answered_already_counts_as_the_last_good_generation(served, monkeypatch):
    # /health_generate reads ``last_generate_ok_at``; it must be set before the request is answered,
    # or a probe right after a generation (a loaded CI machine got there first) sees it stale.
    s = served("sd3")
    mark = s.engine.runner._mark_ok

    def slow_mark() -> None:
        time.sleep(0.3)  # widen the window a late mark would leave open
        mark()

    monkeypatch.setattr(s.engine.runner, "_mark_ok", slow_mark)
    s.engine.last_generate_ok_at = before = time.time() - 100
    s.generate({"prompt": "a cat", "num_inference_steps": 1, "rollout": False})
    assert s.engine.last_generate_ok_at > before
