"""Pieces shared by the example trainers: a server to talk to, the trainer's model, a toy reward.

Design decisions:

- Without ``--url`` the examples bring their own server on a tiny random SD3 model: generated into a
  temporary folder with ``diffusion_rollout.models.save_tiny_model`` and served either by
  ``diffusion-rollout serve`` in a subprocess (``--server subprocess``, the realistic layout: two
  processes talking HTTP) or by the same app under uvicorn on a thread (``--server thread``, faster
  to start; still real HTTP on 127.0.0.1). Either way the server gets ``max_batch_size`` equal to the
  group size, so every request (one GRPO group) is one pipeline batch and the trainer, replaying a
  group as one batch, reproduces the server's model outputs bit for bit (ratio exactly 1).
- The trainer loads its own copy of the transformer from the same folder, in the server's dtype,
  and trains a PEFT LoRA on it; the server only ever receives the adapter.
- The reward (closeness of the image's colours to a target colour) needs no model and no download.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("examples")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    admin_key: str | None
    model_path: Path | None


@contextlib.contextmanager
def _thread_server(model_path: Path, port: int, admin_key: str, max_batch_size: int) -> Iterator[None]:
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.app import create_app
    from diffusion_rollout.entrypoints.http_server import make_server

    config = ServerConfig(
        model=str(model_path),
        device="cpu",
        dtype="float32",
        host="127.0.0.1",
        port=port,
        admin_key=admin_key,
        max_batch_size=max_batch_size,
        log_level="warning",
        shutdown_grace_s=5.0,
    )
    server = make_server(create_app(config), config)
    thread = threading.Thread(target=server.run, name="rollout-server", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextlib.contextmanager
def _subprocess_server(model_path: Path, port: int, admin_key: str, max_batch_size: int) -> Iterator[None]:
    cmd = [
        sys.executable, "-m", "diffusion_rollout.entrypoints.cli", "serve", "--model", str(model_path),
        "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
        "--max-batch-size", str(max_batch_size), "--log-level", "warning", "--shutdown-grace-s", "5",
    ]  # fmt: skip
    # The key travels in the environment, not on the command line (where `ps` would show it).
    env = {**os.environ, "DIFFUSION_ROLLOUT_ADMIN_KEY": admin_key}
    proc = subprocess.Popen(cmd, env=env)
    try:
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def rollout_server(
    url: str | None, model: str | None, mode: str, group_size: int, *, family: str = "sd3"
) -> Iterator[Server]:
    """Connect to ``url``, or start a server on ``model`` (default: a fresh tiny model) and stop it after."""
    if url:
        yield Server(url, os.environ.get("DIFFUSION_ROLLOUT_ADMIN_KEY"), Path(model) if model else None)
        return
    with tempfile.TemporaryDirectory(prefix="diffusion-rollout-example-") as tmp:
        if model is None:
            from diffusion_rollout.models import save_tiny_model

            model_path = save_tiny_model(family, Path(tmp) / f"tiny-{family}")
            logger.info("generated a tiny random %s model in %s", family, model_path)
        else:
            model_path = Path(model)
        port = free_port()
        admin_key = secrets.token_hex(16)
        start = _thread_server if mode == "thread" else _subprocess_server
        with start(model_path, port, admin_key, group_size):
            yield Server(f"http://127.0.0.1:{port}", admin_key, model_path)


def load_trainer_transformer(model_path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The trainer's own copy of the denoiser, frozen (the LoRA added afterwards is what trains)."""
    from diffusers import AutoModel

    transformer = AutoModel.from_pretrained(str(model_path), subfolder="transformer", dtype=dtype)
    transformer.requires_grad_(False)
    return transformer


def color_reward(images: torch.Tensor, target: tuple[float, float, float]) -> torch.Tensor:
    """``[N]`` rewards: minus the mean squared distance of each ``[C, H, W]`` image in [0, 1] to ``target``."""
    goal = torch.tensor(target, dtype=torch.float32).view(1, 3, 1, 1)
    return -((images.float() - goal) ** 2).mean(dim=(1, 2, 3))


def wait_ready(client, timeout_s: float = 300.0) -> None:
    t0 = time.monotonic()
    client.wait_until_ready(timeout_s=timeout_s)
    logger.info("server %s ready after %.1f s", client.url, time.monotonic() - t0)


# The adapter's target layers and the prompt pool, the same for both examples.
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]
PROMPTS = ["a red square", "a crimson circle", "a scarlet sky", "a ruby"]


def base_parser(description: str) -> argparse.ArgumentParser:
    """The options both examples share: where the server is, and the size of a run."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--url", help="a running server (default: start one on a tiny SD3 model)")
    p.add_argument(
        "--model", help="diffusers folder the trainer loads (and the server serves, if started here)"
    )
    p.add_argument(
        "--server", choices=["subprocess", "thread"], default="subprocess", help="how to start the server"
    )
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--prompts", type=int, default=4, help="prompts (groups) per iteration")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=4, help="num_inference_steps")
    p.add_argument("--size", type=int, default=32, help="image width and height")
    return p
