"""``GET /metrics``: valid Prometheus text, and the numbers follow what the server did."""

from __future__ import annotations

import math
import re
import threading

import torch
from safetensors.torch import save

from diffusion_rollout.server.core.metrics import Histogram, Metrics
from tests.reliability_helpers import body, wait_until

SAMPLE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$'
)


def parse(text: str) -> dict[str, float]:
    """Checks the exposition format strictly; returns ``{'name{labels}': value}``."""
    declared: dict[str, str] = {}
    samples: dict[str, float] = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in ("counter", "gauge", "histogram"), line
            assert name not in declared, f"{name} declared twice"
            declared[name] = kind
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        base = re.sub(r"_(bucket|sum|count)$", "", name) if name not in declared else name
        assert base in declared, f"{name} has no TYPE"
        samples[name + labels] = float(value)  # float() accepts NaN and +Inf
    return samples


def scrape(srv) -> dict[str, float]:
    r = srv.client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(r.text)


def test_metrics_follow_rollouts_failures_queue_and_weight_updates(fresh_server):
    srv = fresh_server("sd3")
    m = scrape(srv)
    assert m["diffusion_rollout_queue_depth"] == 0 and m["diffusion_rollout_images_total"] == 0
    assert m["diffusion_rollout_weight_version"] == 0 and m["diffusion_rollout_weight_updates_total"] == 0
    assert m['diffusion_rollout_status{status="ready"}'] == 1

    for _ in range(2):
        srv.generate(body(num_outputs_per_prompt=2))
    srv.generate(body(num_inference_steps=10**6), expect=400)
    m = scrape(srv)
    assert m["diffusion_rollout_images_total"] == 4 and m["diffusion_rollout_batches_total"] == 2
    assert m["diffusion_rollout_batch_size_count"] == 2 and m["diffusion_rollout_batch_size_sum"] == 4
    assert m['diffusion_rollout_batch_size_bucket{le="1"}'] == 0
    assert m['diffusion_rollout_batch_size_bucket{le="2"}'] == 2
    assert m["diffusion_rollout_step_seconds_count"] == 2 and m["diffusion_rollout_step_seconds_sum"] > 0
    assert m["diffusion_rollout_images_per_second"] > 0
    assert m['diffusion_rollout_requests_total{outcome="ok"}'] == 2
    assert m['diffusion_rollout_requests_total{outcome="invalid_request"}'] == 1
    assert m["diffusion_rollout_request_seconds_count"] == 3
    assert (
        m['diffusion_rollout_http_responses_total{method="POST",route="/rollout/generate",code="200"}'] == 2
    )
    assert (
        m['diffusion_rollout_http_responses_total{method="POST",route="/rollout/generate",code="400"}'] == 1
    )

    # Queue depth and paused state are read live.
    srv.engine.worker.pause()
    t = threading.Thread(target=lambda: srv.generate(body()))
    t.start()
    try:
        wait_until(lambda: srv.engine.worker.depth == 1, 10, "the request to queue")
        m = scrape(srv)
        assert m["diffusion_rollout_queue_depth"] == 1 and m["diffusion_rollout_paused"] == 1
    finally:  # a failed assertion must not leave the queued request (and the teardown) hanging
        srv.engine.worker.resume()
        t.join(30)
    m = scrape(srv)
    assert m["diffusion_rollout_queue_depth"] == 0 and m["diffusion_rollout_paused"] == 0
    assert m['diffusion_rollout_requests_total{outcome="ok"}'] == 3  # the held request was served

    # Weight updates: counted, numeric version as a gauge, any version as a label.
    g = torch.Generator().manual_seed(0)
    new = {
        n: p.detach() + 0.01 * torch.randn(p.shape, generator=g)
        for n, p in srv.engine.pipe.transformer.named_parameters()
    }
    assert (
        srv.client.post("/update_weights", content=save(new), params={"weight_version": "7"}).status_code
        == 200
    )
    m = scrape(srv)
    assert m["diffusion_rollout_weight_updates_total"] == 1
    assert m['diffusion_rollout_weight_version_info{weight_version="7"}'] == 1
    assert srv.client.post("/update_weights", content=b"not safetensors").status_code == 400
    assert scrape(srv)["diffusion_rollout_weight_updates_total"] == 1  # failed updates are not counted
    srv.engine.weight_version = 'step "8"\n\\'  # label escaping
    m = scrape(srv)
    assert m['diffusion_rollout_weight_version_info{weight_version="step \\"8\\"\\n\\\\"}'] == 1
    assert math.isnan(m["diffusion_rollout_weight_version"])
    srv.engine.weight_version = 12
    assert scrape(srv)["diffusion_rollout_weight_version"] == 12


def test_histogram_buckets_are_cumulative():
    h = Histogram((1, 2, 4))
    for v in (0.5, 1, 3, 100):
        h.observe(v)
    lines = h.lines("x")
    assert lines == [
        'x_bucket{le="1"} 2',
        'x_bucket{le="2"} 2',
        'x_bucket{le="4"} 3',
        'x_bucket{le="+Inf"} 4',
        "x_sum 104.5",
        "x_count 4",
    ]


def test_images_per_second_forgets_old_batches(monkeypatch):
    import diffusion_rollout.server.core.metrics as metrics_module

    now = [1000.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: now[0])
    m = Metrics(window_s=10)
    now[0] = 1100.0
    m.batch_done(samples=20, steps=4, seconds=1.0)
    assert m.images_per_second() == 2.0
    now[0] = 1111.0
    assert m.images_per_second() == 0.0
    text = m.render(queue_depth=0, busy=False, paused=False, status="ready", weight_version=None)
    parsed = parse(text)
    assert parsed["diffusion_rollout_images_total"] == 20
    assert parsed['diffusion_rollout_step_seconds_bucket{le="0.25"}'] == 1
