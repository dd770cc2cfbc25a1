"""verl-omni's Qwen-Image step through the recipe: the per-phase split, MFU and the bound they imply.

    python -m benchmarks.investigations.peer_bound RUN.json [--gpus 4] [--text-tokens 32] [--out report.json]

Reads a Flow-GRPO run record (``examples/flow_grpo.py --out``, e.g. ``train_recipes
peer-qwen-image-lora``) and reports, over the iterations after the first:

- seconds per step and per phase (rollout, reward, replay, optimizer, sync = the push and its
  verification, release + resume where the server gave its memory back while the trainer trained);
- images per GPU-second, beside verl-omni's published figures (its ``docs/algo/performance.md``: LoRA
  420 s per 512-image step on 4 H800s, full parameters without CFG 250 s on 4 H200s);
- each phase's model FLOP utilisation against an H200's dense bf16 peak (``PEAK_TFLOPS``), from the
  Qwen-Image transformer's matmul count (``transformer_tflops``);
- the bound: the step if every phase ran back to back at its measured rate with nothing else, and what
  each lever that is not yet on would take off it.

FLOP model (forward, one row = one image in one CFG branch): each token passes its own stream's
projections (q, k, v, out: 4 d^2) and MLP (2 d f), 2 FLOPs per multiply-add; attention is
2 * 2 * L^2 * d over the joint sequence L = image + text tokens; the per-sample modulation linears are
negligible. Replay is a forward, a backward through the activations (about 2 forwards; the LoRA's own
weight gradients are small) and, with activation checkpointing, one more forward: 4 forwards per row.
A row's text tokens are the prompt's (Qwen-Image drops its template's 34 tokens and pads to the longest
prompt of a batch), ``--text-tokens`` on average, not ``max_sequence_length``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# QwenImageTransformer2DModel's defaults (Qwen/Qwen-Image's transformer config).
QWEN_IMAGE = {"layers": 60, "hidden": 3072, "mlp": 12288, "patch": 16}
PEAK_TFLOPS = 790.0  # an H200's dense bf16 matmul peak, as the device notes give it
VERL_OMNI = {
    "lora": {"seconds": 420.0, "gpus": 4, "hardware": "4x H800", "images": 512},
    "full": {"seconds": 250.0, "gpus": 4, "hardware": "4x H200", "images": 512},
}


def transformer_tflops(image_tokens: int, text_tokens: int, model: Mapping[str, int] = QWEN_IMAGE) -> float:
    """TFLOPs of one forward of one row (one image, one CFG branch)."""
    d, f, n = model["hidden"], model["mlp"], model["layers"]
    tokens = image_tokens + text_tokens
    linear = 2 * tokens * (4 * d * d + 2 * d * f)
    attention = 2 * 2 * tokens * tokens * d
    return n * (linear + attention) / 1e12


def _mean(history: Sequence[Mapping[str, Any]], key: str) -> float:
    values = [float(h[key]) for h in history if h.get(key) is not None]
    return statistics.fmean(values) if values else 0.0


def report(run: Mapping[str, Any], gpus: int, text_tokens: int) -> dict[str, Any]:
    history = run["history"]
    steady = history[1:] if len(history) > 1 else history
    args = run["args"]
    size = int(args.get("size") or 512)
    image_tokens = (size // QWEN_IMAGE["patch"]) ** 2
    cfg = 2 if args.get("true_cfg_scale") and args.get("negative_prompt") is not None else 1
    images = int(steady[0]["images"])
    window = int(args.get("sde_window") or args.get("steps"))
    row = transformer_tflops(image_tokens, text_tokens)
    phases = {
        "rollout": _mean(steady, "rollout_s"),
        "reward": _mean(steady, "reward_s"),
        "replay": _mean(steady, "train_s") - _mean(steady, "optimizer_s"),
        "optimizer": _mean(steady, "optimizer_s"),
        "sync": _mean(steady, "push_s"),
        "release_resume": _mean(steady, "release_s") + _mean(steady, "resume_s"),
    }
    step = _mean(steady, "iteration_s")
    work = {  # TFLOPs each phase did over all GPUs
        "rollout": images * int(args["steps"]) * cfg * row,
        "replay": images * window * cfg * 4 * row,
    }
    mfu = {k: round(work[k] / (phases[k] * gpus * PEAK_TFLOPS), 4) for k in work if phases[k] > 0}
    bound = sum(phases.values())
    trainable = run.get("trainable", "lora")
    peer = VERL_OMNI["full" if trainable == "full" else "lora"]
    return {
        "iterations_measured": [h["iteration"] for h in steady],
        "seconds_per_step": round(step, 2),
        "seconds_per_step_each": [round(float(h["iteration_s"]), 2) for h in steady],
        "images_per_step": images,
        "images_per_gpu_second": round(images / (step * gpus), 4),
        "phases_s": {k: round(v, 2) for k, v in phases.items()},
        "mfu": mfu,
        "flop_model": {
            "image_tokens": image_tokens,
            "text_tokens": text_tokens,
            "cfg_branches": cfg,
            "tflops_per_row_forward": round(row, 3),
        },
        "bound_s": round(bound, 2),
        "unaccounted_s": round(step - bound, 2),
        "levers_s": {  # what each lever not used in this run would take off the bound, at these rates
            "rollout_at_2x (fast tier)": round(phases["rollout"] / 2, 2),
            "shared_ode_prefix (23% of the rollout on average for this window)": round(
                0.23 * phases["rollout"], 2
            ),
        },
        "peak_gb": {
            "trainer_per_rank": run["history"][-1].get("rank_peak_gb")
            or [run["summary"].get("trainer_peak_gb")],
            "device_used_max_per_rank": run["history"][-1].get("rank_device_used_max_gb")
            or [run["summary"].get("device_used_max_gb")],
            "server": run["summary"].get("server_peak_gb"),
        },
        "peer": {
            **peer,
            "images_per_gpu_second": round(peer["images"] / (peer["seconds"] * peer["gpus"]), 4),
            "ratio_ours_to_peer": round(step / peer["seconds"], 4),
        },
        "first_ratio_max_dev": run["summary"].get("first_ratio_max_dev"),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--text-tokens", type=int, default=32, help="mean prompt tokens per row")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    result = report(json.loads(args.run.read_text()), args.gpus, args.text_tokens)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
