"""A compile cache that survives restarts (``--compile-cache DIR``, issue #43).

Design decisions:

- One subfolder per **key**: the torch version (and its CUDA build), the device (GPU name and
  compute capability, or the CPU's architecture), the model (its resolved path and a hash of its
  ``model_index.json`` and every component's ``config.json``), and the options that change the
  compiled graphs (dtype, quantize, attention backend). A server with another torch, GPU, model or
  option set gets another folder and never loads a stale artifact; torch's own cache keys (which
  cover the graph and the inductor configuration) check the rest.
- Inductor's on-disk caches (FX graph cache, AOTAutograd cache, compiled C++/Triton kernels) are
  pointed at ``<key>/inductor`` through ``TORCHINDUCTOR_CACHE_DIR``, which inductor reads on each
  use: set before the first compile, every later start with the same key reads it.
- After the warm-up, ``torch.compiler.save_cache_artifacts()`` is also written to
  ``<key>/artifacts.bin`` and loaded at the next start (``load_cache_artifacts``): a portable copy
  that can be carried to a fresh machine of the same kind (copy the key folder).
- ``<key>/warmup.json`` keeps the last warm-up's seconds: the estimate ``/health`` shows while the
  next one runs.
- Writing the environment variable is the one side effect; reading configuration stays in
  ``config.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
ARTIFACTS = "artifacts.bin"
WARMUP_RECORD = "warmup.json"


def _device_facts(device: str) -> dict[str, Any]:
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(device)
        return {
            "kind": "cuda",
            "name": torch.cuda.get_device_name(dev),
            "capability": list(torch.cuda.get_device_capability(dev)),
            "cuda": torch.version.cuda,
        }
    return {"kind": device.split(":")[0], "machine": platform.machine(), "processor": platform.processor()}


def model_fingerprint(path: str | None) -> dict[str, Any]:
    """The model's resolved path and a hash of its configuration files (not of its weights: the
    compiled graphs depend on the architecture, and weights change with every update)."""
    if not path:
        return {"path": None, "config_sha256": None}
    root = Path(path).resolve()
    digest = hashlib.sha256()
    files = [root / "model_index.json", *sorted(root.glob("*/config.json"))]
    for f in files:
        if f.is_file():
            digest.update(f.relative_to(root).as_posix().encode())
            digest.update(f.read_bytes())
    return {"path": str(root), "config_sha256": digest.hexdigest()}


def cache_key(
    *,
    model_path: str | None,
    device: str,
    dtype: torch.dtype,
    quantize: str | None,
    attention_backend: str | None,
) -> tuple[str, dict[str, Any]]:
    """The key's short name and the facts it hashes."""
    facts = {
        "torch": torch.__version__,
        "device": _device_facts(device),
        "model": model_fingerprint(model_path),
        "dtype": str(dtype).replace("torch.", ""),
        "quantize": quantize,
        "attention_backend": attention_backend,
        "python": platform.python_version(),
    }
    blob = json.dumps(facts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16], facts


@dataclass
class CompileCache:
    """One key's folder: where inductor writes, and the saved artifacts of the last warm-up."""

    root: Path
    key: str
    facts: dict[str, Any]
    loaded_artifacts: int = 0  # artifacts hot-loaded at start (0: none saved yet)
    saved_bytes: int = 0

    @property
    def folder(self) -> Path:
        return self.root / self.key

    def activate(self) -> None:
        """Point inductor at this key's folder and load the saved artifacts, if any."""
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "key.json").write_text(json.dumps(self.facts, indent=1, sort_keys=True))
        os.environ[INDUCTOR_ENV] = str(self.folder / "inductor")
        path = self.folder / ARTIFACTS
        if path.is_file():
            try:
                info = torch.compiler.load_cache_artifacts(path.read_bytes())
            except Exception as exc:  # a damaged file costs a cold compile, never the start
                logger.warning("compile cache: could not load %s (%s); compiling afresh", path, exc)
            else:
                self.loaded_artifacts = _count(info)
        logger.info(
            "compile cache: %s (key %s; %d saved artifacts loaded)",
            self.folder, self.key, self.loaded_artifacts,
        )  # fmt: skip

    def save(self, warmup_s: float) -> None:
        """After the warm-up: the artifacts compiled in this process, and how long it took."""
        try:
            saved = torch.compiler.save_cache_artifacts()
        except Exception as exc:
            logger.warning("compile cache: could not save artifacts (%s)", exc)
            saved = None
        if saved is not None:
            blob = saved[0]
            tmp = self.folder / (ARTIFACTS + ".tmp")
            tmp.write_bytes(blob)
            tmp.replace(self.folder / ARTIFACTS)
            self.saved_bytes = len(blob)
        (self.folder / WARMUP_RECORD).write_text(json.dumps({"warmup_s": warmup_s}))

    def last_warmup_s(self) -> float | None:
        try:
            return float(json.loads((self.folder / WARMUP_RECORD).read_text())["warmup_s"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def report(self) -> dict[str, Any]:
        return {
            "folder": str(self.folder),
            "key": self.key,
            "keyed_on": self.facts,
            "artifacts_loaded": self.loaded_artifacts,
            "artifacts_saved_bytes": self.saved_bytes,
        }


def _count(info: Any) -> int:
    """Artifacts in a ``CacheInfo`` (lists of keys per kind), counted loosely across torch versions."""
    if info is None:
        return 0
    total = 0
    for value in vars(info).values():
        if isinstance(value, (list, tuple)):
            total += len(value)
        elif isinstance(value, dict):
            total += sum(len(v) if isinstance(v, (list, tuple)) else 1 for v in value.values())
    return total
