"""The command line every recipe shares: where rollouts come from, the trainer's device, the run's
size, the adapter and the reporting options, and the prompts a run cycles through.

One parser for every recipe (``base_parser``), so the same option means the same thing in each; a
recipe adds its own group to it. ``--config run.yaml`` gives any option from a file, the command line
overriding it (:func:`~diffusion_rollout.recipes.config_file.parse_with_config`).
"""

from __future__ import annotations

import argparse

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
