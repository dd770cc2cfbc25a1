"""The cluster's pure rules (no Ray): replica choice, IPC entries per GPU, group ranks, merged metrics."""

from __future__ import annotations

import pytest

from diffusion_rollout.cluster.metrics_merge import merge, parse
from diffusion_rollout.cluster.routing import (
    LeastOutstanding,
    Load,
    ipc_entry_for,
    replica_ranks,
    request_work,
)
from diffusion_rollout.errors import ServiceUnavailableError, WeightUpdateError
from diffusion_rollout.server.core.metrics import Metrics


def test_least_outstanding_work_with_ties_alternating():
    router = LeastOutstanding([Load(0), Load(1), Load(2)])
    first = [router.pick(1).replica_id for _ in range(3)]
    assert sorted(first) == [0, 1, 2]  # equal load: each replica once
    big = router.loads[0]
    router.done(router.loads[1], 1, ok=True)
    router.done(router.loads[2], 1, ok=True)
    assert router.pick(4).replica_id in (1, 2)  # replica 0 still has work
    assert big.outstanding == 1
    router.loads[1].serving = router.loads[2].serving = False
    assert router.pick(1).replica_id == 0  # only serving replicas take work
    router.loads[0].serving = False
    with pytest.raises(ServiceUnavailableError, match="no replica"):
        router.pick(1)
    assert request_work(4, None) == 4 and request_work(1, [1, 2, 3]) == 3 and request_work(None, None) == 1


def test_ipc_entries_follow_the_gpu_they_name():
    entries = ["on-a", "on-b"]
    assert ipc_entry_for(entries, ["gpu-a", "gpu-b"], ["gpu-b"]) == (["on-b"], ["gpu-b"])
    assert ipc_entry_for(entries, ["gpu-a", "gpu-b"], ["gpu-a"]) == (["on-a"], ["gpu-a"])
    # A replica on a GPU the payload does not name reads entry 0, as a single server does.
    assert ipc_entry_for(entries, ["gpu-a", "gpu-b"], ["gpu-c"]) == (["on-a"], None)
    assert ipc_entry_for(entries, None, []) == (entries, None)
    with pytest.raises(WeightUpdateError, match="payload_gpu_uuids has 1 items"):
        ipc_entry_for(entries, ["gpu-a"], ["gpu-a"])


def test_replica_ranks_need_room_in_the_group():
    assert replica_ranks(1, 3, 2) == [1, 2]
    assert replica_ranks(3, 7, 4) == [3, 4, 5, 6]
    with pytest.raises(WeightUpdateError, match="world_size > 2"):
        replica_ranks(1, 2, 2)  # a trainer that thought the front was one rank


def test_metrics_merge_sums_replicas_and_labels_them():
    front, r0, r1 = Metrics(), Metrics(), Metrics()
    front.http_response("POST", "/rollout/generate", 200)
    r0.batch_done(samples=2, steps=3, seconds=0.3)
    r1.batch_done(samples=3, steps=3, seconds=0.3)
    r1.request_done("ok", 0.5)

    def render(m: Metrics, depth: int, version) -> str:
        return m.render(queue_depth=depth, busy=False, paused=False, status="ready", weight_version=version)

    text = merge(render(front, 3, "v1"), [("0", render(r0, 1, "v1")), ("1", render(r1, 2, "v1"))])
    fams = parse(text)
    images = fams["diffusion_rollout_images_total"].samples
    assert images[("diffusion_rollout_images_total", "")] == 5
    assert images[("diffusion_rollout_images_total", 'replica="0"')] == 2
    assert images[("diffusion_rollout_images_total", 'replica="1"')] == 3
    buckets = fams["diffusion_rollout_batch_size"].samples
    assert buckets[("diffusion_rollout_batch_size_count", "")] == 2
    assert buckets[("diffusion_rollout_batch_size_bucket", 'replica="1",le="4"')] == 1
    # The front's own series and state gauges are not summed with the replicas'.
    assert fams["diffusion_rollout_status"].samples[("diffusion_rollout_status", 'status="ready"')] == 1
    assert (
        fams["diffusion_rollout_http_responses_total"].samples[
            ("diffusion_rollout_http_responses_total", 'method="POST",route="/rollout/generate",code="200"')
        ]
        == 1
    )
    # Queue depth is the replicas' (the front's own count of requests in flight overlaps them).
    assert fams["diffusion_rollout_queue_depth"].samples[("diffusion_rollout_queue_depth", "")] == 3
    # Each family once, HELP and TYPE first (what Prometheus parsers require).
    assert text.count("# TYPE diffusion_rollout_images_total counter") == 1


def test_replicas_config_builds_a_cluster_engine_behind_the_same_app(tiny_model_path):
    # What `serve --replicas 2` builds (the engine starts with the app; here it is only built).
    from diffusion_rollout.cluster import ClusterEngine
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.app import create_app
    from diffusion_rollout.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--replicas", "2", "--gpus-per-replica", "0.5"])
    assert (args.replicas, args.gpus_per_replica) == (2, 0.5)
    config = ServerConfig(model=str(tiny_model_path("sd3")), device="cpu", replicas=2)
    app = create_app(config)
    assert isinstance(app.state.engine, ClusterEngine) and app.state.engine.status == "loading"
    assert config.resolved_gpus_per_replica() == 0.0  # a CPU front: CPU replicas
    assert app.state.engine.replica_config().device == "cpu"
    assert app.state.engine.replica_config().replicas is None
