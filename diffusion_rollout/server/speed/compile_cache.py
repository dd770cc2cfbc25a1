"""A compile cache that survives restarts (``--compile-cache DIR``).

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
- **Only the server's own cache is used** (``own_files.py``): the key folder, every entry
  under it (``inductor/`` included) and the folders above it must belong to the server's user and be
  writable by no one else, with no symbolic link inside. Loading the cache runs what is in it (torch
  unpickles the artifacts and blocks, and inductor imports the ``.py`` and ``.so`` files it finds), so
  a folder that fails the check is refused whole, in one log line: nothing is read from it, nothing
  written into it, and inductor compiles into a fresh private temporary folder instead. Folders made
  here are 0700 and files are written without following links.
- Writing the environment variable is the one side effect; reading configuration stays in
  ``config.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffusion_rollout.errors import UntrustedFileError
from diffusion_rollout.own_files import (
    make_private_dirs,
    read_own,
    why_not_own_or_makeable,
    why_not_own_tree,
    write_private,
)

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
    refused: str | None = None  # why the folder is not the server's own (then nothing is read or written)

    @property
    def folder(self) -> Path:
        return self.root / self.key

    @property
    def trusted(self) -> bool:
        return self.refused is None

    def activate(self) -> None:
        """Point inductor at this key's folder and load the saved artifacts, if any; or, when the
        folder is not the server's own, refuse it and point inductor at a private temporary one."""
        self.refused = why_not_own_or_makeable(self.folder)
        if self.refused is None:
            make_private_dirs(self.folder / "inductor")  # inductor would make it with the umask's mode
            self.refused = why_not_own_tree(self.folder)
        if self.refused is not None:
            private = tempfile.mkdtemp(prefix="diffusion-rollout-inductor-")
            os.environ[INDUCTOR_ENV] = private
            logger.warning(
                "compile cache: refusing %s, it is not the server's own: %s; nothing is loaded from it, "
                "every graph compiles afresh into %s (docs/operations.md#security-what-the-server-trusts-on-disk)",
                self.folder, self.refused, private,
            )  # fmt: skip
            return
        write_private(self.folder / "key.json", json.dumps(self.facts, indent=1, sort_keys=True))
        os.environ[INDUCTOR_ENV] = str(self.folder / "inductor")
        path = self.folder / ARTIFACTS
        if path.is_file():
            try:
                info = torch.compiler.load_cache_artifacts(read_own(path))
            except UntrustedFileError as exc:  # swapped in after the folder's check
                logger.warning("compile cache: refusing %s (%s); compiling afresh", path, exc)
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
        if not self.trusted:
            return
        try:
            saved = torch.compiler.save_cache_artifacts()
        except Exception as exc:
            logger.warning("compile cache: could not save artifacts (%s)", exc)
            saved = None
        if saved is not None:
            blob = saved[0]
            write_private(self.folder / ARTIFACTS, blob)
            self.saved_bytes = len(blob)
        write_private(self.folder / WARMUP_RECORD, json.dumps({"warmup_s": warmup_s}))

    def last_warmup_s(self) -> float | None:
        if not self.trusted:
            return None
        try:
            return float(json.loads(read_own(self.folder / WARMUP_RECORD))["warmup_s"])
        except (OSError, UntrustedFileError, ValueError, KeyError, TypeError):
            return None

    def report(self) -> dict[str, Any]:
        return {
            "folder": str(self.folder),
            "key": self.key,
            "keyed_on": self.facts,
            "artifacts_loaded": self.loaded_artifacts,
            "artifacts_saved_bytes": self.saved_bytes,
            "refused": self.refused,
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
