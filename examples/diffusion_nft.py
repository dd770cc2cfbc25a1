"""DiffusionNFT with two LoRA adapters on one server: rollouts from ``old`` (EMA), training ``default``.

    python examples/diffusion_nft.py                      # brings its own tiny SD3 server (CPU, ~30 s)
    python examples/diffusion_nft.py --url http://host:30000 --model /path/to/the/same/diffusers/folder

DiffusionNFT (Zheng et al., 2025) trains on the forward process, so rollouts need no log-probs and
no SDE: any ODE sampler will do. Each iteration:

1. **Rollouts under ``old``.** The server holds both adapters; ``old`` is active
   (``client.lora_activate("old")``). Requests send ``rollout_sde_step_indices=[]`` (every step
   ODE, no noise drawn) with ``rollout_log_prob_no_const=true`` (an all-ODE request with the
   ``gaussian`` form is a 400: an ODE step has no density), and keep only the final latent of the
   trajectory (``rollout_return_step_indices=[T]``) plus the conditioning.
2. **Reward -> optimality.** ``r = 0.5 + 0.5 * clip(A / max|A|, -1, 1)`` from group advantages.
3. **Forward-process loss.** For the final latent ``x0``, a schedule point ``(sigma, timestep)`` of
   the rollout and fresh noise: ``x_t = (1 - sigma) x0 + sigma eps``, target ``v = eps - x0``;
   ``v_old`` from the trainer's ``old`` adapter (no grad), ``v_theta`` from ``default``;
   ``L = r |(1 - b) v_old + b v_theta - v|^2 + (1 - r) |(1 + b) v_old - b v_theta - v|^2``.
   The model is called through ``client.replay_model_output`` with the rollout's
   ``denoising_env`` (conditional branch only: DiffusionNFT is CFG-free).
4. **EMA and sync.** ``old <- decay * old + (1 - decay) * default`` on the trainer; both adapters are
   pushed (``push_lora``, checksums verified) and ``old`` stays active for the next rollouts.
5. **Evaluation** switches the server to ``default`` and back (``client.lora_activate``).

Prints one JSON line per iteration and a summary; ``--out`` writes the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
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
    RolloutClient,
    group_advantages,
    push_lora,
    replay_model_output,
    stack_envs,
)

logger = logging.getLogger("examples.diffusion_nft")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--beta", type=float, default=1.0, help="DiffusionNFT's guidance strength b")
    p.add_argument("--ema-decay", type=float, default=0.5, help="old <- decay * old + (1 - decay) * default")
    p.add_argument("--timesteps-per-sample", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-2)
    p.add_argument("--lora-rank", type=int, default=4)
    p.add_argument(
        "--target", type=float, nargs=3, default=(0.9, 0.1, 0.1), help="target RGB colour in [0, 1]"
    )
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the summary JSON here")
    return p.parse_args(argv)


def evaluate(client: RolloutClient, args: argparse.Namespace, adapter: str) -> float:
    """Mean reward of ODE samples at fixed seeds with ``adapter`` active on the server."""
    client.lora_activate(adapter)
    outs = client.generate(
        "a red square",
        seed=10_000,
        num_outputs_per_prompt=args.eval_samples,
        num_inference_steps=args.steps,
        width=args.size,
        height=args.size,
        guidance_scale=1.0,
        rollout=False,
        generator_device="cpu",
    )
    return float(color_reward(torch.stack([o.generated_output for o in outs]), args.target).mean())


def cfg_free(env: dict[str, Any]) -> dict[str, Any]:
    """The conditional branch of a denoising_env only (DiffusionNFT trains without CFG)."""
    return {**env, "neg_cond_kwargs": None, "guidance": {**env["guidance"], "rule": "none"}}


def nft_loss(transformer, groups, optimality, args: argparse.Namespace, gen: torch.Generator) -> torch.Tensor:
    """DiffusionNFT's loss on the rollouts' final latents, averaged over groups and timesteps."""
    total = torch.zeros(())
    terms = 0
    for group, r in zip(groups, optimality, strict=True):
        traj = group[0].dit_trajectory
        T = traj.num_steps
        x0 = torch.stack([o.dit_trajectory.latent(T) for o in group])
        env = cfg_free(stack_envs([o.denoising_env for o in group]))
        for _ in range(args.timesteps_per_sample):
            i = int(torch.randint(0, T, (), generator=gen))
            sigma, timestep = traj.sigmas[i], traj.timesteps[i]
            eps = torch.randn(x0.shape, generator=gen, dtype=x0.dtype)
            x_t = (1 - sigma) * x0 + sigma * eps
            target = eps - x0
            with torch.no_grad():
                transformer.set_adapter("old")
                v_old = replay_model_output(transformer, x_t, timestep, env)
            transformer.set_adapter("default")
            v_theta = replay_model_output(transformer, x_t, timestep, env)
            b = args.beta
            pos = ((1 - b) * v_old + b * v_theta - target).pow(2).flatten(1).mean(1)
            neg = ((1 + b) * v_old - b * v_theta - target).pow(2).flatten(1).mean(1)
            total = total + (r * pos + (1 - r) * neg).mean()
            terms += 1
    return total / terms


@torch.no_grad()
def ema_update(transformer, decay: float) -> None:
    params = dict(transformer.named_parameters())
    for name, p in params.items():
        if ".default." in name:
            params[name.replace(".default.", ".old.")].mul_(decay).add_(p, alpha=1 - decay)


def run(client: RolloutClient, model_path, args: argparse.Namespace) -> dict[str, Any]:
    from peft import LoraConfig

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    transformer = load_trainer_transformer(model_path)
    config = LoraConfig(
        r=args.lora_rank, lora_alpha=args.lora_rank, target_modules=LORA_TARGETS, lora_dropout=0.0
    )
    transformer.add_adapter(config, adapter_name="default")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns about a second adapter: two is the point here
        transformer.add_adapter(config, adapter_name="old")
    transformer.set_adapter("default")
    params = [p for n, p in transformer.named_parameters() if ".default." in n]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.Adam(params, lr=args.lr)

    def sync(version: str) -> None:
        push_lora(client, transformer, name="default", activate=False, weight_version=version)
        push_lora(client, transformer, name="old", activate=True, weight_version=version)

    version = "nft-0"
    sync(version)
    eval_default = [evaluate(client, args, "default")]
    client.lora_activate("old")
    history: list[dict[str, Any]] = []
    for it in range(args.iterations):
        t0 = time.perf_counter()
        jobs = [
            {"prompt": PROMPTS[k % len(PROMPTS)], "seed": args.seed + 1000 * it + 100 * k}
            for k in range(args.prompts)
        ]
        groups = client.generate_many(
            jobs,
            num_outputs_per_prompt=args.group_size,
            num_inference_steps=args.steps,
            width=args.size,
            height=args.size,
            guidance_scale=1.0,
            rollout_sde_step_indices=[],
            rollout_log_prob_no_const=True,
            rollout_return_dit_trajectory=True,
            rollout_return_step_indices=[args.steps],
            rollout_return_denoising_env=True,
            rollout_debug_mode=False,
            generator_device="cpu",
        )
        outputs = [o for g in groups for o in g]
        if any(o.sde_step_indices for o in outputs) or any(bool(o.rollout_log_probs.any()) for o in outputs):
            raise RuntimeError("an ODE rollout reported a stochastic step")
        rewards = color_reward(torch.stack([o.generated_output for o in outputs]), args.target)
        adv = group_advantages(rewards, args.group_size)
        optimality = (0.5 + 0.5 * (adv / adv.abs().max().clamp_min(1e-8)).clamp(-1, 1)).view(
            len(groups), args.group_size
        )

        optimizer.zero_grad(set_to_none=True)
        loss = nft_loss(transformer, groups, optimality, args, gen)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        ema_update(transformer, args.ema_decay)

        version = f"nft-{it + 1}"
        sync(version)
        listing = client.lora_list()["modules"]["transformer"]
        eval_default.append(evaluate(client, args, "default"))
        client.lora_activate("old")  # rollouts sample from the EMA policy
        record = {
            "iteration": it,
            "reward_mean": float(rewards.mean()),
            "loss": float(loss.detach()),
            "eval_reward_default": eval_default[-1],
            "active_during_rollouts": listing["active"],
            "adapters": sorted(listing["adapters"]),
            "weight_version": version,
            "iteration_s": round(time.perf_counter() - t0, 3),
        }
        history.append(record)
        print(json.dumps(record), flush=True)
    return {
        "iterations": args.iterations,
        "eval_reward_start": eval_default[0],
        "eval_reward_end": eval_default[-1],
        "eval_rewards": eval_default,
        "active_adapter": client.lora_list()["modules"]["transformer"]["active"],
        "weight_version": version,
        "history": history,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
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
