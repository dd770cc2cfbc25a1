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

The Wan image-to-video pipeline cleans prompts with ``ftfy`` (a dependency of the project): on the
device machine carry its wheels too (``fetch_wheels.sh ftfy wcwidth``).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from benchmarks import model_builders_scale, ode_regression, per_model, rollout_overhead
from benchmarks.bodies import SDE_ROLLOUT_ENV, request_body, size_label
from benchmarks.cli import quiet_libraries
from benchmarks.model_builders import BenchModel
from benchmarks.report import document, log, print_table, write_json
from benchmarks.timing import peak_gib, reset_peak

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


def timed_calls(model: BenchModel, steps: int | None) -> list[dict[str, Any]]:
    """Stock, ``rollout=false`` and an SDE rollout (one window per expert), latents only."""
    srv = model.server()
    body = request_body(
        model, rollout_overhead.PROMPT, num_outputs_per_prompt=1, return_generated_output=False
    )
    if steps:
        body["num_inference_steps"] = steps
    T = body["num_inference_steps"]
    experts = model.pipe.config.get("boundary_ratio") is not None
    sde = {**body, **SDE_ROLLOUT_ENV}
    if experts:
        sde["rollout_sde_step_indices"] = [0, T - 1]
    size = size_label(body)
    stock = rollout_overhead.stock_runner(model, body, output_type="latent")
    rows: list[dict[str, Any]] = []
    for variant, req in (("stock", None), ("server_plain", {**body, "rollout": False}), ("server_sde", sde)):
        reset_peak(model.device)
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
            "peak_gib": peak_gib(model.device),
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
        notes = per_model.failure_notes(failures)
        doc = document(
            "scale_suite", device, {"models": names, "steps_override": steps}, gate_rows, ok=ok, notes=notes
        )
        doc.update(ode_gate=gate_rows, timed=timed_rows, failures=failures)
        write_json(out_dir, "scale_suite", doc)

    def measure(model: BenchModel) -> None:
        log(f"scale_suite: {model.name} ODE gate")
        n = GATE_OUTPUTS.get(model.name, 2)
        gate_rows.extend(ode_regression.check_model(model, ["rollout_false", "ode_rollout"], n=n))
        log(f"scale_suite: {model.name} timed calls")
        timed_rows.extend(timed_calls(model, steps))

    per_model.each_model(
        "scale_suite", names, device=device, dtype=dtype, measure=measure, save=save, failures=failures
    )

    ode_regression.report(gate_rows, settings={"models": names}, device=device, out_dir=None)
    print_table("Timed calls (latents only)", timed_rows, COLUMNS)
    save()
    return per_model.exit_status(gate_rows, failures)


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    p = per_model.parser(__doc__.splitlines()[0], TINY_MODELS, "override every model's step count")
    args = p.parse_args(argv)
    device, names, dtype = per_model.choice(args, TINY_MODELS, DEFAULT_MODELS)
    return run(names, device=device, dtype=dtype, steps=args.steps, out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
