"""The built-in demo model: a tiny random SD3 pipeline generated on first use and cached.

``ensure_demo_model(cache_dir)`` returns ``<cache_dir>/demo-sd3``, building it the first time. The
folder only ever appears complete: it is saved into a private temporary folder beside it and moved
into place with one ``os.replace`` (a rename, atomic on one filesystem). When two processes race,
both build, the first rename wins and the loser discards its copy and uses the winner's; since the
build is deterministic the two copies are identical anyway. A folder without ``model_index.json``
at the final path (left by hand, not by this code) is moved aside and rebuilt.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import tempfile
from pathlib import Path

from .tiny import save_tiny_model

__all__ = ["DEMO_FAMILY", "DEMO_MODEL_DIRNAME", "ensure_demo_model"]

logger = logging.getLogger(__name__)

DEMO_FAMILY = "sd3"
DEMO_MODEL_DIRNAME = "demo-sd3"
_DEMO_SEED = 0


def _is_complete(folder: Path) -> bool:
    return (folder / "model_index.json").is_file()


def ensure_demo_model(cache_dir: str | Path) -> Path:
    """Path of the cached tiny demo SD3 model under ``cache_dir``, generated there on first use."""
    cache = Path(cache_dir).expanduser()
    target = cache / DEMO_MODEL_DIRNAME
    if not _is_complete(target):
        cache.mkdir(parents=True, exist_ok=True)
        _build_into_place(target)
    logger.warning(
        "using the built-in RANDOM demo model at %s: a tiny SD3 pipeline with random weights, so its "
        "outputs are noise; pass --model /path/to/diffusers/folder to serve a real model",
        target,
    )
    return target


def _build_into_place(target: Path) -> None:
    logger.info("generating the demo model (tiny random %s) into %s", DEMO_FAMILY, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        save_tiny_model(DEMO_FAMILY, staging, seed=_DEMO_SEED)
        _discard_incomplete(target)
        try:
            os.replace(staging, target)
        except OSError as exc:
            # Renaming onto a non-empty folder fails: another process finished first.
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not _is_complete(target):
                raise
            logger.info("another process created %s first; using its copy", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _discard_incomplete(target: Path) -> None:
    if not target.exists() or _is_complete(target):
        return
    logger.warning("%s exists but holds no model_index.json; replacing it", target)
    trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.broken-", dir=target.parent))
    with contextlib.suppress(FileNotFoundError):  # someone else moved it already
        os.replace(target, trash / target.name)
    shutil.rmtree(trash, ignore_errors=True)
