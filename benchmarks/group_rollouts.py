"""Group rollouts that share work: one Flow-GRPO group's seconds with each option, side by side.

One CLI server (``serve`` on GPU 0, or on the CPU with ``--cpu``), a saved real architecture, one
group request at a time, the options interleaved over ``--reps`` rounds (the same seeds in every
variant, so their images differ only by what the option changes):

- ``plain``: the group as today (x_T shared, an SDE window of 2 at ``--window-start``);
- ``share_prefix``: ``rollout_share_prefix``, against the formula's share of transformer calls saved,
  ``(k/T)(G-1)/G`` for a window at step k of T;
- ``stride2`` / ``stride2_dpm2m`` / ``dpm2m``: fewer or second-order ODE steps outside the window,
  with their drift against ``plain``'s images (mean and max absolute uint8 difference, PSNR);
- ``tree``: ``rollout_branch`` at the window's two steps (G = f1 x f2 leaves), seconds per leaf as
  ``seconds / G`` beside plain's;
- ``screen`` (with ``--screen K``): K candidates from a second server (``--screen-args``, by
  default the fast tier ``--speed fast`` on the same GPU; on the CPU the same exact server), the best
  ``G`` by a cheap reward regenerated on the exact server (``client.regenerate.regenerate_body``):
  seconds per kept sample.

    python -m benchmarks.group_rollouts --model sd3.5-medium --group 16 --size 512 --steps 10 --out $OUT
    python -m benchmarks.group_rollouts --cpu --out DIR          # the CPU dry run (tiny SD3)
    python -m benchmarks.group_rollouts --model qwen-image --window-start 2 --guidance-scale 1 \
        --true-cfg-scale 4 --negative-prompt " " --max-sequence-length 256 --out $OUT   # verl-omni's settings

Each variant's seconds are the whole request as a trainer waits for it (trajectory, env and
log-probs, uint8 images, decoded). The JSON (``group_rollouts.json``) is written after every round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.report import document, print_table, write_json
from benchmarks.train_recipes import model_folder
from diffusion_rollout.testing import free_port, start_cli_server, stop_session

VARIANTS = {
    "plain": {},
    "share_prefix": {"rollout_share_prefix": True},
    "stride2": {"rollout_outside_window_stride": 2},
    "stride2_dpm2m": {"rollout_outside_window_stride": 2, "rollout_ode_solver": "dpm2m"},
    "dpm2m": {"rollout_ode_solver": "dpm2m"},
    "tree": None,  # rollout_branch at the window's two steps, the group as f1 x f2 leaves (tree_fields)
}
COLUMNS = [
    ("variant", "variant", ""),
    ("seconds", "s (median)", ".3f"),
    ("spread", "spread", ".3f"),
    ("seconds_per_output", "s/output", ".4f"),
    ("vs_plain", "vs plain", ".3f"),
    ("formula_vs_plain", "formula", ".3f"),
    ("steps_run", "steps", ""),
    ("drift_mean", "drift mean", ".2f"),
    ("drift_max", "drift max", ".0f"),
    ("psnr_db", "PSNR dB", ".1f"),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: sd3.5-medium on a GPU, tiny-sd3 with --cpu")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--group", type=int, default=None, help="outputs per group (default 16; CPU 4)")
    p.add_argument("--size", type=int, default=None, help="width and height (default 512; CPU 32)")
    p.add_argument("--steps", type=int, default=None, help="num_inference_steps (default 10; CPU 6)")
    p.add_argument("--window-start", type=int, default=None, help="the window's first step (default T/2)")
    p.add_argument("--guidance-scale", type=float, default=4.5)
    # Qwen-Image's true CFG at verl-omni's settings: --true-cfg-scale 4 --negative-prompt " "
    p.add_argument("--true-cfg-scale", type=float, default=None)
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--max-sequence-length", type=int, default=None)
    p.add_argument("--reps", type=int, default=None, help="rounds of every variant (default 5; CPU 1)")
    p.add_argument("--screen", type=int, default=0, help="K candidates screened per kept group (0: off)")
    p.add_argument("--screen-args", default="--speed fast", help="the screening server's serve options")
    p.add_argument(
        "--screen-cache", default=None, choices=["taylorseer", "first_block", "mag"],
        help="screen on the exact server itself with this inexact feature_cache (the recipe's --screen-cache) "
        "instead of a second --screen-args server: one copy of the model, as a 20B model on one GPU needs",
    )  # fmt: skip
    p.add_argument(
        "--server-args", default="",
        help="the exact server's extra serve options (--screen-cache needs --pipeline-lanes 1 on CUDA)",
    )
    p.add_argument(
        "--variants", default=",".join(VARIANTS),
        help="comma-separated variants timed each round (plain always runs: it is the drift reference)",
    )  # fmt: skip
    p.add_argument("--work", type=Path, default=Path("/tmp/train_recipes"), help="saved models")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cpu = args.cpu
    args.model = args.model or ("tiny-sd3" if cpu else "sd3.5-medium")
    args.group = args.group or (4 if cpu else 16)
    args.size = args.size or (32 if cpu else 512)
    args.steps = args.steps or (6 if cpu else 10)
    args.reps = args.reps or (1 if cpu else 5)
    args.window_start = args.steps // 2 if args.window_start is None else args.window_start
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; choose from {list(VARIANTS)}")
    args.variants = ["plain", *[v for v in VARIANTS if v != "plain" and v in args.variants.split(",")]]
    return args


def serve(folder: Path, args: argparse.Namespace, extra: list[str], log: Path) -> tuple[Any, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "diffusion_rollout.entrypoints.cli", "serve", "--model", str(folder),
           "--host", "127.0.0.1", "--port", str(port), "--max-batch-size", str(max(args.group, args.screen)),
           "--request-timeout-s", "3600", *(["--device", "cpu", "--dtype", "float32"] if args.cpu else []),
           *extra]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    return start_cli_server(cmd, log, url, 3600, new_session=True), url


def group_body(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    k = args.window_start
    return {
        "prompt": "a photo of a lighthouse on a cliff at dusk", "seed": seed, "initial_noise_seed": seed + 7,
        "num_outputs_per_prompt": args.group, "width": args.size, "height": args.size,
        "num_inference_steps": args.steps, "guidance_scale": args.guidance_scale,
        "rollout_sde_step_indices": [k, k + 1], "rollout_return_dit_trajectory": True,
        "rollout_return_denoising_env": True, "rollout_debug_mode": False, "output_dtype": "uint8",
        "generator_device": "cpu" if args.cpu else "cuda", "lean_response": True,
        # Sent only when set: SD3 takes no such fields.
        **{k: v for k, v in (("true_cfg_scale", args.true_cfg_scale), ("negative_prompt", args.negative_prompt),
                             ("max_sequence_length", args.max_sequence_length)) if v is not None},
    }  # fmt: skip


def tree_fields(args: argparse.Namespace) -> dict[str, Any]:
    """A BranchGRPO-style tree of ``--group`` leaves branching at the window's two steps."""
    g, k = args.group, args.window_start
    f1 = max(d for d in range(1, int(g**0.5) + 1) if g % d == 0)
    points = [{"step": k, "factor": g // f1}] + ([{"step": k + 1, "factor": f1}] if f1 > 1 else [])
    return {"rollout_branch": points}


def post(client: Any, body: dict[str, Any]) -> tuple[list[Any], float]:
    t0 = time.perf_counter()
    outs = client.generate(**body)
    return outs, time.perf_counter() - t0


def drift(images: Any, reference: Any) -> dict[str, float]:
    import torch

    d = (images.float() - reference.float()).abs()
    mse = float((d**2).mean())
    return {
        "drift_mean": float(d.mean()),
        "drift_max": float(d.max()),
        "psnr_db": float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(255.0**2 / mse)).item(),
    }


def screen_round(exact: Any, screener: Any, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """K candidates screened, the brightest ``G`` (a cheap stand-in reward) regenerated exactly."""
    import torch

    from diffusion_rollout.client.regenerate import regenerate_body

    body = {**group_body(args, seed), "num_outputs_per_prompt": args.screen}
    cache = {"feature_cache": {"kind": args.screen_cache}, "allow_inexact": True} if args.screen_cache else {}
    cands, t_screen = post(screener, {**body, **cache})
    score = torch.stack([o.generated_output.float().mean() for o in cands])
    chosen = sorted(score.argsort(descending=True)[: args.group].tolist())
    _, t_regen = post(exact, regenerate_body(body, cands, chosen))
    return {
        "screen_s": t_screen,
        "regenerate_s": t_regen,
        "seconds_per_kept": (t_screen + t_regen) / len(chosen),
    }


def main(argv: list[str] | None = None) -> int:
    from diffusion_rollout.client import RolloutClient

    args = parse_args(argv)
    folder = model_folder(args.model, args.work)
    out = Path(args.out) if args.out else Path("/tmp/group_rollouts")
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        proc, url = serve(folder, args, args.server_args.split(), out / "server.log")
        procs.append(proc)
        screen_url = url
        if args.screen and not args.cpu and not args.screen_cache:
            proc2, screen_url = serve(folder, args, args.screen_args.split(), out / "screen_server.log")
            procs.append(proc2)
        times: dict[str, list[float]] = {v: [] for v in args.variants}
        drifts: dict[str, list[dict[str, float]]] = {v: [] for v in args.variants}
        steps_run: dict[str, int] = {}
        screens: list[dict[str, Any]] = []
        with RolloutClient(url, timeout=3600) as client, RolloutClient(screen_url, timeout=3600) as screener:
            post(client, {**group_body(args, 1), "num_outputs_per_prompt": 1})  # warm-up
            for rep in range(args.reps):
                seed = 1000 * (rep + 1)
                reference = None
                for variant in args.variants:  # interleaved: one of each per round
                    extra = VARIANTS[variant]
                    extra = tree_fields(args) if extra is None else extra
                    outs, seconds = post(client, {**group_body(args, seed), **extra})
                    times[variant].append(seconds)
                    steps_run[variant] = len(outs[0].rollout_log_probs)
                    images = __import__("torch").stack([o.generated_output for o in outs])
                    if variant == "plain":
                        reference = images
                    drifts[variant].append(drift(images, reference))
                if args.screen:
                    screens.append(screen_round(client, screener, args, seed))
                rows = summarize(args, times, drifts, steps_run)
                doc = document("group_rollouts", "cpu" if args.cpu else "cuda", vars(args) | {"work": str(args.work)},
                               rows, notes=[f"screen rounds: {screens}"] if screens else [])  # fmt: skip
                doc["screen"] = screens
                write_json(out, "group_rollouts", doc)
        print_table("group rollouts", rows, COLUMNS)
        for s in screens:
            print(f"screen {args.screen} -> keep {args.group}: {s}")
        return 0
    finally:
        for proc in procs:
            stop_session(proc)


def summarize(
    args: argparse.Namespace, times: dict[str, list[float]], drifts: dict[str, list[dict[str, float]]],
    steps_run: dict[str, int],
) -> list[dict[str, Any]]:  # fmt: skip
    plain = statistics.median(times["plain"])
    k, t, g = args.window_start, args.steps, args.group
    rows = []
    for variant, xs in times.items():
        if not xs:
            continue
        med = statistics.median(xs)
        last = drifts[variant][-1]
        rows.append({
            "variant": variant, "seconds": med, "seconds_per_output": med / g, "spread": max(xs) - min(xs),
            "vs_plain": med / plain,
            # share_prefix's transformer calls, as a share of plain's (the denoiser is most of a step).
            "formula_vs_plain": 1 - (k / t) * (g - 1) / g if variant == "share_prefix" else None,
            "steps_run": steps_run.get(variant), **last, "reps": len(xs), "all_seconds": xs,
        })  # fmt: skip
    return rows


if __name__ == "__main__":
    sys.exit(main())
