"""Flow-GRPO (and DanceGRPO) with a LoRA, rollouts from a diffusion-rollout server.

    python examples/flow_grpo.py                          # CPU: a tiny SD3 model and its own server
    python examples/flow_grpo.py --step-kind dance        # DanceGRPO: the same trainer, `dance` steps
    python examples/flow_grpo.py --model /models/sd35m --server-gpu 0 --trainer-gpu 0 \
        --steps 10 --size 512 --group-size 8 --lora-rank 32 --iterations 40 --out run.json
    python examples/flow_grpo.py --model /models/sd35m --layout in-process     # no server: the baseline
    python examples/flow_grpo.py --url http://gpu-host:30000 --model /same/diffusers/folder
    torchrun --standalone --nproc-per-node 4 examples/flow_grpo.py --model /models/sd35m --prompts 16 \
        --server-gpus 0,1,2,3 --trainer-gpus 0,1,2,3           # 4 trainer ranks, a 4-replica pool

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

**A lost server** (restarted with its base weights, a dropped connection, an answer later than
``--request-timeout``) is waited for, the adapter re-pushed and verified and the iteration's
rollouts redone (``_recovery.py``); rollouts from any other weight version are rejected, never
trained on, and the record lists each recovery (``recoveries``).

``--async-depth k`` (k > 0) makes the rollouts of the next k iterations while the trainer trains
(``RolloutClient.rollout_stream``): a batch is at most k pushes behind the trainer (older ones are
regenerated), is trained with the truncated importance weight of ``tis_policy_loss`` when stale,
and each iteration records its ``staleness`` and the first-step ratio statistics per staleness
(``ratio_by_staleness``; |ratio - 1| is exactly 0 at staleness 0). ``0`` (the default) is the
synchronous loop above, unchanged.

``--layout in-process`` samples in the trainer's process on its own transformer instead
(``_in_process``: the stock pipeline for SD3, this project's engine for the other families): same
seeds, same requests, nothing to push. ``--release-memory``
has a colocated server release its GPU memory while the trainer trains.

**Several ranks** (``torchrun``; ``_ranks.py``): each rank takes its block of the ``--prompts``
groups, replays them, and the LoRA gradients are summed over the ranks before one optimizer step;
rank 0 starts the server (``--server-gpus 0,1``: a pool of Ray replicas), pushes, and writes the
record with every rank's rewards. ``--full-finetune`` trains every weight instead, sharded with
FSDP2, and syncs the full weights after each step (``_full.py``). One rank is the plain run.

The run is written to ``--out`` as JSON after every iteration: per iteration the rewards, the ratio
statistics, the checksums and the seconds of each phase; at the end the learning statistics.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from _common import (
    PROMPTS,
    Checkpoint,
    Phases,
    RecipeReward,
    add_lora,
    base_parser,
    client_timeout,
    clock,
    environment,
    image_size,
    iteration_record,
    load_trainer_transformer,
    rollout_server,
    server_peak_gb,
    summarize,
    trainer_device,
    trainer_dtype,
    wait_ready,
    write_run,
)
from _config import parse_with_config
from _full import FullFinetune
from _in_process import in_process_sampler
from _ranks import Ranks
from _recovery import Recovery, on_main, server_holds_lora
from _report import Report

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
    tree_advantages,
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
    g.add_argument(
        "--true-cfg-scale",
        type=float,
        default=None,
        help="true CFG (Qwen-Image, FLUX): a conditional and an unconditional call per step; needs "
        "--negative-prompt (Qwen-Image runs no CFG without one)",
    )
    g.add_argument("--negative-prompt", default=None, help="the negative prompt of every request")
    g.add_argument(
        "--max-sequence-length", type=int, default=None, help="text tokens per prompt (default: the model's)"
    )
    g.add_argument(
        "--prompt-set",
        choices=["animals", "ocr"],
        default="animals",
        help="animals: DDPO's subjects; ocr: prompts that ask for a quoted text (for an OCR reward)",
    )
    g.add_argument("--noise-level", type=float, default=0.7, help="rollout_noise_level (eta)")
    g.add_argument("--sde-window", type=int, default=2, help="stochastic steps per rollout (0: every step)")
    g.add_argument(
        "--sde-window-range",
        type=int,
        default=None,
        help="the window starts within the first N steps (default: half the steps)",
    )
    g.add_argument(
        "--share-prefix",
        action="store_true",
        help="rollout_share_prefix: each group's ODE steps before its window run once, then branch "
        "(SD3, Qwen-Image; exact against a batch-1 prefix, not the unshared group's last bits: docs/api.md)",
    )
    g.add_argument(
        "--branch",
        type=branch_spec,
        default=None,
        help="rollout_branch: grow each group as a tree, STEP:FACTOR,... (e.g. 1:2,3:4 makes 8 leaves, "
        "--group-size must be their number); the branch steps are the stochastic ones",
    )
    g.add_argument(
        "--outside-window-stride",
        type=int,
        default=1,
        help="rollout_outside_window_stride: outside the window keep every k-th sigma (fewer ODE steps)",
    )
    g.add_argument(
        "--ode-solver",
        choices=["euler", "dpm2m"],
        default="euler",
        help="rollout_ode_solver for the steps outside the window (dpm2m: DPM-Solver++(2M))",
    )
    g.add_argument(
        "--screen",
        type=int,
        default=0,
        help="screen K candidates per group cheaply, then regenerate the group's --group-size of them "
        "exactly (half the highest rewards, half the lowest) and train on those (0: off)",
    )
    g.add_argument(
        "--screen-cache",
        choices=["taylorseer", "first_block", "mag", "none"],
        default="taylorseer",
        help="the screen's feature_cache on the same server (inexact, never trained on); none: full cost",
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
        "--full-finetune",
        action="store_true",
        help="train every weight of the denoiser instead of a LoRA: sharded with FSDP2 over the "
        "torchrun ranks (float32 master, served-dtype compute), full weights synced to every replica "
        "after each step (not with --layout in-process, --kl-beta or --checkpoint)",
    )
    g.add_argument(
        "--weight-sync",
        choices=["auto", "broadcast", "http"],
        default="auto",
        help="--full-finetune: broadcast (NCCL group with the replicas, servers on this host) or http "
        "(push_weights, any host); auto: broadcast for a server subprocess started here, else http",
    )
    g.add_argument(
        "--recompute-old-log-probs",
        action="store_true",
        help="treat every batch as off-policy: the clipped ratio is taken against the trainer's own "
        "recomputed log-probs and weighted by the truncated importance weight to the server's; for "
        "rollouts from an inexact server (the fast tier: --server-args='--quantize fp8 --compile')",
    )
    args = parse_with_config(p, argv)
    if args.full_finetune:
        for bad, why in ((args.layout == "in-process", "--layout in-process"), (args.kl_beta > 0, "--kl-beta"),
                         (args.checkpoint, "--checkpoint")):  # fmt: skip
            if bad:
                p.error(f"--full-finetune does not support {why} yet")
    return args


def branch_spec(text: str) -> list[dict[str, int]]:
    """``--branch 1:2,3:4`` as ``rollout_branch``'s points."""
    try:
        points = [tuple(int(x) for x in part.split(":")) for part in text.split(",") if part.strip()]
        if not points or any(len(p) != 2 for p in points):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected STEP:FACTOR,... (e.g. 1:2,3:4), got {text!r}") from None
    return [{"step": s, "factor": f} for s, f in points]


def sde_window(args: argparse.Namespace, iteration: int) -> list[int] | None:
    """This iteration's stochastic steps: a window drawn from a per-iteration seeded RNG (with
    --branch, the branch steps)."""
    if args.branch:
        return [p["step"] for p in args.branch]
    if args.sde_window <= 0:
        return None
    # The last step ends at sigma 0 and has no density in the gaussian form: never in the window.
    upper = min(args.sde_window_range or max(args.steps // 2, args.sde_window), args.steps - 1)
    start = random.Random(args.seed * 100_003 + iteration).randint(0, max(upper - args.sde_window, 0))
    return list(range(start, min(start + args.sde_window, args.steps - 1)))


def at(adv: Any, step: int) -> torch.Tensor:
    """A batch's advantages at ``step``: one ``[G]`` for every step, or a tree's ``{step: [G]}``."""
    return adv[step] if isinstance(adv, dict) else adv


def train_iteration(
    transformer, optimizer, params, groups, advantages, args, staleness=None, ranks: Ranks | None = None
) -> dict[str, Any]:
    """``staleness`` (``--async-depth``; None: synchronous) is recorded with the first-step ratio
    statistics; > 0: the rollouts came from older weights (``--async-depth``); the loss is then
    the clipped ratio against the trainer's own policy, weighted by the truncated importance weight
    to the server's (behaviour) log-probs.

    Under torchrun each rank replays its own ``groups``; every loss term is divided by the number of
    terms of the whole iteration and the gradients are summed over the ranks (the LoRA's in one
    all-reduce, FSDP2's in its reduce-scatter), so the step is the 1-rank step. The statistics are
    those of every rank's replays (the same on every rank)."""
    ranks = ranks or Ranks()
    batches = [ReplayBatch(group) for group in groups]
    # Other trainers built on this function (ray_colocated.py) have no such flag.
    tis = bool(staleness or getattr(args, "recompute_old_log_probs", False))
    local_terms = sum(len(b.trainable_steps()) for b in batches)
    n_terms = ranks.sum(local_terms)
    sharded = hasattr(transformer, "set_requires_gradient_sync")  # FSDP2 (--full-finetune)
    # FSDP2 averages the gradients over the ranks (gloo has no pre-scaled sum): scale up to a sum.
    divisor = n_terms / ranks.world if sharded else n_terms
    first_dev, ratios, clip_fracs, losses, kls, first = 0.0, [], [], [], [], []
    optimizer_s = 0.0  # the gradient all-reduce, clipping and the optimizer step: the rest is replay
    proximal: dict[tuple[int, int], torch.Tensor] = {}
    for epoch in range(args.inner_epochs):
        optimizer.zero_grad(set_to_none=True)
        done = 0
        for batch, adv in zip(batches, advantages, strict=True):
            for t in batch.trainable_steps():
                done += 1
                if sharded:  # reduce-scatter the gradients once per pass, with its last backward
                    transformer.set_requires_gradient_sync(done == local_terms)
                step = replay_step(transformer, batch, t)
                if tis:
                    if epoch == 0:  # the trainer's policy before this update, per (batch, step)
                        proximal[(id(batch), t)] = step.log_prob.detach()
                    loss, stats = tis_policy_loss(
                        step.log_prob, proximal[(id(batch), t)], step.old_log_prob, at(adv, t),
                        clip_range=args.clip_range, tis_cap=args.tis_cap, adv_clip_max=args.adv_clip_max,
                    )  # fmt: skip
                else:
                    loss, stats = clipped_policy_loss(
                        step.log_prob, step.old_log_prob, at(adv, t),
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
                (loss / divisor).backward()  # one step's graph at a time
                if epoch == 0:
                    first_dev = max(first_dev, float((step.ratio.detach() - 1).abs().max()))
                    first.append((staleness, step.ratio.detach().float().cpu()))
                ratios.append(step.ratio.detach().float().cpu())
                clip_fracs.append(stats["clip_frac"])
                losses.append(float(loss.detach()))
        t_opt = _synced_clock(params)
        if not sharded:
            ranks.all_reduce_grads(params)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer_s += _synced_clock(params) - t_opt
    # Every rank's replays, in rank order (one rank: its own).
    parts = ranks.gather(
        {"first_dev": first_dev, "ratios": torch.cat(ratios), "clip_fracs": clip_fracs, "losses": losses,
         "kls": kls, "first": first}
    )  # fmt: skip
    r = torch.cat([q["ratios"] for q in parts])
    clip_fracs = [c for q in parts for c in q["clip_fracs"]]
    losses = [x for q in parts for x in q["losses"]]
    kls = [x for q in parts for x in q["kls"]]
    first = [f for q in parts for f in q["first"]]
    by_staleness = ratio_stats_by_staleness(first) if staleness is not None else None
    return {
        "first_ratio_max_dev": max(q["first_dev"] for q in parts),
        **({"first_ratio_max_dev_per_rank": [q["first_dev"] for q in parts]} if ranks.active else {}),
        "ratio_mean": float(r.mean()),
        "ratio_min": float(r.min()),
        "ratio_max": float(r.max()),
        "clip_frac": sum(clip_fracs) / len(clip_fracs),
        "loss": sum(losses) / len(losses),
        "optimizer_s": round(optimizer_s, 4),
        # Whether the loss was TIS-weighted against the trainer's own recomputed log-probs.
        "tis_weighted": tis,
        **({"kl": sum(kls) / len(kls)} if kls else {}),
        **({"staleness": staleness, "ratio_by_staleness": by_staleness} if by_staleness is not None else {}),
    }


def _synced_clock(params) -> float:
    """``perf_counter`` once the device of ``params`` has finished its queued work."""
    device = params[0].device if params else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def prompt_set(name: str) -> list[str]:
    """``--prompt-set``'s prompts."""
    if name == "ocr":
        from rewards import OCR_PROMPTS

        return list(OCR_PROMPTS)
    return list(PROMPTS)


def guidance_record(output) -> dict[str, Any] | None:
    """The guidance the replay applied (the rule and its scale), from the rollout's conditioning."""
    guidance = (output.denoising_env or {}).get("guidance")
    if not guidance:
        return None
    return {k: v for k, v in guidance.items() if isinstance(v, (str, int, float, bool)) or v is None}


def server_adapter_checksum(client: RolloutClient, name: str = "default") -> str | None:
    """The server's checksum of adapter ``name``; None where it holds none (a restarted server)."""
    listing = client.lora_list()["modules"].get("transformer", {})
    return listing.get("adapters", {}).get(name, {}).get("checksum")


def extremes(scores: torch.Tensor, keep: int) -> list[int]:
    """The ``keep`` candidates with the highest and lowest scores (the upper half rounded up), in
    candidate order: a group whose rewards spread wide gives its advantages the most to say."""
    order = scores.argsort(descending=True).tolist()
    high = (keep + 1) // 2
    return sorted(order[:high] + order[len(order) - (keep - high) :] if keep > high else order[:high])


def screened_groups(
    client: RolloutClient, jobs: list[dict[str, Any]], shared: dict[str, Any], args: argparse.Namespace,
    reward_fn: Any, phases: Any,
) -> list[list[Any]]:  # fmt: skip
    """Screen then regenerate (Sol-RL's idea): ``--screen`` candidates per group made cheaply
    (``--screen-cache``, no trajectory), scored, and the chosen ``--group-size`` regenerated exactly
    (``client.regenerate.regenerate_body``: the same x_T and step noise, exact numbers)."""
    from diffusion_rollout.client.regenerate import regenerate_body

    screen = {"num_outputs_per_prompt": args.screen, "rollout_return_dit_trajectory": False,
              "rollout_return_denoising_env": False, "rollout_return_step_indices": None}  # fmt: skip
    if args.screen_cache != "none":
        screen.update(feature_cache={"kind": args.screen_cache}, allow_inexact=True)
    bodies = [{**shared, **job, **screen} for job in jobs]
    with phases("screen"):
        candidates = client.generate_many(bodies)
        chosen = [extremes(reward_fn(c), args.group_size) for c in candidates]
    keep = {k: shared[k] for k in ("rollout_return_dit_trajectory", "rollout_return_denoising_env")}
    again = [
        regenerate_body(b, c, ch, rollout_return_step_indices=job.get("rollout_return_step_indices"), **keep)
        for b, c, ch, job in zip(bodies, candidates, chosen, jobs, strict=True)
    ]
    return client.generate_many(again)


def run(
    client: RolloutClient | None, model_path, args: argparse.Namespace, out_path: str | None,
    ranks: Ranks | None = None,
) -> dict:  # fmt: skip
    ranks = ranks or Ranks()
    device = trainer_device(args, ranks)
    dtype = trainer_dtype(args, device)
    torch.manual_seed(args.seed)
    in_process = client is None
    reward_fn = RecipeReward(args, client)
    if args.branch and (in_process or math.prod(p["factor"] for p in args.branch) != args.group_size):
        raise SystemExit(
            "--branch needs the server layout and --group-size equal to the product of its factors"
        )
    if args.screen and (in_process or args.async_depth > 0 or args.screen < args.group_size):
        raise SystemExit("--screen K needs the server layout, synchronous rollouts and K >= --group-size")
    full = None
    if args.full_finetune:
        # A thread server shares this process, where a second group of the same name cannot be made.
        near = not args.url and args.server != "thread"
        sync = args.weight_sync if args.weight_sync != "auto" else ("broadcast" if near else "http")
        full = FullFinetune(model_path, device, dtype, ranks, args.gradient_checkpointing, sync)
        transformer, params = full.transformer, full.params
    else:
        transformer = load_trainer_transformer(
            model_path, device=device, dtype=dtype, gradient_checkpointing=args.gradient_checkpointing
        )
        params = add_lora(
            transformer, args.lora_rank, dtype, alpha=args.lora_alpha, targets=args.lora_targets
        )
        ranks.broadcast_params(params)  # every rank starts from rank 0's adapter
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    checkpoint = Checkpoint(args.checkpoint)
    state = checkpoint.load(transformer, optimizer) or {"next_iteration": 0, "history": []}
    history: list[dict[str, Any]] = state["history"]
    sampler = in_process_sampler(model_path, transformer, device, args.group_size) if in_process else client
    version = f"iter-{state['next_iteration']}"

    def push(version: str) -> bool | None:
        """Rank 0 pushes the trainer's weights (every rank takes part in an FSDP2 gather); every rank
        leaves with rank 0's verdict, i.e. only once the server holds ``version``."""
        if in_process:
            return None
        if full is not None:  # (a send that fails mid-gather still finishes every rank's gathers: _full.py)
            return on_main(
                ranks, lambda: full.push(client, version), "push", others=lambda: full.push(None, version)
            )

        def lora() -> bool:
            result = push_lora(client, transformer, name="default", activate=True, weight_version=version)
            ok = lora_checksum(transformer, dtype=dtype) == server_adapter_checksum(client)
            return ok and result.weight_version == version

        return on_main(ranks, lora, "push")

    def holds(version: str) -> bool:
        """Rank 0: whether the server still holds the trainer's weights at ``version`` (full
        weights: never assumed; re-pushing the same weights is harmless)."""
        if full is not None:
            return False
        return server_holds_lora(
            client, version, {"default": lora_checksum(transformer, dtype=dtype)}, "default"
        )

    # A lost server (restarted, unreachable, answering late) is waited for, re-pushed and verified,
    # and the iteration's rollouts redone (_recovery.py); every recovery is in the run record.
    recovery = Recovery(client, ranks, timeout_s=args.recover_timeout)
    recovery.restore(state)
    # lora_B starts at zero: the adapter changes nothing yet, so the first rollouts sample the base
    # policy with the adapter's structure in place, and later pushes reload it in place. Full
    # weights: the server already holds them; the push names the version and verifies the bytes.
    if not in_process:
        recovery.push(state["next_iteration"], version, push, holds)
    width, height = image_size(args)
    run_record: dict[str, Any] = {
        "recipe": "flow_grpo", "layout": "in-process" if in_process else "server",
        "ranks": ranks.world, "trainable": "full" if full is not None else "lora",
        # Where everything ran: every rank's device, and the GPUs of a server started here.
        "trainer_devices": ranks.gather(str(device)), "server_gpus": None if in_process else args.server_gpu,
        "args": vars(args), "environment": environment(), "history": history,
    }  # fmt: skip
    shared = dict(
        num_outputs_per_prompt=args.group_size, num_inference_steps=args.steps,
        width=width, height=height, num_frames=args.frames, guidance_scale=args.guidance_scale,
        rollout_sde_type=args.step_kind, rollout_noise_level=args.noise_level,
        rollout_return_dit_trajectory=True, rollout_return_denoising_env=True, rollout_debug_mode=False,
        output_dtype="uint8", generator_device="cuda" if device.type == "cuda" else "cpu",
    )  # fmt: skip
    # Sent only when set, so the families that take no such field are asked exactly as before.
    shared.update({k: v for k, v in (("true_cfg_scale", args.true_cfg_scale), ("negative_prompt", args.negative_prompt),
                                     ("max_sequence_length", args.max_sequence_length)) if v is not None})  # fmt: skip
    if args.share_prefix:
        shared["rollout_share_prefix"] = True
    if args.branch:  # a tree per group: its leaves are the group (server/core/branch_tree.py)
        shared["rollout_branch"] = args.branch
    if args.outside_window_stride != 1 or args.ode_solver != "euler":  # fewer, cheaper ODE steps
        shared.update(
            rollout_outside_window_stride=args.outside_window_stride, rollout_ode_solver=args.ode_solver
        )
    shared.update(reward_fn.request_fields())  # --reward-on server: the server scores, no pixels travel
    prompts = prompt_set(args.prompt_set)

    def iteration_jobs(it: int) -> list[dict[str, Any]]:
        """This rank's groups of iteration ``it``: its block of the iteration's ``--prompts`` groups,
        each seeded by its index in the whole iteration (so N ranks make the 1-rank batch)."""
        window = sde_window(args, it)
        jobs = []
        for k in range(args.prompts):
            seed = (it * args.prompts + k) * 1000 + args.seed * 10_000_000
            # One x_T per group (Flow-GRPO-Fast): samples of a group differ only by the noise of the
            # steps being trained, which sharpens the credit assignment.
            jobs.append({"prompt": prompts[(it * args.prompts + k) % len(prompts)], "seed": seed,
                         "initial_noise_seed": seed + 999, "rollout_sde_step_indices": window,
                         # Replay needs the latents entering and leaving each stochastic step, nothing else.
                         "rollout_return_step_indices":
                             None if window is None else sorted({*window, *(s + 1 for s in window)})})  # fmt: skip
        return ranks.share(jobs)

    def open_stream(first_it: int):
        """Iteration it + k is sent while the trainer trains on iteration it (k = --async-depth)."""
        opened = client.rollout_stream(
            lambda i: iteration_jobs(first_it + i), max_staleness=args.async_depth, on_stale="regenerate",
            max_batches=args.iterations - first_it, **shared,
        )  # fmt: skip
        opened.pushed(version)
        return opened

    def next_batch(it: int):
        """The stream's next batch. A lost server fails the stream: every rank recovers, then opens
        a new stream from iteration ``it`` (its first batch made under the re-pushed version)."""

        def reopen() -> None:
            nonlocal stream
            stream.close()
            stream = open_stream(it)

        # Staleness, not the version, is the stream's rule (stale batches are trained with TIS).
        return recovery.rollouts(
            it, version, lambda: next(stream), push, holds, expect_version=False, reset=reopen
        )

    stream = open_stream(state["next_iteration"]) if args.async_depth > 0 and not in_process else None
    # Rank 0's progress line per iteration, and --log-to's scalars and images.
    report = Report(args, "flow_grpo", "first_ratio_max_dev", enabled=ranks.is_main)
    # Closing the stream aborts what is in flight.
    with contextlib.ExitStack() as closing, report:
        closing.callback(lambda: stream is not None and stream.close())
        if in_process and hasattr(sampler, "close"):
            closing.callback(sampler.close)  # the engine sampler's engine and loopback port
        for it in range(state["next_iteration"], args.iterations):
            phases = Phases(device)
            t_iter = time.perf_counter()
            staleness, server_span, regenerated = None, None, False
            # Answer bytes received this iteration (with --async-depth: whatever arrived meanwhile).
            received = 0 if in_process else client.received_answer_bytes
            with phases("rollout"):
                if stream is not None:
                    batch = next_batch(it)
                    groups, staleness = batch.outputs, batch.staleness
                    server_span = [clock(batch.sent_at), clock(batch.answered_at)]
                    # One version per iteration on every rank: where the ranks' batches disagree
                    # (a push landed between their requests), the older ones are made again now,
                    # under the version every rank holds.
                    if len(set(ranks.gather(staleness))) > 1 and staleness != 0:
                        groups, staleness, regenerated = (
                            client.generate_many(iteration_jobs(it), **shared),
                            0,
                            True,
                        )
                elif in_process:
                    groups = sampler.generate_many(iteration_jobs(it), **shared)
                else:  # only a batch made under the pushed version is trained on
                    make = (
                        (
                            lambda i=it, ph=phases: screened_groups(
                                client, iteration_jobs(i), shared, args, reward_fn, ph
                            )
                        )
                        if args.screen
                        else (lambda i=it: client.generate_many(iteration_jobs(i), **shared))
                    )
                    groups = recovery.rollouts(it, version, make, push, holds)
            outputs = [o for g in groups for o in g]
            versions = {o.weight_version for o in outputs}
            if stream is not None and len(versions) != 1:
                raise RuntimeError(f"a batch mixed versions {versions}")
            # A regenerated batch is trained as on-policy (no TIS): it must come from the version pushed.
            if (stream is None or regenerated) and not in_process and versions != {version}:
                raise RuntimeError(f"rollouts came from {versions}, expected {version!r}")
            if args.release_memory and not in_process:
                # Before the reward: a reward model on the trainer's GPU (the OCR judge) needs the
                # replica's memory as much as the replay does. Every rank waits for the release: the
                # replicas on the other ranks' GPUs are released by rank 0's one call.
                with phases("release"):
                    if ranks.is_main:
                        client.release_memory_occupation()
                    ranks.barrier()
            with phases("reward"):
                rewards = reward_fn(outputs)
                adv = group_advantages(rewards, args.group_size).view(len(groups), args.group_size)
                seen = ranks.gather(
                    {"rewards": rewards, "advantages": adv, "version": versions.pop(), "regenerated": regenerated,
                     "server_peak": server_peak_gb(outputs),
                     "answer_bytes": 0 if in_process else client.received_answer_bytes - received}
                )  # fmt: skip
            with phases("train"):
                # Trees: BranchGRPO's advantage per branch step, its nodes' mean rewards normalised by depth.
                per_step = (
                    [
                        tree_advantages(r, [(b["step"], b["factor"]) for b in args.branch])
                        for r in rewards.view(adv.shape)
                    ]
                    if args.branch
                    else adv
                )
                stats = train_iteration(
                    transformer, optimizer, params, groups, per_step, args, staleness, ranks
                )
            if args.release_memory and not in_process and ranks.is_main:
                with phases("resume"):
                    client.resume_memory_occupation()
            version = f"iter-{it + 1}"
            with phases("push"):
                checksum_ok = None if in_process else recovery.push(it, version, push, holds)
            if stream is not None:
                stream.pushed(version)
            per_rank = ranks.gather(phases.record())
            extra: dict[str, Any] = {}
            if ranks.active:
                extra = {
                    "rank_weight_versions": [q["version"] for q in seen],
                    "regenerated_ranks": [r for r, q in enumerate(seen) if q["regenerated"]],
                    "rank_seconds": [{k: v for k, v in q.items() if k.endswith("_s")} for q in per_rank],
                    "rank_peak_gb": [q.get("trainer_peak_gb") for q in per_rank],
                    "rank_device_used_max_gb": [q.get("device_used_max_gb") for q in per_rank],
                }
            all_rewards = torch.cat([q["rewards"] for q in seen])
            record = iteration_record(
                it, version, all_rewards, outputs, phases, t_iter,
                sde_steps=outputs[0].sde_step_indices, **stats, checksum_ok=checksum_ok,
                **({"shared_prefix_steps": outputs[0].extra.get("shared_prefix_steps")} if args.share_prefix else {}),
                guidance=guidance_record(outputs[0]), answer_bytes=sum(q["answer_bytes"] for q in seen),
                advantages=[float(a) for q in seen for a in q["advantages"].flatten()],
                **({"server_span": server_span} if server_span else {}), **extra,
                images=len(all_rewards), server_peak=max((q["server_peak"] for q in seen if q["server_peak"] is not None), default=None),
            )  # fmt: skip
            record["recovered"] = [e["cause"] for e in recovery.events if e["iteration"] == it]
            history.append(record)
            report.iteration(record, outputs)
            if ranks.is_main:
                if full is not None:
                    run_record["full_sync"] = full.record()
                where = "server_reward" if reward_fn.on_server else "trainer_reward"
                run_record[where] = reward_fn.record(client)
                run_record["summary"] = summarize(history, "first_ratio_max_dev")
                run_record.update(recovery.record())
                write_run(out_path, run_record)
                checkpoint.save(
                    transformer, optimizer, ["default"],
                    {"next_iteration": it + 1, "history": history, **recovery.state()},
                )  # fmt: skip
    if full is not None:
        run_record["full_sync"] = full.record()
        full.close()
    if not in_process and full is None:
        # The server may have been lost after the last push: waited for and re-pushed like any other
        # loss, or the record says why its checksum could not be read (_recovery.py).
        final = recovery.final(
            args.iterations,
            version,
            push,
            holds,
            lambda: {"server_adapter_checksum": server_adapter_checksum(client)},
        )
        run_record["final_adapter_checksum"] = lora_checksum(transformer, dtype=dtype)
        run_record.update(final)
    run_record["summary"] = summarize(history, "first_ratio_max_dev")
    run_record.update(recovery.record())
    if ranks.is_main:
        write_run(out_path, run_record)
    return run_record


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise here
    t0 = time.perf_counter()
    ranks = Ranks.from_env(always_group=args.full_finetune)
    finished = False
    try:
        trainer_device(args, ranks)  # binds this rank's GPU before the first collective
        with rollout_server(args, ranks=ranks) as server:
            if server.url is None:
                record = run(None, server.model_path, args, args.out, ranks)
            else:
                with RolloutClient(
                    server.url,
                    admin_key=server.admin_key,
                    max_concurrency=args.prompts,
                    **client_timeout(args),
                ) as client:
                    wait_ready(client, args.recover_timeout)
                    record = run(client, server.model_path, args, args.out, ranks)
        finished = True
    finally:
        ranks.close(finished=finished)
    record["wall_s"] = round(time.perf_counter() - t0, 2)
    if ranks.is_main:
        write_run(args.out, record)
        print(json.dumps(record["summary"]), flush=True)
    return record


if __name__ == "__main__":
    main()
    sys.exit(0)
