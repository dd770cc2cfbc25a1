"""One command per batch of families: the bit-exact ODE gate, ms/step and peak memory, per model.

For each model, built once (real architectures from their public configs with random weights, on the
device, bf16; or ``tiny-<family>`` zoo models), in this order:

1. **ODE gate** (``ode_regression.check_model``): the stock pipeline vs the server with
   ``rollout=false`` and with an all-ODE rollout, latents and decoded images, two outputs per
   request; every max |difference| must be 0.
2. **Speed** (``rollout_overhead.measure_model``): the stock pipeline (precomputed embeddings) vs
   ``rollout=false`` and a full SDE rollout (log-probs, trajectory, ``denoising_env``) over loopback
   HTTP; median of ``--reps``, ms/step of the whole call.
3. **Peak memory** (CUDA only): ``torch.cuda.max_memory_allocated`` over one stock call and over one
   SDE rollout request, each from a reset, with the weights resident.

Each model is freed before the next is built. Writes ``family_gate.json`` under ``--out`` (the rows
of all three parts, the device, commit and versions) after every model, so a run stopped at its time
limit keeps what finished. Exit status 1 when the gate found a difference, 2 when a model failed.

    python -m benchmarks.family_gate --device cuda --out $OUT     # FLUX.2 klein 4B, Z-Image-Turbo
    python -m benchmarks.family_gate --device cpu --tiny           # the same on the tiny zoo models
    python -m benchmarks.family_gate --device cuda --models hunyuanvideo-1.5-480p,ltx-2 --out $OUT
    python -m benchmarks.family_gate --device cpu --models tiny-hunyuanvideo15,tiny-ltx2   # its dry run
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from benchmarks import ode_regression, per_model, rollout_overhead
from benchmarks.bodies import SDE_ROLLOUT_ENV, request_body
from benchmarks.cli import quiet_libraries
from benchmarks.model_builders import BenchModel
from benchmarks.report import document, log, print_table, write_json
from benchmarks.timing import peak_gib, reset_peak

DEFAULT_MODELS = ("flux.2-klein-4b", "z-image-turbo")
TINY_MODELS = ("tiny-flux2-klein", "tiny-zimage")
MEMORY_COLUMNS = [
    ("model", "model", ""),
    ("weights_gib", "weights GiB", ".2f"),
    ("peak_stock_gib", "peak stock GiB", ".2f"),
    ("peak_rollout_gib", "peak SDE rollout GiB", ".2f"),
]


def peak_memory(model: BenchModel) -> dict[str, Any]:
    """Peak allocated bytes of one stock call and of one SDE rollout request, each from a reset."""
    row: dict[str, Any] = {"model": model.name}
    weights = sum(
        p.numel() * p.element_size()
        for m in model.pipe.components.values()
        if isinstance(m, torch.nn.Module)
        for p in m.parameters()
    )
    row["weights_gib"] = weights / 2**30
    if not model.device.startswith("cuda"):
        row["peak_stock_gib"] = row["peak_rollout_gib"] = None
        return row
    body = request_body(model, rollout_overhead.PROMPT, num_outputs_per_prompt=1)
    stock = rollout_overhead.stock_runner(model, body)
    reset_peak(model.device)
    stock()
    row["peak_stock_gib"] = peak_gib(model.device)
    reset_peak(model.device)
    model.server().remote().time_one({**body, **SDE_ROLLOUT_ENV})
    row["peak_rollout_gib"] = peak_gib(model.device)
    return row


def run(names: list[str], *, device: str, dtype, reps: int, steps: int | None, out_dir) -> int:
    ode_rows: list[dict[str, Any]] = []
    speed_rows: list[dict[str, Any]] = []
    memory_rows: list[dict[str, Any]] = []
    failures: list[dict[str, str]] = []

    def save() -> dict[str, Any]:
        ok = bool(ode_rows) and all(r["exact"] for r in ode_rows)
        doc = document(
            "family_gate",
            device,
            {"models": names, "reps": reps, "steps_override": steps},
            ode_rows,
            ok=ok and not failures,
            notes=per_model.failure_notes(failures),
        )
        doc.update(ode_gate=ode_rows, speed=speed_rows, memory=memory_rows, failures=failures)
        write_json(out_dir, "family_gate", doc)
        return doc

    def measure(model: BenchModel) -> None:
        log(f"family_gate: {model.name} ODE gate")
        ode_rows.extend(ode_regression.check_model(model, ["rollout_false", "ode_rollout"]))
        log(f"family_gate: {model.name} speed")
        speed_rows.extend(rollout_overhead.measure_model(model, reps=reps, steps=steps))
        memory_rows.append(peak_memory(model))

    per_model.each_model(
        "family_gate", names, device=device, dtype=dtype, measure=measure, save=save, failures=failures
    )

    ode_regression.report(ode_rows, settings={"models": names}, device=device, out_dir=None)
    print_table("Speed: SDE rollout over HTTP vs stock pipeline", speed_rows, rollout_overhead.COLUMNS)
    print_table("Peak memory", memory_rows, MEMORY_COLUMNS)
    save()
    return per_model.exit_status(ode_rows, failures)


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    p = per_model.parser(__doc__.splitlines()[0], TINY_MODELS, "override the step count of the speed runs")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    device, names, dtype = per_model.choice(args, TINY_MODELS, DEFAULT_MODELS)
    return run(names, device=device, dtype=dtype, reps=args.reps, steps=args.steps, out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
