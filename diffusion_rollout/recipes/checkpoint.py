"""``--checkpoint DIR``: a run's adapters, optimizer and history after every iteration, so that a
rerun with the same ``DIR`` continues where it stopped (GPU time comes in stretches)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


class Checkpoint:
    """Adapters, optimizer and history in ``DIR`` (``--checkpoint``), written after every iteration.

    One file, ``trainer.pt``, holds all three, so a checkpoint is never half of one iteration and
    half of another: it is written to a temporary file, flushed to disk, and renamed over the last
    one (a rename within a folder is atomic), so a run killed mid-write, or a full disk, leaves the
    previous complete checkpoint. ``state.json`` beside it is a readable copy of the state, written
    the same way after it; resuming reads the state from ``trainer.pt`` (older checkpoints, which
    kept the state only in ``state.json``, still load).
    """

    def __init__(self, directory: str | None) -> None:
        self.dir = Path(directory) if directory else None

    def load(self, transformer, optimizer) -> dict[str, Any] | None:
        if self.dir is None or not (self.dir / "trainer.pt").exists():
            return None
        from peft.utils import set_peft_model_state_dict

        saved = torch.load(self.dir / "trainer.pt", map_location="cpu", weights_only=True)
        for name, sd in saved["adapters"].items():
            set_peft_model_state_dict(transformer, sd, adapter_name=name)
        optimizer.load_state_dict(saved["optimizer"])
        state = (
            json.loads(saved["state"])
            if "state" in saved
            else json.loads((self.dir / "state.json").read_text())
        )
        logger.info("resumed from %s at iteration %d", self.dir, state["next_iteration"])
        return state

    def save(self, transformer, optimizer, adapters: Sequence[str], state: Mapping[str, Any]) -> None:
        if self.dir is None:
            return
        from peft.utils import get_peft_model_state_dict

        self.dir.mkdir(parents=True, exist_ok=True)
        sd = {a: get_peft_model_state_dict(transformer, adapter_name=a) for a in adapters}
        text = json.dumps(state)
        _write_atomically(
            self.dir / "trainer.pt",
            lambda f: torch.save({"adapters": sd, "optimizer": optimizer.state_dict(), "state": text}, f),
        )
        _write_atomically(self.dir / "state.json", lambda f: f.write(text.encode()))


def _write_atomically(path: Path, write) -> None:
    """``write(file)`` into ``path.tmp``, flushed to disk, then renamed over ``path``: a reader sees
    the old file or the new one, never a part (the temporary file is removed on any failure)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
