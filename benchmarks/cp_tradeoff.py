"""Two GPUs for video Flow-GRPO: 2 replicas x 1 GPU against 1 replica with context parallelism 2.

One command per model runs both layouts in turn on the same two-GPU machine and writes one JSON
(``cp_tradeoff_<model>.json``):

    python -m benchmarks.cp_tradeoff --model wan2.1-1.3b --group 8 --out $OUT
    python -m benchmarks.cp_tradeoff --model wan2.2-a14b --group 4 --out $OUT
    python -m benchmarks.cp_tradeoff --model tiny-wan --cpu --out DIR          # CPU dry run

The model is a real architecture with random weights saved as a diffusers folder
(``train_recipes.model_folder``: built on GPU 0 once, kept under ``--work``; Wan 2.2 A14B's two
experts are about 57 GB on disk), served by the CLI as a user runs it, in a process of its own:

- ``replicas``: ``diffusion-rollout serve --model DIR --replicas 2 --gpus-per-replica 1``
  (two Ray replicas, one GPU each; on the CPU ``--gpus-per-replica 0``).
- ``context_parallel``: ``diffusion-rollout serve --model DIR --context-parallel 2`` (one engine,
  rank 0 on GPU 0 and a follower on GPU 1, Ulysses attention; on the CPU the follower mirrors rank 0).

This process is the trainer's side. For each layout, after the server is ready: a warm-up (two
small requests at once: one video, one step, the measured size; every replica and both ranks run),
then **latency**: one Flow-GRPO group request alone, sent from here (seconds until its response is
decoded; the response is checked: ``group`` uint8 videos of the requested frames and size,
per-step log-probs, the trajectory and the denoising env), then **throughput**: ``--requests`` group
requests from ``--clients`` concurrent clients in another process (``RemoteClients``): videos/s =
requests x group / wall seconds. The request is the Flow-GRPO rollout (``bodies.SDE_ROLLOUT_ENV``:
SDE at noise level 0.7, log-probs, ``dit_trajectory``, ``denoising_env``) with ``output_dtype
uint8`` and the lean response form, at the model's defaults (480x832; 81 frames unless
``--frames``; ``--steps`` overrides the model's step count).

The summary gives both layouts' videos/s and latency and the ratios context_parallel / replicas
(throughput: below 1 means replicas serve more videos per second; latency: below 1 means the
context-parallel layout answers one request sooner). ``--layouts`` runs one of them only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bodies import GRPO_PROMPT, SDE_ROLLOUT_ENV
from benchmarks.common import free_port, stop_session
from benchmarks.train_recipes import model_folder

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ("replicas", "context_parallel")
COLUMNS = [  # (key, header, format)
    ("layout", "layout", ""),
    ("videos_per_s", "videos/s", ".4f"),
    ("latency_s", "latency s", ".2f"),
    ("throughput_s", "throughput s", ".2f"),
    ("ready_s", "start s", ".1f"),
    ("outputs_ok", "outputs ok", ""),
    ("error", "error", ""),
]


def serve_command(layout: str, folder: Path, port: int, cpu: bool, k: int = 2) -> list[str]:
    """The CLI command a user runs for ``layout`` (two replicas, or one replica over k ranks)."""
    cmd = [sys.executable, "-m", "diffusion_rollout.entrypoints.cli", "serve", "--model", str(folder),
           "--port", str(port), "--host", "127.0.0.1", "--request-timeout-s", "3600"]  # fmt: skip
    cmd += ["--device", "cpu", "--dtype", "float32"] if cpu else ["--dtype", "bfloat16"]
    if layout == "replicas":
        cmd += ["--replicas", str(k), "--gpus-per-replica", "0" if cpu else "1"]
    else:
        cmd += ["--context-parallel", str(k)]
    return cmd


def request_body(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The Flow-GRPO group request at the model's defaults (seed and prompt set per request)."""
    from benchmarks import model_builders_scale  # noqa: F401  (Wan 2.2 A14B's defaults)
    from benchmarks.cluster_scaling import request_defaults

    body = {"prompt": GRPO_PROMPT, "seed": 0, "generator_device": "cpu" if args.cpu else "cuda"}
    body.update(request_defaults(name), **SDE_ROLLOUT_ENV)
    body.update(output_dtype="uint8", lean_response=True, num_outputs_per_prompt=args.group)
    if args.frames:
        body["num_frames"] = args.frames
    if args.steps:
        body["num_inference_steps"] = args.steps
    return body


def check_outputs(results: list[dict[str, Any]], body: dict[str, Any]) -> dict[str, Any]:
    """What a Flow-GRPO trainer needs from one group response, checked: one uint8 video per output
    of the requested frames and size, per-step log-probs, the trajectory and the denoising env."""
    import torch

    n, steps = body["num_outputs_per_prompt"], body["num_inference_steps"]
    problems = []
    if len(results) != n:
        problems.append(f"{len(results)} outputs for a group of {n}")
    first = results[0] if results else {}
    video = first.get("generated_output")
    shape = list(video.shape) if isinstance(video, torch.Tensor) else None
    for i, r in enumerate(results):
        v, lp = r.get("generated_output"), r.get("rollout_log_probs")
        if not isinstance(v, torch.Tensor) or v.dtype != torch.uint8:
            problems.append(f"output {i}: video is {type(v).__name__} {getattr(v, 'dtype', '')}")
        elif body["num_frames"] not in v.shape or v.shape[-2:] != (body["height"], body["width"]):
            problems.append(f"output {i}: video shape {list(v.shape)}")
        if not isinstance(lp, torch.Tensor) or lp.numel() != steps or not bool(torch.isfinite(lp).all()):
            problems.append(f"output {i}: log-probs {getattr(lp, 'shape', lp)}")
        if r.get("dit_trajectory") is None or r.get("denoising_env") is None:
            problems.append(f"output {i}: no trajectory or denoising_env")
    return {
        "outputs": len(results),
        "video_shape": shape,
        "outputs_ok": not problems,
        "problems": problems[:5],
    }


def run_layout(layout: str, folder: Path, body: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from benchmarks.common import RemoteClients, post_rollout
    from diffusion_rollout import lean
    from diffusion_rollout.client import RolloutClient

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = serve_command(layout, folder, port, args.cpu)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    print(f"[cp_tradeoff] {layout}: {' '.join(cmd)}", flush=True)
    row: dict[str, Any] = {"layout": layout, "command": cmd[cmd.index("serve") :]}
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    remote = None
    try:
        with RolloutClient(url, timeout=3600.0) as client:
            client.wait_until_ready(timeout_s=args.ready_timeout_s)
            row["ready_s"] = time.perf_counter() - t0
        remote = RemoteClients(url)
        small = {**body, "num_outputs_per_prompt": 1, "num_inference_steps": 1}
        warm = remote.run([{**small, "seed": 10_000 + i} for i in range(2)], 2)
        row["warmup_s"] = warm["seconds"]
        with httpx.Client(base_url=url, timeout=httpx.Timeout(3600.0)) as http:
            t1 = time.perf_counter()
            decoded, size = post_rollout(http, {**body, "seed": 1})
            results = lean.from_lean(decoded)
            row["latency_s"] = time.perf_counter() - t1
        row["latency_inference_s"] = max(float(r.get("inference_time_s") or 0.0) for r in results)
        row["response_mb"] = size / 1e6
        row.update(check_outputs(results, body))
        del decoded, results
        bodies = [{**body, "prompt": f"{GRPO_PROMPT}, variation {i}", "seed": 1000 * (i + 1)}
                  for i in range(args.requests)]  # fmt: skip
        reply = remote.run(bodies, args.clients)
        row["throughput_s"] = reply["seconds"]
        row["videos"] = args.requests * args.group
        row["videos_per_s"] = row["videos"] / reply["seconds"]
        row["pipeline_s"] = reply["pipeline_s"]
        with RolloutClient(url, timeout=60.0) as client:  # what served it: replicas, or k ranks
            info = client.server_info()
        replicas = info.get("replicas")
        row["served_requests_per_replica"] = (
            [r.get("served_requests") for r in replicas] if replicas else None
        )
        cp = (info.get("speed") or {}).get("context_parallel")
        if cp:
            row["context_parallel"] = {"ranks": cp.get("ranks"), "mode": cp.get("mode"),
                                       "follower_forwards": [f.get("forwards") for f in cp.get("followers", [])]}  # fmt: skip
    except Exception as exc:  # one layout failing must not hide the other's figures
        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        if remote is not None:
            remote.close()
        stop_session(server, timeout_s=120)
    row["exit_code"] = server.returncode
    return row


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["layout"]: r for r in rows if "error" not in r}
    out: dict[str, Any] = {
        f"{lay}_{key}": by[lay][key] for lay in by for key in ("videos_per_s", "latency_s") if key in by[lay]
    }
    if set(LAYOUTS) <= set(by):
        rep, cp = by["replicas"], by["context_parallel"]
        out["cp_over_replicas_throughput"] = cp["videos_per_s"] / rep["videos_per_s"]
        out["cp_over_replicas_latency"] = cp["latency_s"] / rep["latency_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import document, print_table, write_json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="wan2.1-1.3b", help="wan2.1-1.3b, wan2.2-a14b, or tiny-wan (CPU)")
    p.add_argument("--out", default=None)
    p.add_argument("--work", type=Path, default=Path("/tmp/cp_tradeoff"), help="where model folders go")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: replicas, context_parallel")
    p.add_argument("--group", type=int, default=4, help="videos per request (a Flow-GRPO group)")
    p.add_argument("--requests", type=int, default=4, help="group requests in the throughput phase")
    p.add_argument("--clients", type=int, default=2, help="concurrent clients in the throughput phase")
    p.add_argument("--frames", type=int, default=None, help="frames per video (default 81; tiny: its own)")
    p.add_argument("--steps", type=int, default=None, help="override the model's step count")
    p.add_argument("--ready-timeout-s", type=float, default=1800.0)
    p.add_argument("--cpu", action="store_true", help="CPU dry run: CPU Ray replicas, CP mirror mode")
    args = p.parse_args(argv)
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if not set(layouts) <= set(LAYOUTS):
        p.error(f"--layouts: {', '.join(LAYOUTS)}; got {args.layouts!r}")
    if args.frames is None and not args.model.startswith("tiny-"):
        args.frames = 81
    folder = model_folder(args.model, args.work)  # train_recipes': built once under --work
    body = request_body(args.model, args)
    rows = [{"model": args.model, **run_layout(layout, folder, body, args)} for layout in layouts]
    device = "cpu" if args.cpu else "cuda"
    ok = all("error" not in r and r.get("outputs_ok") for r in rows)
    settings = {**vars(args), "work": str(args.work), "model_folder": str(folder), "layouts": layouts,
                "body": {k: v for k, v in body.items() if k != "prompt"}}  # fmt: skip
    notes = ["videos_per_s: requests x group / wall seconds of the throughput phase; latency_s: one "
             "group request alone, until its response is decoded"]  # fmt: skip
    doc = document("cp_tradeoff", device, settings, rows, ok=ok, notes=notes)
    doc["summary"] = summary(rows)
    write_json(args.out, f"cp_tradeoff_{args.model}", doc)
    print_table(f"2 GPUs for Flow-GRPO video: {args.model}, group {args.group}", rows, COLUMNS)
    print("[cp_tradeoff] summary", doc["summary"], flush=True)
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
