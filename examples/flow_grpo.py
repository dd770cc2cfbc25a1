"""Flow-GRPO (and DanceGRPO) with a LoRA, rollouts from a diffusion-rollout server.

    python examples/flow_grpo.py                          # CPU: a tiny SD3 model and its own server
    python examples/flow_grpo.py --step-kind dance        # DanceGRPO: the same trainer, `dance` steps
    python examples/flow_grpo.py --model /models/sd35m --server-gpu 0 --trainer-gpu 0 \
        --steps 10 --size 512 --group-size 8 --lora-rank 32 --iterations 40 --out run.json
    python examples/flow_grpo.py --model /models/sd35m --layout in-process     # no server: the baseline
    python examples/flow_grpo.py --url http://gpu-host:30000 --model /same/diffusers/folder

Each iteration:

1. **Rollouts.** One request per prompt with ``num_outputs_per_prompt = G`` (a GRPO group, one
   shared x_T per group as in Flow-GRPO-Fast), stochastic steps only in a window of ``--sde-window``
   steps whose start is drawn per iteration from the first ``--sde-window-range`` steps (the other
   steps are ODE and draw no noise); the trajectory and the conditioning come back for replay, the
   images as uint8.
2. **Reward and advantages.** The ``--reward`` plug-in (``rewards.py``; JPEG compressibility by
   default) on the images, normalised within each group.
3. **Training.** For ``--inner-epochs`` passes: replay each group's stochastic steps with the
   trainer's PEFT-wrapped transformer (``replay_steps``: the family's guidance rule, the shared step
   math), Flow-GRPO's clipped ratio loss (optionally plus ``--kl-beta`` times the KL to the base
   model, i.e. the adapter disabled), backward per step, one optimizer step per pass. The first pass is
   on-policy: the trainer holds exactly the server's weights and replays each group as the batch the
   server ran, so the ratio is exactly 1 (``first_ratio_max_dev``, which must be 0).
4. **Sync.** The adapter is pushed (``push_lora``: reloaded in place, activated, checksum verified)
   and the server's checksum read back and compared with the trainer's.

``--async-depth k`` (k > 0) makes the rollouts of the next k iterations while the trainer trains
(``RolloutClient.rollout_stream``): a batch is at most k pushes behind the trainer (older ones are
regenerated), is trained with the truncated importance weight of ``tis_policy_loss`` when stale,
and each iteration records its ``staleness`` and the first-step ratio statistics per staleness
(``ratio_by_staleness``; |ratio - 1| is exactly 0 at staleness 0). ``0`` (the default) is the
synchronous loop above, unchanged.

``--layout in-process`` samples with the stock pipeline on the trainer's own transformer instead
(``_common.InProcessSampler``): same seeds, same requests, nothing to push. ``--release-memory``
has a colocated server release its GPU memory while the trainer trains.

The run is written to ``--out`` as JSON after every iteration: per iteration the rewards, the ratio
statistics, the checksums and the seconds of each phase; at the end the learning statistics.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from _common import (
    PROMPTS,
    Checkpoint,
    InProcessSampler,
    Phases,
    add_lora,
    base_parser,
    clock,
    environment,
    image_size,
    iteration_record,
    load_trainer_transformer,
    rollout_server,
    summarize,
    trainer_device,
    trainer_dtype,
    uint8_images,
    wait_ready,
    write_run,
)
from rewards import load_reward

from diffusion_rollout.client import (
    ReplayBatch,
    RolloutClient,
    clipped_policy_loss,
    gaussian_kl,
    group_advantages,
    lora_checksum,
    push_lora,
    ratio_stats_by_staleness,
    replay_step,
    tis_policy_loss,
)

logger = logging.getLogger("examples.flow_grpo")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0])
    g = p.add_argument_group("Flow-GRPO")
    g.add_argument(
        "--step-kind",
        choices=["sde", "dance", "cps"],
        default="sde",
        help="sde: Flow-GRPO; dance: DanceGRPO; cps: coefficients-preserving",
    )
    g.add_argument("--guidance-scale", type=float, default=4.5)
    g.add_argument("--noise-level", type=float, default=0.7, help="rollout_noise_level (eta)")
    g.add_argument("--sde-window", type=int, default=2, help="stochastic steps per rollout (0: every step)")
    g.add_argument(
        "--sde-window-range",
        type=int,
        default=None,
        help="the window starts within the first N steps (default: half the steps)",
    )
    g.add_argument("--inner-epochs", type=int, default=1, help="optimizer steps per batch of rollouts")
    g.add_argument("--clip-range", type=float, default=1e-4)
    g.add_argument("--adv-clip-max", type=float, default=5.0)
    g.add_argument("--kl-beta", type=float, default=0.0, help="weight of the KL to the base model (0: off)")
    g.add_argument(
        "--async-depth",
        type=int,
        default=0,
        help="rollouts made this many iterations ahead, at most this many pushes stale (0: synchronous)",
    )
    g.add_argument(
        "--tis-cap", type=float, default=2.0, help="truncated importance weight cap (stale batches)"
    )
    g.add_argument(
        "--recompute-old-log-probs",
        action="store_true",
        help="treat every batch as off-policy: the clipped ratio is taken against the trainer's own "
        "recomputed log-probs and weighted by the truncated importance weight to the server's; for "
        "rollouts from an inexact server (the fast tier: --server-args='--quantize fp8 --compile')",
    )
    return p.parse_args(argv)


def sde_window(args: argparse.Namespace, iteration: int) -> list[int] | None:
    """This iteration's stochastic steps: a window drawn from a per-iteration seeded RNG."""
    if args.sde_window <= 0:
        return None
    # The last step ends at sigma 0 and has no density in the gaussian form: never in the window.
    upper = min(args.sde_window_range or max(args.steps // 2, args.sde_window), args.steps - 1)
    start = random.Random(args.seed * 100_003 + iteration).randint(0, max(upper - args.sde_window, 0))
    return list(range(start, min(start + args.sde_window, args.steps - 1)))


def train_iteration(
    transformer, optimizer, params, groups, advantages, args, staleness=None
) -> dict[str, Any]:
    """``staleness`` (``--async-depth``; None: synchronous) is recorded with the first-step ratio
    statistics; > 0: the rollouts came from older weights (``--async-depth``); the loss is then
    the clipped ratio against the trainer's own policy, weighted by the truncated importance weight
    to the server's (behaviour) log-probs."""
    batches = [ReplayBatch(group) for group in groups]
    # Other trainers built on this function (ray_colocated.py) have no such flag.
    tis = bool(staleness or getattr(args, "recompute_old_log_probs", False))
    n_terms = sum(len(b.trainable_steps()) for b in batches)
    first_dev, ratios, clip_fracs, losses, kls, first = 0.0, [], [], [], [], []
    proximal: dict[tuple[int, int], torch.Tensor] = {}
    for epoch in range(args.inner_epochs):
        optimizer.zero_grad(set_to_none=True)
        for batch, adv in zip(batches, advantages, strict=True):
            for t in batch.trainable_steps():
                step = replay_step(transformer, batch, t)
                if tis:
                    if epoch == 0:  # the trainer's policy before this update, per (batch, step)
                        proximal[(id(batch), t)] = step.log_prob.detach()
                    loss, stats = tis_policy_loss(
                        step.log_prob, proximal[(id(batch), t)], step.old_log_prob, adv,
                        clip_range=args.clip_range, tis_cap=args.tis_cap, adv_clip_max=args.adv_clip_max,
                    )  # fmt: skip
                else:
                    loss, stats = clipped_policy_loss(
                        step.log_prob, step.old_log_prob, adv,
                        clip_range=args.clip_range, adv_clip_max=args.adv_clip_max,
                    )  # fmt: skip
                if args.kl_beta > 0:
                    with torch.no_grad():
                        transformer.disable_adapters()
                        try:
                            ref = replay_step(transformer, batch, t)
                        finally:
                            transformer.enable_adapters()
                    kl = gaussian_kl(step.mean, ref.mean, step.std).mean()
                    loss = loss + args.kl_beta * kl
                    kls.append(float(kl.detach()))
                (loss / n_terms).backward()  # one step's graph at a time
                if epoch == 0:
                    first_dev = max(first_dev, float((step.ratio.detach() - 1).abs().max()))
                    first.append((staleness, step.ratio.detach()))
                ratios.append(step.ratio.detach().float().cpu())
                clip_fracs.append(stats["clip_frac"])
                losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
    r = torch.cat(ratios)
    by_staleness = ratio_stats_by_staleness(first) if staleness is not None else None
    return {
        "first_ratio_max_dev": first_dev,
        "ratio_mean": float(r.mean()),
        "ratio_min": float(r.min()),
        "ratio_max": float(r.max()),
        "clip_frac": sum(clip_fracs) / len(clip_fracs),
        "loss": sum(losses) / len(losses),
        # Whether the loss was TIS-weighted against the trainer's own recomputed log-probs.
        "tis_weighted": tis,
        **({"kl": sum(kls) / len(kls)} if kls else {}),
        **({"staleness": staleness, "ratio_by_staleness": by_staleness} if by_staleness is not None else {}),
    }


def server_adapter_checksum(client: RolloutClient, name: str = "default") -> str:
    return client.lora_list()["modules"]["transformer"]["adapters"][name]["checksum"]


def run(client: RolloutClient | None, model_path, args: argparse.Namespace, out_path: str | None) -> dict:
    device = trainer_device(args)
    torch.manual_seed(args.seed)
    reward_fn = load_reward(args.reward)
    transformer = load_trainer_transformer(
        model_path,
        device=device,
        dtype=trainer_dtype(args, device),
        gradient_checkpointing=args.gradient_checkpointing,
    )
    params = add_lora(transformer, args.lora_rank, trainer_dtype(args, device))
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    checkpoint = Checkpoint(args.checkpoint)
    state = checkpoint.load(transformer, optimizer) or {"next_iteration": 0, "history": []}
    history: list[dict[str, Any]] = state["history"]
    in_process = client is None
    sampler = InProcessSampler(model_path, transformer, device) if in_process else client
    version = f"iter-{state['next_iteration']}"
    if not in_process:
        # lora_B starts at zero: the adapter changes nothing yet, so the first rollouts sample the base
        # policy with the adapter's structure in place, and later pushes reload it in place.
        push_lora(client, transformer, name="default", activate=True, weight_version=version)
    width, height = image_size(args)
    run_record: dict[str, Any] = {
        "recipe": "flow_grpo", "layout": "in-process" if in_process else "server",
        "args": vars(args), "environment": environment(), "history": history,
    }  # fmt: skip
    shared = dict(
        num_outputs_per_prompt=args.group_size, num_inference_steps=args.steps,
        width=width, height=height, num_frames=args.frames, guidance_scale=args.guidance_scale,
        rollout_sde_type=args.step_kind, rollout_noise_level=args.noise_level,
        rollout_return_dit_trajectory=True, rollout_return_denoising_env=True, rollout_debug_mode=False,
        output_dtype="uint8", generator_device="cuda" if device.type == "cuda" else "cpu",
    )  # fmt: skip

    def iteration_jobs(it: int) -> list[dict[str, Any]]:
        window = sde_window(args, it)
        jobs = []
        for k in range(args.prompts):
            seed = (it * args.prompts + k) * 1000 + args.seed * 10_000_000
            # One x_T per group (Flow-GRPO-Fast): samples of a group differ only by the noise of the
            # steps being trained, which sharpens the credit assignment.
            jobs.append({"prompt": PROMPTS[(it * args.prompts + k) % len(PROMPTS)], "seed": seed,
                         "initial_noise_seed": seed + 999, "rollout_sde_step_indices": window,
                         # Replay needs the latents entering and leaving each stochastic step, nothing else.
                         "rollout_return_step_indices":
                             None if window is None else sorted({*window, *(s + 1 for s in window)})})  # fmt: skip
        return jobs

    stream = None
    if args.async_depth > 0 and not in_process:
        # Iteration it + k is sent while the trainer trains on iteration it (k = --async-depth).
        first_it = state["next_iteration"]
        stream = client.rollout_stream(
            lambda i: iteration_jobs(first_it + i), max_staleness=args.async_depth, on_stale="regenerate",
            max_batches=args.iterations - first_it, **shared,
        )  # fmt: skip
        stream.pushed(version)
    with stream if stream is not None else contextlib.nullcontext():  # closing aborts what is in flight
        for it in range(state["next_iteration"], args.iterations):
            phases = Phases(device)
            t_iter = time.perf_counter()
            staleness, server_span = None, None
            with phases("rollout"):
                if stream is not None:
                    batch = next(stream)
                    groups, staleness = batch.outputs, batch.staleness
                    server_span = [clock(batch.sent_at), clock(batch.answered_at)]
                else:
                    groups = sampler.generate_many(iteration_jobs(it), **shared)
            outputs = [o for g in groups for o in g]
            if stream is not None and len({o.weight_version for o in outputs}) != 1:
                raise RuntimeError(f"a batch mixed versions { ({o.weight_version for o in outputs}) }")
            if stream is None and not in_process and {o.weight_version for o in outputs} != {version}:
                raise RuntimeError(
                    f"rollouts came from { ({o.weight_version for o in outputs}) }, expected {version!r}"
                )
            if args.release_memory and not in_process:
                with phases("release"):
                    client.release_memory_occupation()
            with phases("reward"):
                rewards = reward_fn(uint8_images(outputs), [o.prompt for o in outputs]).float()
                adv = group_advantages(rewards, args.group_size).view(len(groups), args.group_size)
            with phases("train"):
                stats = train_iteration(transformer, optimizer, params, groups, adv, args, staleness)
            version = f"iter-{it + 1}"
            checksum_ok = None
            if args.release_memory and not in_process:
                with phases("resume"):
                    client.resume_memory_occupation()
            if not in_process:
                with phases("push"):
                    result = push_lora(
                        client, transformer, name="default", activate=True, weight_version=version
                    )
                    local = lora_checksum(transformer, dtype=trainer_dtype(args, device))
                    checksum_ok = (
                        local == server_adapter_checksum(client) and result.weight_version == version
                    )
                if stream is not None:
                    stream.pushed(version)
            record = iteration_record(
                it, version, rewards, outputs, phases, t_iter,
                sde_steps=outputs[0].sde_step_indices, **stats, checksum_ok=checksum_ok,
                **({"server_span": server_span} if server_span else {}),
            )  # fmt: skip
            history.append(record)
            run_record["summary"] = summarize(history, "first_ratio_max_dev")
            write_run(out_path, run_record)
            checkpoint.save(
                transformer, optimizer, ["default"], {"next_iteration": it + 1, "history": history}
            )
    if not in_process:
        run_record["final_adapter_checksum"] = lora_checksum(transformer, dtype=trainer_dtype(args, device))
        run_record["server_adapter_checksum"] = server_adapter_checksum(client)
    run_record["summary"] = summarize(history, "first_ratio_max_dev")
    write_run(out_path, run_record)
    return run_record


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise here
    t0 = time.perf_counter()
    with rollout_server(args) as server:
        if server.url is None:
            record = run(None, server.model_path, args, args.out)
        else:
            with RolloutClient(
                server.url, admin_key=server.admin_key, max_concurrency=args.prompts
            ) as client:
                wait_ready(client)
                record = run(client, server.model_path, args, args.out)
    record["wall_s"] = round(time.perf_counter() - t0, 2)
    write_run(args.out, record)
    print(json.dumps(record["summary"]), flush=True)
    return record


if __name__ == "__main__":
    main()
    sys.exit(0)
