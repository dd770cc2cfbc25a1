"""Every configured limit is reported by ``/server_info`` and, when exceeded, answered with a 4xx
whose message names it. (413 by Content-Length and the 429 of a full queue are in
``test_rollout_api.py``; the request timeout is in ``test_reliability_cancel.py``.)
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import torch

from tests.reliability_helpers import body, collect_logs, live_server

QUALITY_MD_LIMITS = {
    "max_steps", "max_pixels", "max_frames", "max_outputs_per_request", "max_queue_depth",
    "max_body_bytes", "max_upload_bytes", "request_timeout_s", "max_trajectory_bytes", "max_batch_size",
}  # fmt: skip


@pytest.fixture(scope="module")
def private(tiny_model_path):
    """A server of this module's own: its tests change its config (the engine reads it per request)."""
    from tests.conftest import ServedModel

    server = ServedModel(tiny_model_path("sd3"))
    yield server
    server.close()


def _error(r, status: int) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status
    return err["message"]


def test_server_info_reports_every_limit_as_configured(fresh_server):
    overrides = {
        "max_steps": 9, "max_pixels": 4096, "max_frames": 17, "max_outputs_per_request": 3,
        "max_queue_depth": 5, "max_body_bytes": 4096, "max_upload_bytes": 8192,
        "request_timeout_s": 12.5, "max_trajectory_bytes": 123456, "max_batch_size": 2,
    }  # fmt: skip
    srv = fresh_server("sd3", **overrides)
    limits = srv.client.get("/server_info").json()["limits"]
    assert set(limits) >= QUALITY_MD_LIMITS
    for name, value in overrides.items():
        assert limits[name] == value, name


@pytest.mark.parametrize(
    ("limit", "value", "request_fields"),
    [
        ("max_steps", 4, {"num_inference_steps": 5}),
        ("max_pixels", 32 * 32 - 1, {}),
        ("max_outputs_per_request", 2, {"num_outputs_per_prompt": 3}),
        ("max_trajectory_bytes", 1024, {"rollout_return_dit_trajectory": True}),
    ],
)
def test_request_over_a_limit_is_400_naming_it(private, limit, value, request_fields):
    srv = private
    old = getattr(srv.config, limit)
    setattr(srv.config, limit, value)
    try:
        msg = _error(srv.client.post("/rollout/generate", json=body(**request_fields)), 400)
    finally:
        setattr(srv.config, limit, old)
    assert limit in msg
    assert srv.client.post("/rollout/generate", json=body(**request_fields)).status_code == 200


def test_video_frames_over_max_frames_is_400(served):
    srv = served("wan")
    frames = srv.config.max_frames + 4
    msg = _error(srv.client.post("/rollout/generate", json=body(num_frames=frames)), 400)
    assert "max_frames" in msg and str(frames) in msg


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    return 0


def test_max_trajectory_bytes_is_exact_at_the_boundary(private):
    """The estimate equals the bytes of the latent-sized tensors actually returned."""
    srv = private
    req = body(
        num_inference_steps=3,
        num_outputs_per_prompt=2,
        rollout_return_dit_trajectory=True,
        rollout_return_step_indices=[0, 3],
    )
    outs = srv.generate(req)
    actual = sum(
        _tensor_bytes(o["dit_trajectory"]["latents"])
        + sum(
            _tensor_bytes(o["rollout_debug_tensors"][k])
            for k in ("rollout_variance_noises", "rollout_prev_sample_means", "rollout_model_outputs")
        )
        for o in outs
    )
    old = srv.config.max_trajectory_bytes
    try:
        srv.config.max_trajectory_bytes = actual - 1
        msg = _error(srv.client.post("/rollout/generate", json=req), 400)
        assert f"would take {actual} bytes" in msg and "max_trajectory_bytes" in msg
        srv.config.max_trajectory_bytes = actual
        assert srv.client.post("/rollout/generate", json=req).status_code == 200
        # Plain generation and a rollout without debug tensors or trajectory carry none.
        srv.config.max_trajectory_bytes = 1
        assert srv.client.post("/rollout/generate", json=body(rollout=False)).status_code == 200
        lean = body(rollout_debug_mode=False)
        assert srv.client.post("/rollout/generate", json=lean).status_code == 200
    finally:
        srv.config.max_trajectory_bytes = old


def _chunks(total: int, size: int = 512):
    sent = 0
    while sent < total:
        n = min(size, total - sent)
        yield b" " * n
        sent += n


def test_chunked_bodies_without_content_length_are_limited_too(fresh_server):
    srv = fresh_server("sd3", max_body_bytes=2048, max_upload_bytes=4096)
    with live_server(srv) as (base, _), httpx.Client(base_url=base, timeout=30) as client:
        if True:  # a JSON body padded with whitespace, streamed: no Content-Length header
            small = json.dumps(body()).encode()

            def padded(total: int):
                yield small
                yield from _chunks(total - len(small))

            r = client.post(
                "/rollout/generate",
                content=padded(6000),
                headers={"Content-Type": "application/json", "Accept": "application/json"},
            )
            assert "content-length" not in r.request.headers
            assert "max_body_bytes" in _error(r, 413)
            r = client.post(
                "/rollout/generate",
                content=padded(1500),
                headers={"Content-Type": "application/json", "Accept": "application/json"},
            )
            assert r.status_code == 200, r.text
            r = client.post("/update_weights", content=_chunks(10000))
            assert "max_upload_bytes" in _error(r, 413)
            r = client.post("/update_weights", content=b"x" * 5000)  # with Content-Length
            assert "max_upload_bytes" in _error(r, 413)
            assert client.get("/health").status_code == 200


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # numpy, in the shift itself
def test_unservable_derived_schedule_is_refused_before_the_worker(private):
    """Found by the fuzzer: a tiny flow_shift gives an infinite sigma; it must be a 400 from
    validation, not a failed batch (which would log an error and fail its batch mates)."""
    with collect_logs() as logs:
        msg = _error(private.client.post("/rollout/generate", json=body(flow_shift=1e-17)), 400)
    assert "flow_shift" in msg and "finite" in msg
    assert not [r for r in logs.records if r.levelno >= logging.ERROR]
