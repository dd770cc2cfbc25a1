"""Replicas on two GPUs (the device machine's ``nvidia-h200-x2``): placement, routing, IPC by GPU.

Skipped without two CUDA devices. One replica per GPU, the tiny SD3 model in bfloat16; the test
process plays the colocated trainer (CUDA IPC handles on both GPUs).
"""

from __future__ import annotations

import os

import pytest
import torch

from diffusion_rollout.protocol import wire
from diffusion_rollout.protocol.checksums import trainer_weights_checksum
from diffusion_rollout.protocol.weight_transport import serialize_named_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

BODY = {
    "prompt": "a red square",
    "seed": 7,
    "width": 32,
    "height": 32,
    "max_sequence_length": 16,
    "num_inference_steps": 3,
    "rollout_debug_mode": False,
}


@pytest.fixture(scope="module")
def gpu_cluster(tiny_model_path):
    import ray
    from fastapi.testclient import TestClient

    from diffusion_rollout.cluster import ClusterEngine
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.app import create_app

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_gpus=2, num_cpus=4, include_dashboard=False, object_store_memory=2 * 2**30)
    engine = None
    try:
        config = ServerConfig(model=str(tiny_model_path("sd3")), dtype="bfloat16", replicas=2)
        engine = ClusterEngine(config)
        engine.start()
        with TestClient(create_app(config, engine=engine)) as client:
            yield engine, client
    finally:
        if engine is not None:
            engine.stop(grace_s=5)
        ray.shutdown()


def _generate(client, body):
    r = client.post("/rollout/generate", json=body, headers={"Accept": "application/msgpack"})
    assert r.status_code == 200, r.text[:2000]
    return wire.decode(r.content, r.headers["content-type"])


def test_one_replica_per_gpu_and_identical_outputs(gpu_cluster):
    _, client = gpu_cluster
    info = client.get("/server_info").json()["replicas"]
    uuids = [r["gpu_uuids"] for r in info]
    assert all(len(u) == 1 for u in uuids) and uuids[0] != uuids[1], info
    visible = {str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())}
    assert {u[0] for u in uuids} <= visible
    # Equal load alternates replicas: the same request on both GPUs gives the same bits.
    a, b = (_generate(client, BODY)[0] for _ in range(2))
    assert [r["served_requests"] for r in client.get("/server_info").json()["replicas"]] == [1, 1]
    assert torch.equal(a["generated_output"], b["generated_output"])
    assert torch.equal(a["rollout_log_probs"], b["rollout_log_probs"])


def test_ipc_payloads_reach_the_replica_on_their_gpu(gpu_cluster, tiny_model_path):
    from diffusers import DiffusionPipeline

    _, client = gpu_cluster
    info = client.get("/server_info").json()["replicas"]
    index_of = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    pipe = DiffusionPipeline.from_pretrained(str(tiny_model_path("sd3")), dtype=torch.bfloat16)
    base = {n: p.detach() for n, p in pipe.transformer.named_parameters()}
    g = torch.Generator().manual_seed(3)
    new = {
        n: (p.float() + 0.01 * torch.randn(p.shape, generator=g)).to(torch.bfloat16) for n, p in base.items()
    }

    def push(values_for_gpu) -> object:
        held, entries, gpu_ids = [], [], []
        for r in info:
            uuid = r["gpu_uuids"][0]
            device = f"cuda:{index_of[uuid]}"
            tensors = [(n, t.to(device)) for n, t in values_for_gpu(uuid).items()]
            held.append(tensors)  # the IPC handles stay valid while the sender keeps the tensors
            entries.append(serialize_named_tensors(tensors, load_format="flattened_bucket"))
            gpu_ids.append(uuid)
        torch.cuda.synchronize()
        return client.post(
            "/update_weights_from_tensor",
            json={
                "serialized_named_tensors": entries,
                "load_format": "flattened_bucket",
                "payload_gpu_uuids": gpu_ids,
                "weight_version": "ipc",
            },
        )

    r = push(lambda uuid: new)
    assert r.status_code == 200 and r.json()["weight_version"] == "ipc", r.text
    sums = client.post("/get_weights_checksum", json={"module_names": ["transformer"]})
    assert sums.status_code == 200, sums.text
    assert sums.json()["transformer"] == trainer_weights_checksum(new.items(), torch.bfloat16)

    # Different values per GPU: each replica took its own GPU's entry, so the checksums differ and
    # the answer names the replica that disagrees.
    second = info[1]["gpu_uuids"][0]
    r = push(lambda uuid: base if uuid == second else new)
    assert r.status_code == 200, r.text
    sums = client.post("/get_weights_checksum", json={"module_names": ["transformer"]})
    assert sums.status_code == 500 and "replica 1" in sums.json()["error"]["message"], sums.text
    r = push(lambda uuid: base)
    assert r.status_code == 200, r.text
    assert client.post("/get_weights_checksum", json={}).status_code == 200
