"""The command line the model benchmarks share: ``--out``, ``--device``, ``--models``, the device
``auto`` resolves to, and the libraries' per-call warnings turned off.

One parser base so that every benchmark takes the same three options with the same meaning (a run
on the device machine is the same command with ``--device cuda``).
"""

from __future__ import annotations

import argparse

import torch


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=None, help="folder for the JSON result (default: none)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument(
        "--models",
        default=None,
        help="comma-separated model names (tiny-<family> or sd3.5-medium, flux.1-dev, wan2.1-1.3b); "
        "default: tiny models on CPU, real architectures on CUDA",
    )
    return p


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def quiet_libraries() -> None:
    """Silence the libraries' per-call warnings (truncated prompts, experimental attention backends)."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
