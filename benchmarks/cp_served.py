"""One whole served video rollout per family at k = 1, 2 and 4 context-parallel ranks, each against k = 1.

``cp_scaling`` times one transformer call; this times what a trainer waits for: one Flow-GRPO
request to the CLI server (``serve`` on one GPU, ``serve --context-parallel k`` on k), from the
request to its decoded answer, text encoding, every step, the VAE decode on rank 0 and the wire
included. For every case (``model@WxHxF``) and every k of ``--gpus``:

    python -m benchmarks.cp_served --gpus 4 --cases wan2.2-ti2v-5b@1280x704x121,ltx-2@1280x704x121 --out $OUT
    python -m benchmarks.cp_served --cpu --cases tiny-wan --out DIR        # CPU dry run: k = 1 and 2 (mirror)

Each server is started as a user starts it, in a process of its own that sees only its GPUs
(``CUDA_VISIBLE_DEVICES``), waits for ready, takes one warm-up request (one video, one step, the
measured size: every rank, the VAE and the wire run once), then **one timed request**: the
Flow-GRPO group (``--group`` videos, default 1; SDE with log-probs, ``dit_trajectory``,
``denoising_env``, lean uint8) at the case's size and ``--steps``. Its outputs are checked as
``cp_tradeoff`` checks them, and compared with k = 1's, output by output: the uint8 videos, the
per-step log-probs and the trajectory, each ``torch.equal`` and max \\|diff\\| (the same seed and
generator device on every k, so Ulysses, which is exact per call, should give equal tensors).

With ``--overlap`` (the default on 4 GPUs) the layouts that fit side by side run at once on
disjoint GPUs (k = 1 on GPU 0 and k = 2 on GPUs 1-2, then k = 4 on all four): a shared CPU and host
memory, separate GPUs; each row names what ran beside it (``beside``). ``--no-overlap`` runs them
one after another. The JSON (``cp_served[_<tag>].json``) is written after every case, so a call cut
short keeps the cases it finished.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.cp_tradeoff import (
    Layout,
    check_layout,
    request_body,
    serve_command,
    server_log,
    timed_request,
)
from benchmarks.train_recipes import model_folder
from diffusion_rollout.testing import free_port, start_cli_server, stop_session

ROOT = Path(__file__).resolve().parent.parent
COMPARED = ("generated_output", "rollout_log_probs", "dit_trajectory")  # what a trainer consumes
COLUMNS = [  # (key, header, format)
    ("model", "model", ""),
    ("size", "size", ""),
    ("k", "k", ""),
    ("latency_s", "latency s", ".2f"),
    ("speedup_vs_k1", "speedup", ".2f"),
    ("efficiency", "speedup / k", ".2f"),
    ("latency_inference_s", "server s", ".2f"),
    ("ready_s", "start s", ".1f"),
    ("equal_to_k1", "equal to k1", ""),
    ("outputs_ok", "outputs ok", ""),
    ("error", "error", ""),
]


def phases(gpus: int, overlap: bool) -> list[list[tuple[int, list[int]]]]:
    """The k of ``gpus`` (1, 2, 4 up to it) in runs of (k, its GPU indices): with ``overlap``, the
    smaller layouts that fit on disjoint GPUs together, in one run; else one layout per run."""
    ks = [k for k in (1, 2, 4) if k <= gpus]
    runs: list[list[tuple[int, list[int]]]] = []
    current: list[tuple[int, list[int]]] = []
    used = 0
    for k in ks:
        if current and (not overlap or used + k > gpus):
            runs.append(current)
            current, used = [], 0
        current.append((k, list(range(used, used + k))))
        used += k
    if current:
        runs.append(current)
    return runs


def visible_devices(gpu_ids: list[int], outer: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a server on ``gpu_ids``, indices into this process's GPUs: the
    outer setting's entries when there is one (``CUDA_VISIBLE_DEVICES=4,5,6,7`` runs on those)."""
    names = [x.strip() for x in outer.split(",") if x.strip()] if outer else None
    return ",".join(names[i] if names else str(i) for i in gpu_ids)


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for key in sorted(value) for t in _tensors(value[key])]
    return []


def kept(results: list[dict[str, Any]]) -> list[dict[str, list[Any]]]:
    """The compared fields of each output as owned tensors (a decoded answer may sit in pooled
    receive memory that the next answer reuses)."""
    return [{name: [t.clone() for t in _tensors(r.get(name))] for name in COMPARED} for r in results]


def compare(out: list[dict[str, list[Any]]], ref: list[dict[str, list[Any]]]) -> dict[str, Any]:
    """Per compared field over every output: all ``torch.equal`` to the reference, and the largest
    |diff| (uint8 videos compared as integers); ``equal`` is every field's."""
    import torch

    row: dict[str, Any] = {}
    for name in COMPARED:
        pairs = [
            (a, b) for o, r in zip(out, ref, strict=False) for a, b in zip(o[name], r[name], strict=False)
        ]
        counts_match = len(out) == len(ref) and all(
            len(o[name]) == len(r[name]) for o, r in zip(out, ref, strict=False)
        )
        same_shapes = counts_match and all(a.shape == b.shape and a.dtype == b.dtype for a, b in pairs)
        if not same_shapes:
            row[name] = {"equal": False, "max_abs_diff": None, "tensors": len(pairs)}
            continue
        worst = 0.0
        for a, b in pairs:
            if a.numel():
                worst = max(worst, float((a.double() - b.double()).abs().max()))
        row[name] = {
            "equal": all(torch.equal(a, b) for a, b in pairs),
            "max_abs_diff": worst,
            "tensors": len(pairs),
        }
    row["equal"] = all(row[name]["equal"] for name in COMPARED)
    return row


def serve_once(
    model: str, folder: Path, k: int, gpu_ids: list[int], body: dict[str, Any], args: argparse.Namespace
) -> tuple[dict[str, Any], list[dict[str, list[Any]]] | None]:
    """Start the server of ``k`` ranks on ``gpu_ids``, warm it, time one request; (row, its
    compared tensors, or None if it failed)."""
    import httpx

    from benchmarks.remote_clients import post_rollout
    from diffusion_rollout.client import RolloutClient

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = serve_command(Layout(1, k), folder, port, args.cpu, args.cp_mode)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if args.cpu:
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    else:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"))
    log = server_log(args.work, f"cp_served_{model}_k{k}")
    print(f"[cp_served] {model} k={k} on {gpu_ids}: {' '.join(cmd)} (log: {log})", flush=True)
    row: dict[str, Any] = {"k": k, "gpu_ids": gpu_ids, "cp_mode": args.cp_mode if k > 1 else None,
                           "command": cmd[cmd.index("serve") :]}  # fmt: skip
    tensors = None
    server = None
    try:
        t0 = time.perf_counter()
        server = start_cli_server(cmd, log, url, args.ready_timeout_s, new_session=True, env=env)
        row["ready_s"] = time.perf_counter() - t0
        with httpx.Client(base_url=url, timeout=httpx.Timeout(3600.0)) as http:
            t1 = time.perf_counter()
            post_rollout(
                http, {**body, "num_outputs_per_prompt": 1, "num_inference_steps": 1, "seed": 10_000}
            )
            row["warmup_s"] = time.perf_counter() - t1
        results, timed = timed_request(url, body)
        row.update(timed)
        tensors = kept(results)
        del results
        with RolloutClient(url, timeout=60.0) as client:
            row.update(check_layout(Layout(1, k), client.server_info(), cuda=not args.cpu))
    # One layout failing must not hide the others' figures (a server that never got ready is a
    # SystemExit carrying the end of its log).
    except (Exception, SystemExit) as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        tensors = None
    finally:
        if server is not None:
            stop_session(server, timeout_s=120)
    row["exit_code"] = server.returncode if server is not None else None
    return row, tensors


def run_case(case: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every k of one case, k = 1 first; rows with the speedup and the comparison against k = 1."""
    folder = model_folder(case.model, args.work)
    opts = argparse.Namespace(cpu=args.cpu, group=args.group, frames=case.frames, steps=args.steps,
                              height=case.height, width=case.width)  # fmt: skip
    body = request_body(case.model, opts)
    rows: list[dict[str, Any]] = []
    ref = None
    for run in phases(args.gpus, args.overlap):
        with ThreadPoolExecutor(len(run)) as pool:
            futures = [pool.submit(serve_once, case.model, folder, k, ids, body, args) for k, ids in run]
            done = [f.result() for f in futures]
        for (k, _), (row, tensors) in zip(run, done, strict=True):
            row = {"model": case.model, "size": case.size, "group": args.group,
                   "steps": body["num_inference_steps"], **row,
                   "beside": [other for other, _ in run if other != k]}  # fmt: skip
            if k == 1:
                ref = tensors
            if tensors is not None and ref is not None:
                row["vs_k1"] = compare(tensors, ref)
                row["equal_to_k1"] = row["vs_k1"]["equal"]
            rows.append(row)
    base = next((r for r in rows if r["k"] == 1 and r.get("latency_s")), None)
    for r in rows:
        if base and r.get("latency_s"):
            r["speedup_vs_k1"] = base["latency_s"] / r["latency_s"]
            r["efficiency"] = r["speedup_vs_k1"] / r["k"]
            if r.get("latency_inference_s") and base.get("latency_inference_s"):
                r["inference_speedup_vs_k1"] = base["latency_inference_s"] / r["latency_inference_s"]
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks.cp_scaling import Case
    from benchmarks.report import document, print_table, write_json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cases", required=True, help="comma-separated model@WIDTHxHEIGHTxFRAMES (tiny-<family> alone)"
    )
    p.add_argument(
        "--gpus", type=int, default=None, help="N: k runs over 1, 2, 4 up to N (default: 4 or 2 on --cpu)"
    )
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="run the layouts that fit side by side on disjoint GPUs (default: on with 4 GPUs)")  # fmt: skip
    p.add_argument("--cp-mode", default="ulysses", choices=["ulysses", "ring", "hybrid"])
    p.add_argument("--group", type=int, default=1, help="videos in the timed request")
    p.add_argument("--steps", type=int, default=4, help="denoising steps of the timed request")
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="", help="suffix of the JSON's name")
    p.add_argument("--work", type=Path, default=Path("/tmp/cp_tradeoff"), help="where model folders go")
    p.add_argument("--ready-timeout-s", type=float, default=1800.0)
    p.add_argument("--cpu", action="store_true", help="CPU dry run (mirror mode; no overlap)")
    args = p.parse_args(argv)
    args.gpus = args.gpus or (2 if args.cpu else 4)
    if args.gpus not in (2, 4):
        p.error(f"--gpus: 2 or 4; got {args.gpus}")
    if args.overlap is None:
        args.overlap = args.gpus == 4 and not args.cpu
    if args.overlap and args.cpu:
        p.error("--overlap: GPUs only (the CPU's ranks would share its two cores)")
    try:
        cases = [Case.parse(c) for c in args.cases.split(",") if c.strip()]
    except ValueError as exc:
        p.error(str(exc))
    if not args.cpu:
        import torch

        if torch.cuda.device_count() < args.gpus:
            p.error(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    device = "cpu" if args.cpu else "cuda"
    settings = {**vars(args), "work": str(args.work), "runs": phases(args.gpus, args.overlap)}
    notes = ["latency_s: one Flow-GRPO request alone after one warm-up request, from the request to its "
             "decoded answer; latency_inference_s: the server's own time for it; speedup_vs_k1: k = 1's latency_s "
             "over this row's; vs_k1: each compared field equal to k = 1's (torch.equal) and its max |diff|; "
             "beside: the k that ran at the same time on other GPUs"]  # fmt: skip
    name = "cp_served" + (f"_{args.tag}" if args.tag else "")
    rows: list[dict[str, Any]] = []
    doc: dict[str, Any] = {}
    for case in cases:
        t0 = time.perf_counter()
        rows += run_case(case, args)
        ok = all("error" not in r and r.get("outputs_ok") and r.get("layout_ok") for r in rows)
        doc = document("cp_served", device, settings, rows, ok=ok, notes=notes)
        write_json(args.out, name, doc)
        print(f"[cp_served] {case.model}@{case.size}: {time.perf_counter() - t0:.1f} s", flush=True)
    print_table(f"one served rollout per k ({args.cp_mode})", rows, COLUMNS)
    return 0 if doc.get("ok") else 2


if __name__ == "__main__":
    sys.exit(main())
