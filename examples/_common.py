"""Pieces the training recipes share: a server to talk to, the trainer's model, timing, records.

The recipes (``flow_grpo.py``, ``diffusion_nft.py``) are meant to be read top to bottom; everything
they have in common and that is not the algorithm lives here:

- **Where the rollouts come from.** ``--url`` points at a running server (the trainer must load the
  same ``--model`` folder). Without it the recipe starts ``diffusion-rollout serve`` itself on
  ``--model`` (default on a CPU: a fresh tiny random SD3 model) in a subprocess bound to
  ``--server-gpu`` (``CUDA_VISIBLE_DEVICES``), or on a thread (``--server thread``, CPU only: faster to
  start, still real HTTP). ``--server-gpu 0 --trainer-gpu 0`` is the colocated layout (two processes
  on one GPU), ``--trainer-gpu 1`` the disaggregated one: the same code with other GPU numbers.
  ``--layout in-process`` has no server at all: ``_in_process`` samples on the trainer's own
  transformer, the stock diffusers pipeline with the project's scheduler mixin for SD3 (flow_grpo's
  and DanceGRPO's layout, the baseline the server is timed against), the project's engine in the
  trainer's process for the other families.
- **One batch per group.** The server gets ``max_batch_size`` equal to the group size, so each
  request (one GRPO group) is one pipeline call, and the trainer replays a group as one batch: the
  transformer then sees the same batch shape on both sides and the on-policy ratio is exactly 1.
- **The trainer's model.** Its own copy of the denoiser from the same folder, in bf16 on CUDA
  (float32 on a CPU), frozen, with a PEFT LoRA whose weights are kept in the model's dtype: the
  server holds the pushed adapter in its dtype, and the same dtype on both sides is what makes the
  replayed model output equal the server's bit for bit. (An fp32 master copy would be more precise
  for tiny updates; the optimizer here is Adam with a learning rate large enough for bf16 steps.)
- **Timing.** :class:`Phases` times the phases of an iteration (rollout, reward, replay with
  backward, push) with a device synchronise at each boundary, and samples the GPU's memory in use by
  every process (``torch.cuda.mem_get_info``) besides the trainer's own peak.
- **Records.** One JSON object per iteration, the whole run rewritten after every iteration (a run
  cut short keeps what it did), with :func:`learning_stats` (first vs last iterations' rewards, in
  standard errors) and :func:`plot_reward_curves` (matplotlib, optional extra ``plot``).
- **Resuming.** ``--checkpoint DIR`` saves the adapters, the optimizer and the history after every
  iteration; a rerun with the same ``DIR`` continues from there (GPU time comes in stretches).
- **Reporting** (``_report.py``). :class:`Report` prints one progress line per iteration on rank 0 (reward, the
  recipe's exactness key, seconds per phase, ETA; ``--print-json``: the record's JSON line instead)
  and hands the record and a few images to ``--log-to tensorboard,wandb`` (``_logging.py``).
  ``--config run.yaml`` gives any option from a file, the command line overriding it
  (``_config.parse_with_config``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _ranks import Ranks

from diffusion_rollout.client import RolloutOutput
from diffusion_rollout.testing import free_port

logger = logging.getLogger("examples")

# DDPO's animal prompts: simple subjects; JPEG compressibility does not read them, a user's reward may.
PROMPTS = [
    "a cat", "a dog", "a horse", "a monkey", "a rabbit", "a zebra", "a spider", "a bird",
    "a sheep", "a deer", "a cow", "a goat", "a lion", "a tiger", "a bear", "a raccoon",
]  # fmt: skip
# The adapter's target layers: attention projections, the same names in SD3/SD3.5, FLUX and Wan.
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
# Named target lists for --lora-targets. ``qwen-image``: verl-omni's Qwen-Image Flow-GRPO recipe
# (both streams' attention projections and both streams' MLPs).
LORA_TARGET_PRESETS = {
    "attention": LORA_TARGETS,
    "qwen-image": [
        *LORA_TARGETS, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    ],
}  # fmt: skip


def lora_targets(text: str) -> list[str]:
    """``--lora-targets``: a preset name of :data:`LORA_TARGET_PRESETS` or a comma list of module names."""
    if text in LORA_TARGET_PRESETS:
        return list(LORA_TARGET_PRESETS[text])
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected a preset {sorted(LORA_TARGET_PRESETS)} or module names")
    return names


# ---------------------------------------------------------------------------------------------- options
def base_parser(description: str, *, reporting: bool = True) -> argparse.ArgumentParser:
    """The options every recipe shares: where rollouts come from, the trainer's device, the run's size.

    ``reporting``: the options of :class:`Report` (``--print-json``, ``--log-to``, ``--log-dir``), for
    recipes that report per iteration. Parse with :func:`parse_with_config` (``--config``).
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--config",
        metavar="YAML",
        help="options from a YAML file: keys are option names (group_size or group-size), values their "
        "values (true/false for flags, a list for a repeatable option); the command line overrides them",
    )
    g = p.add_argument_group("server and layout")
    g.add_argument("--url", help="a running server (default: start one here)")
    g.add_argument(
        "--model", help="diffusers folder the trainer loads (and the server serves, if started here)"
    )
    g.add_argument(
        "--layout",
        choices=["server", "in-process"],
        default="server",
        help="server: rollouts over HTTP; in-process: sampled in the trainer on its own transformer (the "
        "stock pipeline for SD3, this project's engine for the other families)",
    )
    g.add_argument(
        "--server",
        choices=["subprocess", "thread"],
        default="subprocess",
        help="how to start the server when no --url is given (thread: CPU only)",
    )
    g.add_argument(
        "--server-gpu",
        "--server-gpus",
        dest="server_gpu",
        type=gpu_list,
        default=None,
        help="GPU(s) of a server started here (default 0 on CUDA), numbered as this process sees them "
        "(through CUDA_VISIBLE_DEVICES); several (0,1) start a pool of that many Ray replicas behind "
        "one endpoint (`serve --replicas`)",
    )
    g.add_argument(
        "--trainer-gpu",
        "--trainer-gpus",
        dest="trainer_gpu",
        type=gpu_list,
        default=None,
        help="GPU of the trainer, or of each torchrun rank on this host in local-rank order "
        "(default: the local rank's number)",
    )
    g.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="rollout replicas of a server started here (default: one per --server-gpus; on a CPU, "
        "replicas > 1 start a Ray pool of CPU replicas)",
    )
    g.add_argument(
        "--cpu", action="store_true", help="run the trainer (and a server started here) on the CPU"
    )
    g.add_argument(
        "--server-args", default="", help="extra `diffusion-rollout serve` options for a server started here"
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds the trainer waits for any one answer before it recovers (default: the client's, 900)",
    )
    g.add_argument(
        "--recover-timeout",
        type=float,
        default=600.0,
        help="seconds a lost server (restarting, unreachable) is waited for and re-pushed before the run "
        "stops with an error naming the cause",
    )
    g.add_argument(
        "--release-memory",
        action="store_true",
        help="colocated: the server releases its GPU memory while the trainer scores and trains",
    )
    g = p.add_argument_group("run")
    g.add_argument("--iterations", type=int, default=12)
    g.add_argument("--prompts", type=int, default=4, help="prompts (groups) per iteration")
    g.add_argument("--group-size", type=int, default=8)
    g.add_argument("--steps", type=int, default=4, help="num_inference_steps")
    g.add_argument("--size", type=int, default=32, help="image width and height (see --width/--height)")
    g.add_argument("--width", type=int, default=None)
    g.add_argument("--height", type=int, default=None)
    g.add_argument("--frames", type=int, default=None, help="num_frames (video models)")
    g.add_argument(
        "--reward",
        default="jpeg_compressibility",
        help="a reward of rewards.py or module:callable (NAME=SPEC names it for --reward-on server)",
    )
    g.add_argument(
        "--reward-on",
        choices=["trainer", "server"],
        default="trainer",
        help="score in this process (trainer) or on the rollout server (server: a server started here "
        "gets --reward NAME=SPEC; one at --url must serve NAME), where no pixels need to travel",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", help="write the run (per-iteration records and summary) as JSON here")
    g.add_argument("--checkpoint", help="save adapters and optimizer here every iteration; resume from it")
    g = p.add_argument_group("trainer")
    g.add_argument("--lora-rank", type=int, default=4)
    g.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: the rank)")
    g.add_argument(
        "--lora-targets",
        type=lora_targets,
        default=list(LORA_TARGETS),
        help=f"the adapter's target modules: a preset {sorted(LORA_TARGET_PRESETS)} or a comma list "
        "(default: attention, the projections every family names alike)",
    )
    g.add_argument("--lr", type=float, default=1e-2)
    g.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="the model's dtype, trainer and server alike (auto: bf16 on CUDA, float32 on a CPU)",
    )
    g.add_argument("--gradient-checkpointing", action="store_true")
    if reporting:
        g = p.add_argument_group("reporting")
        g.add_argument(
            "--print-json",
            action="store_true",
            help="print each iteration's record as one JSON line instead of the progress line",
        )
        g.add_argument(
            "--log-to",
            action="extend",
            type=log_targets,
            default=[],
            metavar="{tensorboard,wandb}",
            help="also log scalars and sample images per iteration to TensorBoard and/or W&B "
            "(repeatable or a comma list; W&B's mode, project and directory from WANDB_* variables)",
        )
        g.add_argument(
            "--log-dir",
            help="TensorBoard's (and W&B's, without WANDB_DIR) directory (default: next to --out, "
            "RUN-logs for RUN.json, else runs/RECIPE-TIME)",
        )
    return p


def log_targets(text: str) -> list[str]:
    """``"tensorboard"`` or ``"tensorboard,wandb"``: where ``--log-to`` sends the run."""
    targets = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in targets if t not in ("tensorboard", "wandb")]
    if bad or not targets:
        raise argparse.ArgumentTypeError(f"choose tensorboard and/or wandb, not {text!r}")
    return targets


def image_size(args: argparse.Namespace) -> tuple[int, int]:
    return (args.width or args.size, args.height or args.size)


def gpu_list(text: str) -> list[int]:
    """``"2"`` or ``"0,1"``: GPU numbers."""
    try:
        gpus = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a GPU number or a comma-separated list of them: {text!r}"
        ) from None
    if not gpus or min(gpus) < 0 or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"GPU numbers must be distinct and >= 0: {text!r}")
    return gpus


def trainer_device(args: argparse.Namespace, ranks: Ranks | None = None) -> torch.device:
    """This rank's device: ``--trainer-gpus[local_rank]`` (default the local rank's GPU) on CUDA."""
    ranks = ranks or Ranks()
    if args.cpu or not torch.cuda.is_available():
        device = torch.device("cpu")
    else:
        gpus = args.trainer_gpu or [ranks.local_rank]
        if ranks.local_rank >= len(gpus):
            raise SystemExit(
                f"--trainer-gpus names {len(gpus)} GPU(s) but this host runs local rank {ranks.local_rank}"
            )
        device = torch.device("cuda", gpus[ranks.local_rank])
        torch.cuda.set_device(device)  # so that generator_device "cuda" means the trainer's GPU in-process
    ranks.use_device(device)
    return device


def trainer_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    """``--dtype``; auto: bf16 on CUDA (what the server serves there), float32 on a CPU."""
    if args.dtype != "auto":
        return getattr(torch, args.dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


# ---------------------------------------------------------------------------------------------- server
@dataclass
class Server:
    url: str | None
    admin_key: str | None
    model_path: Path


def recipe_reward(args: argparse.Namespace) -> tuple[str, str]:
    """``--reward`` as (NAME, SPEC): ``NAME=SPEC``, a built-in named after itself, else ``reward``."""
    from diffusion_rollout.rewards import parse_named_reward

    try:
        return parse_named_reward(args.reward)
    except ValueError:
        return "reward", args.reward


def server_rewards(args: argparse.Namespace) -> list[str]:
    """The ``serve --reward`` values for a server started here."""
    if getattr(args, "reward_on", "trainer") != "server":
        return []
    name, spec = recipe_reward(args)
    return [f"{name}={spec}"]


class RecipeReward:
    """``--reward`` scored where ``--reward-on`` says: the same callable in this process, or on
    the server (the request names it, and no pixels travel unless ``--log-to`` shows them)."""

    def __init__(self, args: argparse.Namespace, client: Any) -> None:
        from diffusion_rollout.rewards import load_reward

        self.name, spec = recipe_reward(args)
        self.on_server = args.reward_on == "server"
        self.keep_pixels = bool(getattr(args, "log_to", None))
        if not self.on_server:
            # The GPU memory the reward model holds in this process, for the placement comparison.
            before = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
            self.fn = load_reward(spec)
            self.resident_bytes = None if before is None else torch.cuda.memory_allocated() - before
            return
        if client is None:
            raise SystemExit("--reward-on server needs a rollout server (not --layout in-process)")
        served = client.server_info().get("rewards") or []
        if self.name not in served:
            raise SystemExit(
                f"--reward-on server: the server at {client.urls[0]} does not serve a reward named "
                f"{self.name!r} (it serves {list(served) or 'none'}); start it with --reward {self.name}=SPEC"
            )

    def record(self, client: Any) -> dict[str, Any] | None:
        """The server's account of the reward (calls, seconds, device, memory held), for the run record;
        for a reward scored here, the memory it holds in this process."""
        if not self.on_server:
            return {"name": self.name, "where": "trainer", "resident_bytes": self.resident_bytes}
        rewards = client.server_info(admin=client.admin_key is not None).get("rewards")
        return rewards.get(self.name) if isinstance(rewards, dict) else None

    def request_fields(self) -> dict[str, Any]:
        if not self.on_server:
            return {}
        return {"rewards": [self.name], **({} if self.keep_pixels else {"return_output": False})}

    def __call__(self, outputs: Sequence[RolloutOutput]) -> torch.Tensor:
        if not self.on_server:
            return self.fn(uint8_images(outputs), [o.prompt for o in outputs]).float()
        values = []
        for i, o in enumerate(outputs):
            value = (o.rewards or {}).get(self.name)
            if value is None:  # a missing reward cannot be trained on: stop, naming why
                why = (o.reward_errors or {}).get(self.name, "the answer has no such reward")
                raise RuntimeError(f"the server's reward {self.name!r} failed for output {i} ({o.prompt!r}): {why}")
            values.append(value)
        return torch.tensor(values, dtype=torch.float32)


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
    server = make_server(create_app(config), config)
    thread = threading.Thread(target=server.run, name="rollout-server", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=30)


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


# ---------------------------------------------------------------------------------------------- trainer
def load_trainer_transformer(
    model_path: Path, *, device: torch.device, dtype: torch.dtype, gradient_checkpointing: bool = False
) -> torch.nn.Module:
    """The trainer's own copy of the denoiser, frozen (the LoRA added afterwards is what trains)."""
    from diffusers import AutoModel

    transformer = AutoModel.from_pretrained(str(model_path), subfolder="transformer", dtype=dtype).to(device)
    transformer.requires_grad_(False)
    if gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    return transformer


def add_lora(
    transformer: torch.nn.Module,
    rank: int,
    dtype: torch.dtype,
    name: str = "default",
    *,
    alpha: float | None = None,
    targets: Sequence[str] | None = None,
) -> list[torch.nn.Parameter]:
    """A PEFT LoRA adapter ``name`` in ``dtype`` (the served dtype); returns its trainable parameters.
    ``alpha`` defaults to the rank (scale 1), ``targets`` to :data:`LORA_TARGETS`."""
    import warnings

    from peft import LoraConfig

    config = LoraConfig(
        r=rank, lora_alpha=alpha or rank, target_modules=list(targets or LORA_TARGETS), lora_dropout=0.0,
        init_lora_weights=True,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns about a second adapter (DiffusionNFT's "old")
        transformer.add_adapter(config, adapter_name=name)
    # Not "the dtype of the first parameter": Wan keeps some (scale_shift_table) in float32, and a
    # float32 adapter on the trainer against the server's bf16 one breaks the ratio's exactness.
    params = []
    for n, p in transformer.named_parameters():
        if f".{name}." in n:
            p.data = p.data.to(dtype)  # see the module docstring: the server's dtype on both sides
            params.append(p)
    return params


class Checkpoint:
    """Adapters, optimizer and history in ``DIR`` (``--checkpoint``), written after every iteration.

    One file, ``trainer.pt``, holds all three, so a checkpoint is never half of one iteration and
    half of another: it is written to a temporary file, flushed to disk, and renamed over the last
    one (a rename within a folder is atomic), so a run killed mid-write, or a full disk, leaves the
    previous complete checkpoint. ``state.json`` beside it is a readable copy of the state, written
    the same way after it; resuming reads the state from ``trainer.pt`` (older checkpoints, which
    kept the state only in ``state.json``, still load).
    """

    def __init__(self, directory: str | None) -> None:
        self.dir = Path(directory) if directory else None

    def load(self, transformer, optimizer) -> dict[str, Any] | None:
        if self.dir is None or not (self.dir / "trainer.pt").exists():
            return None
        from peft.utils import set_peft_model_state_dict

        saved = torch.load(self.dir / "trainer.pt", map_location="cpu", weights_only=True)
        for name, sd in saved["adapters"].items():
            set_peft_model_state_dict(transformer, sd, adapter_name=name)
        optimizer.load_state_dict(saved["optimizer"])
        state = (
            json.loads(saved["state"])
            if "state" in saved
            else json.loads((self.dir / "state.json").read_text())
        )
        logger.info("resumed from %s at iteration %d", self.dir, state["next_iteration"])
        return state

    def save(self, transformer, optimizer, adapters: Sequence[str], state: Mapping[str, Any]) -> None:
        if self.dir is None:
            return
        from peft.utils import get_peft_model_state_dict

        self.dir.mkdir(parents=True, exist_ok=True)
        sd = {a: get_peft_model_state_dict(transformer, adapter_name=a) for a in adapters}
        text = json.dumps(state)
        _write_atomically(
            self.dir / "trainer.pt",
            lambda f: torch.save({"adapters": sd, "optimizer": optimizer.state_dict(), "state": text}, f),
        )
        _write_atomically(self.dir / "state.json", lambda f: f.write(text.encode()))


def _write_atomically(path: Path, write) -> None:
    """``write(file)`` into ``path.tmp``, flushed to disk, then renamed over ``path``: a reader sees
    the old file or the new one, never a part (the temporary file is removed on any failure)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def uint8_images(outputs: Sequence[RolloutOutput]) -> torch.Tensor:
    return torch.stack([o.generated_output for o in outputs])


# ---------------------------------------------------------------------------------------------- timing
# The origin of every recorded span (``Phases.spans``): seconds since the recipe's process started.
CLOCK_ORIGIN = time.perf_counter()


def clock(t: float | None = None) -> float:
    """``t`` (a ``time.perf_counter()`` value; default now) on the recipe's timeline, in seconds."""
    return round((time.perf_counter() if t is None else t) - CLOCK_ORIGIN, 4)


class Phases:
    """Seconds per phase of one iteration, synchronised with the device; GPU memory in use sampled.

    ``spans`` keeps when each phase ran (``clock()`` seconds), for the sync/async timeline figure.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []
        self.device_used_max_gb = 0.0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            self.device_used_max_gb = max(self.device_used_max_gb, (total - free) / 2**30)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            t1 = time.perf_counter()
            self.seconds[name] = self.seconds.get(name, 0.0) + t1 - t0
            self.spans.append((name, clock(t0), clock(t1)))

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"{k}_s": round(v, 4) for k, v in self.seconds.items()}
        out["spans"] = [list(span) for span in self.spans]
        if self.device.type == "cuda":
            out["trainer_peak_gb"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
            out["device_used_max_gb"] = round(self.device_used_max_gb, 3)
        return out


def server_peak_gb(outputs: Sequence[RolloutOutput]) -> float | None:
    peaks = [o.peak_memory_mb for o in outputs if o.peak_memory_mb is not None]
    return round(max(peaks) / 1024, 3) if peaks else None


# ---------------------------------------------------------------------------------------------- records
def iteration_record(
    iteration: int, version: Any, rewards: torch.Tensor, outputs: Sequence[RolloutOutput], phases: Phases,
    started: float, *, images: int | None = None, server_peak: float | None = None, **fields: Any,
) -> dict[str, Any]:  # fmt: skip
    """One iteration's JSON record: rewards, the recipe's ``fields``, seconds per phase, memory, rate.

    ``images`` and ``server_peak`` (GB) default to those of ``outputs``; a rank of several passes the
    whole iteration's (every rank's). :class:`Report` shows it.
    """
    record = {
        "iteration": iteration,
        "weight_version": version,
        "rewards": [round(float(r), 5) for r in rewards],
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        **fields,
        "images": len(outputs) if images is None else images,
        **phases.record(),
        "server_peak_gb": server_peak_gb(outputs) if server_peak is None else server_peak,
    }
    record["iteration_s"] = round(time.perf_counter() - started, 4)
    record["images_per_second"] = round(record["images"] / record["iteration_s"], 4)
    return record


def summarize(history: Sequence[Mapping[str, Any]], exactness_key: str) -> dict[str, Any]:
    """The run at a glance; phase seconds are means over iterations after the first (warm-up).

    ``exactness_key`` is the recipe's on-policy check (``first_ratio_max_dev``, ``old_policy_max_dev``):
    its largest value over the run, which must be 0.
    """
    timed = history[1:] or history
    phases = sorted({k for h in timed for k in h if k.endswith("_s")})
    return {
        "iterations": len(history),
        exactness_key: max((h[exactness_key] for h in history), default=None),
        "checksums_ok": all(h["checksum_ok"] is not False for h in history),
        "mean_seconds": {k: sum(h.get(k, 0.0) for h in timed) / len(timed) for k in phases},
        "images_per_second": sum(h["images"] for h in timed) / sum(h["iteration_s"] for h in timed),
        "trainer_peak_gb": max((h.get("trainer_peak_gb", 0.0) for h in history), default=None),
        "device_used_max_gb": max((h.get("device_used_max_gb", 0.0) for h in history), default=None),
        "server_peak_gb": max((h.get("server_peak_gb") or 0.0 for h in history), default=None),
        "learning": learning_stats(history),
        **({"ratio_by_staleness": by_staleness} if (by_staleness := staleness_summary(history)) else {}),
    }


def staleness_summary(history: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """The first step's ``|ratio - 1|`` per staleness over the run (``--async-depth``): batches,
    ratios, their mean and max. Staleness 0 must give max 0; staleness 1 gives the spread."""
    acc: dict[str, dict[str, float]] = {}
    for h in history:
        for staleness, st in (h.get("ratio_by_staleness") or {}).items():
            a = acc.setdefault(str(staleness), {"batches": 0, "count": 0, "sum": 0.0, "max": 0.0})
            a["batches"] += 1
            a["count"] += st["count"]
            a["sum"] += st["mean"] * st["count"]
            a["max"] = max(a["max"], st["max"])
    return {
        k: {"batches": a["batches"], "count": a["count"], "mean": a["sum"] / a["count"], "max": a["max"]}
        for k, a in sorted(acc.items())
    }


def learning_stats(history: Sequence[Mapping[str, Any]], k: int = 5) -> dict[str, Any]:
    """First ``k`` vs last ``k`` iterations' rewards: the difference in standard errors, and Cohen's d.

    ``z_samples`` treats every sample as one observation (the SE of a difference of two means,
    Welch); ``z_iterations`` treats each iteration's mean as one (more conservative: samples of an
    iteration share prompts and weights).
    """
    if len(history) < 2 * k:
        return {}

    def pooled(rows):
        return torch.tensor([r for h in rows for r in h["rewards"]], dtype=torch.float64)

    first, last = pooled(history[:k]), pooled(history[-k:])
    diff = float(last.mean() - first.mean())
    se = math.sqrt(float(first.var() / first.numel() + last.var() / last.numel()))
    it_first = torch.tensor([h["reward_mean"] for h in history[:k]], dtype=torch.float64)
    it_last = torch.tensor([h["reward_mean"] for h in history[-k:]], dtype=torch.float64)
    se_it = math.sqrt(float(it_first.var() / k + it_last.var() / k))
    sd = math.sqrt(float((first.var() + last.var()) / 2))
    return {
        "k": k,
        "reward_first_k": float(first.mean()),
        "reward_last_k": float(last.mean()),
        "difference": diff,
        "z_samples": diff / se if se > 0 else math.inf,
        "z_iterations": diff / se_it if se_it > 0 else math.inf,
        "cohens_d": diff / sd if sd > 0 else math.inf,
    }


def write_run(path: str | None, run: Mapping[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(run, indent=1))
        os.replace(tmp, path)


def environment() -> dict[str, Any]:
    import diffusers
    import peft

    info: dict[str, Any] = {
        "torch": torch.__version__, "diffusers": diffusers.__version__, "peft": peft.__version__,
        "python": sys.version.split()[0],
    }  # fmt: skip
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    # A copied tree (the GPU machine's) may carry stale git metadata: the caller may name the commit.
    info["commit"] = os.environ.get("RECIPE_COMMIT")
    with contextlib.suppress(Exception):
        info["commit"] = (
            info["commit"]
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
            ).stdout.strip()
        )
    return info


def plot_reward_curves(runs: Mapping[str, Mapping[str, Any]], png: str, title: str = "") -> None:
    """Mean reward per iteration (with one standard error) of each run, on one plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, run in runs.items():
        hist = run["history"]
        x = [h["iteration"] for h in hist]
        mean = [h["reward_mean"] for h in hist]
        se = [h["reward_std"] / math.sqrt(len(h["rewards"])) for h in hist]
        ax.plot(x, mean, label=label)
        low = [m - s for m, s in zip(mean, se, strict=True)]
        high = [m + s for m, s in zip(mean, se, strict=True)]
        ax.fill_between(x, low, high, alpha=0.25)
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110, metadata={"Software": None})  # no version in the file: same JSON, same bytes
    plt.close(fig)
