"""The package's layers, bottom first, and the rule that keeps them: a module never imports one of a
layer above its own. Every import counts, at the top of a file or inside a function.

1. **protocol and step math**: the ``protocol`` package (what server and client share: the wire
   format, checksums, weight versions, the group-sharing rows), the exception hierarchy
   (``errors``) and the scheduler mixins' step math (``scheduler_mixins``);
2. **support**: file safety, hardware checks, speed presets, logging, rewards, the tiny models, the
   test harness (free ports, CLI servers started and stopped);
3. **config**: the typed server configuration;
4. **server**: one engine in one process (pipelines, batching, speed, weights);
5. **cluster**: replicas of the engine on Ray;
6. **entrypoints**: HTTP, the upload port, the CLI;
7. **recipes**: the training recipes' machinery, a trainer of the client's that may also run the
   server in its own process (``--layout in-process``, ``--server thread``).

The client (``diffusion_rollout.client``) imports only layer 1, and the rest of the package never
imports the client, except the recipes, which are written on it. A new top-level module must be placed in a layer here, on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, set[str]]] = [
    (
        "protocol and step math",
        {"protocol", "errors", "scheduler_mixins"},
    ),
    ("support", {"logging_utils", "own_files", "fast_tier_checks", "speed_presets", "rewards", "models", "testing"}),
    ("config", {"config", "config_options", "config_checks"}),
    ("server", {"server"}),
    ("cluster", {"cluster"}),
    ("entrypoints", {"entrypoints"}),
    ("recipes", {"recipes"}),
]  # fmt: skip
CLIENT = "client"
CLIENT_USERS = {"recipes"}  # the units above the client: trainers written on it


def _unit(module: str, package: str) -> str | None:
    """The top-level unit (``server``, ``protocol``, ...) a dotted module name belongs to, or None."""
    parts = module.split(".")
    if parts[0] != package:
        return None
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path, root: Path, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import of ``package`` in one file, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    containing = list(path.relative_to(root).parent.parts)  # the package the file is in
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = containing[: len(containing) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((node.lineno, module))
    return [(line, m) for line, m in found if _unit(m, package) is not None]


def violations(root: Path, package: str = "diffusion_rollout") -> list[str]:
    """Every import that breaks the layering of ``root/package``, one line each."""
    level = {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units}
    names = {i: name for i, (name, _) in enumerate(LAYERS)}
    pkg = root / package
    out = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(root)
        unit = rel.parts[1].removesuffix(".py") if len(rel.parts) > 1 else ""
        if unit in ("", "__init__", "__main__"):
            continue
        if unit != CLIENT and unit not in level:
            out.append(f"{rel}: the unit {unit!r} is in no layer (place it in tests/test_layers.py LAYERS)")
            continue
        for line, module in _imports(path, root, package):
            target = _unit(module, package)
            if target in ("", unit):
                continue
            where = f"{rel}:{line} imports {module}"
            if unit == CLIENT:
                if level.get(target) != 0:
                    out.append(f"{where}: the client imports only the protocol and step math layer")
            elif target == CLIENT:
                if unit not in CLIENT_USERS:
                    out.append(f"{where}: the package never imports the client")
            elif target not in level:
                out.append(f"{where}: {target!r} is in no layer")
            elif level[target] > level[unit]:
                out.append(
                    f"{where}: {names[level[unit]]} imports from {names[level[target]]}, a layer above"
                )
    return out


def test_no_module_imports_from_a_layer_above_its_own():
    assert violations(ROOT) == []


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "diffusion_rollout" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # The server reaching up into the HTTP layer, inside a function (lazy imports count).
        (
            {"server/core/engine.py": "def f():\n    from diffusion_rollout.entrypoints.app import create_app\n"},
            "server/core/engine.py:2 imports diffusion_rollout.entrypoints.app: server imports from entrypoints",
        ),
        # A relative import resolves to the same module.
        (
            {"cluster/replica.py": "from ..entrypoints import upload_listener\n"},
            "cluster/replica.py:1 imports diffusion_rollout.entrypoints: cluster imports from entrypoints",
        ),
        ({"config.py": "import diffusion_rollout.server.speed.fast_tier\n"}, "config imports from server"),
        (
            {"client/sync.py": "from diffusion_rollout.config import ServerConfig\n"},
            "the client imports only",
        ),
        ({"server/x.py": "from diffusion_rollout.client import RolloutClient\n"}, "never imports the client"),
        ({"newthing.py": "x = 1\n"}, "'newthing' is in no layer"),
        # The protocol package is the bottom layer: it never reaches into the server.
        (
            {"protocol/wire.py": "from ..server.core.params import GenerateParams\n"},
            "protocol/wire.py:1 imports diffusion_rollout.server.core.params: protocol and step math imports from server",
        ),
        (
            {"entrypoints/cli.py": "from diffusion_rollout.recipes.ranks import Ranks\n"},
            "entrypoints imports from recipes, a layer above",
        ),
    ],
)
def test_an_upward_import_is_reported(tmp_path, files, expected):
    root = _package(tmp_path, {"__init__.py": "", "server/__init__.py": "", **files})
    found = violations(root)
    assert len(found) == 1 and expected in found[0], found


def test_downward_and_same_layer_imports_pass(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "entrypoints/app.py": "from diffusion_rollout.cluster import ClusterEngine\nfrom . import cli\n",
        "cluster/engine.py": "from diffusion_rollout.server.core.engine import Engine\n",
        "server/core/engine.py": "from diffusion_rollout.config import ServerConfig\n"
                                 "from diffusion_rollout.protocol import wire\n",
        "client/sync.py": "from diffusion_rollout.scheduler_mixins import step\nfrom diffusion_rollout.errors import E\n",
        "protocol/wire.py": "from diffusion_rollout.protocol.safetensors_layout import layout\n"
                            "from diffusion_rollout.errors import E\nfrom . import lean\n",
    })  # fmt: skip
    assert violations(root) == []


# Weight sync is one subsystem behind a facade: the layers above the server (the cluster, the HTTP
# layer) import ``server.weights`` and its transport interface, never a module inside it.
WEIGHTS = "diffusion_rollout.server.weights"
WEIGHTS_FACADE = {WEIGHTS, f"{WEIGHTS}.transports"}


def weights_facade_violations(root: Path, package: str = "diffusion_rollout") -> list[str]:
    """Every import of a ``server.weights`` internal from ``cluster`` or ``entrypoints``, one line each."""
    out = []
    for unit in ("cluster", "entrypoints"):
        for path in sorted((root / package / unit).rglob("*.py")):
            for line, module in _imports(path, root, package):
                if module.startswith(WEIGHTS + ".") and module not in WEIGHTS_FACADE:
                    where = f"{path.relative_to(root / package)}:{line} imports {module}"
                    out.append(f"{where}: use {WEIGHTS} or its transports")
    return out


def test_cluster_and_http_reach_weight_sync_through_its_facade():
    assert weights_facade_violations(ROOT) == []


def test_an_import_past_the_weights_facade_is_reported(tmp_path):
    root = _package(tmp_path, {
        "cluster/weights.py": "from diffusion_rollout.server.weights import Lease\n"
                              "from diffusion_rollout.server.weights.transports import WeightTransactions\n",
        "cluster/replica.py": "def f():\n    from ..server.weights.manager_core import validate_targets\n",
        "entrypoints/upload.py": "from diffusion_rollout.server.weights.receive import Lease\n",
    })  # fmt: skip
    found = weights_facade_violations(root)
    where = [f.split(" imports ")[0] for f in found]
    assert where == ["cluster/replica.py:2", "entrypoints/upload.py:1"], found
    assert "server.weights.manager_core" in found[0]
