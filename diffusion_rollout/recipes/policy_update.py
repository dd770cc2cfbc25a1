"""Flow-GRPO's update on one batch of rollouts: replay, the clipped ratio loss, one optimizer step
per inner epoch, and the ratio statistics that prove the first pass on-policy.

:func:`train_iteration` is the trainer half of the recipe, shared by every layout (server,
in-process, a Ray-colocated trainer) and by every number of ranks.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from diffusion_rollout.client import (
    ReplayBatch,
    clipped_policy_loss,
    gaussian_kl,
    ratio_stats_by_staleness,
    replay_step,
    tis_policy_loss,
)
from diffusion_rollout.recipes.ranks import Ranks


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
