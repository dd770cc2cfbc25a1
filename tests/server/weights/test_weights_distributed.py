"""The NCCL-protocol update path through a real ``torch.distributed`` group: gloo, two processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from diffusion_rollout.protocol.checksums import trainer_weights_checksum
from diffusion_rollout.testing import free_port

REPO = Path(__file__).resolve().parents[3]

# The trainer: rank 0 of the group, hosting its TCP store; broadcasts two rounds of tensors.
TRAINER = r"""
import json, sys
import torch, torch.distributed as dist
from diffusion_rollout.server.weights.distributed import join_group

spec = json.load(open(sys.argv[1]))
group = join_group(master_address="127.0.0.1", master_port=int(sys.argv[2]), rank=0, world_size=2,
                   group_name="trainer_sync", backend="gloo", timeout_s=60)
for round_ in spec["rounds"]:
    g = torch.Generator().manual_seed(round_["seed"])
    for shape, dtype in zip(round_["shapes"], round_["dtypes"]):
        t = (0.05 * torch.randn(shape, generator=g)).to(getattr(torch, dtype))
        dist.broadcast(t, src=0, group=group)
# Tear down only after the server has left the group: a gloo process that exits while its peer is
# still connected can abort in its C++ destructors, which made this test flaky under load.
sys.stdin.readline()
dist.destroy_process_group(group)
print("trainer done", flush=True)
"""


def tensors_of(round_: dict) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(round_["seed"])
    return [
        (n, (0.05 * torch.randn(shape, generator=g)).to(getattr(torch, dtype)))
        for n, shape, dtype in zip(round_["names"], round_["shapes"], round_["dtypes"], strict=True)
    ]


def test_gloo_group_lands_broadcast_tensors(fresh_server, tmp_path):
    server = fresh_server("sd3")
    params = list(server.engine.pipe.transformer.named_parameters())
    good = {
        "seed": 1,
        "names": [f"transformer.{n}" for n, _ in params],
        "shapes": [list(p.shape) for _, p in params],
        # bf16 from the trainer for some tensors: the server casts with .to(param.dtype).
        "dtypes": ["bfloat16" if i % 2 else "float32" for i in range(len(params))],
    }
    ghost = {"seed": 2, "names": ["ghost.weight"], "shapes": [[3, 3]], "dtypes": ["float32"]}
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"rounds": [good, ghost]}))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(spec), str(port)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        client = server.client
        r = client.post(
            "/init_weights_update_group",
            json={
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": "trainer_sync",
                "backend": "gloo",
                "timeout_s": 60,
            },
        )
        assert r.status_code == 200, r.text
        assert "rank 1 of 2" in r.json()["message"]
        before = client.post("/get_weights_checksum", json={"module_names": ["transformer"]}).json()

        r = client.post(
            "/update_weights_from_distributed",
            json={
                **{k: good[k] for k in ("names", "dtypes", "shapes")},
                "group_name": "trainer_sync",
                "weight_version": "dist-1",
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["weight_version"] == "dist-1"
        got = client.post("/get_weights_checksum", json={"module_names": ["transformer"]}).json()[
            "transformer"
        ]
        expected = trainer_weights_checksum(tensors_of(good), torch.float32, strip_prefix="transformer")
        assert got == expected != before["transformer"]

        # An announcement this model cannot take is still received (the trainer is not left
        # hanging in its broadcast), then refused with the name, and nothing changes.
        r = client.post(
            "/update_weights_from_distributed",
            json={**{k: ghost[k] for k in ("names", "dtypes", "shapes")}, "group_name": "trainer_sync"},
        )
        assert r.status_code == 400 and "transformer.ghost.weight" in r.json()["error"]["message"]
        assert (
            client.post("/get_weights_checksum", json={"module_names": ["transformer"]}).json()["transformer"]
            == got
        )

        assert (
            client.post("/destroy_weights_update_group", json={"group_name": "trainer_sync"}).status_code
            == 200
        )
        out, _ = trainer.communicate("leave\n", timeout=60)
        assert trainer.returncode == 0, out
        assert "trainer done" in out
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)


def test_group_errors(fresh_server):
    client = fresh_server("sd3").client
    r = client.post(
        "/update_weights_from_distributed",
        json={"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"},
    )
    assert r.status_code == 404 and "no weight update group 'nope'" in r.json()["error"]["message"]
    r = client.post("/destroy_weights_update_group", json={"group_name": "nope"})
    assert r.status_code == 404
    body = {
        "master_address": "127.0.0.1",
        "master_port": 1234,
        "rank_offset": 0,
        "world_size": 2,
        "backend": "gloo",
    }
    assert client.post("/init_weights_update_group", json=body).status_code == 422  # rank 0 is the trainer
    r = client.post("/init_weights_update_group", json={**body, "rank_offset": 1, "backend": "nccl"})
    if not torch.cuda.is_available():
        assert r.status_code == 400 and "needs a GPU" in r.json()["error"]["message"]
    r = client.post("/init_weights_update_group", json={**body, "rank_offset": 2})
    assert r.status_code == 400 and "rank_offset must be in 1..world_size-1" in r.json()["error"]["message"]
    # Nobody listens on this port: joining fails within the timeout and says where it tried.
    r = client.post(
        "/init_weights_update_group",
        json={**body, "master_port": free_port(), "rank_offset": 1, "timeout_s": 1},
    )
    assert r.status_code == 400 and "could not join group" in r.json()["error"]["message"]
