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
import traceback
from typing import Any

import torch

from benchmarks import ode_regression, rollout_overhead
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

DEFAULT_MODELS = ("flux.2-klein-4b", "z-image-turbo")
TINY_MODELS = ("tiny-flux2-klein", "tiny-zimage")
MEMORY_COLUMNS = [
    ("model", "model", ""),
    ("weights_gib", "weights GiB", ".2f"),
    ("peak_stock_gib", "peak stock GiB", ".2f"),
    ("peak_rollout_gib", "peak SDE rollout GiB", ".2f"),
]


def _gib(n: int) -> float:
    return n / 2**30


def peak_memory(model: BenchModel) -> dict[str, Any]:
    """Peak allocated bytes of one stock call and of one SDE rollout request, each from a reset."""
    row: dict[str, Any] = {"model": model.name}
    weights = sum(
        p.numel() * p.element_size()
        for m in model.pipe.components.values()
        if isinstance(m, torch.nn.Module)
        for p in m.parameters()
    )
    row["weights_gib"] = _gib(weights)
    if not model.device.startswith("cuda"):
        row["peak_stock_gib"] = row["peak_rollout_gib"] = None
        return row
    body = {
        "prompt": rollout_overhead.PROMPT,
        "seed": 0,
        "num_outputs_per_prompt": 1,
        "generator_device": model.generator_device,
        **model.defaults,
    }
    stock = rollout_overhead.stock_runner(model, body)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    stock()
    torch.cuda.synchronize()
    row["peak_stock_gib"] = _gib(torch.cuda.max_memory_allocated())
    torch.cuda.reset_peak_memory_stats()
    model.server().remote().time_one({**body, **rollout_overhead.ROLLOUT})
    torch.cuda.synchronize()
    row["peak_rollout_gib"] = _gib(torch.cuda.max_memory_allocated())
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
            notes=[f"FAILED {f['model']}: {f['error']}" for f in failures],
        )
        doc.update(ode_gate=ode_rows, speed=speed_rows, memory=memory_rows, failures=failures)
        write_json(out_dir, "family_gate", doc)
        return doc

    for name in names:
        model = None
        try:
            log(f"family_gate: building {name}")
            model = build(name, device, dtype)
            log(f"family_gate: {name} built in {model.build_s:.1f} s; ODE gate")
            ode_rows.extend(ode_regression.check_model(model, ["rollout_false", "ode_rollout"]))
            log(f"family_gate: {name} speed")
            speed_rows.extend(rollout_overhead.measure_model(model, reps=reps, steps=steps))
            memory_rows.append(peak_memory(model))
        except Exception as exc:
            traceback.print_exc()
            failures.append({"model": name, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        finally:
            if model is not None:
                model.close()
        save()

    ode_regression.report(ode_rows, settings={"models": names}, device=device, out_dir=None)
    print_table("Speed: SDE rollout over HTTP vs stock pipeline", speed_rows, rollout_overhead.COLUMNS)
    print_table("Peak memory", memory_rows, MEMORY_COLUMNS)
    save()
    if not all(r["exact"] for r in ode_rows):
        return 1
    return 2 if failures else 0


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help=f"the tiny zoo models ({', '.join(TINY_MODELS)})")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="override the step count of the speed runs")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: float32 tiny, bfloat16 real)")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    names = args.models.split(",") if args.models else list(TINY_MODELS if args.tiny else DEFAULT_MODELS)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    return run(names, device=device, dtype=dtype, reps=args.reps, steps=args.steps, out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
