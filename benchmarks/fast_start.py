"""Start-up of the fast tier through the real CLI (issue #43): start -> ready -> first answer, cold
and from the compile cache, then 4-in-flight throughput against stock and against ``serve``'s defaults.

Each server is ``python -m diffusion_rollout.entrypoints.cli serve`` in a process of its own on a
saved model folder (the real architecture with random weights, built once under ``--work``):

1. ``fast_cold``: ``--speed fast --warmup-shapes {size}x{size} --max-batch-size {group}`` with an
   empty ``--compile-cache``: seconds from the process start to ``/health_generate`` 200 (the
   warm-up included) and to the answer of the first Flow-GRPO request (one prompt x ``group``,
   ``steps`` steps, SDE with log-probs, trajectory and ``denoising_env``, lean uint8), then
   ``--in-flight`` such requests at once: images/s.
2. ``fast_warm``: the same command again, on the cache the first run wrote.
3. ``defaults``: ``serve`` with no speed flag (``--speed exact``: two pipeline lanes on CUDA).
4. ``stock``: the stock diffusers pipeline from the same folder in this process, the same batches
   back to back (precomputed embeddings, images on the device).

Each server's ``/server_info`` (speed choice, compile counters, warm-up, cache) goes into the JSON.

The trainer process (``RemoteClients``, which imports its receive path before it says ready) starts
before each server, as a training job's trainer is already up: the first answer's seconds are the
server's. GPU: about 6 minutes for the four runs on an H100 (SD3.5-medium built once under
``--work``, about 30 s; byte-compile a ``--no-compile`` install first, or every process compiles the
sources it imports: on an image that sets ``PYTHONDONTWRITEBYTECODE=1``, unset it and set
``PYTHONPYCACHEPREFIX``, RESULTS ``fast-start-bytecode``; ``facts.python_bytecode`` records it); the
runs can also be split over calls on the same machine, sharing ``--work``::

    python -m benchmarks.fast_start --device cuda --out $OUT
    python -m benchmarks.fast_start --device cuda --runs fast_cold --out $OUT
    python -m benchmarks.fast_start --device cuda --runs fast_warm,defaults,stock --out $OUT

A restart's first answer at a size the warm-up was not told about (``--speed fast`` with no
``--warmup-shapes``: the warm-up is at the model's default size, 1024² for SD3.5-medium) on a compile
cache of its own, ``WORK/compile-cache-remember`` (the ``remember_*`` runs, named in ``--runs``):

5. ``remember_cold``: an empty cache; the first {size}² request compiles in the foreground, and the
   server writes the shape into ``served_shapes.json`` in its key folder.
6. ``remember_off``: a restart with ``--no-warmup-remembered-shapes``: the {size}² request compiles
   in the foreground again (the behaviour before the shapes were remembered).
7. ``remember_warm``: a restart as a user starts it: its warm-up covers the default size and the
   remembered {size}², and it saves the {size}² blocks precompiled (once) when first idle after
   ready: the run leaves it idle after its throughput, as a trainer's training phase does, until the
   save ends (``idle_save_wait_s``).
8. ``remember_warm2``: the same again: every remembered shape loads precompiled::

    python -m benchmarks.fast_start --device cuda --runs remember_cold --out $OUT
    python -m benchmarks.fast_start --device cuda --runs remember_off,remember_warm,remember_warm2 --out $OUT

Where the warm-up's time goes (``--warmup-profile``: each fast server profiles its warm-up, server/
warmup_profile.py): ``$OUT/warmup_profile_<run>/`` gets ``warmup_stacks.txt`` (the worker's stack every
10 s, written as it goes, so a run that hits ``--ready-timeout-s`` still shows where it was) and
``warmup_call_<i>.txt`` (cProfile's top functions per warm-up call); the ``.pstats`` go to
``--work``/warmup_profile/<run> once the server stops. With ``--runs fast_cold`` that is at most 6
files in ``$OUT``::

    python -m benchmarks.fast_start --device cuda --work /tmp/tr --runs fast_cold --ready-timeout-s 420 \
        --warmup-profile --out $OUT

CPU smoke (tiny SD3, 32x32; minutes, compiling on the CPU)::

    python -m benchmarks.fast_start --device cpu --model tiny-sd3 --size 32 --group 2 --steps 2 --out /tmp/fs
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bodies import GRPO_PROMPT, SDE_ROLLOUT_ENV
from benchmarks.remote_clients import RemoteClients
from benchmarks.report import document, log, print_table, write_json
from benchmarks.train_recipes import model_folder
from diffusion_rollout.testing import free_port, stop_session

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("fast_cold", "fast_warm", "defaults", "stock")
# The remembered shapes (server/speed/served_shapes.py): the fast tier with no --warmup-shapes, on a compile
# cache of its own. Not in the default set of runs: name them in --runs.
REMEMBER_RUNS = ("remember_cold", "remember_off", "remember_warm", "remember_warm2")


def grpo_body(args: argparse.Namespace, seed: int = 0) -> dict[str, Any]:
    return {
        "prompt": GRPO_PROMPT,
        "seed": seed,
        "num_outputs_per_prompt": args.group,
        "num_inference_steps": args.steps,
        "guidance_scale": 4.5,
        "height": args.size,
        "width": args.size,
        "output_dtype": "uint8",
        "lean_response": True,
        **SDE_ROLLOUT_ENV,
    }


def serve_run(name: str, args: argparse.Namespace, folder: Path, flags: list[str]) -> dict[str, Any]:
    """Start ``serve`` with ``flags``, time ready and the first answer, then the in-flight batch."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "diffusion_rollout.entrypoints.cli", "serve", "--model", str(folder),
        "--device", args.device, "--port", str(port), "--max-batch-size", str(args.group), *flags,
    ]  # fmt: skip
    logfile = Path(args.out) / f"fast_start_{name}.log"
    logfile.parent.mkdir(parents=True, exist_ok=True)
    profile = None
    if args.warmup_profile and "--speed" in flags:  # the compiled runs: they warm up
        profile = Path(args.out) / f"warmup_profile_{name}"
        shutil.rmtree(profile, ignore_errors=True)
        cmd += [
            "--warmup-profile",
            str(profile),
            "--warmup-profile-interval-s",
            str(args.warmup_profile_interval_s),
        ]
        if args.warmup_profile_stacks_only:
            cmd.append("--no-warmup-profile-cprofile")
    seen = f"{logfile}" + (f" and {profile / 'warmup_stacks.txt'}" if profile else "")
    log(f"{name}: {' '.join(cmd[2:])}")
    # The trainer is up before the server answers, as in a training job: its process (which imports
    # torch) starts first, so the first answer's seconds are the server's, not the trainer's start.
    with contextlib.closing(RemoteClients(url)) as clients, logfile.open("w") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        row: dict[str, Any] = {"run": name, "flags": " ".join(flags) or "(defaults)"}
        try:
            with httpx.Client(base_url=url, timeout=600) as c:
                while True:
                    if proc.poll() is not None:
                        raise RuntimeError(f"{name}: serve exited {proc.returncode}; see {seen}")
                    if time.monotonic() - t0 > args.ready_timeout_s:
                        raise RuntimeError(f"{name}: not ready after {args.ready_timeout_s} s; see {seen}")
                    try:
                        if c.get("/health_generate").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.5)
                row["start_to_ready_s"] = time.monotonic() - t0
                clients.time_one(grpo_body(args))
                row["start_to_first_answer_s"] = time.monotonic() - t0
                clients.run([grpo_body(args, seed=i) for i in range(args.in_flight)], args.in_flight)  # warm
                reply = clients.run(
                    [grpo_body(args, seed=10 + i) for i in range(args.in_flight)], args.in_flight
                )
                row["images_per_s"] = args.in_flight * args.group / reply["seconds"]
                row["server_info"] = c.get("/server_info").json().get("speed")
                if _save_pending(row["server_info"]):  # a restart saves new blocks once idle
                    row["idle_save_wait_s"] = _wait_for_idle_save(c, args.ready_timeout_s)
                    row["server_info"] = c.get("/server_info").json().get("speed")
        finally:
            stop_session(proc)
            if profile is not None:  # few files back from a GPU machine: the raw profiles stay in --work
                keep = args.work / "warmup_profile" / name
                keep.mkdir(parents=True, exist_ok=True)
                for raw in profile.glob("*.pstats"):
                    shutil.move(str(raw), str(keep / raw.name))
    compile_info = (row.get("server_info") or {}).get("compile") or {}
    if isinstance(compile_info, dict) and compile_info.get("warmup"):
        row["warmup_s"] = compile_info["warmup"]["elapsed_s"]
        row["fx_cache_hits"] = compile_info["warmup"]["fx_graph_cache_hits"]
        row["recompiles"] = compile_info.get("recompiles")
        row["warmup_shapes"] = ",".join(compile_info["warmup"].get("shapes") or [])
        row["remembered_shapes"] = ",".join(compile_info["warmup"].get("remembered_shapes") or [])
        pre = compile_info.get("precompiled") or {}
        row["precompiled_loaded"] = pre.get("loaded")  # blocks a restart runs without Dynamo's tracing
        row["precompiled_save_s"] = pre.get("save_s")  # what the save took (a restart: after ready, idle)
        if compile_info["warmup"].get("profile"):
            row["warmup_profile"] = str(profile)
    log(f"{name}: ready {row['start_to_ready_s']:.1f} s, first answer {row['start_to_first_answer_s']:.1f} s, "
        f"{row['images_per_s']:.2f} img/s")  # fmt: skip
    return row


def _save_pending(speed: dict[str, Any] | None) -> bool:
    pre = ((speed or {}).get("compile") or {}).get("precompiled") or {}
    return "save" in pre


def _wait_for_idle_save(c: Any, timeout_s: float) -> float:
    """Leave the server idle, as a trainer's loss and optimizer step do, until its put-off save of
    precompiled blocks ends (server/speed/idle_save.py); the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not _save_pending(c.get("/server_info").json().get("speed")):
            return time.monotonic() - t0
        time.sleep(1.0)
    raise RuntimeError(f"the precompiled blocks were not saved within {timeout_s:.0f} s of idle time")


def stock_run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The stock pipeline on the same folder, the in-flight batches back to back."""
    import torch
    from diffusers import DiffusionPipeline

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    pipe = DiffusionPipeline.from_pretrained(str(folder), dtype=dtype).to(args.device)
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        embeds = pipe.encode_prompt(GRPO_PROMPT, GRPO_PROMPT, GRPO_PROMPT, do_classifier_free_guidance=True)
    names = (
        "prompt_embeds",
        "negative_prompt_embeds",
        "pooled_prompt_embeds",
        "negative_pooled_prompt_embeds",
    )
    kwargs = {n: t.repeat(args.group, *([1] * (t.dim() - 1))) for n, t in zip(names, embeds, strict=True)}

    def batch(seed: int) -> None:
        gens = [torch.Generator(args.device).manual_seed(seed + i) for i in range(args.group)]
        with torch.inference_mode():
            pipe(**kwargs, num_inference_steps=args.steps, guidance_scale=4.5, height=args.size,
                 width=args.size, generator=gens, output_type="pt")  # fmt: skip

    batch(0)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(args.in_flight):
        batch(10 + i)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {
        "run": "stock",
        "flags": "diffusers pipeline",
        "images_per_s": args.in_flight * args.group / seconds,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="sd3.5-medium", help="a model_builders name, or tiny-<family>")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--group", type=int, default=16, help="outputs per Flow-GRPO request")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--work", type=Path, default=Path("/tmp/fast_start"), help="model folder and caches")
    p.add_argument("--ready-timeout-s", type=float, default=1800.0)
    p.add_argument(
        "--runs",
        default=",".join(RUNS),
        help="which of the runs, in order (a GPU call is at most 10 minutes: the cold run can go in one "
        "call and the rest in the next, on the same machine, which keeps --work)",
    )
    p.add_argument(
        "--warmup-profile",
        action="store_true",
        help="the compiled servers profile their warm-up into OUT/warmup_profile_<run>/ (stack samples, "
        "cProfile summaries; the .pstats are moved to WORK/warmup_profile/<run>/)",
    )
    p.add_argument(
        "--warmup-profile-interval-s", type=float, default=10.0, help="seconds between stack samples"
    )
    p.add_argument(
        "--warmup-profile-stacks-only",
        action="store_true",
        help="with --warmup-profile: no cProfile (its overhead inflates Python-heavy phases), stack samples only",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = sorted(set(runs) - set(RUNS) - set(REMEMBER_RUNS))
    if unknown:
        p.error(f"--runs: unknown {unknown}; choose from {list(RUNS) + list(REMEMBER_RUNS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    folder = model_folder(args.model, args.work)
    cache = args.work / "compile-cache"
    if "fast_cold" in runs:
        shutil.rmtree(cache, ignore_errors=True)  # the cold run starts from nothing
    fast = ["--speed", "fast", "--warmup-shapes", f"{args.size}x{args.size}", "--compile-cache", str(cache)]
    remember_cache = args.work / "compile-cache-remember"
    if "remember_cold" in runs:
        shutil.rmtree(remember_cache, ignore_errors=True)
    remember = ["--speed", "fast", "--compile-cache", str(remember_cache)]  # no --warmup-shapes
    flags = {
        "fast_cold": fast,
        "fast_warm": fast,
        "defaults": [],
        "remember_cold": remember,
        "remember_off": [*remember, "--no-warmup-remembered-shapes"],
        "remember_warm": remember,
        "remember_warm2": remember,
    }
    rows = [stock_run(args, folder) if r == "stock" else serve_run(r, args, folder, flags[r]) for r in runs]
    by_run = {row["run"]: row for row in rows}
    for base in ("stock", "defaults"):
        if base in by_run:
            for row in rows:
                row[f"ratio_vs_{base}"] = row["images_per_s"] / by_run[base]["images_per_s"]
    print_table(
        f"fast-tier start-up and throughput ({args.model}, {args.size}², {args.steps} steps, "
        f"{args.in_flight} x {args.group} in flight)",
        rows,
        [
            ("run", "run", ""),
            ("start_to_ready_s", "start->ready s", ".1f"),
            ("start_to_first_answer_s", "start->first answer s", ".1f"),
            ("warmup_s", "warm-up s", ".1f"),
            ("warmup_shapes", "warmed", ""),
            ("fx_cache_hits", "cache hits", ""),
            ("recompiles", "recompiles", ""),
            ("precompiled_loaded", "precompiled", ""),
            ("precompiled_save_s", "save s", ".1f"),
            ("images_per_s", "img/s", ".2f"),
            ("ratio_vs_stock", "vs stock", ".3f"),
            ("ratio_vs_defaults", "vs defaults", ".3f"),
        ],
    )
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    name = "fast_start" if runs == list(RUNS) else "fast_start_" + "_".join(runs)
    path = write_json(args.out, name, document("fast_start", args.device, settings, rows))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
