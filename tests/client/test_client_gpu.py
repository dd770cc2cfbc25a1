"""The client's GPU paths: CUDA IPC pushes across processes, NCCL broadcast, bf16 replay on CUDA.

Skipped without CUDA (``gpu`` marker). The IPC and NCCL tests run the server as a separate process,
as in production: CUDA IPC handles cannot be opened by the process that made them, and NCCL needs
one GPU per rank (the broadcast test needs two GPUs).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from diffusion_rollout.client import (
    RolloutClient,
    WeightBroadcaster,
    push_weights_ipc,
    replay_steps,
    verify_weights_checksum,
)
from diffusion_rollout.testing import free_port
from tests.client.test_client_weights import perturbed, trainer_transformer

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def server_process(model_path, device: str):
    port = free_port()
    env = {**os.environ, "DIFFUSION_ROLLOUT_ADMIN_KEY": "gpu-key"}
    cmd = [
        sys.executable, "-m", "diffusion_rollout.entrypoints.cli", "serve", "--model", str(model_path),
        "--device", device, "--dtype", "bfloat16", "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env)
    client = RolloutClient(f"http://127.0.0.1:{port}", admin_key="gpu-key")
    try:
        client.wait_until_ready(timeout_s=300)
        yield client
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_cuda_ipc_push_from_the_trainer_process(tiny_model_path):
    path = tiny_model_path("sd3")
    with server_process(path, "cuda:0") as client:
        assert client.model_info()["dtype"] == "bfloat16"
        master = {n: t.to("cuda:0") for n, t in perturbed(trainer_transformer(path), 3).items()}
        # float32 master on the GPU -> cast to the server's bf16 on the GPU -> IPC handles.
        res = push_weights_ipc(client, master, weight_version="ipc-gpu")
        assert res.weight_version == "ipc-gpu"
        verify_weights_checksum(client, master)  # bf16 cast, same checksum code
        res = push_weights_ipc(client, master, load_format=None, weight_version="ipc-gpu-2")
        assert res.weight_version == "ipc-gpu-2"


@pytest.mark.timeout(180)
def test_nccl_broadcast_to_a_server_on_another_gpu(tiny_model_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank: this machine has one")
    path = tiny_model_path("sd3")
    with server_process(path, "cuda:1") as client:
        master = {n: t.to("cuda:0") for n, t in perturbed(trainer_transformer(path), 4).items()}
        with WeightBroadcaster(
            client, master_address="127.0.0.1", master_port=free_port(), backend="nccl", device="cuda:0"
        ) as broadcaster:
            res = broadcaster.broadcast(master, dtype=torch.bfloat16, weight_version="nccl-1")
            assert res.weight_version == "nccl-1"
            res = broadcaster.broadcast(master, dtype=torch.bfloat16, weight_version="nccl-2")
        assert client.model_info()["weight_version"] == "nccl-2"
        verify_weights_checksum(client, master, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("family", "fields"),
    [("sd3", {"guidance_scale": 4.5}), ("flux", {"negative_prompt": "blurry", "true_cfg_scale": 2.0})],
)
def test_replay_is_exact_in_bf16_on_cuda(fresh_server, tiny_model_path, family, fields):
    from diffusers import AutoModel

    server = fresh_server(family, device="cuda", dtype="bfloat16")
    client = RolloutClient("http://testserver", http_client=server.client)
    outs = client.generate(
        "a red square",
        seed=3,
        num_outputs_per_prompt=3,
        num_inference_steps=4,
        width=32,
        height=32,
        max_sequence_length=16,
        rollout_return_dit_trajectory=True,
        rollout_return_denoising_env=True,
        rollout_debug_mode=True,
        **fields,
    )
    trainer = AutoModel.from_pretrained(
        str(tiny_model_path(family)), subfolder="transformer", dtype=torch.bfloat16
    ).to("cuda")
    trainer.requires_grad_(True)
    for step in replay_steps(trainer, outs):
        server_v = torch.stack([o.rollout_debug_tensors["rollout_model_outputs"][step.step] for o in outs])
        assert step.model_output.dtype == torch.bfloat16
        assert torch.equal(step.model_output.detach().cpu(), server_v)
        assert torch.equal(step.log_prob.detach(), step.old_log_prob)
        assert torch.equal(step.ratio.detach().cpu(), torch.ones(3))
