"""Tiny offline model zoo: complete, randomly initialised diffusers pipelines of every family.

Nothing here touches a model hub. ``build_tiny_pipeline`` makes a pipeline in memory,
``save_tiny_model`` writes it as an ordinary diffusers folder (loadable with
``DiffusionPipeline.from_pretrained``), and ``ensure_demo_model`` keeps the cached demo model the
server uses when it is started without ``--model``. ``REAL_SCHEDULER_CONFIGS`` holds the scheduler
configuration each real checkpoint ships, for the zoo and for benchmarks on real architectures.

The family names (``FAMILIES``, ``IMAGE_FAMILIES``) import nothing heavy; everything else is
imported on first use (the builders import every family's diffusers classes, seconds).
"""

from __future__ import annotations

import importlib
from typing import Any

from .family_names import FAMILIES, IMAGE_FAMILIES, REQUEST_DEFAULTS_FILE

_LAZY = {
    "DEMO_FAMILY": ".demo",
    "ensure_demo_model": ".demo",
    "REAL_SCHEDULER_CONFIGS": ".scheduler_configs",
    "WAN22_A14B_BOUNDARY_RATIO": ".scheduler_configs",
    "make_real_scheduler": ".scheduler_configs",
    "TINY_CALL_DEFAULTS": ".tiny",
    "build_tiny_pipeline": ".tiny",
    "family_of": ".tiny",
    "save_tiny_model": ".tiny",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "DEMO_FAMILY",
    "FAMILIES",
    "IMAGE_FAMILIES",
    "REAL_SCHEDULER_CONFIGS",
    "REQUEST_DEFAULTS_FILE",
    "TINY_CALL_DEFAULTS",
    "WAN22_A14B_BOUNDARY_RATIO",
    "build_tiny_pipeline",
    "ensure_demo_model",
    "family_of",
    "make_real_scheduler",
    "save_tiny_model",
]
