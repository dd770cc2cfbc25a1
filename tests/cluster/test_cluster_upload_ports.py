"""Full weights straight to every replica: each replica's own upload port, the commit at the front.

A local Ray instance with two tiny CPU replicas started with ``upload_port=0``: every replica opens
a port of its own and the front advertises them (``replica_upload_urls``). ``push_weights`` then
sends every part to both replicas at once and commits with an empty final part at the front, which
applies the upload on every replica or on none. The front runs under ``TestClient``; the replicas'
ports are real sockets, reached through the same ``httpx`` client.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import httpx
import pytest
import torch

from diffusion_rollout.client import RolloutClient, push_weights
from diffusion_rollout.client.exceptions import RolloutHTTPError
from diffusion_rollout.protocol.checksums import trainer_weights_checksum
from diffusion_rollout.protocol.safetensors_layout import SafetensorsBody


@pytest.fixture(scope="module")
def cluster(tiny_model_path):
    import ray

    from benchmarks.loopback import LoopbackServer
    from diffusion_rollout.cluster import ClusterEngine
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.upload_listener import UploadListener

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False)
    engine = front = None
    try:
        config = ServerConfig(
            model=str(tiny_model_path("sd3")), device="cpu", dtype="float32", replicas=2,
            gpus_per_replica=0, upload_port=0,
        )  # fmt: skip
        engine = ClusterEngine(config, upload_listener=UploadListener)
        engine.start()
        front = LoopbackServer(engine, config)  # the front on a real port, as the replicas' are
        with RolloutClient(front.url, timeout=60.0) as client:
            yield SimpleNamespace(
                engine=engine, front=httpx.Client(base_url=front.url), client=client, ray=ray
            )
    finally:
        if front is not None:
            front.close()
        if engine is not None:
            engine.stop(grace_s=5)
        ray.shutdown()


def replica_infos(cluster) -> list[dict]:
    return cluster.ray.get([r.actor.info.remote() for r in cluster.engine.replicas])


def state(cluster) -> tuple[set, set]:
    """(the versions the replicas report, their transformer checksums)."""
    infos = replica_infos(cluster)
    sums = cluster.ray.get(
        [r.actor.manager_call.remote("checksums", {"module_names": ["transformer"]}) for r in cluster.engine.replicas]
    )  # fmt: skip
    return {i["weight_version"] for i in infos}, {s["transformer"] for s in sums}


def new_weights(served, seed: int) -> dict[str, torch.Tensor]:
    reference = served("sd3").engine.pipe.transformer  # read only: names and shapes
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.02 * torch.randn(p.shape, generator=g) for n, p in reference.named_parameters()}


def test_every_part_goes_to_every_replica_port_and_the_front_commits(cluster, served):
    info = cluster.client.model_info()
    urls = info["replica_upload_urls"]
    assert len(urls) == 2 and len(set(urls)) == 2 and all(u.startswith("http://") for u in urls)
    before = [i["upload_parts_received"] for i in replica_infos(cluster)]
    master = new_weights(served, 1)
    result = push_weights(cluster.client, master, max_part_bytes=64 * 1024, weight_version="direct-1")
    assert result.weight_version == "direct-1"  # verified: push_weights checks every tensor (default)
    versions, sums = state(cluster)
    assert versions == {"direct-1"} and sums == {trainer_weights_checksum(master.items(), torch.float32)}
    received = [i["upload_parts_received"] - b for i, b in zip(replica_infos(cluster), before, strict=True)]
    parts = sum(1 for _ in _parts(master)) + 1  # and the empty part 0 that opens the upload
    assert received == [parts, parts] and parts > 3  # every data part reached both replicas directly


def _parts(master):
    from diffusion_rollout.client import safetensors_parts

    return safetensors_parts(master, max_part_bytes=64 * 1024)


def test_a_replica_failing_the_commit_rolls_every_replica_back(cluster, served):
    start = state(cluster)
    cluster.ray.get(cluster.engine.replicas[1].actor.inject_copy_fault.remote())
    with pytest.raises(RolloutHTTPError) as info:
        push_weights(cluster.client, new_weights(served, 2), max_part_bytes=64 * 1024, weight_version="fails")
    assert info.value.status_code == 500 and "replica 1" in str(info.value)
    assert state(cluster) == start  # replica 0 applied, then rolled back


def test_a_replica_missing_a_part_refuses_the_commit_and_nothing_applies(cluster, served):
    start = state(cluster)
    master = new_weights(served, 3)
    url0, _ = cluster.client.model_info()["replica_upload_urls"]
    parts = list(_parts(master))
    with httpx.Client(timeout=60.0) as direct:
        for i, part in enumerate(parts):  # replica 0 only
            r = direct.post(
                f"{url0}/update_weights", content=bytes(part.body),
                params={"upload_id": "half", "part": i, "final": "false", "weight_version": "half"},
                headers={"Content-Type": "application/octet-stream"},
            )  # fmt: skip
            assert r.status_code == 200, r.text
        # A replica's port never commits: the final part belongs to the front.
        r = direct.post(
            f"{url0}/update_weights", content=bytes(SafetensorsBody({})),
            params={"upload_id": "half", "part": len(parts), "final": "true"},
            headers={"Content-Type": "application/octet-stream"},
        )  # fmt: skip
        assert r.status_code == 400 and "final part to the cluster front" in r.json()["error"]["message"], (
            r.text
        )
    r = cluster.front.post(
        "/update_weights", content=bytes(SafetensorsBody({})),
        params={"upload_id": "half", "part": len(parts), "final": "true", "weight_version": "half"},
        headers={"Content-Type": "application/octet-stream"},
    )  # fmt: skip
    assert r.status_code == 400, r.text  # replica 1 has none of it: nobody applies
    assert state(cluster) == start
