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
# Under pytest-xdist (scripts/test.sh runs two workers) every worker gets its own Ray temp dir: a
# plain `ray.init()` joins the cluster named in `<RAY_TMPDIR>/ray/ray_current_cluster`, so without
# this one worker's `ray start --head` (tests/cluster/test_cluster_multinode.py) would capture the other
# worker's Ray tests. Short, because Ray's unix socket paths must fit 107 bytes.
if os.environ.get("PYTEST_XDIST_WORKER") and "RAY_TMPDIR" not in os.environ:
    os.environ["RAY_TMPDIR"] = f"/tmp/dr-{os.environ['PYTEST_XDIST_WORKER']}-{os.getpid()}"
    os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)

import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Tiny models gain nothing from many threads, and CI has two cores.
torch.set_num_threads(min(2, os.cpu_count() or 1))


# What the fast path (``--fast``; ``./scripts/test.sh --fast``) leaves out: tests that build or serve
# a model, start Ray, or are marked slow. What stays is the step math, the wire, the protocol, the
# rewards and the other units: a loop of well under a minute on two cores.
_MODEL_FIXTURES = {"tiny_model_path", "served", "fresh_server", "demo_cache_dir", "cluster", "served_rewards"}
# Files whose tests build their own models, servers or recipe runs (measured over 10 s in a fast run),
# by file name: the names are unique across tests/'s folders.
_INTEGRATION_FILES = {
    "test_benchmarks_smoke.py", "test_examples.py", "test_cli_serve.py", "test_scale_suite.py",
    "test_recipe_reporting.py", "test_docs_site.py", "test_vae_split.py", "test_ltx2_cp_plan.py",
    "test_pipeline_lanes.py", "test_hunyuanvideo15_cp_plan.py", "test_cp_scaling.py",
    "test_ring_attention_diagnosis.py", "test_outside_window.py", "test_flow_grpo_minimal.py",
    "test_zoo_defaults.py", "test_flow_grpo_dropin.py",
}  # fmt: skip


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast", action="store_true", help="only the unit tests: nothing that builds or serves a model, or is slow"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--fast"):
        keep = [
            i for i in items
            if "slow" not in i.keywords and "gpu" not in i.keywords
            and i.path.name not in _INTEGRATION_FILES
            and not _MODEL_FIXTURES & set(getattr(i, "fixturenames", ()))
        ]  # fmt: skip
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    _slow_files_first(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    own = f"/tmp/dr-{os.environ.get('PYTEST_XDIST_WORKER')}-{os.getpid()}"
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("RAY_TMPDIR") == own:
        shutil.rmtree(own, ignore_errors=True)  # this worker's Ray session logs; its clusters are stopped


def _slow_files_first(items: list[pytest.Item]) -> None:
    """Files with more ``slow`` tests run first, each file's tests in their own order.

    scripts/test.sh hands whole files to two xdist workers in this order (``--dist loadfile
    --no-loadscope-reorder``): the long files start at once and the short ones fill the end, so the
    two workers finish close together instead of one waiting on a long file picked last.
    """

    def path(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    slow: dict[str, int] = {}
    for item in items:
        slow[path(item)] = slow.get(path(item), 0) + (item.get_closest_marker("slow") is not None)
    first_seen = {p: i for i, p in enumerate(dict.fromkeys(path(item) for item in items))}
    items.sort(key=lambda item: (-slow[path(item)], first_seen[path(item)]))


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


class ServedModel:
    """A started engine on a tiny model, its app and a TestClient through the real HTTP stack."""

    def __init__(self, path: Path | None, *, pipeline=None, **config_overrides) -> None:
        """Serve the model folder ``path``, or an in-memory ``pipeline`` (``path=None``) for a tiny
        model that cannot be saved here (Qwen-Image-Edit's processor needs torchvision to save)."""
        from fastapi.testclient import TestClient

        from diffusion_rollout.config import ServerConfig
        from diffusion_rollout.entrypoints.app import create_app
        from diffusion_rollout.server.core.engine import Engine
        from diffusion_rollout.server.core.loader import prepare_pipeline

        self.path = path
        model = None if path is None else str(path)
        self.config = ServerConfig(
            **{"model": model, "device": "cpu", "dtype": "float32", **config_overrides}
        )
        loaded = None
        if pipeline is not None:
            loaded = prepare_pipeline(pipeline, device=self.config.resolved_device())
        self.engine = Engine(self.config, loaded=loaded)
        self.engine.start()
        self.app = create_app(self.config, engine=self.engine)
        # A loopback peer, as a trainer on the server's host is (same-host answers check it).
        self.client = TestClient(self.app, client=("127.0.0.1", 50000))
        self.client.__enter__()

    def generate(self, body: dict, *, accept: str = "application/msgpack", expect: int = 200):
        """POST /rollout/generate and decode; asserts the status code."""
        from diffusion_rollout.protocol import wire

        r = self.client.post("/rollout/generate", json=body, headers={"Accept": accept})
        assert r.status_code == expect, r.text[:2000]
        return wire.decode(r.content, r.headers["content-type"]) if expect == 200 else r

    def close(self) -> None:
        self.client.__exit__(None, None, None)
        self.engine.stop(grace_s=5)


@pytest.fixture(scope="session")
def served(tiny_model_path) -> Callable[[str], ServedModel]:
    """``served(family)``: a shared, session-wide server on the tiny model (do not pause or mutate it)."""
    servers: dict[str, ServedModel] = {}

    def get(family: str) -> ServedModel:
        if family not in servers:
            servers[family] = ServedModel(tiny_model_path(family))
        return servers[family]

    yield get
    for s in servers.values():
        s.close()


@pytest.fixture
def fresh_server(tiny_model_path):
    """``fresh_server(family, **config)``: a private server for tests that pause, fill or change it."""
    made: list[ServedModel] = []

    def make(family: str, **overrides) -> ServedModel:
        s = ServedModel(tiny_model_path(family), **overrides)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
