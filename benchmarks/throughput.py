"""Batched throughput (the Flow-GRPO workload), FLUX ms/step, and the opt-in speed options.

Three measurements, each side by side with the stock pipeline on the same weights in one run:

- ``grpo``: SD3.5-medium 512x512, 10 steps, CFG 4.5, groups of 16 outputs per prompt. The server
  gets ``requests`` group requests (distinct prompts) from ``clients`` concurrent HTTP clients in
  a separate process (``RemoteClients``), every one an SDE rollout with log-probabilities and the
  full trajectory, float32 images in the response; images per second from the first request sent to
  the last response decoded. Measured at each ``max_batch_size`` in ``batch_sizes`` (16: one group
  per pipeline call; larger: the worker batches groups of different prompts into one call), and
  once with ``output_dtype="uint8"`` (a quarter of the image bytes). The stock pipeline is called with batch 16
  (``num_images_per_prompt=16``, precomputed embeddings, plain ODE sampling, images on the device).
  Target: server >= 1.5x the stock batched throughput.
- ``ms_per_step``: batch 1, latents out: stock vs server ``rollout=false`` vs server SDE rollout with
  trajectory. Target for FLUX.1-dev 1024x1024: <= 110 ms per step.
- ``speed_options``: the same ms/step with each attention backend (``set_attention_backend``) and
  with regional ``torch.compile`` of the transformer blocks (``server/core/loader.py``). The options are
  applied to the live pipeline with the loader's own ``apply_speed_options``; the stock twin shares
  the modules, so it runs the same kernels. Compiled kernels are not bit-identical to eager: the
  table reports max |difference| of the latents against eager, for information. Compiled, the
  stock twin runs the same compiled blocks (same grad mode as the server, so no second compile);
  ``ratio_vs_eager_stock`` in the JSON compares with the eager stock pipeline.

    python -m benchmarks.throughput --device cuda --models sd3.5-medium --out bench_out
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from benchmarks.bodies import GRPO_PROMPT, SDE_ROLLOUT, request_body
from benchmarks.cli import base_parser, quiet_libraries, resolve_device
from benchmarks.model_builders import BenchModel, built_models, default_models
from benchmarks.report import document, log, print_table, write_json
from benchmarks.rollout_overhead import stock_runner
from benchmarks.timing import median, spread, sync, timed

GRPO_COLUMNS = [
    ("model", "model", ""),
    ("variant", "variant", ""),
    ("max_batch_size", "max batch", ""),
    ("images", "images", ""),
    ("seconds", "seconds", ".2f"),
    ("images_per_s", "images/s", ".2f"),
    ("ratio", "vs stock", ".3f"),
    ("mean_batch", "mean batch", ".1f"),
    ("response_mb", "response MB", ".1f"),
]
STEP_COLUMNS = [
    ("model", "model", ""),
    ("option", "option", ""),
    ("variant", "variant", ""),
    ("steps", "steps", ""),
    ("ms_per_step", "ms/step", ".1f"),
    ("ratio", "vs stock", ".3f"),
    ("spread", "spread", ".3f"),
    ("max_abs_diff_vs_eager", "max|diff| vs eager", ".3g"),
    ("error", "error", ""),
]


def _base_body(model: BenchModel, **kw: Any) -> dict[str, Any]:
    return request_body(model, GRPO_PROMPT, **kw)


# ---------------------------------------------------------------------------------------------
# Flow-GRPO throughput
# ---------------------------------------------------------------------------------------------
def grpo_throughput(
    model: BenchModel,
    *,
    group: int = 16,
    requests: int = 8,
    clients: int = 4,
    batch_sizes: tuple[int, ...] = (16, 64),
    uint8_variant: bool = True,
    stock_reps: int = 2,
    tag: str = "",
) -> list[dict[str, Any]]:
    """Rows for the stock batch and each server variant; ``tag`` is appended to the variant names."""
    srv = model.server()
    worker = srv.engine.worker
    body = _base_body(model, num_outputs_per_prompt=group)
    stock = stock_runner(model, body)
    stock()  # warm-up
    stock_times = [timed(stock, model.device)[1] for _ in range(stock_reps)]
    stock_ips = group / median(stock_times)
    rows = [
        {
            "model": model.name,
            "variant": "stock" + tag,
            "max_batch_size": group,
            "images": group * stock_reps,
            "seconds": sum(stock_times),
            "images_per_s": stock_ips,
            "ratio": 1.0,
            "mean_batch": float(group),
            "spread": spread(stock_times),
        }
    ]
    variants = [("server_sde_rollout", mb, {}) for mb in batch_sizes]
    if uint8_variant:
        variants.append(("server_sde_rollout_uint8", batch_sizes[0], {"output_dtype": "uint8"}))
    remote = srv.remote()
    saved = worker.max_batch_samples
    try:
        for n, (label, mb, extra) in enumerate(variants):
            worker.max_batch_samples = mb
            bodies = [
                {**body, **SDE_ROLLOUT, **extra, "prompt": f"{GRPO_PROMPT}, variation {i}", "seed": 1000 * i}
                for i in range(requests)
            ]
            if n == 0:
                remote.run(bodies[:1])  # warm-up: the SDE path at batch `group`, the allocator
            before = worker.batches_run
            reply = remote.run(bodies, clients)
            seconds = reply["seconds"]
            calls = max(1, worker.batches_run - before)
            ips = group * requests / seconds
            rows.append(
                {
                    "model": model.name,
                    "variant": label + tag,
                    "max_batch_size": mb,
                    "images": group * requests,
                    "seconds": seconds,
                    "images_per_s": ips,
                    "ratio": ips / stock_ips,
                    "mean_batch": group * requests / calls,
                    "clients": clients,
                    "response_mb": median(reply["bytes"]) / 1e6,
                    "request_s": reply["times"],
                }
            )
    finally:
        worker.max_batch_samples = saved
    return rows


# ---------------------------------------------------------------------------------------------
# ms per step, speed options
# ---------------------------------------------------------------------------------------------
def _time_variants(
    model: BenchModel, body: dict[str, Any], variants: list[str], reps: int, warm: bool = True
) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    srv = model.server()
    stock = stock_runner(model, body, output_type="latent")
    bodies = {
        "server_plain": {**body, "rollout": False, "return_generated_output": False},
        "server_sde": {**body, **SDE_ROLLOUT, "return_generated_output": False},
    }
    latents: dict[str, torch.Tensor] = {}

    def one(name: str) -> float:
        sync(model.device)
        t0 = time.perf_counter()
        if name == "stock":
            stock()
            sync(model.device)
        else:
            results, _ = srv.generate(bodies[name])
            if name == "server_plain":
                latents[name] = results[0]["generated_output"]
        return time.perf_counter() - t0

    if warm:
        for name in variants:
            one(name)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):
        for name in variants:
            times[name].append(one(name))
    return times, latents


def _step_rows(model, option, times, T, diff=None) -> list[dict[str, Any]]:
    base = median(times["stock"]) if "stock" in times else None
    rows = []
    for name, ts in times.items():
        m = median(ts)
        rows.append(
            {
                "model": model.name,
                "option": option,
                "variant": name,
                "steps": T,
                "ms_per_step": 1000 * m / T,
                "ratio": m / base if base else None,
                "spread": spread(ts),
                "times_s": ts,
                "max_abs_diff_vs_eager": diff if name == "server_plain" else None,
            }
        )
    return rows


def ms_per_step(model: BenchModel, *, steps: int | None = None, reps: int = 2) -> list[dict[str, Any]]:
    body = _base_body(model, num_outputs_per_prompt=1)
    if steps:
        body["num_inference_steps"] = steps
    times, _ = _time_variants(model, body, ["stock", "server_plain", "server_sde"], reps)
    return _step_rows(model, "eager", times, body["num_inference_steps"])


def speed_options(
    model: BenchModel,
    *,
    backends: tuple[str, ...] = ("_native_cudnn", "_native_flash"),
    compile: bool = True,
    steps: int | None = 10,
    reps: int = 2,
    deadline=None,
    compile_estimate_s: float = 150.0,
) -> list[dict[str, Any]]:
    """ms/step for the eager default, each attention backend, then regional compile (last: in place)."""
    from diffusion_rollout.server.core.loader import apply_speed_options

    body = _base_body(model, num_outputs_per_prompt=1)
    if steps:
        body["num_inference_steps"] = steps
    T = body["num_inference_steps"]
    rows: list[dict[str, Any]] = []
    times, lat = _time_variants(model, body, ["stock", "server_plain"], reps)
    eager = lat["server_plain"]
    rows += _step_rows(model, "eager (native SDPA)", times, T, 0.0)
    for backend in backends:
        try:
            apply_speed_options(model.pipe, attention_backend=backend)
            times, lat = _time_variants(model, body, ["stock", "server_plain"], reps)
            diff = float((lat["server_plain"].float() - eager.float()).abs().max())
            rows += _step_rows(model, f"attention {backend}", times, T, diff)
        except Exception as exc:  # a backend the build lacks
            rows.append(
                {
                    "model": model.name,
                    "option": f"attention {backend}",
                    "error": f"{type(exc).__name__}: {str(exc)[:80]}",
                }
            )
        finally:
            apply_speed_options(model.pipe, attention_backend="native")
    if compile and (deadline is None or deadline.allows(compile_estimate_s)):
        apply_speed_options(model.pipe, compile=True)
        srv = model.server()
        t0 = time.perf_counter()
        srv.generate({**body, "rollout": False, "return_generated_output": False})  # compiles
        compile_s = time.perf_counter() - t0
        # The stock twin shares the compiled blocks and runs under the same grad mode (inference
        # mode + the pipeline's no_grad), so its warm-up call reuses the compiled code.
        times, lat = _time_variants(model, body, ["stock", "server_plain", "server_sde"], reps, warm=True)
        diff = float((lat["server_plain"].float() - eager.float()).abs().max())
        eager_stock = next(r for r in rows if r["option"].startswith("eager") and r["variant"] == "stock")
        for r in _step_rows(model, "regional compile", times, T, diff):
            r["first_call_s"] = compile_s
            r["ratio_vs_eager_stock"] = r["ms_per_step"] / eager_stock["ms_per_step"]
            rows.append(r)
    elif compile:
        rows.append({"model": model.name, "option": "regional compile", "error": "skipped: time budget"})
    return rows


# ---------------------------------------------------------------------------------------------
def report(
    grpo_rows: list[dict[str, Any]],
    step_rows: list[dict[str, Any]],
    *,
    settings: dict[str, Any],
    device: str,
    out_dir=None,
    notes: list[str] | None = None,
) -> dict[str, Any]:
    tables = []
    if grpo_rows:
        tables.append(
            print_table("Flow-GRPO throughput (groups of 16, SDE rollouts)", grpo_rows, GRPO_COLUMNS)
        )
    if step_rows:
        tables.append(print_table("ms per step, batch 1, latents out", step_rows, STEP_COLUMNS))
    targets = {}

    def vs_eager(r: dict[str, Any]) -> float:
        return r.get("ratio_vs_eager_stock", r["ratio"])

    servers = [r for r in grpo_rows if not r["variant"].startswith("stock")]
    best = max(servers, key=vs_eager, default=None)
    if best:
        targets["grpo_vs_stock_batched"] = {
            "ratio": vs_eager(best),
            "variant": best["variant"],
            "max_batch_size": best["max_batch_size"],
            "target": 1.5,
            "met": best["ratio"] >= 1.5,
        }
    flux = [r for r in step_rows if r.get("model") == "flux.1-dev" and "ms_per_step" in r]
    fastest = min(
        (r for r in flux if r["variant"].startswith("server")), key=lambda r: r["ms_per_step"], default=None
    )
    if fastest:
        targets["flux_ms_per_step"] = {
            "ms_per_step": fastest["ms_per_step"],
            "option": fastest["option"],
            "variant": fastest["variant"],
            "target": 110.0,
            "met": fastest["ms_per_step"] <= 110.0,
        }
    doc = document(
        "throughput",
        device,
        {"grpo_rollout": SDE_ROLLOUT, "prompt": GRPO_PROMPT, **settings},
        grpo_rows + step_rows,
        notes=notes or [],
    )
    doc["targets"] = targets
    doc["table"] = "\n\n".join(tables)
    write_json(out_dir, "throughput", doc)
    return doc


def run(
    grpo_model: BenchModel | None,
    step_models: list[BenchModel],
    *,
    out_dir=None,
    device: str = "cpu",
    grpo: dict[str, Any] | None = None,
    steps: dict[str, int] | None = None,
    option_models: list[BenchModel] = (),
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    grpo_rows: list[dict[str, Any]] = []
    step_rows: list[dict[str, Any]] = []
    if grpo_model is not None:
        log(f"throughput: grpo on {grpo_model.name}")
        grpo_rows = grpo_throughput(grpo_model, **(grpo or {}))
    for m in step_models:
        log(f"throughput: ms/step on {m.name}")
        step_rows += ms_per_step(m, steps=(steps or {}).get(m.name))
    for m in option_models:
        log(f"throughput: speed options on {m.name}")
        step_rows += speed_options(m, **(options or {}))
    settings = {
        "grpo_model": grpo_model.name if grpo_model else None,
        "grpo": grpo or {},
        "step_models": [m.name for m in step_models],
        "steps": steps,
        "option_models": [m.name for m in option_models],
        "options": options or {},
        "defaults": {m.name: m.defaults for m in [*([grpo_model] if grpo_model else []), *step_models]},
    }
    return report(grpo_rows, step_rows, settings=settings, device=device, out_dir=out_dir)


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--group", type=int, default=16)
    p.add_argument("--batch-sizes", default="16,64")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--speed-options", action="store_true", help="also attention backends and compile")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    names = args.models.split(",") if args.models else default_models(device)[:2]
    with built_models(names, device) as models:
        grpo_model = models[0]
        run(
            grpo_model,
            models[1:] if len(models) > 1 else models,
            out_dir=args.out,
            device=device,
            grpo={
                "group": args.group,
                "requests": args.requests,
                "clients": args.clients,
                "batch_sizes": tuple(int(b) for b in args.batch_sizes.split(",")),
            },
            steps={n: args.steps for n in names} if args.steps else None,
            option_models=models[-1:] if args.speed_options else [],
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
