"""The request shapes a compiled server served, remembered in its compile cache for the next start.

Why: a fast-tier server warms up at the model's default size unless ``--warmup-shapes`` says more,
so a trainer's 512x512 requests compiled in the foreground at every start (one H200, SD3.5-medium:
a restart on the compile cache answered its first 512x512 request after 40.4 s, and after 14.1 s
with ``--warmup-shapes 512x512``). A server now writes the shapes it served into its compile cache's
key folder, and the next start with that key warms them before ready.

Design decisions:

- **One small file per key folder**: ``<key>/served_shapes.json``, ``{"version": 1, "shapes":
  [{"width", "height", "frames", "max_sequence_length", "last_served", "starts"}, ...]}``, the most
  recently served first. A shape is what sets the compiled blocks' input shapes, batch aside
  (``warmup.shape_key``): width, height, frames (video; null for images) and the text length
  (``max_sequence_length``; null: the model's default). The batch is not kept: the warm-up covers
  every batch size of a shape (``warmup.warmup_batches``).
- **Bounded**: at most :data:`MAX_SHAPES` (8) shapes; a new one pushes out the one served longest
  ago. ``starts`` counts the server processes that served the shape (informational).
- **Written rarely, never in the way**: when a call of a shape not yet served in this process
  finishes (that call compiled anyway), after the call, as a whole new 0600 file renamed over the
  old one (``own_files.write_private``: atomic, never through a link). Only successful compiled calls
  of a ready server count (not the warm-up, not eager calls). A write that fails is one warning.
  Servers sharing a key folder (replicas on one machine) each write what they read at start plus what
  they served: the last writer wins, and a shape it never saw waits for its next request.
- **Trusted as the rest of the cache**: read only from a key folder the compile cache trusted
  (``compile_cache.py``), through ``own_files.read_own`` (the server's own regular file, writable by
  no one else, not a link), at most :data:`MAX_BYTES`, as JSON, each value checked (positive
  integers within :data:`MAX_SIDE`, :data:`MAX_FRAMES`, :data:`MAX_TOKENS`). Nothing in it is run. A
  file that fails any check is ignored with one warning; the server starts as without it.
- **Precedence**: remembered shapes are warmed (after the default size) only when
  ``--warmup-shapes`` is unset; an explicit ``--warmup-shapes`` (``none`` included) is exactly what
  is warmed. ``--no-warmup-remembered-shapes`` turns the warm-up of remembered shapes off (they are
  still recorded). A remembered shape whose warm-up call fails (a limit changed, out of memory) is
  skipped with a warning and forgotten, never failing the start.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from diffusion_rollout.errors import UntrustedFileError
from diffusion_rollout.own_files import read_own, write_private
from diffusion_rollout.server.speed.warmup import Shape

logger = logging.getLogger(__name__)

FILE = "served_shapes.json"  # inside the compile cache's key folder
VERSION = 1
MAX_SHAPES = 8
MAX_BYTES = 64 * 1024
MAX_SIDE = 65536
MAX_FRAMES = 100_000
MAX_TOKENS = 1_000_000


def _entry_key(entry: dict[str, Any]) -> tuple:
    return (entry["width"], entry["height"], entry["frames"], entry["max_sequence_length"])


def _positive(value: Any, limit: int, *, optional: bool) -> bool:
    if value is None:
        return optional
    return type(value) is int and 0 < value <= limit


def parse(blob: bytes) -> list[dict[str, Any]]:
    """The entries of a shapes file, checked; raises ValueError for anything else."""
    if len(blob) > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES} bytes")
    try:
        doc = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("shapes"), list):
        raise ValueError(f'not {{"version": {VERSION}, "shapes": [...]}}')
    entries: list[dict[str, Any]] = []
    seen: set[tuple] = set()
    for i, item in enumerate(doc["shapes"]):
        if not isinstance(item, dict):
            raise ValueError(f"shapes[{i}] is not an object")
        entry = {
            "width": item.get("width"),
            "height": item.get("height"),
            "frames": item.get("frames"),
            "max_sequence_length": item.get("max_sequence_length"),
            "last_served": item.get("last_served", 0),
            "starts": item.get("starts", 0),
        }
        ok = (
            _positive(entry["width"], MAX_SIDE, optional=False)
            and _positive(entry["height"], MAX_SIDE, optional=False)
            and _positive(entry["frames"], MAX_FRAMES, optional=True)
            and _positive(entry["max_sequence_length"], MAX_TOKENS, optional=True)
            and type(entry["last_served"]) in (int, float)
            and type(entry["starts"]) is int
            and entry["starts"] >= 0
        )
        if not ok:
            raise ValueError(f"shapes[{i}] is not a shape ({json.dumps(item)[:200]})")
        if _entry_key(entry) not in seen:
            seen.add(_entry_key(entry))
            entries.append(entry)
    entries.sort(key=lambda e: -e["last_served"])
    return entries[:MAX_SHAPES]


class ServedShapes:
    """The shapes file of one trusted key folder: read once at start, rewritten on each new shape."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / FILE
        self._lock = threading.Lock()
        self._entries: list[dict[str, Any]] = []  # the most recently served first
        self._seen: set[tuple] = set()  # shapes served by this process (each written once)
        self.ignored: str | None = None  # why the file found at start was ignored
        self.write_error: str | None = None

    def load(self) -> list[Shape]:
        """The remembered shapes, the most recently served first ([] when none or ignored)."""
        if not self.path.exists() and not self.path.is_symlink():
            return []
        try:
            entries = parse(read_own(self.path))
        except (OSError, UntrustedFileError, ValueError) as exc:
            self.ignored = str(exc)
            logger.warning(
                "compile cache: ignoring %s (%s); no remembered shape is warmed, and the file is "
                "replaced when this server serves a new shape", self.path, exc,
            )  # fmt: skip
            return []
        with self._lock:
            self._entries = entries
        return [self.shape(e) for e in entries]

    @staticmethod
    def shape(entry: dict[str, Any]) -> Shape:
        return Shape(
            entry["width"],
            entry["height"],
            entry["frames"],
            max_sequence_length=entry["max_sequence_length"],
            remembered=True,
        )

    def entries(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(e) for e in self._entries]

    def served(self, key: tuple) -> None:
        """A compiled call of ``key`` (``warmup.shape_key``: width, height, frames, text length)
        finished: the first one of each shape in this process is written (module doc)."""
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
            width, height, frames, tokens = key
            entry = {"width": width, "height": height, "frames": frames, "max_sequence_length": tokens}
            old = next((e for e in self._entries if _entry_key(e) == key), None)
            entry["starts"] = (old["starts"] if old else 0) + 1
            entry["last_served"] = round(time.time(), 3)
            self._entries = [entry, *(e for e in self._entries if e is not old)][:MAX_SHAPES]
            self._write_locked()

    def forget(self, shapes: list[Shape]) -> None:
        """Remembered shapes whose warm-up failed: dropped from the file."""
        keys = {(s.width, s.height, s.frames, s.max_sequence_length) for s in shapes}
        with self._lock:
            kept = [e for e in self._entries if _entry_key(e) not in keys]
            if len(kept) != len(self._entries):
                self._entries = kept
                self._write_locked()

    def _write_locked(self) -> None:
        doc = {"version": VERSION, "shapes": self._entries}
        try:
            write_private(self.path, json.dumps(doc, indent=1) + "\n")
        except OSError as exc:
            self.write_error = str(exc)
            logger.warning("compile cache: could not write %s (%s)", self.path, exc)
        else:
            self.write_error = None

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"file": str(self.path), "shapes": [str(self.shape(e)) for e in self.entries()]}
        if self.ignored is not None:
            out["ignored"] = self.ignored
        if self.write_error is not None:
            out["write_error"] = self.write_error
        return out
