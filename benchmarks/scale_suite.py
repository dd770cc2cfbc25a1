"""Real-scale and image-conditioned models on one GPU: the ODE gate, an SDE rollout, ms/step, memory.

For each model (``benchmarks/model_builders_scale.py``: Qwen-Image 20B at 1328x1328, Wan 2.2 A14B
at 480x832x81, Wan 2.2 TI2V-5B, FLUX.1 Kontext [dev] and Wan 2.2 I2V-A14B with an input image; all
random weights in bf16, built on the device), in this order:

Models: Qwen-Image, FLUX.1 Kontext [dev], Qwen-Image-Edit, Wan 2.2 TI2V-5B, Wan 2.2 I2V-A14B
(480x832x33), Wan 2.2 A14B (480x832x81), cheapest first.

1. **ODE gate** (``ode_regression.check_model``): the stock pipeline vs the server with
   ``rollout=false`` and with an all-ODE rollout, latents and decoded outputs; every max |difference|
   must be 0. Image-conditioned models send the image as ``image_data`` and hand the same image to
   the stock pipeline. One output per request for the 14B video models, two otherwise.
2. **Timed calls**, latents only (``return_generated_output=false``, so ms/step is the denoising
   loop and not the VAE decode), each from a reset of the CUDA peak-memory counter, after the gate has
   warmed the kernels: the stock pipeline with precomputed embeddings, ``rollout=false``, and an SDE
   rollout with trajectory and ``denoising_env``. On two-expert models the SDE rollout has one
   stochastic window per expert (the first and the last step, which the pipeline gives to the high-
   and the low-noise expert); the row records which expert ran each SDE step, that the log-probs are
   non-zero exactly there, the response size, and for image models the recorded image latents.

Step counts are small (2 to 4, ``model_builders_scale.DEFAULTS``; ``--steps`` overrides) so the set
fits a device call. Writes ``scale_suite.json`` under ``--out`` after every model. Exit status 1
when the gate found a difference, 2 when a model failed.

    python -m benchmarks.scale_suite --device cuda --out $OUT                       # every model
    python -m benchmarks.scale_suite --device cuda --models wan2.2-a14b --out $OUT  # one of them
    python -m benchmarks.scale_suite --device cpu --tiny                            # CPU dry run
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any

import torch

from benchmarks import model_builders_scale, ode_regression, rollout_overhead
from benchmarks.common import (
    base_parser,
    document,
    log,
    print_table,
    quiet_libraries,
    resolve_device,
    write_json,
)
from benchmarks.model_builders import BenchModel, build

# The cheap models first, so a run stopped at its time limit keeps the most rows.
DEFAULT_MODELS: tuple[str, ...] = (
    "qwen-image",
    "flux.1-kontext-dev",
    "qwen-image-edit",
    "wan2.2-ti2v-5b",
    "wan2.2-i2v-a14b",
    "wan2.2-a14b",
)
# Importing model_builders_scale registers the builders; wan2.2-ti2v-5b-i2v runs on request (--models).
assert set(DEFAULT_MODELS) <= set(model_builders_scale.BUILDERS)
TINY_MODELS = ("tiny-qwenimage", "tiny-wan2.2", "tiny-flux-kontext", "tiny-wan-i2v", "tiny-qwenimage-edit")
# One output per gate request where a call is heavy (14B experts at 81 frames).
GATE_OUTPUTS = {"wan2.2-a14b": 1, "wan2.2-i2v-a14b": 1}
SDE = {
    "rollout": True,
    "rollout_sde_type": "sde",
    "rollout_noise_level": 0.7,
    "rollout_return_dit_trajectory": True,
    "rollout_return_denoising_env": True,
    "rollout_debug_mode": False,
}
COLUMNS = [
    ("model", "model", ""),
    ("size", "size", ""),
    ("steps", "steps", ""),
    ("variant", "variant", ""),
    ("ms_per_step", "ms/step", ".1f"),
    ("ratio", "vs stock", ".3f"),
    ("peak_gib", "peak GiB", ".2f"),
    ("response_mb", "response MB", ".2f"),
    ("sde_experts", "SDE steps on", ""),
]


def _peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def timed_calls(model: BenchModel, steps: int | None) -> list[dict[str, Any]]:
    """Stock, ``rollout=false`` and an SDE rollout (one window per expert), latents only."""
    srv = model.server()
    body = {
        "prompt": rollout_overhead.PROMPT,
        "seed": 0,
        "num_outputs_per_prompt": 1,
        "generator_device": model.generator_device,
        "return_generated_output": False,
        **model.defaults,
    }
    if steps:
        body["num_inference_steps"] = steps
    T = body["num_inference_steps"]
    experts = model.pipe.config.get("boundary_ratio") is not None
    sde = {**body, **SDE}
    if experts:
        sde["rollout_sde_step_indices"] = [0, T - 1]
    size = f"{body['width']}x{body['height']}" + (f"x{body['num_frames']}" if body.get("num_frames") else "")
    stock = rollout_overhead.stock_runner(model, body, output_type="latent")
    rows: list[dict[str, Any]] = []
    for variant, req in (("stock", None), ("server_plain", {**body, "rollout": False}), ("server_sde", sde)):
        _peak_reset(model.device)
        t0 = time.perf_counter()
        if req is None:
            stock()
            results, nbytes = None, None
        else:
            results, nbytes = srv.generate(req)
        if model.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        row: dict[str, Any] = {
            "model": model.name,
            "family": model.family,
            "size": size,
            "steps": T,
            "variant": variant,
            "seconds": seconds,
            "ms_per_step": 1000 * seconds / T,
            "peak_gib": _peak(model.device),
            "response_mb": nbytes / 1e6 if nbytes is not None else None,
        }
        if variant == "server_sde":
            row.update(_sde_facts(results[0], T))
        rows.append(row)
    base = rows[0]["seconds"]
    for row in rows:
        row["ratio"] = row["seconds"] / base
    return rows


def _sde_facts(out: dict[str, Any], T: int) -> dict[str, Any]:
    """What an SDE rollout's response shows: where the noise went, which expert ran, the image part."""
    sde_steps = list(out.get("sde_step_indices") or [])
    lp = out["rollout_log_probs"]
    nonzero = [i for i in range(T) if float(lp[i]) != 0.0]
    experts = out.get("expert_per_step")
    facts: dict[str, Any] = {
        "sde_step_indices": sde_steps,
        "log_probs_nonzero_exactly_at_sde_steps": nonzero == sorted(sde_steps),
        "log_probs_finite": bool(torch.isfinite(lp).all()),
        "expert_per_step": experts,
        "sde_experts": ",".join(experts[i] for i in sde_steps) if experts else "",
    }
    if experts:
        facts["one_window_per_expert"] = len({experts[i] for i in sde_steps}) == len(set(experts)) == 2
    env = out.get("denoising_env") or {}
    for key in ("latent_condition", "latent_first_frame"):  # the image part the transformer saw
        if env.get(key) is not None:
            facts[f"{key}_shape"] = list(env[key]["latents"].shape)
    return facts


def run(names: list[str], *, device: str, dtype, steps: int | None, out_dir) -> int:
    gate_rows: list[dict[str, Any]] = []
    timed_rows: list[dict[str, Any]] = []
    failures: list[dict[str, str]] = []

    def save() -> None:
        ok = bool(gate_rows) and all(r["exact"] for r in gate_rows) and not failures
        notes = [f"FAILED {f['model']}: {f['error']}" for f in failures]
        doc = document(
            "scale_suite", device, {"models": names, "steps_override": steps}, gate_rows, ok=ok, notes=notes
        )
        doc.update(ode_gate=gate_rows, timed=timed_rows, failures=failures)
        write_json(out_dir, "scale_suite", doc)

    for name in names:
        model = None
        try:
            log(f"scale_suite: building {name}")
            model = build(name, device, dtype)
            log(f"scale_suite: {name} built in {model.build_s:.1f} s; ODE gate")
            n = GATE_OUTPUTS.get(name, 2)
            gate_rows.extend(ode_regression.check_model(model, ["rollout_false", "ode_rollout"], n=n))
            log(f"scale_suite: {name} timed calls")
            timed_rows.extend(timed_calls(model, steps))
        except Exception as exc:
            traceback.print_exc()
            failures.append({"model": name, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        finally:
            if model is not None:
                model.close()
        save()

    ode_regression.report(gate_rows, settings={"models": names}, device=device, out_dir=None)
    print_table("Timed calls (latents only)", timed_rows, COLUMNS)
    save()
    if not all(r["exact"] for r in gate_rows):
        return 1
    return 2 if failures else 0


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help=f"the tiny zoo models ({', '.join(TINY_MODELS)})")
    p.add_argument("--steps", type=int, default=None, help="override every model's step count")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: float32 tiny, bfloat16 real)")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    names = args.models.split(",") if args.models else list(TINY_MODELS if args.tiny else DEFAULT_MODELS)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    return run(names, device=device, dtype=dtype, steps=args.steps, out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
