"""NCCL weight broadcast through a cluster front: trainer rank 0 on one GPU, a replica on the other.

Skipped without two CUDA devices. (NCCL refuses two ranks of one group on the same GPU, so on a
two-GPU machine the trainer and one replica take one GPU each; on more GPUs every replica joins the
same way: one rank per replica, ``weight_update_ranks`` in ``/server_info``.)
"""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch

from diffusion_rollout.protocol.checksums import trainer_weights_checksum

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


@pytest.fixture(scope="module")
def one_replica(tiny_model_path):
    import ray
    from fastapi.testclient import TestClient

    from diffusion_rollout.cluster import ClusterEngine
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.app import create_app

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_gpus=1, num_cpus=2, include_dashboard=False, object_store_memory=2**30)
    engine = None
    try:
        config = ServerConfig(model=str(tiny_model_path("sd3")), dtype="bfloat16", replicas=1)
        engine = ClusterEngine(config)
        engine.start()
        with TestClient(create_app(config, engine=engine)) as client:
            yield engine, client
    finally:
        if engine is not None:
            engine.stop(grace_s=5)
        ray.shutdown()


def test_nccl_broadcast_reaches_the_replica(one_replica, tiny_model_path):
    from diffusers import DiffusionPipeline

    from diffusion_rollout.client import RolloutClient, WeightBroadcaster

    _, client = one_replica
    [replica] = client.get("/server_info").json()["replicas"]
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    trainer_gpu = next(i for i, u in enumerate(uuids) if u not in replica["gpu_uuids"])
    pipe = DiffusionPipeline.from_pretrained(str(tiny_model_path("sd3")), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(9)
    new = {
        n: (p.detach().float() + 0.01 * torch.randn(p.shape, generator=g)).to(torch.bfloat16)
        for n, p in pipe.transformer.named_parameters()
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = RolloutClient("http://testserver", http_client=client)
    out, errors = {}, []

    def trainer() -> None:
        try:
            torch.cuda.set_device(trainer_gpu)
            with WeightBroadcaster(
                rc,
                master_address="127.0.0.1",
                master_port=port,
                backend="nccl",
                timeout_s=120,
                device=f"cuda:{trainer_gpu}",
            ) as b:
                out["result"] = b.broadcast(new, weight_version="nccl-1")
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=trainer)
    thread.start()
    thread.join(300)
    assert not thread.is_alive(), "broadcast hung"
    if errors:
        raise errors[0]
    assert out["result"].weight_version == "nccl-1"
    info = client.get("/server_info").json()
    assert info["weight_version"] == "nccl-1" and info["replicas"][0]["weight_version"] == "nccl-1"
    sums = client.post("/get_weights_checksum", json={"module_names": ["transformer"]}).json()
    assert sums["transformer"] == trainer_weights_checksum(new.items(), torch.bfloat16)
