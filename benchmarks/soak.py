"""Soak: thousands of rollouts and hundreds of weight updates against one CLI server; memory slopes.

    python -m benchmarks.soak --out benchmarks/results/cpu            # CPU: tiny SD3, 2000/200/20
    python -m benchmarks.soak --gpu --out benchmarks/results/h100     # GPU: SD3.5-medium, 500/90/10

starts ``python -m diffusion_rollout.entrypoints.cli serve`` on a saved model folder (the tiny SD3
model on CPU; on ``--gpu`` the SD3.5-medium architecture with random bf16 weights, built by
``benchmarks.model_builders`` and saved once under ``--work``), then runs ``--rollouts`` rollout
requests one after another through the project's client, with a LoRA push (``push_lora`` into the
adapter ``default``, replaced in place, two adapter tensor sets alternating) every k rollouts and a
full transformer push (``push_weights``, two snapshots alternating) every m, k and m chosen so that
``--lora-updates`` and ``--full-updates`` spread evenly over the run. Every answer's
``weight_version`` is checked against the version the last push returned.

Sampled ``--samples`` times (and at the start and the end), from outside the server:

- its resident memory (``VmRSS`` of ``/proc/<pid>/status``) and open descriptors (``/proc/<pid>/fd``);
- on a GPU, torch's allocated and reserved bytes, from the server's ``/metrics``
  (``diffusion_rollout_cuda_memory_{allocated,reserved}_bytes``).

Reported: least-squares slopes of each series per 1000 rollouts and per update (updates = LoRA +
full pushes so far), fitted after a warm-up (the first ``--warmup`` fraction of the rollouts:
allocator pools, prompt cache and receive buffers settle there), plus the first and last samples.
Flat memory means slopes near zero against the series' size; the JSON holds every sample.

Design decisions:

- A subprocess server, as a user runs it: the numbers are the server's own process, with nothing of
  the trainer side (payloads, hashing, client buffers) mixed in.
- Sequential requests: the run measures what accumulates per request and per update, not what a
  burst holds; a concurrency test lives in ``benchmarks/load.py``.
- Two payloads of each kind alternate, so every update really changes the weights (and every
  LoRA push replaces existing tensors in place, the trainer's steady state).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import document, print_table, write_json
from diffusion_rollout.testing import free_port, start_cli_server, stop_session

GPU_MODEL = "sd3.5-medium"
LORA_RANK = 8
LORA_LAYERS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")


# ---------------------------------------------------------------------------------------------
# What is sampled
# ---------------------------------------------------------------------------------------------
def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def gpu_memory_mib(metrics_text: str) -> dict[str, float]:
    out = {}
    for kind in ("allocated", "reserved"):
        m = re.search(rf"^diffusion_rollout_cuda_memory_{kind}_bytes (\S+)$", metrics_text, re.M)
        if m:
            out[f"gpu_{kind}_mib"] = float(m.group(1)) / 2**20
    return out


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys against xs (None with fewer than 2 distinct xs)."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


# ---------------------------------------------------------------------------------------------
# Model folder, payloads, server
# ---------------------------------------------------------------------------------------------
def model_folder(gpu: bool, work: Path) -> Path:
    """The saved model (built in a process of its own on first use, so its memory is given back)."""
    path = work / ("sd3.5-medium" if gpu else "tiny-sd3")
    if (path / "model_index.json").exists():
        return path
    if gpu:
        code = (
            "import sys, torch\n"
            "from benchmarks.model_builders import build_real_pipeline\n"
            f"build_real_pipeline({GPU_MODEL!r}, 'cuda', torch.bfloat16, 0).save_pretrained(sys.argv[1])\n"
        )
    else:
        code = "import sys\nfrom diffusion_rollout.models import save_tiny_model\nsave_tiny_model('sd3', sys.argv[1])\n"
    t0 = time.perf_counter()
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, cwd=root, env=env)
    print(f"[soak] built and saved {path.name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


def payloads(model: Path) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """Two full transformer snapshots (the saved one and its negation) and two LoRA tensor sets."""
    from safetensors.torch import load_file

    base: dict[str, torch.Tensor] = {}
    for f in sorted((model / "transformer").glob("*.safetensors")):
        base.update(load_file(f))
    snapshots = [base, {n: t.neg() for n, t in base.items()}]
    g = torch.Generator().manual_seed(0)
    adapters: list[dict[str, torch.Tensor]] = [{}, {}]
    for name, t in base.items():
        path = name.removesuffix(".weight")
        if name.endswith(".weight") and t.ndim == 2 and path.endswith(LORA_LAYERS):
            out_f, in_f = t.shape
            for tensors in adapters:
                tensors[f"{path}.lora_A.weight"] = 0.01 * torch.randn(LORA_RANK, in_f, generator=g)
                tensors[f"{path}.lora_B.weight"] = 0.01 * torch.randn(out_f, LORA_RANK, generator=g)
    if not adapters[0]:
        raise RuntimeError("no attention projection found for the LoRA payload")
    return snapshots, adapters


def start_server(model: Path, gpu: bool, log: Path) -> tuple[subprocess.Popen, str]:

    port = free_port()
    device = ["--device", "cuda", "--dtype", "bfloat16"] if gpu else ["--device", "cpu", "--dtype", "float32"]
    cmd = [
        sys.executable, "-m", "diffusion_rollout.entrypoints.cli", "serve", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), *device, "--log-level", "warning",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    return start_cli_server(cmd, log, url, 600, new_session=True), url


def every(total: int, count: int) -> int:
    """The interval (in rollouts) that spreads ``count`` events over ``total`` rollouts (0: never)."""
    return 0 if count <= 0 else max(1, total // count)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
def soak(args: argparse.Namespace) -> dict[str, Any]:
    from diffusion_rollout.client import RolloutClient
    from diffusion_rollout.client.weights import push_lora, push_weights

    work = Path(args.work or tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else model_folder(args.gpu, work)
    snapshots, adapters = payloads(model)
    log = work / "server.log"
    proc, url = start_server(model, args.gpu, log)
    lora_every, full_every = every(args.rollouts, args.lora_updates), every(args.rollouts, args.full_updates)
    sample_every = max(1, args.rollouts // max(1, args.samples))
    samples: list[dict[str, Any]] = []
    counts = {"rollouts": 0, "lora": 0, "full": 0, "version_mismatches": 0}
    t0 = time.perf_counter()
    try:
        with RolloutClient(url, timeout=600) as client:

            def sample() -> None:
                row = {
                    "rollouts": counts["rollouts"],
                    "updates": counts["lora"] + counts["full"],
                    "lora_updates": counts["lora"],
                    "full_updates": counts["full"],
                    "t_s": round(time.perf_counter() - t0, 2),
                    "rss_mib": round(rss_mib(proc.pid), 2),
                    "open_fds": open_fds(proc.pid),
                }
                if args.gpu:
                    row.update({k: round(v, 2) for k, v in gpu_memory_mib(client.metrics()).items()})
                samples.append(row)

            version: Any = client.model_info().get("weight_version")
            sample()
            for i in range(1, args.rollouts + 1):
                outs = client.generate(
                    "a soak test prompt", seed=i, width=args.size, height=args.size,
                    num_inference_steps=args.steps, rollout=True, rollout_return_dit_trajectory=True,
                )  # fmt: skip
                counts["rollouts"] += 1
                counts["version_mismatches"] += sum(str(o.weight_version) != str(version) for o in outs)
                if full_every and i % full_every == 0 and counts["full"] < args.full_updates:
                    counts["full"] += 1
                    version = f"full-{counts['full']}"
                    push_weights(client, snapshots[counts["full"] % 2], weight_version=version)
                if lora_every and i % lora_every == 0 and counts["lora"] < args.lora_updates:
                    counts["lora"] += 1
                    version = f"lora-{counts['lora']}"
                    push_lora(
                        client, adapters[counts["lora"] % 2], name="default", lora_alpha=LORA_RANK,
                        weight_version=version,
                    )  # fmt: skip
                if i % sample_every == 0 or i == args.rollouts:
                    sample()
                    if len(samples) % 10 == 0:
                        s = samples[-1]
                        print(
                            f"[soak] {i} rollouts, {s['updates']} updates, RSS {s['rss_mib']:.1f} MiB, "
                            f"{s['open_fds']} fds, {s['t_s']:.0f} s",
                            flush=True,
                        )
    finally:
        code = stop_session(proc)
    return {
        "model": GPU_MODEL if args.gpu else "tiny-sd3",
        "wall_s": round(time.perf_counter() - t0, 1),
        "server_exit_code": code,
        **counts,
        **fit(samples, args.rollouts * args.warmup),
        "samples": samples,
    }


def fit(samples: list[dict[str, Any]], warmup_rollouts: float) -> dict[str, Any]:
    """Slopes of every sampled series after the warm-up, per 1000 rollouts and per update."""
    kept = [s for s in samples if s["rollouts"] >= warmup_rollouts]
    out: dict[str, Any] = {"fitted_samples": len(kept), "slopes": {}}
    for key in ("rss_mib", "open_fds", "gpu_allocated_mib", "gpu_reserved_mib"):
        rows = [s for s in kept if key in s]
        if not rows:
            continue
        ys = [float(s[key]) for s in rows]
        per_rollout = slope([s["rollouts"] for s in rows], ys)
        per_update = slope([s["updates"] for s in rows], ys)
        out["slopes"][key] = {
            "per_1000_rollouts": None if per_rollout is None else round(per_rollout * 1000, 4),
            "per_update": None if per_update is None else round(per_update, 5),
            "first": samples[0][key],
            "after_warmup": rows[0][key],
            "last": rows[-1][key],
            "max": max(ys),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", action="store_true", help="SD3.5-medium (random bf16 weights) on cuda")
    p.add_argument("--rollouts", type=int, default=None, help="default 2000 (CPU), 500 (GPU)")
    p.add_argument("--lora-updates", type=int, default=None, help="default 200 (CPU), 90 (GPU)")
    p.add_argument("--full-updates", type=int, default=None, help="default 20 (CPU), 10 (GPU)")
    p.add_argument("--steps", type=int, default=2, help="denoising steps per rollout")
    p.add_argument("--size", type=int, default=None, help="image side in pixels (default 32 CPU, 256 GPU)")
    p.add_argument("--samples", type=int, default=50, help="memory samples over the run")
    p.add_argument("--warmup", type=float, default=0.1, help="fraction of the rollouts left out of the fit")
    p.add_argument("--model", default=None, help="a saved model folder to serve (default: build one)")
    p.add_argument("--work", default=None, help="folder for the built model and the server log")
    p.add_argument("--out", default=None, help="folder for the JSON result")
    p.add_argument("--name", default=None, help="JSON name (default soak_cpu / soak_sd3.5-medium)")
    args = p.parse_args(argv)
    gpu = args.gpu
    args.rollouts = args.rollouts if args.rollouts is not None else (500 if gpu else 2000)
    args.lora_updates = args.lora_updates if args.lora_updates is not None else (90 if gpu else 200)
    args.full_updates = args.full_updates if args.full_updates is not None else (10 if gpu else 20)
    args.size = args.size or (256 if gpu else 32)
    # The trainer side must not starve the server of cores; restored after, since a caller in this
    # process (the test suite) keeps its own servers' threads at its own count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = soak(args)
    finally:
        torch.set_num_threads(threads)
    device = "cuda" if gpu else "cpu"
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "name")}
    rows = [{"series": k, **s} for k, s in result["slopes"].items()]
    table = print_table(
        f"soak: {result['rollouts']} rollouts, {result['lora']} LoRA + {result['full']} full updates "
        f"in {result['wall_s']} s",
        rows,
        [
            ("series", "series", ""),
            ("per_1000_rollouts", "slope /1000 rollouts", ".4g"),
            ("per_update", "slope /update", ".4g"),
            ("first", "first", ".1f"),
            ("after_warmup", "after warm-up", ".1f"),
            ("last", "last", ".1f"),
        ],
    )
    ok = result["version_mismatches"] == 0 and result["rollouts"] == args.rollouts
    notes = [table]
    if gpu:
        # The server's fd count includes CUDA's device files; it must stay flat all the same.
        notes.append("GPU memory from the server's /metrics (torch.cuda.memory_allocated/reserved)")
    doc = document("soak", device, settings, [result], ok=ok, notes=notes)
    name = args.name or ("soak_sd3.5-medium" if gpu else "soak_cpu")
    path = write_json(args.out, name, doc)
    if path:
        print(f"[soak] wrote {path}")
    if not all(math.isfinite(s["per_1000_rollouts"] or 0.0) for s in result["slopes"].values()):
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
