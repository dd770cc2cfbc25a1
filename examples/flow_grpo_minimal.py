"""Flow-GRPO with a LoRA in one file, from the package's public API alone: read it top to bottom.

    python examples/flow_grpo_minimal.py           # CPU: a tiny random SD3 model, its own `serve`
    python examples/flow_grpo_minimal.py --url http://gpu-host:30000 --model /same/diffusers/folder

Each iteration:

1. **Rollouts.** One request per prompt for a group of ``--group-size`` images sharing one x_T
   (Flow-GRPO-Fast), stochastic steps only in a seeded window of ``--sde-window`` steps; the
   trajectory and the denoising env come back for replay, the images as uint8.
2. **Reward.** JPEG compressibility (``diffusion_rollout.rewards``), normalised within each group.
3. **Training.** Each group's stochastic steps replayed with the trainer's LoRA-wrapped transformer
   (``replay_step``: the server's step math), the clipped ratio loss, one optimizer step. The trainer
   holds the server's weights and replays each group as the batch the server ran: ratio exactly 1.
4. **Sync.** ``push_lora`` reloads the adapter on the server and verifies its checksum.

The seeds and requests are ``examples/flow_grpo.py``'s (its first iteration's rewards are these, to
the last digit); that recipe adds recovery, asynchronous rollouts, ranks, checkpoints and records.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import secrets
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from diffusion_rollout.client import (
    ReplayBatch,
    RolloutClient,
    clipped_policy_loss,
    group_advantages,
    push_lora,
    replay_step,
)
from diffusion_rollout.rewards import jpeg_compressibility

PROMPTS = ["a cat", "a dog", "a horse", "a monkey", "a rabbit", "a zebra", "a spider", "a bird",
           "a sheep", "a deer", "a cow", "a goat", "a lion", "a tiger", "a bear", "a raccoon"]  # fmt: skip
# The options of examples/flow_grpo.py that matter here, with its defaults.
DEFAULTS = {
    "iterations": 12, "prompts": 4, "group_size": 8, "steps": 4, "size": 32, "guidance_scale": 4.5,
    "noise_level": 0.7, "sde_window": 2, "lora_rank": 4, "lr": 1e-2, "clip_range": 1e-4,
    "adv_clip_max": 5.0, "seed": 0,
}  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server (default: start one here)")
    p.add_argument("--model", help="the diffusers folder (the server's, with --url; default: a tiny SD3)")
    for name, default in DEFAULTS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    p.add_argument("--out", help="write the per-iteration records here as JSON")
    return p.parse_args(argv)


@contextlib.contextmanager
def rollout_server(args: argparse.Namespace, device: torch.device) -> Iterator[tuple[str, str | None, str]]:
    """(url, admin key, model folder): ``--url``'s server, or ``diffusion-rollout serve`` started here on
    ``--model`` or a fresh tiny SD3, one group per batch."""
    if args.url:
        if not args.model:
            raise SystemExit("--url needs --model: the trainer loads the server's diffusers folder")
        yield args.url, None, args.model  # admin key: the client reads DIFFUSION_ROLLOUT_ADMIN_KEY
        return
    from diffusion_rollout.models import save_tiny_model
    from diffusion_rollout.testing import free_port, start_cli_server, stop_session

    port, key = free_port(), secrets.token_hex(16)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(save_tiny_model("sd3", Path(tmp) / "tiny-sd3"))
        dtype = "float32" if device.type == "cpu" else "bfloat16"
        cmd = [sys.executable, "-m", "diffusion_rollout.entrypoints.cli", "serve", "--model", model,
               "--device", device.type, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
               "--max-batch-size", str(args.group_size), "--log-level", "warning", "--shutdown-grace-s", "5"]  # fmt: skip
        url, env = f"http://127.0.0.1:{port}", {"DIFFUSION_ROLLOUT_ADMIN_KEY": key}  # not on the command line
        server = start_cli_server(cmd, Path(tmp) / "server.log", url, 600, new_session=True, env=env)
        try:
            yield url, key, model
        finally:
            stop_session(server)


def sde_window(args: argparse.Namespace, iteration: int) -> list[int]:
    """This iteration's stochastic steps: ``--sde-window`` steps starting in the first half (seeded);
    never the last step (it ends at sigma 0, where the gaussian step has no density)."""
    upper = min(max(args.steps // 2, args.sde_window), args.steps - 1)
    start = random.Random(args.seed * 100_003 + iteration).randint(0, max(upper - args.sde_window, 0))
    return list(range(start, min(start + args.sde_window, args.steps - 1)))


def trainer_model(model: str, rank: int, device: torch.device, dtype: torch.dtype):
    """The trainer's own frozen denoiser with a PEFT LoRA in the served dtype (lora_B is zero: the
    adapter changes nothing yet); returns it and the LoRA's parameters."""
    from diffusers import AutoModel
    from peft import LoraConfig

    transformer = AutoModel.from_pretrained(model, subfolder="transformer", dtype=dtype).to(device)
    transformer.requires_grad_(False)
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, lora_dropout=0.0))
    params = [p for n, p in transformer.named_parameters() if ".default." in n]
    for p in params:
        p.data = p.data.to(dtype)  # the same dtype as the server's copy: the ratio stays exactly 1
    return transformer, params


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reward_fn, G = jpeg_compressibility(), args.group_size
    history: list[dict[str, Any]] = []
    with (
        rollout_server(args, device) as (url, key, model),
        RolloutClient(url, admin_key=key, max_concurrency=args.prompts) as client,
    ):
        client.wait_until_ready(timeout_s=600)
        torch.manual_seed(args.seed)  # the LoRA's initial lora_A
        transformer, params = trainer_model(model, args.lora_rank, device, dtype)
        optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
        version = "iter-0"
        push_lora(client, transformer, name="default", activate=True, weight_version=version)
        shared = dict(
            num_outputs_per_prompt=G, num_inference_steps=args.steps, width=args.size, height=args.size,
            guidance_scale=args.guidance_scale, rollout_sde_type="sde", rollout_noise_level=args.noise_level,
            rollout_return_dit_trajectory=True, rollout_return_denoising_env=True, rollout_debug_mode=False,
            output_dtype="uint8", generator_device=device.type,
        )  # fmt: skip
        for it in range(args.iterations):
            # 1. Rollouts: group k of iteration it is seeded by its index; x_T shared by the group.
            window = sde_window(args, it)
            jobs = []
            for k in range(args.prompts):
                seed = (it * args.prompts + k) * 1000 + args.seed * 10_000_000
                jobs.append({
                    "prompt": PROMPTS[(it * args.prompts + k) % len(PROMPTS)], "seed": seed,
                    "initial_noise_seed": seed + 999, "rollout_sde_step_indices": window,
                    # Replay needs only the latents entering and leaving each stochastic step.
                    "rollout_return_step_indices": sorted({*window, *(s + 1 for s in window)}),
                })  # fmt: skip
            groups = client.generate_many(jobs, **shared)
            outputs = [o for g in groups for o in g]
            if (versions := {o.weight_version for o in outputs}) != {version}:
                raise RuntimeError(f"rollouts from {versions}, expected {version}")  # never trained on
            # 2. Reward on the uint8 images, advantages normalised within each group.
            images = torch.stack([o.generated_output for o in outputs])
            rewards = reward_fn(images, [o.prompt for o in outputs]).float()
            advantages = group_advantages(rewards, G).view(len(groups), G)
            # 3. Replay every stochastic step (backward per step), clipped ratio loss, one step.
            batches = [ReplayBatch(group) for group in groups]
            n_terms = sum(len(b.trainable_steps()) for b in batches)
            optimizer.zero_grad(set_to_none=True)
            ratio_dev, losses = 0.0, []
            for batch, adv in zip(batches, advantages, strict=True):
                for t in batch.trainable_steps():
                    step = replay_step(transformer, batch, t)
                    loss, _ = clipped_policy_loss(
                        step.log_prob, step.old_log_prob, adv,
                        clip_range=args.clip_range, adv_clip_max=args.adv_clip_max,
                    )  # fmt: skip
                    (loss / n_terms).backward()
                    ratio_dev = max(ratio_dev, float((step.ratio.detach() - 1).abs().max()))
                    losses.append(float(loss.detach()))
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            # 4. Sync: the server reloads the adapter in place; push_lora verifies its checksum.
            version = f"iter-{it + 1}"
            push_lora(client, transformer, name="default", activate=True, weight_version=version)
            history.append({
                "iteration": it, "sde_steps": window, "rewards": rewards.tolist(),
                "reward_mean": float(rewards.mean()), "loss": sum(losses) / len(losses),
                "first_ratio_max_dev": ratio_dev,  # |ratio - 1| on-policy: must be 0.0
            })  # fmt: skip
            print(json.dumps({k: v for k, v in history[-1].items() if k != "rewards"}), flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(history, indent=1))
    return history


if __name__ == "__main__":
    main()
