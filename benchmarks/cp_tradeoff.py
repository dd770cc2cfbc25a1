"""Video Flow-GRPO on 2 or 4 GPUs: every "R replicas x k GPUs each" layout of the same GPUs.

One command per model and GPU count runs every layout in turn on the same machine and writes one
JSON (``cp_tradeoff_<model>_x<N>.json``):

    python -m benchmarks.cp_tradeoff --gpus 2 --model wan2.1-1.3b --group 4 --out $OUT
    python -m benchmarks.cp_tradeoff --gpus 4 --model wan2.1-1.3b --group 4 --out $OUT
    python -m benchmarks.cp_tradeoff --gpus 4 --model wan2.2-a14b --group 4 --out $OUT
    python -m benchmarks.cp_tradeoff --model tiny-wan --cpu --out DIR          # CPU dry run (N = 2)

The layouts of N GPUs are ``RxK`` for every R * k = N with k in {1, 2, 4} (``plan_layouts``), each
served by the CLI as a user runs it, in a process of its own:

- ``Nx1`` (all replicas): ``serve --replicas N --gpus-per-replica 1`` (Ray replicas, one GPU each;
  on the CPU ``--gpus-per-replica 0``). The baseline the others are compared with.
- ``Rxk`` with R > 1 and k > 1 (``2x2`` on four GPUs): ``serve --replicas R --context-parallel k``:
  on CUDA ``--gpus-per-replica`` defaults to k (``ServerConfig.resolved_gpus_per_replica``), so Ray
  gives each replica actor k GPUs, and its engine is rank 0 on the first and spawns k-1 followers on
  the others. The row checks it from ``/server_info``: R replicas, each seeing k GPUs of its own
  (``replica_gpus``, ``distinct_gpus``), and replica 0's k ranks with followers that ran forwards.
- ``1xN`` (all context parallel): ``serve --context-parallel N`` (one engine, no Ray; rank 0 on GPU
  0, followers on the next GPUs, Ulysses attention; on the CPU the followers mirror rank 0).
  ``--layouts`` picks a subset (``replicas`` and ``context_parallel`` are kept as names of ``Nx1``
  and ``1xN``). On CUDA the server processes see the first N GPUs only (``CUDA_VISIBLE_DEVICES``,
  unless it is set already), so a 2-GPU run on a bigger machine uses two.

The model is a real architecture with random weights saved as a diffusers folder
(``train_recipes.model_folder``: built on GPU 0 once, kept under ``--work``; Wan 2.2 A14B's two
experts are about 57 GB in bfloat16, and every replica's rank 0 holds them all, the VAE and the text
encoder, so no layout holds less on its first GPU).

This process is the trainer's side. For each layout, after the server is ready (its client process
starts meanwhile: a trainer is up before the server answers): a warm-up (N small requests at once:
one video, one step, the measured size; every replica and every rank runs), then **latency**: one
Flow-GRPO group request alone, sent from here (seconds until its response is decoded; the response
is checked: ``group`` uint8 videos of the requested frames and size, per-step log-probs, the
trajectory and the denoising env), then **throughput**: ``--requests`` group requests from
``--clients`` concurrent clients in another process (``RemoteClients``): videos/s = requests x
group / wall seconds. The request is the Flow-GRPO rollout (``bodies.SDE_ROLLOUT_ENV``: SDE at noise
level 0.7, log-probs, ``dit_trajectory``, ``denoising_env``) with ``output_dtype uint8`` and the
lean response form, at the model's defaults (480x832; 81 frames unless ``--frames``; ``--steps``
overrides the model's step count).

The throughput load is **the same for every layout**: 2N requests from N clients by default. N
clients (the most replicas any layout has) keep every replica of ``Nx1`` busy with one request each
and always one queued behind it, and with fewer replicas the rest wait in the server's queue rather
than in the trainer; 2N requests give each replica of ``Nx1`` at least two, so its tail (the last
request finishing alone) is not the whole measurement. The clients do not follow R: a trainer's
demand does not change with the server's layout, and only the same work at the same offered
concurrency makes videos/s comparable. (A video request is one pipeline call of its own,
``max_batch_pixels``, so a queued request is never merged into a running one in any layout.)

The summary gives every layout's videos/s and latency, both relative to ``Nx1`` (throughput above 1:
more videos per second than all replicas; latency below 1: one request answered sooner), and names
the best layout for each. ``advice_table`` turns the rows into the markdown table the README's
advice is written from; it is printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.bodies import GRPO_PROMPT, SDE_ROLLOUT_ENV
from benchmarks.train_recipes import model_folder
from diffusion_rollout.testing import free_port, start_cli_server, stop_session

ROOT = Path(__file__).resolve().parent.parent
GPU_COUNTS = (2, 4)
RANKS_PER_REPLICA = (1, 2, 4)  # k: the context-parallel degrees a layout may use
COLUMNS = [  # (key, header, format)
    ("layout", "layout", ""),
    ("replicas", "R", ""),
    ("k", "k", ""),
    ("videos_per_s", "videos/s", ".4f"),
    ("latency_s", "latency s", ".2f"),
    ("throughput_s", "throughput s", ".2f"),
    ("ready_s", "start s", ".1f"),
    ("outputs_ok", "outputs ok", ""),
    ("layout_ok", "layout ok", ""),
    ("error", "error", ""),
]


@dataclass(frozen=True)
class Layout:
    """R replicas of k GPUs each (k context-parallel ranks per replica)."""

    replicas: int
    k: int

    @property
    def name(self) -> str:
        return f"{self.replicas}x{self.k}"

    @property
    def gpus(self) -> int:
        return self.replicas * self.k


def plan_layouts(gpus: int, wanted: str | None = None) -> list[Layout]:
    """Every layout of ``gpus`` GPUs, all replicas first (``Nx1``, ..., ``1xN``), or those of
    ``wanted`` (comma-separated names; ``replicas`` = ``Nx1``, ``context_parallel`` = ``1xN``)."""
    if gpus not in GPU_COUNTS:
        raise ValueError(f"--gpus: one of {', '.join(map(str, GPU_COUNTS))}; got {gpus}")
    every = [Layout(gpus // k, k) for k in RANKS_PER_REPLICA if k <= gpus and gpus % k == 0]
    if not wanted:
        return every
    aliases = {"replicas": every[0].name, "context_parallel": every[-1].name}
    names = {aliases.get(x.strip(), x.strip()) for x in wanted.split(",") if x.strip()}
    unknown = sorted(names - {lay.name for lay in every})
    if unknown or not names:
        choices = ", ".join([lay.name for lay in every] + list(aliases))
        raise ValueError(f"--layouts for --gpus {gpus}: {choices}; got {wanted!r}")
    return [lay for lay in every if lay.name in names]


def serve_command(layout: Layout, folder: Path, port: int, cpu: bool, cp_mode: str = "ulysses") -> list[str]:
    """The CLI command a user runs for ``layout`` (its k ranks in ``cp_mode``: ulysses, ring, hybrid)."""
    cmd = [sys.executable, "-m", "diffusion_rollout.entrypoints.cli", "serve", "--model", str(folder),
           "--port", str(port), "--host", "127.0.0.1", "--request-timeout-s", "3600"]  # fmt: skip
    cmd += ["--device", "cpu", "--dtype", "float32"] if cpu else ["--dtype", "bfloat16"]
    if layout.replicas > 1:
        cmd += ["--replicas", str(layout.replicas)]
        if layout.k == 1:
            cmd += ["--gpus-per-replica", "0" if cpu else "1"]
    if layout.k > 1:  # with --replicas, each replica then asks Ray for k GPUs (0 on a CPU front)
        cmd += ["--context-parallel", str(layout.k)]
        if cp_mode != "ulysses":
            cmd += ["--context-parallel-mode", cp_mode]
    return cmd


def request_body(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The Flow-GRPO group request at the model's defaults (seed and prompt set per request), its
    size and steps as overridden; an image-to-video family's request carries an input image of the
    output size."""
    from benchmarks import model_builders_scale  # noqa: F401  (Wan 2.2 A14B's defaults)
    from benchmarks.cluster_scaling import request_defaults
    from benchmarks.model_builders import _REAL_FAMILY, input_image_b64
    from diffusion_rollout.models.tiny import IMAGE_FAMILIES

    body = {"prompt": GRPO_PROMPT, "seed": 0, "generator_device": "cpu" if args.cpu else "cuda"}
    body.update(request_defaults(name), **SDE_ROLLOUT_ENV)
    body.update(output_dtype="uint8", lean_response=True, num_outputs_per_prompt=args.group)
    overrides = {"num_frames": args.frames, "num_inference_steps": args.steps,
                 "height": getattr(args, "height", None), "width": getattr(args, "width", None)}  # fmt: skip
    body.update({k: v for k, v in overrides.items() if v})
    family = name.removeprefix("tiny-") if name.startswith("tiny-") else _REAL_FAMILY.get(name, "")
    if family in IMAGE_FAMILIES:
        body["image_data"] = [input_image_b64(body["width"], body["height"])]
    return body


def check_outputs(results: list[dict[str, Any]], body: dict[str, Any]) -> dict[str, Any]:
    """What a Flow-GRPO trainer needs from one group response, checked: one uint8 video per output
    of the requested frames and size, finite per-step log-probs, the trajectory and the denoising
    env, and no output the server flagged non-finite."""
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
        if r.get("nonfinite_output"):  # the server's own NaN/Inf flag (the video is uint8, clamped)
            problems.append(f"output {i}: nonfinite_output")
    return {
        "outputs": len(results),
        "video_shape": shape,
        "outputs_ok": not problems,
        "problems": problems[:5],
    }


def check_layout(layout: Layout, info: dict[str, Any], cuda: bool) -> dict[str, Any]:
    """What served the layout, from ``/server_info``: the replicas and the GPUs each one sees (CUDA),
    and the context-parallel ranks (replica 0's with Ray) with the forwards their followers ran."""
    out: dict[str, Any] = {}
    problems = []
    replicas = info.get("replicas")
    if layout.replicas > 1 or replicas is not None:
        replicas = replicas or []
        out["served_requests_per_replica"] = [r.get("served_requests") for r in replicas]
        if len(replicas) != layout.replicas:
            problems.append(f"{len(replicas)} replicas, not {layout.replicas}")
        if cuda:
            uuids = [r.get("gpu_uuids") or [] for r in replicas]
            out["replica_gpus"] = [len(u) for u in uuids]
            out["distinct_gpus"] = len({g for u in uuids for g in u})
            if out["replica_gpus"] != [layout.k] * layout.replicas or out["distinct_gpus"] != layout.gpus:
                problems.append(f"replicas see {out['replica_gpus']} GPUs, {out['distinct_gpus']} distinct")
    cp = (info.get("speed") or {}).get("context_parallel")
    if cp:
        forwards = [f.get("forwards") for f in cp.get("followers", [])]
        out["context_parallel"] = {
            "ranks": cp.get("ranks"),
            "mode": cp.get("mode"),
            "follower_forwards": forwards,
        }
    if layout.k > 1 and (not cp or cp.get("ranks") != layout.k or not all(f and f > 0 for f in forwards)):
        problems.append(f"context parallel {out.get('context_parallel')}, not {layout.k} ranks that all ran")
    if layout.k == 1 and cp:
        problems.append(f"context parallel {cp.get('ranks')} ranks in an all-replicas layout")
    out["layout_ok"] = not problems
    if problems:
        out["layout_problems"] = problems
    return out


def timed_request(url: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One Flow-GRPO group request alone, as a trainer sends and reads it: (its decoded outputs;
    ``latency_s`` until they are decoded, the server's ``latency_inference_s``, ``response_mb``,
    ``peak_memory_gib`` and :func:`check_outputs`'s fields)."""
    import httpx

    from benchmarks.remote_clients import post_rollout
    from diffusion_rollout.protocol import lean

    with httpx.Client(base_url=url, timeout=httpx.Timeout(3600.0)) as http:
        t0 = time.perf_counter()
        decoded, size = post_rollout(http, {**body, "seed": 1})
        results = lean.from_lean(decoded)
        latency = time.perf_counter() - t0
    peaks = [r["peak_memory_mb"] for r in results if r.get("peak_memory_mb")]
    fields = {
        "latency_s": latency,
        "latency_inference_s": max(float(r.get("inference_time_s") or 0.0) for r in results),
        "response_mb": size / 1e6,
        # rank 0's torch.cuda.max_memory_allocated over the batch (None on a CPU): what a layout
        # whose one GPU runs the whole group must fit
        "peak_memory_gib": max(peaks) / 1024 if peaks else None,
        **check_outputs(results, body),
    }
    return results, fields


def run_layout(
    layout: Layout, folder: Path, body: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:

    from benchmarks.remote_clients import RemoteClients
    from diffusion_rollout.client import RolloutClient

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = serve_command(layout, folder, port, args.cpu, args.cp_mode)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if args.cpu:  # one thread per rank or replica: the dry run's two cores are not oversubscribed
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    else:
        env["CUDA_VISIBLE_DEVICES"] = os.environ.get(
            "CUDA_VISIBLE_DEVICES", ",".join(map(str, range(args.gpus)))
        )
    log = server_log(args.work, f"cp_tradeoff_{layout.name}")
    print(f"[cp_tradeoff] {layout.name}: {' '.join(cmd)} (log: {log})", flush=True)
    row: dict[str, Any] = {"layout": layout.name, "replicas": layout.replicas, "k": layout.k,
                           "cp_mode": args.cp_mode if layout.k > 1 else None,
                           "command": cmd[cmd.index("serve") :]}  # fmt: skip
    server = None
    starter = ThreadPoolExecutor(1)
    pending = starter.submit(RemoteClients, url)  # the trainer's process starts while the server loads
    try:
        t0 = time.perf_counter()
        server = start_cli_server(cmd, log, url, args.ready_timeout_s, new_session=True, env=env)
        row["ready_s"] = time.perf_counter() - t0
        remote = pending.result()
        small = {**body, "num_outputs_per_prompt": 1, "num_inference_steps": 1}
        warm = remote.run([{**small, "seed": 10_000 + i} for i in range(args.gpus)], args.gpus)
        row["warmup_s"] = warm["seconds"]
        results, timed = timed_request(url, body)
        row.update(timed)
        del results
        bodies = [{**body, "prompt": f"{GRPO_PROMPT}, variation {i}", "seed": 1000 * (i + 1)}
                  for i in range(args.requests)]  # fmt: skip
        reply = remote.run(bodies, args.clients)
        row["throughput_s"] = reply["seconds"]
        row["videos"] = args.requests * args.group
        row["videos_per_s"] = row["videos"] / reply["seconds"]
        row["pipeline_s"] = reply["pipeline_s"]
        with RolloutClient(url, timeout=60.0) as client:  # what served it: replicas, GPUs, ranks
            row.update(check_layout(layout, client.server_info(), cuda=not args.cpu))
    # One layout failing must not hide the others' figures (a server that never got ready is a
    # SystemExit carrying the end of its log).
    except (Exception, SystemExit) as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        with contextlib.suppress(Exception):  # if it never started, the error above says why
            pending.result().close()
        starter.shutdown()
        if server is not None:
            stop_session(server, timeout_s=120)
    row["exit_code"] = server.returncode if server is not None else None
    return row


def server_log(work: Path, name: str) -> Path:
    """Where a server's output goes: ``WORK/logs/NAME.log`` (the error of a row that failed quotes its end)."""
    (work / "logs").mkdir(parents=True, exist_ok=True)
    return work / "logs" / f"{name}.log"


def relative(rows: list[dict[str, Any]]) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """(the all-replicas layout's name, or None if it did not answer; per layout that answered: its
    videos/s and latency, and both over the all-replicas layout's)."""
    done = [r for r in rows if "error" not in r and r.get("videos_per_s") and r.get("latency_s")]
    base = next((r for r in done if r["k"] == 1), None)
    out = {}
    for r in done:
        out[r["layout"]] = {
            "replicas": r["replicas"],
            "k": r["k"],
            "videos_per_s": r["videos_per_s"],
            "latency_s": r["latency_s"],
            "throughput_vs_all_replicas": r["videos_per_s"] / base["videos_per_s"] if base else None,
            "latency_vs_all_replicas": r["latency_s"] / base["latency_s"] if base else None,
        }
    return (base["layout"] if base else None), out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    base, per = relative(rows)
    return {
        "all_replicas": base,
        "layouts": per,
        "best_throughput": max(per, key=lambda n: per[n]["videos_per_s"]) if per else None,
        "best_latency": min(per, key=lambda n: per[n]["latency_s"]) if per else None,
    }


def advice_table(rows: list[dict[str, Any]]) -> str:
    """The README's advice table (markdown) from the JSON rows: layout, videos/s, latency of one
    request, and both relative to the all-replicas layout; a layout that failed says so."""
    base, per = relative(rows)
    vs = f"vs {base}" if base else "vs all replicas"
    lines = [f"| layout | videos/s | latency s | videos/s {vs} | latency {vs} |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        name = f"{r['layout']} ({_plural(r['replicas'], 'replica')} x {_plural(r['k'], 'GPU')})"
        p = per.get(r["layout"])
        if p is None:
            lines.append(f"| {name} | failed | - | - | - |")
            continue
        ratios = [f"{x:.2f}x" if x is not None else "-" for x in (p["throughput_vs_all_replicas"],
                                                                   p["latency_vs_all_replicas"])]  # fmt: skip
        lines.append(
            f"| {name} | {p['videos_per_s']:.3g} | {p['latency_s']:.3g} | {ratios[0]} | {ratios[1]} |"
        )
    return "\n".join(lines)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def main(argv: list[str] | None = None) -> int:
    from benchmarks.report import document, print_table, write_json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="wan2.1-1.3b", help="wan2.1-1.3b, wan2.2-a14b, or tiny-wan (CPU)")
    p.add_argument("--gpus", type=int, default=2, choices=GPU_COUNTS, help="N: the GPUs every layout uses")
    p.add_argument("--out", default=None)
    p.add_argument("--work", type=Path, default=Path("/tmp/cp_tradeoff"), help="where model folders go")
    p.add_argument("--layouts", default=None,
                   help="comma-separated RxK names (default: all of N GPUs, e.g. 4x1,2x2,1x4); "
                        "replicas = Nx1, context_parallel = 1xN")  # fmt: skip
    p.add_argument("--cp-mode", default="ulysses", choices=["ulysses", "ring", "hybrid"],
                   help="context_parallel_mode of the layouts with k > 1")  # fmt: skip
    p.add_argument("--group", type=int, default=4, help="videos per request (a Flow-GRPO group)")
    p.add_argument("--requests", type=int, default=None, help="group requests in the throughput phase (2N)")
    p.add_argument("--clients", type=int, default=None, help="concurrent clients in the throughput phase (N)")
    p.add_argument("--frames", type=int, default=None, help="frames per video (default 81; tiny: its own)")
    p.add_argument("--steps", type=int, default=None, help="override the model's step count")
    p.add_argument("--height", type=int, default=None, help="override the model's height")
    p.add_argument("--width", type=int, default=None, help="override the model's width")
    p.add_argument("--ready-timeout-s", type=float, default=1800.0)
    p.add_argument("--cpu", action="store_true", help="CPU dry run: CPU Ray replicas, CP mirror mode")
    args = p.parse_args(argv)
    try:
        layouts = plan_layouts(args.gpus, args.layouts)
    except ValueError as exc:
        p.error(str(exc))
    args.requests = args.requests or 2 * args.gpus
    args.clients = args.clients or args.gpus
    if args.frames is None and not args.model.startswith("tiny-"):
        args.frames = 81
    if not args.cpu:
        import torch

        if torch.cuda.device_count() < args.gpus:  # Ray would wait for GPUs that never come
            p.error(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    folder = model_folder(args.model, args.work)  # train_recipes': built once under --work
    body = request_body(args.model, args)
    device = "cpu" if args.cpu else "cuda"
    settings = {**vars(args), "work": str(args.work), "model_folder": str(folder),
                "layouts": [lay.name for lay in layouts],
                "body": {k: v for k, v in body.items() if k != "prompt"}}  # fmt: skip
    notes = ["videos_per_s: requests x group / wall seconds of the throughput phase (the same requests "
             "and clients for every layout); latency_s: one group request alone, until its response is "
             "decoded; *_vs_all_replicas: over the Nx1 layout's"]  # fmt: skip
    mode = "" if args.cp_mode == "ulysses" else f"_{args.cp_mode}"
    rows: list[dict[str, Any]] = []
    for layout in layouts:  # the JSON after every layout: a run cut short keeps the layouts it finished
        rows.append({"model": args.model, **run_layout(layout, folder, body, args)})
        ok = len(rows) == len(layouts) and all(
            "error" not in r and r.get("outputs_ok") and r.get("layout_ok") for r in rows
        )
        doc = document("cp_tradeoff", device, settings, rows, ok=ok, notes=notes)
        doc["summary"] = summary(rows)
        write_json(args.out, f"cp_tradeoff_{args.model}_x{args.gpus}{mode}", doc)
        print(f"[cp_tradeoff] {rows[-1]['layout']}: " + ", ".join(
            f"{key} {rows[-1].get(key)}" for key in ("ready_s", "latency_s", "videos_per_s", "outputs_ok", "error")
        ), flush=True)  # fmt: skip
    print_table(f"{args.gpus} GPUs for Flow-GRPO video: {args.model}, group {args.group}", rows, COLUMNS)
    print(advice_table(rows), flush=True)
    s = doc["summary"]
    print(f"[cp_tradeoff] best for throughput: {s['best_throughput']}; for latency: {s['best_latency']}",
          flush=True)  # fmt: skip
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
