"""``min_weight_version``: bounded staleness on the server (weight_versions.py).

The order of versions (applied order, text comparison, rollbacks), then through the real HTTP app
on the tiny SD3 model: a waiting request proceeds when a LoRA push with its version lands, 409 when
told not to wait, 504 at ``request_timeout_s`` with nothing queued, ``/abort_request`` reaches a
waiting request, and the fields are validated (422 naming them).
"""

from __future__ import annotations

import threading
import time

import pytest

from diffusion_rollout.protocol.weight_versions import VersionHistory
from tests.reliability_helpers import body, wait_until
from tests.server.weights.test_lora import adapter, load_bytes


def test_versions_are_ordered_as_applied_and_compare_as_text():
    h = VersionHistory()  # a fresh server holds its initial version 0 only
    assert h.holds(0) and h.holds("0") and not h.holds(1) and not h.holds("lora-a")
    h.record("lora-a")
    h.record(7)
    h.record("step-2")  # strings and integers in one sequence: no value order is assumed
    assert h.current == "step-2"
    for held in (0, "lora-a", 7, "7", "step-2"):
        assert h.holds(held), held
    assert not h.holds(8) and not h.holds("step-3")
    h.record("step-2")  # the current version again: nothing changes
    assert h.as_list() == [0, "lora-a", 7, "step-2"]
    h.record("7")  # an earlier version again (a rollback): the later ones are no longer held
    assert h.as_list() == [0, "lora-a", 7] and h.current == 7
    assert not h.holds("step-2") and h.holds("lora-a")
    h.replace(["x", 3])  # a replica re-synced from a peer takes the peer's sequence
    assert h.as_list() == ["x", 3] and not h.holds(0)


def _post_later(srv, results: dict, key: str, **fields) -> threading.Thread:
    def run():
        r = srv.client.post("/rollout/generate", json=body(**fields), headers={"Accept": "application/json"})
        results[key] = (r, time.monotonic())

    t = threading.Thread(target=run)
    t.start()
    return t


def _waiting(srv, rid: str) -> bool:
    return rid in srv.engine.version_gate.waiting_requests()


def test_a_request_waits_for_its_version_and_runs_on_it(fresh_server):
    srv = fresh_server("sd3")
    cfg, tensors = adapter("default", seed=4)
    results: dict = {}
    t = _post_later(srv, results, "r", min_weight_version="lora-1", rid="waiter")
    wait_until(lambda: _waiting(srv, "waiter"), 10, "the request to wait for its version")
    time.sleep(0.2)
    assert "r" not in results and srv.engine.worker.batches_run == 0  # it did not run on version 0
    pushed_at = time.monotonic()
    load_bytes(srv, "default", tensors, cfg, activate="true", weight_version="lora-1")
    t.join(30)
    r, done_at = results["r"]
    assert r.status_code == 200, r.text
    assert done_at >= pushed_at
    assert [o["weight_version"] for o in r.json()] == ["lora-1"]
    assert not srv.engine.version_gate.waiting_requests()


def test_versions_held_earlier_satisfy_and_unknown_ones_are_409_without_waiting(fresh_server):
    srv = fresh_server("sd3")
    cfg, tensors = adapter("default", seed=4)
    load_bytes(srv, "default", tensors, cfg, activate="true", weight_version="lora-1")
    r = srv.client.post("/lora/activate", json={"name": None, "weight_version": 7})
    assert r.status_code == 200, r.text
    for wanted in ("lora-1", 7, "7", 0):  # the current version and every one applied before it
        [out] = srv.generate(body(min_weight_version=wanted, min_weight_version_wait=False))
        assert out["weight_version"] == 7
    r = srv.client.post("/rollout/generate", json=body(min_weight_version=8, min_weight_version_wait=False))
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["type"] == "weight_version_not_held"
    assert "min_weight_version=8" in err["message"] and "weight_version=7" in err["message"]
    assert "min_weight_version_wait" in err["message"]
    assert srv.engine.worker.depth == 0 and not srv.engine.version_gate.waiting_requests()


def test_a_version_that_never_lands_is_504_with_nothing_queued(fresh_server):
    srv = fresh_server("sd3", request_timeout_s=0.4)
    t0 = time.monotonic()
    r = srv.client.post("/rollout/generate", json=body(min_weight_version="never"))
    assert 0.4 <= time.monotonic() - t0 < 10
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["type"] == "request_timeout"
    assert "min_weight_version='never'" in err["message"] and "request_timeout_s" in err["message"]
    assert srv.engine.worker.batches_run == 0 and srv.engine.worker.depth == 0
    assert not srv.engine.version_gate.waiting_requests()
    srv.engine.config.request_timeout_s = 60.0
    srv.generate(body())  # still serving


def test_abort_reaches_a_request_waiting_for_its_version(fresh_server):
    srv = fresh_server("sd3")
    results: dict = {}
    t = _post_later(srv, results, "r", min_weight_version="later", rid="stuck")
    wait_until(lambda: _waiting(srv, "stuck"), 10, "the request to wait")
    a = srv.client.post("/abort_request", json={"rid": "stuck"})
    assert a.status_code == 200 and a.json()["dropped"] == 1, a.text
    t.join(30)
    r, _ = results["r"]
    assert r.status_code == 499 and r.json()["error"]["type"] == "request_aborted", r.text
    # A version pushed afterwards runs nothing: the aborted request never entered the queue.
    cfg, tensors = adapter("default", seed=4)
    load_bytes(srv, "default", tensors, cfg, activate="true", weight_version="later")
    time.sleep(0.1)
    assert srv.engine.worker.batches_run == 0


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"min_weight_version": ""}, "min_weight_version"),
        ({"min_weight_version": 1.5}, "min_weight_version"),
        ({"min_weight_version": True}, "min_weight_version"),
        ({"min_weight_version": ["v1"]}, "min_weight_version"),
        ({"min_weight_version": "v" * 257}, "min_weight_version"),
        ({"min_weight_version": "v1", "min_weight_version_wait": "maybe"}, "min_weight_version_wait"),
    ],
)
def test_bad_min_weight_version_fields_are_422_naming_them(served, fields, name):
    r = served("sd3").client.post("/rollout/generate", json=body(**fields))
    assert r.status_code == 422, r.text
    assert name in r.json()["error"]["message"]
