"""Faults inside generation and weight updates.

- A (simulated) CUDA out-of-memory inside a batch: 503 for that batch only, the failed call's
  tensors are freed (its frames are cleared), the next request succeeds.
- Any other exception fails only the requests batched together; a request of another batch that
  was queued at the same time succeeds.
- NaN/Inf produced by the model is flagged per sample (``nonfinite_output``), logged with the
  request id and counted, and the response is still delivered.
- A weight update that fails half way, while rollouts run, leaves the old weights: every rollout
  answers with the old version and the old image, the checksum is unchanged.
"""

from __future__ import annotations

import threading
import weakref

import torch
from safetensors.torch import save

from diffusion_rollout.server.weights import get_weight_manager
from tests.batch_helpers import settled_batches
from tests.reliability_helpers import body, collect_logs, slow_transformer, wait_until


def _metric(srv, line_start: str) -> float:
    for line in srv.client.get("/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_cuda_oom_in_a_batch_is_503_frees_its_tensors_and_the_next_request_succeeds(
    fresh_server, monkeypatch
):
    srv = fresh_server("sd3")
    pipe_cls = type(srv.engine.pipe)
    original = pipe_cls.__call__
    refs = []

    def out_of_memory(self, *args, **kwargs):
        activations = torch.empty(1 << 20)  # what a real call would hold when the allocator gives up
        refs.append(weakref.ref(activations))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(pipe_cls, "__call__", out_of_memory)
    r = srv.client.post("/rollout/generate", json=body())
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and "out of memory" in err["message"]
    assert "batch of 1" in err["message"]
    # The traceback no longer pins the failed call's tensors.
    wait_until(lambda: refs[0]() is None, 5, "the failed call's tensors to be freed")

    monkeypatch.setattr(pipe_cls, "__call__", original)
    assert srv.client.post("/rollout/generate", json=body()).status_code == 200
    assert srv.client.get("/health_generate").status_code == 200
    assert _metric(srv, 'diffusion_rollout_batch_failures_total{type="service_unavailable"}') == 1
    assert _metric(srv, 'diffusion_rollout_requests_total{outcome="service_unavailable"}') == 1


def test_an_exception_fails_only_the_requests_of_its_batch(fresh_server, monkeypatch):
    srv = fresh_server("sd3")
    worker = srv.engine.worker
    pipe_cls = type(srv.engine.pipe)
    original = pipe_cls.__call__

    def fails_at_four_steps(self, *args, **kwargs):
        if kwargs.get("num_inference_steps") == 4:
            raise RuntimeError("injected failure in the 4-step batch")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(pipe_cls, "__call__", fails_at_four_steps)
    worker.pause()
    results: dict = {}
    threads = []
    # a1 and a2 share a batch key (batched together), b does not (its own batch, queued after).
    for depth, (key, fields) in enumerate(
        [("a1", {"seed": 1}), ("a2", {"seed": 2}), ("b", {"num_inference_steps": 3})], start=1
    ):

        def run(key=key, fields=fields):
            results[key] = srv.client.post("/rollout/generate", json=body(**fields))

        threads.append(threading.Thread(target=run))
        threads[-1].start()
        wait_until(lambda depth=depth: worker.depth == depth, 10, f"{key} to queue")
    worker.resume()
    for t in threads:
        t.join(30)
    for key in ("a1", "a2"):
        r = results[key]
        assert r.status_code == 500, r.text
        assert "injected failure in the 4-step batch" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "generation_error"
    assert results["b"].status_code == 200
    assert settled_batches(worker) == 1  # b; the failed batch is not counted
    assert _metric(srv, 'diffusion_rollout_batch_failures_total{type="generation_error"}') == 1


def test_nan_in_the_model_output_is_flagged_per_sample_and_logged(fresh_server):
    srv = fresh_server("sd3")

    def poison_second_sample(module, args, output):
        out = output[0] if isinstance(output, tuple) else output.sample
        out[1] = float("nan")  # no CFG at guidance_scale=1: row i is sample i
        return output

    hook = srv.engine.pipe.transformer.register_forward_hook(poison_second_sample)
    try:
        with collect_logs() as logs:
            outs = srv.generate(body(num_outputs_per_prompt=2, guidance_scale=1.0), accept="application/json")
            r = srv.client.post(
                "/rollout/generate",
                json=body(num_outputs_per_prompt=2, guidance_scale=1.0, return_generated_output=False),
                headers={"X-Request-Id": "nan-probe"},
            )
    finally:
        hook.remove()
    assert [o["nonfinite_output"] for o in outs] == [False, True]
    assert torch.isfinite(outs[0]["generated_output"]).all()
    assert not torch.isfinite(outs[1]["generated_output"]).all()
    assert r.status_code == 200  # reported, not refused
    warnings = [rec for rec in logs.records if "nonfinite_output" in rec.getMessage()]
    assert any(
        rec.request_id == "nan-probe" and "request_id=nan-probe" in rec.getMessage() for rec in warnings
    )
    assert _metric(srv, "diffusion_rollout_nonfinite_outputs_total") == 2
    # Clean outputs again once the model is.
    assert [o["nonfinite_output"] for o in srv.generate(body(num_outputs_per_prompt=2))] == [False, False]


def test_failed_update_during_rollouts_keeps_the_old_weights(fresh_server):
    srv = fresh_server("sd3", max_batch_size=1)
    manager = get_weight_manager(srv.engine)
    checksum = srv.client.post("/get_weights_checksum", json={}).json()
    [reference] = srv.generate(body())
    copied = []

    def explode(module: str, name: str) -> None:
        copied.append(name)
        if len(copied) == 10:
            raise RuntimeError("simulated failure half way through the copy")

    manager.before_copy = explode
    g = torch.Generator().manual_seed(3)
    new = {
        n: p.detach() + 0.1 * torch.randn(p.shape, generator=g)
        for n, p in srv.engine.pipe.transformer.named_parameters()
    }
    outputs, errors = [], []
    hook = slow_transformer(srv, 0.01)

    def rollouts():
        for _ in range(3):
            r = srv.client.post("/rollout/generate", json=body())
            if r.status_code != 200:
                errors.append(r.text)
            else:
                from diffusion_rollout.protocol import wire

                outputs.extend(wire.decode(r.content, r.headers["content-type"]))

    threads = [threading.Thread(target=rollouts) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        r = srv.client.post("/update_weights", content=save(new), params={"weight_version": "bad"})
        for t in threads:
            t.join(60)
    finally:
        hook.remove()
        manager.before_copy = None
    assert r.status_code == 500, r.text
    assert "previous weights were restored" in r.json()["error"]["message"]
    assert not errors and len(outputs) == 6
    for out in outputs:
        assert out["weight_version"] == 0
        assert torch.equal(out["generated_output"], reference["generated_output"])
    assert srv.client.post("/get_weights_checksum", json={}).json() == checksum
    assert srv.client.get("/model_info").json()["weight_version"] == 0


def test_a_model_that_fails_to_load_leaves_a_server_that_answers_503(tmp_path):
    from fastapi.testclient import TestClient

    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.app import create_app

    app = create_app(ServerConfig(model=str(tmp_path / "missing"), device="cpu"))
    with collect_logs(), TestClient(app) as client:
        wait_until(lambda: app.state.engine.status == "failed", 30, "the load to fail")
        assert client.get("/health").status_code == 200
        r = client.post("/rollout/generate", json=body())
        assert r.status_code == 503 and "failed" in r.json()["error"]["message"]
        assert client.get("/health_generate").status_code == 503
