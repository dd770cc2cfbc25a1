"""Rollout overhead: a full SDE rollout received over loopback HTTP vs the plain stock pipeline.

Per model, with the same inputs (prompt embeddings, seed, size, steps), interleaved and after a
warm-up, median of the repeats:

- ``stock``: the stock diffusers pipeline in process, handed precomputed prompt embeddings,
  ``output_type="pt"``, batch 1; timed until the image is on the device (synchronised).
- ``server_plain``: ``rollout=false`` over HTTP, image in the response.
- Server requests are sent and timed by a client in another process (``RemoteClients``), from the
  request to the decoded response, as a trainer would see them.
- ``server_rollout``: an SDE rollout (``rollout_sde_type="sde"``, noise level 0.7, every step
  stochastic) with per-step log-probabilities, the full ``dit_trajectory``, ``denoising_env`` and
  the image, encoded as msgpack, received and decoded by the client. ``rollout_debug_mode`` is off
  (the debug tensors are for checking the math, not for training).

The ratio ``server_rollout / stock`` is the overhead figure (target: at most 1.05 for SD3.5-medium
512x512 10 steps and FLUX.1-dev 1024x1024 28 steps). ``ms/step`` divides the whole call by the step
count (VAE decode and the HTTP round trip included).

    python -m benchmarks.rollout_overhead --device cuda --models sd3.5-medium,flux.1-dev --out bench_out
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from benchmarks.bodies import SDE_ROLLOUT_ENV, request_body, size_label
from benchmarks.cli import base_parser, quiet_libraries, resolve_device
from benchmarks.model_builders import BenchModel, built_models, default_models
from benchmarks.report import document, log, print_table, write_json
from benchmarks.timing import median, spread, sync

PROMPT = "a photo of an astronaut riding a horse on the moon"


COLUMNS = [
    ("model", "model", ""),
    ("size", "size", ""),
    ("steps", "steps", ""),
    ("variant", "variant", ""),
    ("median_s", "median s", ".4f"),
    ("ms_per_step", "ms/step", ".1f"),
    ("ratio", "vs stock", ".3f"),
    ("spread", "spread", ".3f"),
    ("response_mb", "response MB", ".2f"),
]


def stock_runner(model: BenchModel, body: dict[str, Any], output_type: str = "pt", pipe=None):
    """A closure running the stock pipeline (or ``pipe``, a twin sharing its modules) with precomputed
    embeddings (what is timed)."""
    from diffusion_rollout.server.families import adapter_for

    n = body.get("num_outputs_per_prompt", 1)
    # Embeddings handed to a pipeline are used as given: one per output, stacked as the server stacks
    # them (rows of a tensor, or a list for Z-Image).
    embeds = adapter_for(model.stock).stack_encodings([model.encode_for_stock(body["prompt"], body)] * n)
    kwargs = model.stock_kwargs(model.stock, {**body, "prompt": None, "negative_prompt": None})
    kwargs.pop("generator")
    for key in ("num_images_per_prompt", "num_videos_per_prompt"):
        if key in kwargs:
            kwargs[key] = 1
    seeds = body.get("seeds") or [body["seed"] + i for i in range(n)]

    def run():
        gens = [torch.Generator(model.generator_device).manual_seed(s) for s in seeds]
        with torch.inference_mode():
            out = (pipe or model.stock)(**kwargs, **embeds, generator=gens, output_type=output_type)
        return out

    return run


def measure_model(model: BenchModel, *, reps: int, steps: int | None = None) -> list[dict[str, Any]]:
    srv = model.server()
    body = request_body(model, PROMPT, num_outputs_per_prompt=1)
    if steps:
        body["num_inference_steps"] = steps
    T = body["num_inference_steps"]
    stock = stock_runner(model, body)
    variants = {
        "stock": None,
        "server_plain": {**body, "rollout": False},
        "server_rollout": {**body, **SDE_ROLLOUT_ENV},
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    sizes: dict[str, int] = {}

    def one(name: str) -> float:
        sync(model.device)
        t0 = time.perf_counter()
        if name == "stock":
            stock()
            sync(model.device)
            return time.perf_counter() - t0
        seconds, sizes[name] = srv.remote().time_one(variants[name])
        return seconds

    for name in ("stock", "server_rollout"):  # warm-up: kernels, allocator, prompt cache
        one(name)
    for _ in range(reps):
        for name in variants:
            times[name].append(one(name))
    base = median(times["stock"])
    rows = []
    for name in variants:
        m = median(times[name])
        rows.append(
            {
                "model": model.name,
                "size": size_label(body),
                "steps": T,
                "variant": name,
                "median_s": m,
                "ms_per_step": 1000 * m / T,
                "ratio": m / base,
                "spread": spread(times[name]),
                "times_s": times[name],
                "response_mb": sizes.get(name, 0) / 1e6 if name != "stock" else None,
            }
        )
    return rows


def report(
    rows: list[dict[str, Any]], *, settings: dict[str, Any], device: str, out_dir=None, target: float = 1.05
) -> dict[str, Any]:
    table = print_table("Rollout overhead: SDE rollout over HTTP vs stock pipeline", rows, COLUMNS)
    verdicts = {
        r["model"]: {"ratio": r["ratio"], "target": target, "met": r["ratio"] <= target}
        for r in rows
        if r["variant"] == "server_rollout"
    }
    doc = document(
        "rollout_overhead",
        device,
        {
            "prompt": PROMPT,
            "rollout": SDE_ROLLOUT_ENV,
            "stock": "precomputed prompt embeddings, output_type='pt', batch 1",
            **settings,
        },
        rows,
        notes=[f"{k}: rollout/stock = {v['ratio']:.3f} (target <= {target})" for k, v in verdicts.items()],
    )
    doc["targets"] = verdicts
    doc["table"] = table
    write_json(out_dir, "rollout_overhead", doc)
    return doc


def run(
    models: list[BenchModel],
    *,
    out_dir=None,
    reps: int = 3,
    steps: dict[str, int] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for model in models:
        log(f"rollout_overhead: {model.name}")
        rows.extend(measure_model(model, reps=reps, steps=(steps or {}).get(model.name)))
    settings = {
        "models": [m.name for m in models],
        "reps": reps,
        "steps": steps,
        "defaults": {m.name: m.defaults for m in models},
    }
    return report(rows, settings=settings, device=device, out_dir=out_dir)


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="override the step count of every model")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    names = args.models.split(",") if args.models else default_models(device)[:2]
    with built_models(names, device) as models:
        steps = {n: args.steps for n in names} if args.steps else None
        run(models, out_dir=args.out, reps=args.reps, steps=steps, device=device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
