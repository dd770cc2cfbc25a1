"""Flow-GRPO's command line: the shared options (``base_parser``) plus the algorithm's own group.

DanceGRPO (``--step-kind dance``), trees (``--branch``), screening (``--screen``), asynchronous
rollouts (``--async-depth``) and full fine-tuning (``--full-finetune``) are options of the same
recipe; the combinations it does not support are refused here, before anything loads.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from diffusion_rollout.recipes.config_file import parse_with_config
from diffusion_rollout.recipes.options import base_parser

DESCRIPTION = "Flow-GRPO (and DanceGRPO) with a LoRA, rollouts from a diffusion-rollout server."


def parse_args(argv: Sequence[str] | None = None, description: str = DESCRIPTION) -> argparse.Namespace:
    p = base_parser(description)
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
