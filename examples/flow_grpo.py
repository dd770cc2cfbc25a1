"""Flow-GRPO with a LoRA, driving a rollout server through ``diffusion_rollout.client``.

    python examples/flow_grpo.py                         # brings its own tiny SD3 server (CPU, ~30 s)
    python examples/flow_grpo.py --url http://host:30000 --model /path/to/the/same/diffusers/folder

Each iteration:

1. **Rollouts.** One request per prompt with ``num_outputs_per_prompt = G`` (a GRPO group), SDE
   steps (``rollout_sde_type="sde"``), the trajectory and the conditioning returned for replay.
2. **Reward and advantages.** A toy reward (how close the image's colours are to ``--target``),
   normalised within each group.
3. **Training.** For ``--inner-epochs`` passes: replay every stochastic step of every group with the
   trainer's PEFT-wrapped transformer (``client.replay_steps``), Flow-GRPO's clipped ratio loss,
   backward per step, one optimizer step per pass. The first pass is on-policy: the trainer holds
   exactly the server's weights and replays each group as the batch the server ran, so the ratio
   is exactly 1 (logged as ``first_ratio_max_dev``, which must be 0).
4. **Sync.** The adapter is pushed to the server (``client.push_lora``: one safetensors body with its
   LoraConfig, reloaded in place, activated) and its checksum verified against the trainer's.
5. **Evaluation.** ODE samples at fixed seeds (``rollout=False``) under the new adapter; their mean
   reward should rise over the run.

Prints one JSON line per iteration and a summary; ``--out`` writes the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from _common import (
    LORA_TARGETS,
    PROMPTS,
    base_parser,
    color_reward,
    load_trainer_transformer,
    rollout_server,
    wait_ready,
)

from diffusion_rollout.client import (
    ReplayBatch,
    RolloutClient,
    clipped_policy_loss,
    group_advantages,
    lora_checksum,
    push_lora,
    replay_steps,
)

logger = logging.getLogger("examples.flow_grpo")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--guidance-scale", type=float, default=4.5)
    p.add_argument("--noise-level", type=float, default=0.7, help="rollout_noise_level (eta)")
    p.add_argument("--inner-epochs", type=int, default=2, help="optimizer steps per batch of rollouts")
    p.add_argument("--lr", type=float, default=2e-2)
    p.add_argument("--clip-range", type=float, default=0.2)
    p.add_argument("--lora-rank", type=int, default=4)
    p.add_argument(
        "--target", type=float, nargs=3, default=(0.9, 0.1, 0.1), help="target RGB colour in [0, 1]"
    )
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument(
        "--shared-noise",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one initial noise per group (initial_noise_seed)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the summary JSON here")
    return p.parse_args(argv)


def server_adapter_checksum(client: RolloutClient, name: str = "default") -> str:
    return client.lora_list()["modules"]["transformer"]["adapters"][name]["checksum"]


def evaluate(client: RolloutClient, args: argparse.Namespace) -> float:
    """Mean reward of ODE samples at fixed seeds under the server's current policy."""
    outs = client.generate(
        "a red square",
        seed=10_000,
        num_outputs_per_prompt=args.eval_samples,
        num_inference_steps=args.steps,
        width=args.size,
        height=args.size,
        guidance_scale=args.guidance_scale,
        rollout=False,
        generator_device="cpu",
    )
    return float(color_reward(torch.stack([o.generated_output for o in outs]), args.target).mean())


def train_iteration(
    transformer, optimizer, params, groups, advantages, args: argparse.Namespace
) -> dict[str, Any]:
    batches = [ReplayBatch(group) for group in groups]
    n_terms = sum(len(b.trainable_steps()) for b in batches)
    first_dev = 0.0
    ratios, clip_fracs, losses = [], [], []
    for epoch in range(args.inner_epochs):
        optimizer.zero_grad(set_to_none=True)
        for batch, adv in zip(batches, advantages, strict=True):
            for step in replay_steps(transformer, batch):
                loss, stats = clipped_policy_loss(
                    step.log_prob, step.old_log_prob, adv, clip_range=args.clip_range, adv_clip_max=5.0
                )
                (loss / n_terms).backward()  # one step's graph at a time
                if epoch == 0:
                    first_dev = max(first_dev, float((step.ratio.detach() - 1).abs().max()))
                ratios.append(step.ratio.detach())
                clip_fracs.append(stats["clip_frac"])
                losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
    r = torch.cat(ratios)
    return {
        "first_ratio_max_dev": first_dev,
        "ratio_mean": float(r.mean()),
        "ratio_min": float(r.min()),
        "ratio_max": float(r.max()),
        "clip_frac": sum(clip_fracs) / len(clip_fracs),
        "loss": sum(losses) / len(losses),
    }


def run(client: RolloutClient, model_path, args: argparse.Namespace) -> dict[str, Any]:
    from peft import LoraConfig

    torch.manual_seed(args.seed)
    transformer = load_trainer_transformer(model_path)
    transformer.add_adapter(
        LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank, target_modules=LORA_TARGETS, lora_dropout=0.0)
    )
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=args.lr)

    # lora_B starts at zero: the adapter changes nothing yet, so the server samples the base model's
    # policy with the adapter's structure in place and later pushes reload it in place.
    push_lora(client, transformer, name="default", activate=True, weight_version="iter-0")
    version = "iter-0"
    eval_rewards = [evaluate(client, args)]
    history: list[dict[str, Any]] = []
    checksums_ok = True
    first_dev_all = 0.0
    for it in range(args.iterations):
        t0 = time.perf_counter()
        jobs = [
            {
                "prompt": PROMPTS[k % len(PROMPTS)],
                "seed": args.seed + 1000 * it + 100 * k,
                # One x_T per group (Flow-GRPO-Fast): the group's samples then differ only by the
                # SDE noise of the steps being trained, which sharpens the credit assignment.
                "initial_noise_seed": args.seed + 1000 * it + 100 * k + 50 if args.shared_noise else None,
            }
            for k in range(args.prompts)
        ]
        groups = client.generate_many(
            jobs,
            num_outputs_per_prompt=args.group_size,
            num_inference_steps=args.steps,
            width=args.size,
            height=args.size,
            guidance_scale=args.guidance_scale,
            rollout_sde_type="sde",
            rollout_noise_level=args.noise_level,
            rollout_return_dit_trajectory=True,
            rollout_return_denoising_env=True,
            rollout_debug_mode=False,
            generator_device="cpu",
        )
        versions = {o.weight_version for g in groups for o in g}
        if versions != {version}:
            raise RuntimeError(f"rollouts came from weight versions {versions}, expected {version!r}")
        images = torch.stack([o.generated_output for g in groups for o in g])
        rewards = color_reward(images, args.target)
        adv = group_advantages(rewards, args.group_size).view(len(groups), args.group_size)
        t_roll = time.perf_counter() - t0

        stats = train_iteration(transformer, optimizer, params, groups, adv, args)
        first_dev_all = max(first_dev_all, stats["first_ratio_max_dev"])

        version = f"iter-{it + 1}"
        result = push_lora(client, transformer, name="default", activate=True, weight_version=version)
        local = lora_checksum(transformer, dtype=torch.float32)
        remote = server_adapter_checksum(client)
        checksums_ok &= local == remote and result.weight_version == version
        eval_rewards.append(evaluate(client, args))
        record = {
            "iteration": it,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "eval_reward": eval_rewards[-1],
            **stats,
            "weight_version": result.weight_version,
            "adapter_checksum": local,
            "checksum_ok": local == remote,
            "rollout_s": round(t_roll, 3),
            "iteration_s": round(time.perf_counter() - t0, 3),
        }
        history.append(record)
        print(json.dumps(record), flush=True)
    return {
        "iterations": args.iterations,
        "first_ratio_max_dev": first_dev_all,
        "eval_reward_start": eval_rewards[0],
        "eval_reward_end": eval_rewards[-1],
        "eval_rewards": eval_rewards,
        "train_reward_first": history[0]["reward_mean"] if history else math.nan,
        "train_reward_last": history[-1]["reward_mean"] if history else math.nan,
        "checksums_ok": checksums_ok,
        "final_adapter_checksum": lora_checksum(transformer, dtype=torch.float32),
        "server_adapter_checksum": server_adapter_checksum(client),
        "weight_version": version,
        "history": history,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise here
    with rollout_server(args.url, args.model, args.server, args.group_size) as server:
        if server.model_path is None:
            raise SystemExit("--model is required with --url: the trainer loads the same weights")
        with RolloutClient(server.url, admin_key=server.admin_key, max_concurrency=args.prompts) as client:
            wait_ready(client)
            summary = run(client, server.model_path, args)
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
    sys.exit(0)
