"""Shared test setup: the hub is off, torch uses few threads, tiny models are built once per session.

Fixtures:

- ``tiny_model_path(family) -> Path``: the folder of the tiny ``family`` model (seed 0), saved on
  first request into a session temp dir and shared by every test afterwards. Treat it as read-only;
  copy it (``shutil.copytree``) before changing anything in it.
- ``demo_cache_dir -> Path``: a cache dir that already holds the demo model (``demo-sd3``), for
  tests that start the server with ``DIFFUSION_ROLLOUT_CACHE`` pointing there.

Tests marked ``@pytest.mark.gpu`` are skipped when CUDA is unavailable.
"""

from __future__ import annotations

import os

# Before anything imports huggingface_hub / transformers: no test may reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Tiny models gain nothing from many threads, and CI has two cores.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    from diffusion_rollout.models import save_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[str, Path] = {}
    lock = threading.Lock()

    def get(family: str) -> Path:
        with lock:
            if family not in built:
                built[family] = save_tiny_model(family, root / family)
            return built[family]

    return get


@pytest.fixture(scope="session")
def demo_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusion_rollout.models import ensure_demo_model

    cache = tmp_path_factory.mktemp("demo-cache")
    ensure_demo_model(cache)
    return cache
