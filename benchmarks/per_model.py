"""The frame of a suite that builds one model at a time (``family_gate``, ``scale_suite``).

Each model is built, measured, freed and the results so far saved before the next is built, so a run
stopped at its time limit keeps what finished; a model that fails is recorded and the next one runs.
"""

from __future__ import annotations

import argparse
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks.cli import base_parser, resolve_device
from benchmarks.model_builders import BenchModel, build
from benchmarks.report import log


def parser(description: str, tiny_models: Sequence[str], steps_help: str) -> argparse.ArgumentParser:
    """``base_parser`` with the suite options: ``--tiny``, ``--steps`` and ``--dtype``."""
    p = base_parser(description)
    p.add_argument("--tiny", action="store_true", help=f"the tiny zoo models ({', '.join(tiny_models)})")
    p.add_argument("--steps", type=int, default=None, help=steps_help)
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: float32 tiny, bfloat16 real)")
    return p


def choice(
    args: argparse.Namespace, tiny_models: Sequence[str], default_models: Sequence[str]
) -> tuple[str, list[str], torch.dtype | None]:
    """The device, the model names (``--models``, else the tiny or the default set) and the dtype."""
    device = resolve_device(args.device)
    names = args.models.split(",") if args.models else list(tiny_models if args.tiny else default_models)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    return device, names, dtype


def each_model(
    tag: str,
    names: Sequence[str],
    *,
    device: str,
    dtype: torch.dtype | None,
    measure: Callable[[BenchModel], None],
    save: Callable[[], Any],
    failures: list[dict[str, str]],
) -> None:
    """Build each model, ``measure`` it, free it, then ``save``; a failure goes to ``failures``."""
    for name in names:
        model = None
        try:
            log(f"{tag}: building {name}")
            model = build(name, device, dtype)
            log(f"{tag}: {name} built in {model.build_s:.1f} s")
            measure(model)
        except Exception as exc:
            traceback.print_exc()
            failures.append({"model": name, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        finally:
            if model is not None:
                model.close()
        save()


def failure_notes(failures: list[dict[str, str]]) -> list[str]:
    return [f"FAILED {f['model']}: {f['error']}" for f in failures]


def exit_status(gate_rows: list[dict[str, Any]], failures: list[dict[str, str]]) -> int:
    """1 when the ODE gate found a difference, 2 when a model failed, else 0."""
    if not all(r["exact"] for r in gate_rows):
        return 1
    return 2 if failures else 0
