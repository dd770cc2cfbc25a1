"""What a figure was measured on: the device, the commit, the library versions and the host.

Every benchmark's JSON carries these ``facts`` so that a RESULTS.md row can say where its number
came from. The commit is ``$BENCH_COMMIT`` when set (the device machine receives a copy of the
working tree without ``.git``), else ``git rev-parse HEAD``, with ``+dirty`` when the tree has local
changes. Facts are collected once per process: the version look-ups and ``git`` calls are not free,
and every document a process writes describes the same machine.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
_VERSIONED = (
    "torch", "diffusers", "transformers", "accelerate", "peft", "safetensors", "fastapi", "starlette",
    "uvicorn", "pydantic", "httpx", "msgpack", "numpy", "triton", "diffusion-rollout",
)  # fmt: skip


def commit() -> str:
    env = os.environ.get("BENCH_COMMIT")
    if env:
        return env
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["cudnn"] = str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None
    return out


_FACTS: dict[str, Any] | None = None


def facts(device: str) -> dict[str, Any]:
    """Device, commit, versions, host: collected once per process."""
    from diffusion_rollout.entrypoints.cli import missing_bytecode

    global _FACTS
    if _FACTS is None or _FACTS["device"] != device:
        info: dict[str, Any] = {
            "device": device,
            "device_name": platform.processor() or platform.machine(),
            "commit": commit(),
            "versions": versions(),
            "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "torch_threads": torch.get_num_threads(),
            # Start-up figures depend on it (RESULTS fast-start-bytecode): None when byte code is fine.
            "python_bytecode": missing_bytecode(),
        }
        if device.startswith("cuda"):
            props = torch.cuda.get_device_properties(device)
            info["device_name"] = props.name
            info["gpu"] = {
                "memory_gib": round(props.total_memory / 2**30, 1),
                "multiprocessors": props.multi_processor_count,
                "capability": f"{props.major}.{props.minor}",
            }
        _FACTS = info
    return _FACTS
