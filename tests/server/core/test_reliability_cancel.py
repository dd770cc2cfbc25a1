"""Cancellation, timeouts and graceful shutdown.

- A client that disconnects has its queued work dropped: the worker is paused so the job must wait,
  the client (a real socket to a real uvicorn) gives up, and after resuming the job never ran.
- ``request_timeout_s``: 504 naming the limit; a queued job is dropped, a running batch finishes
  (it cannot be interrupted) and the server keeps serving.
- Shutdown: new rollouts get 503 at once, queued and running work is answered within
  ``shutdown_grace_s``, what is left after the deadline gets 503; through uvicorn too.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.batch_helpers import settled_batches
from tests.reliability_helpers import body, live_server, slow_transformer, wait_until


def _metric(srv, line_start: str) -> float:
    for line in srv.client.get("/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_disconnected_client_has_its_queued_work_dropped(fresh_server):
    srv = fresh_server("sd3")
    worker = srv.engine.worker
    with live_server(srv) as (base, _):
        worker.pause()
        ran_before = worker.batches_run
        # The client gives up after 0.5 s of silence and closes its connection.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/rollout/generate", json=body(), timeout=httpx.Timeout(10.0, read=0.5))
        wait_until(lambda: worker.dropped_cancelled == 1 and worker.depth == 0, 10, "the job to be dropped")
        worker.resume()
        r = httpx.post(base + "/rollout/generate", json=body(seed=8), timeout=30)
        assert r.status_code == 200
        assert settled_batches(worker) == ran_before + 1  # only the second request ran
        assert srv.engine.worker.dropped_cancelled == 1
    assert _metric(srv, 'diffusion_rollout_requests_cancelled_total{reason="disconnect"}') == 1


def test_disconnect_while_running_discards_the_result_and_keeps_serving(fresh_server):
    srv = fresh_server("sd3")
    hook = slow_transformer(srv, 0.1)
    try:
        with live_server(srv) as (base, _):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(base + "/rollout/generate", json=body(), timeout=httpx.Timeout(10.0, read=0.15))
            # The running batch cannot be interrupted; it finishes and frees the worker.
            wait_until(lambda: srv.engine.worker.batches_run == 1 and not srv.engine.worker.busy, 20)
            hook.remove()
            assert httpx.post(base + "/rollout/generate", json=body(), timeout=30).status_code == 200
    finally:
        hook.remove()


def test_queued_request_past_its_timeout_is_504_and_dropped(fresh_server):
    srv = fresh_server("sd3", request_timeout_s=0.3)
    worker = srv.engine.worker
    worker.pause()
    r = srv.client.post("/rollout/generate", json=body())
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["type"] == "request_timeout" and "request_timeout_s" in err["message"]
    assert "dropped" in err["message"]
    wait_until(lambda: worker.depth == 0, 5, "the timed-out job to be dropped")
    worker.resume()
    # The follow-up only shows the server still serves: give it a timeout a loaded CI machine meets.
    srv.engine.config.request_timeout_s = 60.0
    assert srv.client.post("/rollout/generate", json=body()).status_code == 200
    wait_until(lambda: worker.batches_run == 1, 10, "the follow-up batch to be counted")
    assert worker.batches_run == 1 and worker.dropped_cancelled == 1
    assert _metric(srv, 'diffusion_rollout_requests_cancelled_total{reason="timeout"}') == 1
    assert _metric(srv, 'diffusion_rollout_requests_total{outcome="request_timeout"}') == 1


def test_running_request_past_its_timeout_is_504_and_the_server_recovers(fresh_server):
    srv = fresh_server("sd3", request_timeout_s=0.2)
    hook = slow_transformer(srv, 0.1)  # 4 steps: about 0.4 s
    try:
        r = srv.client.post("/rollout/generate", json=body())
        assert r.status_code == 504 and "discarded" in r.json()["error"]["message"]
    finally:
        hook.remove()
    wait_until(lambda: srv.engine.worker.batches_run == 1 and not srv.engine.worker.busy, 10)
    assert srv.client.post("/rollout/generate", json=body()).status_code == 200


def _start(srv, results: dict, key: str, **fields) -> threading.Thread:
    def run():
        results[key] = srv.client.post("/rollout/generate", json=body(**fields))

    t = threading.Thread(target=run)
    t.start()
    return t


def test_shutdown_refuses_new_work_and_drains_in_flight_work(fresh_server):
    srv = fresh_server("sd3")
    engine = srv.engine
    hook = slow_transformer(srv, 0.05)
    results: dict = {}
    try:
        running = _start(srv, results, "running")
        wait_until(lambda: engine.worker.busy, 10, "the first batch to start")
        queued = _start(srv, results, "queued", num_inference_steps=3)  # another batch key
        wait_until(lambda: engine.worker.depth == 1, 10, "the second request to queue")

        engine.begin_shutdown(grace_s=30)
        r = srv.client.post("/rollout/generate", json=body())
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        t0 = time.monotonic()
        engine.stop()
        assert time.monotonic() - t0 < 30
        running.join(30)
        queued.join(30)
    finally:
        hook.remove()
    assert results["running"].status_code == 200 and results["queued"].status_code == 200
    assert srv.client.get("/health").status_code == 200  # the process still answers
    assert srv.client.get("/health_generate").status_code == 503


def test_shutdown_deadline_fails_what_is_left_with_503(fresh_server):
    srv = fresh_server("sd3")
    engine = srv.engine
    hook = slow_transformer(srv, 0.1)  # about 0.4 s per batch
    results: dict = {}
    try:
        running = _start(srv, results, "running")
        wait_until(lambda: engine.worker.busy, 10, "the first batch to start")
        queued = _start(srv, results, "queued", num_inference_steps=3)
        wait_until(lambda: engine.worker.depth == 1, 10, "the second request to queue")
        t0 = time.monotonic()
        engine.stop(grace_s=0.05)
        assert time.monotonic() - t0 < 3
        running.join(30)
        queued.join(30)
    finally:
        hook.remove()
    assert results["running"].status_code == 200  # a running batch is never cut short
    r = results["queued"]
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]


def test_uvicorn_shutdown_drains_the_request_in_flight(fresh_server):
    srv = fresh_server("sd3")
    hook = slow_transformer(srv, 0.05)
    results: dict = {}
    try:
        with live_server(srv) as (base, server):

            def run():
                results["r"] = httpx.post(base + "/rollout/generate", json=body(), timeout=30)

            t = threading.Thread(target=run)
            t.start()
            wait_until(lambda: srv.engine.worker.busy, 10, "the batch to start")
            server.should_exit = True  # what SIGINT/SIGTERM do
            wait_until(lambda: srv.engine.status == "stopping", 10, "the engine to start draining")
            t.join(30)
    finally:
        hook.remove()
    assert results["r"].status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(base + "/health", timeout=2)
