"""What a benchmark hands back: one JSON document per run, a plain text table, progress lines.

Every benchmark writes one JSON object: ``{"benchmark", "written_at", "facts", "settings",
"results", "ok", "notes"}``. ``facts`` (``benchmarks/facts.py``) holds the device, the commit, the
library versions and the host; ``settings`` everything the run was told. RESULTS.md copies figures
from these files, so the shape is the same for every benchmark. The table printed beside it is for
the person watching the run; the JSON is the record.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.facts import facts


def document(
    benchmark: str,
    device: str,
    settings: dict[str, Any],
    results: list[dict[str, Any]],
    *,
    ok: bool = True,
    notes: Sequence[str] = (),
) -> dict[str, Any]:
    return {
        "benchmark": benchmark,
        "written_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "facts": facts(device),
        "settings": settings,
        "results": results,
        "ok": ok,
        "notes": list(notes),
    }


def write_json(out_dir: str | Path | None, name: str, doc: dict[str, Any]) -> Path | None:
    if out_dir is None:
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    return path


def _json_default(o: Any) -> Any:
    if isinstance(o, (torch.dtype, torch.device, Path)):
        return str(o)
    if isinstance(o, float) and o != o:
        return None
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:
            return "nan"
        return format(value, spec or ".4g")
    return str(value)


def print_table(title: str, rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """Print (and return) a plain text table; ``columns`` are ``(key, header, format spec)``."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append([fmt(row.get(key), spec) for key, _, spec in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = [f"== {title}"]
    for n, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if n else c.ljust(w) for c, w in zip(r, widths, strict=True)))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
