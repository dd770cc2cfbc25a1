"""Bit-exact ODE regression: stock diffusers pipeline vs the server, per family. Exit 1 on any difference.

For every model it runs the stock pipeline (called as a user would: prompt string, a list of
per-sample generators, ``num_images_per_prompt``), then the server over loopback HTTP with
``rollout=false`` and with all-ODE rollouts (``rollout_sde_type="ode"``; on CPU also an SDE rollout
with an empty ``rollout_sde_step_indices``), and prints max |difference| of latents
(``output_type="latent"`` / ``return_generated_output=false``) and of decoded images or videos.
Every value must be exactly 0: this is the gate to run after upgrading torch or diffusers.

Reference per mode: ``rollout=false`` against the checkpoint's own stock scheduler; ODE rollouts
against the stock pipeline with the scheduler a rollout runs on (the same one, except Wan: flow-match
Euler at the checkpoint's ``flow_shift`` instead of UniPC, see ``server/families/wan.py``).

The gate is defined for the eager path; a server started with ``compile`` or another
``attention_backend`` is not bit-identical and is not what this checks.

    python -m benchmarks.ode_regression                    # CPU: every tiny family served
    python -m benchmarks.ode_regression --device cuda --models sd3.5-medium,flux.1-dev --out bench_out
    python -m benchmarks.ode_regression --device cuda --dtype bfloat16 \
        --models tiny-sd3,tiny-flux,tiny-qwenimage,tiny-wan,tiny-wan2.2   # every family on the GPU
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from benchmarks.bodies import request_body
from benchmarks.cli import base_parser, quiet_libraries, resolve_device
from benchmarks.model_builders import BenchModel, built_models, default_models
from benchmarks.report import document, log, print_table, write_json

PROMPT = "a red cat sitting on a blue sofa, studio light"
MODES: dict[str, dict[str, Any]] = {
    "rollout_false": {"rollout": False},
    "ode_rollout": {
        "rollout_sde_type": "ode",
        "rollout_log_prob_no_const": True,
        "rollout_debug_mode": False,
    },
    "no_sde_steps": {
        "rollout_sde_step_indices": [],
        "rollout_log_prob_no_const": True,
        "rollout_debug_mode": False,
    },
}
COLUMNS = [
    ("model", "model", ""),
    ("mode", "server mode", ""),
    ("output", "output", ""),
    ("shape", "shape", ""),
    ("max_abs_diff", "max |diff|", ".3g"),
    ("exact", "bit-exact", ""),
    ("nonfinite", "non-finite", ""),
]


def compare(server: torch.Tensor, stock: torch.Tensor) -> dict[str, Any]:
    """Exact equality (NaN where the other has NaN counts as equal) and max |difference|."""
    a, b = server.detach().float().cpu(), stock.detach().float().cpu()
    if a.shape != b.shape:
        return {"exact": False, "max_abs_diff": float("inf"), "nonfinite": None, "shape": list(a.shape)}
    same = (a == b) | (a.isnan() & b.isnan())
    finite = torch.isfinite(a) & torch.isfinite(b)
    diff = (a - b).abs()[finite]
    return {
        "exact": bool(same.all()),
        "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
        "nonfinite": int((~torch.isfinite(b)).sum()),
        "shape": list(a.shape),
    }


def stock_reference(model: BenchModel, pipe: Any, body: dict[str, Any], output_type: str) -> torch.Tensor:
    kwargs = model.stock_kwargs(pipe, body)
    with torch.inference_mode():
        out = pipe(output_type=output_type, **kwargs)
    return model.stock_output(pipe, out, decoded=output_type != "latent").float().cpu()


def check_model(model: BenchModel, modes: list[str], n: int = 2) -> list[dict[str, Any]]:
    srv = model.server()
    body = request_body(model, PROMPT, seed=7, num_outputs_per_prompt=n)
    rows = []
    for output_type in ("latent", "pt"):
        if output_type == "pt" and model.decodes_one_video_per_call:
            body = {**body, "num_outputs_per_prompt": 1}
        refs = {"stock": stock_reference(model, model.stock, body, output_type)}
        if any(m != "rollout_false" for m in modes):
            refs["stock_ode"] = (
                refs["stock"]
                if model.stock_ode is model.stock
                else stock_reference(model, model.stock_ode, body, output_type)
            )
        for mode in modes:
            req = {**body, **MODES[mode], "return_generated_output": output_type != "latent"}
            results, _ = srv.generate(req)
            got = torch.stack([r["generated_output"] for r in results])
            ref = refs["stock" if mode == "rollout_false" else "stock_ode"]
            row = {
                "model": model.name,
                "family": model.family,
                "mode": mode,
                "output": "latents"
                if output_type == "latent"
                else ("videos" if model.is_video else "images"),
                "reference": "stock"
                if mode == "rollout_false" or model.stock_ode is model.stock
                else "stock_euler",
                **compare(got, ref),
            }
            if mode != "rollout_false":
                lp = torch.stack([r["rollout_log_probs"] for r in results])
                row["log_probs_all_zero"] = bool((lp == 0).all())
            rows.append(row)
    return rows


def report(
    rows: list[dict[str, Any]], *, settings: dict[str, Any], device: str, out_dir=None
) -> dict[str, Any]:
    ok = bool(rows) and all(r["exact"] for r in rows)
    notes = [] if ok else ["NOT bit-exact: see rows with exact=false"]
    table = print_table("ODE regression: max |difference| vs the stock pipeline (must be 0)", rows, COLUMNS)
    doc = document("ode_regression", device, {"prompt": PROMPT, "outputs_per_request": 2, **settings}, rows,
                   ok=ok, notes=notes)  # fmt: skip
    doc["table"] = table
    write_json(out_dir, "ode_regression", doc)
    return doc


def run(
    models: list[BenchModel], *, out_dir=None, modes: list[str] | None = None, device: str = "cpu"
) -> dict[str, Any]:
    modes = modes or list(MODES)
    rows: list[dict[str, Any]] = []
    for model in models:
        log(f"ode_regression: {model.name}")
        rows.extend(check_model(model, modes))
    settings = {
        "models": [m.name for m in models],
        "modes": modes,
        "defaults": {m.name: m.defaults for m in models},
    }
    return report(rows, settings=settings, device=device, out_dir=out_dir)


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--modes", default=None, help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument(
        "--dtype", default=None, help="float32 or bfloat16 (default: float32 tiny models, bfloat16 real ones)"
    )
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    device = resolve_device(args.device)
    names = args.models.split(",") if args.models else default_models(device)
    modes = args.modes.split(",") if args.modes else None
    with built_models(names, device, dtype) as models:
        doc = run(models, out_dir=args.out, modes=modes, device=device)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
