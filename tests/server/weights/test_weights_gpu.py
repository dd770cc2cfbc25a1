"""GPU-only paths: CUDA IPC payloads from another process, NCCL broadcasts, pinned-memory release.

Skipped without CUDA (``gpu`` marker); the NCCL test needs two GPUs (trainer and server each own one,
as NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[3]
ODE = {
    "prompt": "a green teapot",
    "seed": 9,
    "num_inference_steps": 3,
    "rollout_sde_type": "ode",
    "rollout_debug_mode": False,
    "rollout_log_prob_no_const": True,
}

# A trainer on the same GPU, serializing the way SGLang clients do: torch's reductions patched
# so a CUDA tensor names its device by UUID (pickled as SGLang's rebuild function).
IPC_TRAINER = r"""
import json, sys, types
import torch
from torch.multiprocessing import reductions
from diffusion_rollout.protocol.checksums import trainer_weights_checksum
from diffusion_rollout.server.weights import ipc

for name in ["sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.utils.patch_torch"]:
    sys.modules[name] = types.ModuleType(name)
original_reduce, original_rebuild = reductions.reduce_tensor, reductions.rebuild_cuda_tensor
def _rebuild_cuda_tensor_modified(*args):
    return original_rebuild(*args)
_rebuild_cuda_tensor_modified.__module__ = "sglang.srt.utils.patch_torch"
sys.modules["sglang.srt.utils.patch_torch"]._rebuild_cuda_tensor_modified = _rebuild_cuda_tensor_modified
def _reduce_tensor_modified(*a, **k):
    fn, args = original_reduce(*a, **k)
    if len(args) > 6 and isinstance(args[6], int):
        args = (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
    return fn, args
reductions.reduce_tensor = _reduce_tensor_modified
reductions.rebuild_cuda_tensor = _rebuild_cuda_tensor_modified
reductions.init_reductions()

spec = json.load(open(sys.argv[1]))
g = torch.Generator("cuda").manual_seed(4)
named = [(n, 0.05 * torch.randn(s, generator=g, device="cuda")) for n, s in zip(spec["names"], spec["shapes"])]
out = {
    "plain": ipc.serialize(named),
    "bucket": ipc.serialize(ipc.flatten_bucket(named)),
    "uuid": str(torch.cuda.get_device_properties(0).uuid),
    "checksum": trainer_weights_checksum(named, torch.bfloat16),
}
json.dump(out, open(sys.argv[2], "w"))
print("ready", flush=True)
sys.stdin.readline()  # keep the CUDA memory alive until the server has copied it
print("done", flush=True)
"""

NCCL_TRAINER = r"""
import json, sys
import torch, torch.distributed as dist
from diffusion_rollout.server.weights.distributed import join_group

spec = json.load(open(sys.argv[1]))
group = join_group(master_address="127.0.0.1", master_port=int(sys.argv[2]), rank=0, world_size=2,
                   group_name="nccl_sync", backend="nccl", timeout_s=120)
g = torch.Generator("cuda").manual_seed(5)
for shape in spec["shapes"]:
    dist.broadcast(0.05 * torch.randn(shape, generator=g, device="cuda"), src=0, group=group)
torch.cuda.synchronize()
dist.destroy_process_group(group)
print("trainer done", flush=True)
"""


class GpuServer:
    def __init__(self, path: Path) -> None:
        from fastapi.testclient import TestClient

        from diffusion_rollout.config import ServerConfig
        from diffusion_rollout.entrypoints.app import create_app
        from diffusion_rollout.server.core.engine import Engine

        self.config = ServerConfig(model=str(path), device="cuda", dtype="bfloat16")
        self.engine = Engine(self.config)
        self.engine.start()
        self.client = TestClient(create_app(self.config, engine=self.engine))
        self.client.__enter__()

    def generate(self, body: dict):
        from diffusion_rollout.protocol import wire

        r = self.client.post("/rollout/generate", json=body)
        assert r.status_code == 200, r.text
        return wire.decode(r.content, r.headers["content-type"])

    def checksum(self, module: str = "transformer") -> str:
        return self.client.post("/get_weights_checksum", json={"module_names": [module]}).json()[module]

    def close(self) -> None:
        self.client.__exit__(None, None, None)
        self.engine.stop(grace_s=5)


@pytest.fixture
def gpu_server(tiny_model_path):
    server = GpuServer(tiny_model_path("sd3"))
    yield server
    server.close()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _spec(server, tmp_path: Path) -> Path:
    params = list(server.engine.pipe.transformer.named_parameters())
    path = tmp_path / "spec.json"
    path.write_text(
        json.dumps({"names": [n for n, _ in params], "shapes": [list(p.shape) for _, p in params]})
    )
    return path


def test_cuda_ipc_payload_from_another_process(gpu_server, tmp_path):
    spec, out = _spec(gpu_server, tmp_path), tmp_path / "payload.json"
    trainer = subprocess.Popen(
        [sys.executable, "-c", IPC_TRAINER, str(spec), str(out)],
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert trainer.stdout.readline().strip() == "ready", trainer.stdout.read()
        payload = json.loads(out.read_text())
        for load_format in (None, "flattened_bucket"):
            entry = payload["bucket" if load_format else "plain"]
            r = gpu_server.client.post(
                "/update_weights_from_tensor",
                json={
                    "serialized_named_tensors": [entry],
                    "load_format": load_format,
                    "payload_gpu_uuids": [payload["uuid"]],
                },
            )
            assert r.status_code == 200, r.text
            assert gpu_server.checksum() == payload["checksum"]
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        assert trainer.wait(60) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_nccl_group_from_a_trainer_on_another_gpu(gpu_server, tmp_path):
    spec = _spec(gpu_server, tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**_env(), "CUDA_VISIBLE_DEVICES": "1"}
    trainer = subprocess.Popen(
        [sys.executable, "-c", NCCL_TRAINER, str(spec), str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        c = gpu_server.client
        r = c.post(
            "/init_weights_update_group",
            json={
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": "nccl_sync",
                "backend": "nccl",
                "timeout_s": 120,
            },
        )
        assert r.status_code == 200, r.text
        meta = json.loads(spec.read_text())
        r = c.post(
            "/update_weights_from_distributed",
            json={
                "names": meta["names"],
                "shapes": meta["shapes"],
                "dtypes": ["float32"] * len(meta["names"]),
                "group_name": "nccl_sync",
            },
        )
        assert r.status_code == 200, r.text
        from diffusion_rollout.protocol.checksums import trainer_weights_checksum

        g = torch.Generator("cuda").manual_seed(5)
        expected = [
            (n, 0.05 * torch.randn(s, generator=g, device="cuda"))
            for n, s in zip(meta["names"], meta["shapes"], strict=True)
        ]
        assert gpu_server.checksum() == trainer_weights_checksum(expected, torch.bfloat16)
        assert c.post("/destroy_weights_update_group", json={"group_name": "nccl_sync"}).status_code == 200
        out, _ = trainer.communicate(timeout=120)
        assert trainer.returncode == 0, out
    finally:
        if trainer.poll() is None:
            trainer.kill()


def test_release_frees_the_gpu_and_resume_restores_exactly(gpu_server):
    from safetensors.torch import save

    c = gpu_server.client
    # A merged LoRA too: its kept base copies must travel with the model.
    tr = gpu_server.engine.pipe.transformer
    lora = {}
    g = torch.Generator().manual_seed(0)
    for name, module in tr.named_modules():
        if name.endswith("attn.to_q"):
            lora[f"{name}.lora_A.weight"] = 0.1 * torch.randn(4, module.in_features, generator=g)
            lora[f"{name}.lora_B.weight"] = 0.1 * torch.randn(module.out_features, 4, generator=g)
    r = c.post(
        "/lora/load",
        content=save(lora),
        params={"name": "default", "activate": "true", "mode": "merged"},
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 200, r.text
    before = c.post("/get_weights_checksum", json={}).json()
    [img0] = gpu_server.generate(ODE)
    torch.cuda.synchronize()
    model_bytes = sum(p.numel() * p.element_size() for p in tr.parameters())
    allocated = torch.cuda.memory_allocated()

    assert c.post("/release_memory_occupation").status_code == 200
    assert torch.cuda.memory_allocated() <= allocated - model_bytes
    assert all(p.device.type == "cpu" and p.is_pinned() for p in tr.parameters())
    assert c.post("/rollout/generate", json=ODE).status_code == 503
    assert c.post("/get_weights_checksum", json={}).json() == before

    assert c.post("/resume_memory_occupation").status_code == 200
    assert all(p.device.type == "cuda" for p in tr.parameters())
    assert c.post("/get_weights_checksum", json={}).json() == before
    [img1] = gpu_server.generate(ODE)
    assert torch.equal(img0["generated_output"], img1["generated_output"])
    assert c.post("/lora/unload", json={}).status_code == 200


def test_lora_dynamic_is_bit_identical_to_peft_on_gpu(gpu_server, tiny_model_path):
    from peft import LoraConfig, set_peft_model_state_dict
    from safetensors.torch import save

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    tr = gpu_server.engine.pipe.transformer
    g = torch.Generator().manual_seed(1)
    lora = {}
    for name, module in tr.named_modules():
        if name.endswith(
            (
                "attn.to_q",
                "attn.to_k",
                "attn.to_v",
                "attn.to_out.0",
                "attn2.to_q",
                "attn2.to_k",
                "attn2.to_v",
                "attn2.to_out.0",
            )
        ):
            lora[f"{name}.lora_A.weight"] = 0.3 * torch.randn(4, module.in_features, generator=g)
            lora[f"{name}.lora_B.weight"] = 0.3 * torch.randn(module.out_features, 4, generator=g)
    cfg = json.dumps(json.loads(json.dumps(config.to_dict(), default=list)))
    r = gpu_server.client.post(
        "/lora/load",
        content=save(lora, metadata={"peft_config": cfg}),
        params={"name": "default", "activate": "true"},
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 200, r.text
    [ours] = gpu_server.generate(ODE)

    ref = GpuServer(tiny_model_path("sd3"))
    try:
        ref.engine.pipe.transformer.add_adapter(config)
        set_peft_model_state_dict(ref.engine.pipe.transformer, lora)
        [theirs] = ref.generate(ODE)
    finally:
        ref.close()
    assert torch.equal(ours["generated_output"], theirs["generated_output"])
