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
from diffusion_rollout.server.core.engine import Engine

LOGGER = "diffusion_rollout"


def _records(caplog, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == level and r.name.startswith(LOGGER)]


def _info_lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in _records(caplog, logging.INFO) if text in r.getMessage()]


def held_engine(tiny_model_path, **config) -> tuple[Engine, threading.Event]:
    """An engine on the tiny SD3 model whose load waits for the returned event."""
    config = ServerConfig(model=str(tiny_model_path("sd3")), device="cpu", dtype="float32", **config)
    engine = Engine(config)
    release_load = threading.Event()
    real_load = engine.load

    def held_load() -> None:
        assert release_load.wait(60)
        real_load()

    engine.load = held_load
    return engine, release_load


def test_probes_during_loading_pause_and_release_log_once_per_state(tiny_model_path, caplog):
    # A held request gives up after ready_wait_s (here 0.05 s) with a 503 naming the state.
    engine, release_load = held_engine(tiny_model_path, ready_wait_s=0.05)
    app = create_app(engine.config, engine=engine)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with TestClient(app) as client:
        try:
            for _ in range(25):
                r = client.get("/health_generate")
                assert r.status_code == 503 and r.json()["error"]["message"] == "not ready: loading", r.text
                r = client.post("/rollout/generate", json={"prompt": "a cat", "num_inference_steps": 1})
                assert r.status_code == 503, r.text
                assert "still loading after waiting 0.05 s (ready_wait_s)" in r.json()["error"]["message"]
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


def test_a_launcher_that_trusts_health_has_its_next_request_served(tiny_model_path):
    """Relax's ``_wait_healthy`` and the SGLang router poll ``GET /health`` until 200, SGLang's test
    fixture waits for uvicorn's "Application startup complete." line (printed before the model
    loads here), and each then sends its first request straight away and fails on a 503. That
    request is held while the model loads and answered once it serves; ``/health`` keeps answering
    at once with the state meanwhile."""
    engine, release_load = held_engine(tiny_model_path)
    app = create_app(engine.config, engine=engine)
    with TestClient(app) as client:  # lifespan entered: uvicorn would have printed its startup line
        try:
            health = client.get("/health")
            assert health.status_code == 200 and health.json()["state"] == "loading"
            answers: dict = {}

            def first_requests() -> None:
                body = {"prompt": "a cat", "num_inference_steps": 1, "width": 32, "height": 32}
                answers["generate"] = client.post("/rollout/generate", json={**body, "rollout": False})
                answers["update"] = client.post("/update_weights_from_disk", json={})

            sender = threading.Thread(target=first_requests)
            sender.start()
            time.sleep(0.5)
            assert not answers and client.get("/health").json()["state"] == "loading"  # held, not refused
        finally:
            release_load.set()
        sender.join(60)
        assert answers["generate"].status_code == 200, answers["generate"].text
        assert answers["update"].status_code == 400  # SGLang's answer to a missing model_path
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
