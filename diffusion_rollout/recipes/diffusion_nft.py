"""DiffusionNFT with UniRL's EMA pattern: the server samples from ``old`` (EMA), the trainer trains
``default`` (``examples/diffusion_nft.py`` runs it).

DiffusionNFT (Zheng et al., 2025) trains on the forward process, so rollouts need no log-probs and
no SDE: any ODE sampler will do. Each iteration:

1. **Rollouts under ``old``.** The server holds both adapters with ``old`` active. Requests send
   ``rollout_sde_step_indices=[]`` (every step ODE, no noise drawn) with
   ``rollout_log_prob_no_const=true`` (an all-ODE request in the ``gaussian`` form is a 400: an ODE step
   has no density), and keep only two trajectory entries (a parity check, below) and the final latent,
   plus the conditioning and uint8 images.
2. **Reward -> optimality.** ``r = 0.5 + 0.5 * clip(A / max|A|, -1, 1)`` from group advantages.
3. **Forward-process loss** (:func:`nft_backward`). For the final latent ``x0``, a schedule point
   ``(sigma, timestep)`` of the rollout and fresh noise: ``x_t = (1 - sigma) x0 + sigma eps``, target
   ``v = eps - x0``; ``v_old`` from the trainer's ``old`` adapter (no grad), ``v_theta`` from ``default``;
   ``L = r |(1 - b) v_old + b v_theta - v|^2 + (1 - r) |(1 + b) v_old - b v_theta - v|^2``.
   The model is called through ``replay_model_output`` with the rollout's ``denoising_env``
   (conditional branch only: DiffusionNFT is CFG-free).
4. **EMA and sync.** ``old <- decay * old + (1 - decay) * default`` on the trainer; both adapters are
   pushed and verified (:class:`~diffusion_rollout.recipes.weight_sync.ServedAdapters`) and ``old``
   stays active. The decay ramps up from 0 by ``--ema-ramp`` per iteration to at most ``--ema-decay``:
   a constant decay from the start leaves ``old`` lagging ``default`` (benchmarks/RESULTS.md#train-nft).

A lost server (restarted, unreachable, late) is waited for, both adapters re-pushed and verified
and the rollouts redone (:mod:`~diffusion_rollout.recipes.recovery`); rollouts from another version
are never trained on.

**Parity check** (the counterpart of Flow-GRPO's ratio of exactly 1 for deterministic rollouts): the
trainer's ``old`` adapter recomputes one ODE step of every group from the returned trajectory entry,
as one batch, and the result must equal the server's next entry bit for bit (``old_policy_max_dev``
is 0): the trainer holds exactly the policy the server sampled from.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch

from diffusion_rollout.client import RolloutClient, group_advantages, replay_model_output, stack_envs
from diffusion_rollout.recipes.checkpoint import Checkpoint
from diffusion_rollout.recipes.config_file import parse_with_config
from diffusion_rollout.recipes.launch import launch
from diffusion_rollout.recipes.options import PROMPTS, base_parser, image_size
from diffusion_rollout.recipes.ranks import Ranks
from diffusion_rollout.recipes.records import environment, iteration_record, summarize, write_run
from diffusion_rollout.recipes.recovery import Recovery
from diffusion_rollout.recipes.report import Report
from diffusion_rollout.recipes.reward import RecipeReward
from diffusion_rollout.recipes.timing import Phases
from diffusion_rollout.recipes.trainer import (
    add_lora,
    load_trainer_transformer,
    trainer_device,
    trainer_dtype,
)
from diffusion_rollout.recipes.weight_sync import ServedAdapters
from diffusion_rollout.scheduler_mixins import transition

DESCRIPTION = "DiffusionNFT with UniRL's EMA pattern: the server samples from ``old`` (EMA), the trainer trains ``default``."


def parse_args(argv: Sequence[str] | None = None, description: str = DESCRIPTION) -> argparse.Namespace:
    p = base_parser(description)
    g = p.add_argument_group("DiffusionNFT")
    g.add_argument("--beta", type=float, default=1.0, help="DiffusionNFT's guidance strength b")
    g.add_argument(
        "--ema-decay", type=float, default=0.5, help="the largest decay: old <- d * old + (1 - d) * default"
    )
    g.add_argument("--ema-ramp", type=float, default=0.001, help="the decay grows by this much per iteration")
    g.add_argument("--timesteps-per-sample", type=int, default=2)
    g.add_argument(
        "--parity-step", type=int, default=None, help="ODE step checked for parity (default T // 2)"
    )
    args = parse_with_config(p, argv)
    if args.layout != "server":
        p.error("DiffusionNFT runs against a server (--layout server)")
    return args


def cfg_free(env: dict[str, Any]) -> dict[str, Any]:
    """The conditional branch of a denoising_env only (DiffusionNFT trains without CFG)."""
    return {**env, "neg_cond_kwargs": None, "guidance": {**env["guidance"], "rule": "none"}}


def nft_backward(
    transformer, groups, optimality, args, gen: torch.Generator, device, ranks: Ranks | None = None
) -> float:
    """DiffusionNFT's loss on the rollouts' final latents, averaged over groups and timesteps.

    Each (group, timestep) term is backpropagated on its own, so only one term's graph is alive.
    Under torchrun the terms are divided by the whole iteration's count and rank r first draws (and
    drops) the timesteps and noise of the groups before its block, so every group gets the draws it
    gets in a 1-rank run. Returns this rank's share of the loss.
    """
    ranks = ranks or Ranks()
    terms = int(ranks.sum(len(groups) * args.timesteps_per_sample))
    total = 0.0
    shape = (len(groups[0]), *groups[0][0].dit_trajectory.latent(groups[0][0].dit_trajectory.num_steps).shape)
    for _ in range(ranks.rank * len(groups) * args.timesteps_per_sample):
        torch.randint(0, groups[0][0].dit_trajectory.num_steps, (), generator=gen)
        torch.randn(shape, generator=gen, dtype=torch.float32)
    for group, r in zip(groups, optimality, strict=True):
        traj = group[0].dit_trajectory
        T = traj.num_steps
        x0 = torch.stack([o.dit_trajectory.latent(T) for o in group]).to(device)
        env = cfg_free(stack_envs([o.denoising_env for o in group]))
        r = r.to(device)
        for _ in range(args.timesteps_per_sample):
            i = int(torch.randint(0, T, (), generator=gen))
            sigma, timestep = float(traj.sigmas[i]), traj.timesteps[i]
            eps = torch.randn(x0.shape, generator=gen, dtype=torch.float32).to(device)
            x_t = ((1 - sigma) * x0.float() + sigma * eps).to(x0.dtype)
            target = eps - x0.float()
            with torch.no_grad():
                transformer.set_adapter("old")
                v_old = replay_model_output(transformer, x_t, timestep, env).float()
            transformer.set_adapter("default")
            v_theta = replay_model_output(transformer, x_t, timestep, env).float()
            b = args.beta
            pos = ((1 - b) * v_old + b * v_theta - target).pow(2).flatten(1).mean(1)
            neg = ((1 + b) * v_old - b * v_theta - target).pow(2).flatten(1).mean(1)
            loss = (r * pos + (1 - r) * neg).mean() / terms
            loss.backward()
            total += float(loss.detach())
    return total


@torch.no_grad()
def old_policy_max_dev(transformer, groups, step: int, device) -> float:
    """Max |server's ODE step - the trainer's ``old`` adapter's| over every group (0: same policy)."""
    transformer.set_adapter("old")
    dev = 0.0
    for group in groups:
        traj = group[0].dit_trajectory
        x = torch.stack([o.dit_trajectory.latent(step) for o in group]).to(device)
        served_next = torch.stack([o.dit_trajectory.latent(step + 1) for o in group]).to(device)
        env = stack_envs([o.denoising_env for o in group])
        v = replay_model_output(transformer, x, traj.timesteps[step], env, step=step)
        s, s_next = traj.sigmas[step].to(device), traj.sigmas[step + 1].to(device)
        res = transition("ode", x, v, s, s_next, eta=0.0, sigma_max=traj.sigmas[1].to(device))
        dev = max(dev, float((res.next_sample.to(served_next.dtype) - served_next).abs().max()))
    transformer.set_adapter("default")
    return dev


def ema_decay_at(args: argparse.Namespace, iteration: int) -> float:
    """The EMA decay after ``iteration``: ``min(--ema-decay, --ema-ramp * iteration)``."""
    return min(args.ema_decay, args.ema_ramp * iteration)


@torch.no_grad()
def ema_update(transformer, decay: float) -> None:
    params = dict(transformer.named_parameters())
    for name, p in params.items():
        if ".default." in name:
            old = params[name.replace(".default.", ".old.")]
            old.copy_((old.float() * decay + p.float() * (1 - decay)).to(old.dtype))


def run(
    client: RolloutClient,
    model_path,
    args: argparse.Namespace,
    out_path: str | None,
    ranks: Ranks | None = None,
) -> dict[str, Any]:
    ranks = ranks or Ranks()
    device = trainer_device(args, ranks)
    dtype = trainer_dtype(args, device)
    torch.manual_seed(args.seed)
    reward_fn = RecipeReward(args, client)
    transformer = load_trainer_transformer(
        model_path, device=device, dtype=dtype, gradient_checkpointing=args.gradient_checkpointing
    )
    lora = {"alpha": args.lora_alpha, "targets": args.lora_targets}
    params = add_lora(transformer, args.lora_rank, dtype, "default", **lora)
    add_lora(transformer, args.lora_rank, dtype, "old", **lora)
    with torch.no_grad():  # old starts as a copy of default (both change nothing yet: lora_B = 0)
        named = dict(transformer.named_parameters())
        for n, p in named.items():
            if ".default." in n:
                named[n.replace(".default.", ".old.")].copy_(p)
    transformer.set_adapter("default")
    for p in params:
        p.requires_grad_(True)
    ranks.broadcast_params([p for n, p in transformer.named_parameters() if ".default." in n or ".old." in n])
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    checkpoint = Checkpoint(args.checkpoint)
    state = checkpoint.load(transformer, optimizer) or {"next_iteration": 0, "history": []}
    history: list[dict[str, Any]] = state["history"]
    parity_step = args.steps // 2 if args.parity_step is None else args.parity_step

    # Rank 0 pushes both adapters and reads their checksums back; holds() asks before a re-push.
    served = ServedAdapters(client, transformer, dtype, ranks)
    sync, holds = served.push, served.holds
    # A lost server is waited for, both adapters re-pushed and verified, the rollouts redone
    # (recovery.py); every recovery is in the run record.
    recovery = Recovery(client, ranks, timeout_s=args.recover_timeout)
    recovery.restore(state)
    version = f"nft-{state['next_iteration']}"
    recovery.push(state["next_iteration"], version, sync, holds)
    width, height = image_size(args)
    run_record: dict[str, Any] = {
        "recipe": "diffusion_nft", "layout": "server", "ranks": ranks.world, "args": vars(args),
        "environment": environment(),
        "history": history,
    }  # fmt: skip
    # Rank 0's progress line per iteration, and --log-to's scalars and images.
    with Report(args, "diffusion_nft", "old_policy_max_dev", enabled=ranks.is_main) as report:
        for it in range(state["next_iteration"], args.iterations):
            # Per-iteration draws (loss timesteps and noise), so a resumed run continues with the same ones.
            gen = torch.Generator().manual_seed(args.seed * 100_003 + it)
            phases = Phases(device)
            t_iter = time.perf_counter()
            jobs = [
                {"prompt": PROMPTS[(it * args.prompts + k) % len(PROMPTS)],
                 "seed": (it * args.prompts + k) * 1000 + args.seed * 10_000_000}
                for k in range(args.prompts)
            ]  # fmt: skip
            jobs = ranks.share(jobs)  # this rank's block of the iteration's groups
            request = dict(
                    num_outputs_per_prompt=args.group_size, num_inference_steps=args.steps,
                    width=width, height=height, num_frames=args.frames, guidance_scale=1.0,
                    rollout_sde_step_indices=[], rollout_log_prob_no_const=True,
                    rollout_return_dit_trajectory=True,
                    rollout_return_step_indices=sorted({parity_step, parity_step + 1, args.steps}),
                    rollout_return_denoising_env=True, rollout_debug_mode=False, output_dtype="uint8",
                    generator_device="cuda" if device.type == "cuda" else "cpu",
                    **reward_fn.request_fields(),
            )  # fmt: skip
            with phases("rollout"):  # only a batch made under the pushed version is trained on
                groups = recovery.rollouts(
                    it, version, lambda j=jobs, r=request: client.generate_many(j, **r), sync, holds
                )
            outputs = [o for g in groups for o in g]
            if any(o.sde_step_indices for o in outputs) or any(
                bool(o.rollout_log_probs.any()) for o in outputs
            ):
                raise RuntimeError("an ODE rollout reported a stochastic step")
            if {o.weight_version for o in outputs} != {version}:
                raise RuntimeError(
                    f"rollouts came from { ({o.weight_version for o in outputs}) }, expected {version!r}"
                )
            with phases("reward"):
                rewards = reward_fn(outputs)
                adv = group_advantages(rewards, args.group_size)
                seen = ranks.gather({"rewards": rewards, "adv_max": float(adv.abs().max())})
                # The scale is the whole iteration's largest |advantage|, as in a 1-rank run.
                scale = max(q["adv_max"] for q in seen)
                optimality = (0.5 + 0.5 * (adv / max(scale, 1e-8)).clamp(-1, 1)).view(
                    len(groups), args.group_size
                )
            with phases("train"):
                parity = max(ranks.gather(old_policy_max_dev(transformer, groups, parity_step, device)))
                optimizer.zero_grad(set_to_none=True)
                loss = ranks.sum(nft_backward(transformer, groups, optimality, args, gen, device, ranks))
                ranks.all_reduce_grads(params)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                decay = ema_decay_at(args, it)
                ema_update(transformer, decay)
            version = f"nft-{it + 1}"
            with phases("push"):
                checksum_ok = recovery.push(it, version, sync, holds)
            all_rewards = torch.cat([q["rewards"] for q in seen])
            record = iteration_record(
                it, version, all_rewards, outputs, phases, t_iter, images=len(all_rewards),
                loss=loss, old_policy_max_dev=parity, checksum_ok=checksum_ok, ema_decay=decay,
            )  # fmt: skip
            record["recovered"] = [e["cause"] for e in recovery.events if e["iteration"] == it]
            history.append(record)
            report.iteration(record, outputs)
            if ranks.is_main:
                run_record["summary"] = summarize(history, "old_policy_max_dev")
                run_record.update(recovery.record())
                write_run(out_path, run_record)
                checkpoint.save(
                    transformer, optimizer, ["default", "old"],
                    {"next_iteration": it + 1, "history": history, **recovery.state()},
                )  # fmt: skip
    run_record["summary"] = summarize(history, "old_policy_max_dev")
    # The server may have been lost after the last push: waited for and re-pushed like any other
    # loss, or the record says why the final state could not be read (recovery.py).
    run_record.update(
        recovery.final(
            args.iterations, version, sync, holds,
            served.final_state,
        )
    )  # fmt: skip
    run_record.update(recovery.record())
    if ranks.is_main:
        run_record["final_adapter_checksums"] = served.checksums()
        write_run(out_path, run_record)
    return run_record


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return launch(parse_args(argv), run)
