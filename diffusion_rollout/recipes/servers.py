"""Where a recipe's rollouts come from: the server at ``--url``, or one started here.

Without ``--url`` the recipe starts ``diffusion-rollout serve`` itself on ``--model`` (default on a
CPU: a fresh tiny random SD3 model) in a subprocess bound to ``--server-gpu`` (``CUDA_VISIBLE_DEVICES``),
or on a thread (``--server thread``, CPU only: faster to start, still real HTTP). ``--server-gpu 0
--trainer-gpu 0`` is the colocated layout (two processes on one GPU), ``--trainer-gpu 1`` the
disaggregated one: the same code with other GPU numbers. ``--layout in-process`` has no server at all
(:mod:`~diffusion_rollout.recipes.in_process`).

**One batch per group.** A server started here gets ``max_batch_size`` equal to the group size, so
each request (one GRPO group) is one pipeline call, and the trainer replays a group as one batch: the
transformer then sees the same batch shape on both sides and the on-policy ratio is exactly 1.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffusion_rollout.recipes.ranks import Ranks
from diffusion_rollout.recipes.reward import server_rewards
from diffusion_rollout.testing import free_port, serve_in_thread

logger = logging.getLogger(__name__)


@dataclass
class Server:
    url: str | None
    admin_key: str | None
    model_path: Path


@contextlib.contextmanager
def _thread_server(
    model_path: Path, port: int, admin_key: str, max_batch_size: int, rewards: Sequence[str] = ()
) -> Iterator[None]:
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.app import create_app
    from diffusion_rollout.entrypoints.http_server import make_server

    config = ServerConfig(
        model=str(model_path), device="cpu", dtype="float32", host="127.0.0.1", port=port,
        admin_key=admin_key, max_batch_size=max_batch_size, log_level="warning", shutdown_grace_s=5.0,
        reward=list(rewards),
    )  # fmt: skip
    with serve_in_thread(make_server(create_app(config), config), name="rollout-server"):
        yield


def server_visible_devices(gpus: Sequence[int], visible: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a server on ``gpus``, numbered as this process sees its GPUs.

    A recipe run under ``CUDA_VISIBLE_DEVICES=2,3`` that asks for ``--server-gpus 0`` means the first GPU
    it sees, physical GPU 2: handing the server the bare ``0`` would put it on GPU 0, beside whatever
    else runs there (two such runs on one host once shared a GPU and measured half speed).
    """
    if visible is None or not visible.strip():
        return ",".join(map(str, gpus))
    seen = [d.strip() for d in visible.split(",") if d.strip()]
    missing = [g for g in gpus if not 0 <= g < len(seen)]
    if missing:
        raise SystemExit(
            f"--server-gpus {','.join(map(str, gpus))}: this process sees {len(seen)} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={visible}), numbered 0..{len(seen) - 1}; {missing} is not one of them"
        )
    return ",".join(seen[g] for g in gpus)


@contextlib.contextmanager
def _subprocess_server(
    model_path: Path, port: int, admin_key: str, max_batch_size: int, gpus: list[int] | None,
    replicas: int | None, dtype: str, extra: str, rewards: Sequence[str] = (),
) -> Iterator[None]:  # fmt: skip
    device = "cpu" if gpus is None else "cuda"
    if dtype == "auto":
        dtype = "float32" if gpus is None else "bfloat16"
    cmd = [
        sys.executable, "-m", "diffusion_rollout.entrypoints.cli", "serve", "--model", str(model_path),
        "--device", device, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
        "--max-batch-size", str(max_batch_size), "--log-level", "warning", "--shutdown-grace-s", "5",
        *(["--replicas", str(replicas)] if replicas and replicas > 1 else []), *extra.split(),
        *(a for r in rewards for a in ("--reward", r)),
    ]  # fmt: skip
    # The key travels in the environment, not on the command line (where `ps` would show it).
    env = {**os.environ, "DIFFUSION_ROLLOUT_ADMIN_KEY": admin_key}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # the server is no trainer rank (torch.distributed reads these)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = server_visible_devices(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    # In the recipe's process group: a supervisor that stops the group (benchmarks.train_recipes)
    # stops the server and its Ray replicas with it.
    proc = subprocess.Popen(cmd, env=env)
    try:
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def rollout_server(
    args: argparse.Namespace, *, family: str = "sd3", ranks: Ranks | None = None
) -> Iterator[Server]:
    """The server of ``--url``, or one started here on ``--model`` (no server with ``--layout in-process``).

    Under torchrun only rank 0 starts it (and a tiny model, without ``--model``); the other ranks get
    its URL, key and model folder from rank 0 and leave only once every rank is done with it.
    """
    ranks = ranks or Ranks()
    if ranks.is_main:
        with _start_rollout_server(args, family) as server:
            ranks.broadcast(server)
            try:
                yield server
            finally:
                ranks.barrier()  # nobody is talking to it any more
        return
    server = ranks.broadcast(None)
    try:
        yield server
    finally:
        ranks.barrier()


@contextlib.contextmanager
def _start_rollout_server(args: argparse.Namespace, family: str) -> Iterator[Server]:
    if args.url:
        if not args.model:
            raise SystemExit("--model is required with --url: the trainer loads the same weights")
        yield Server(args.url, os.environ.get("DIFFUSION_ROLLOUT_ADMIN_KEY"), Path(args.model))
        return
    with tempfile.TemporaryDirectory(prefix="diffusion-rollout-recipe-") as tmp:
        if args.model is None:
            if torch.cuda.is_available() and not args.cpu:
                raise SystemExit("--model is required on a GPU (a diffusers folder of the model to train)")
            from diffusion_rollout.models import save_tiny_model

            model_path = save_tiny_model(family, Path(tmp) / f"tiny-{family}")
            logger.info("generated a tiny random %s model in %s", family, model_path)
        else:
            model_path = Path(args.model)
        if args.layout == "in-process":
            yield Server(None, None, model_path)
            return
        port, admin_key = free_port(), secrets.token_hex(16)
        on_gpu = torch.cuda.is_available() and not args.cpu
        gpus = (args.server_gpu or [0]) if on_gpu else None
        replicas = args.replicas or (len(gpus) if gpus else 1)
        if args.server == "thread":
            if on_gpu or args.dtype == "bfloat16" or replicas > 1:
                raise SystemExit(
                    "--server thread is one float32 CPU server: use --server subprocess for a GPU or replicas"
                )
            start = _thread_server(model_path, port, admin_key, args.group_size, server_rewards(args))
        else:
            start = _subprocess_server(
                model_path, port, admin_key, args.group_size, gpus, replicas, args.dtype, args.server_args,
                server_rewards(args),
            )  # fmt: skip
        with start:
            yield Server(f"http://127.0.0.1:{port}", admin_key, model_path)


def client_timeout(args: argparse.Namespace) -> dict[str, Any]:
    """The client's ``timeout`` keyword for ``--request-timeout`` (none: the client's default)."""
    return {"timeout": args.request_timeout} if args.request_timeout else {}


def wait_ready(client, timeout_s: float = 600.0) -> None:
    t0 = time.monotonic()
    client.wait_until_ready(timeout_s=timeout_s)
    logger.info("server %s ready after %.1f s", client.url, time.monotonic() - t0)
