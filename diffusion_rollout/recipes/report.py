"""What rank 0 shows of each iteration: a progress line, and ``--log-to``'s scalars and images."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from diffusion_rollout.client import RolloutOutput
from diffusion_rollout.recipes.reward import uint8_images

# What the progress line calls each recipe's exactness key.
EXACTNESS_LABELS = {"first_ratio_max_dev": "|ratio-1|", "old_policy_max_dev": "old-policy dev"}
# Phases in the order an iteration runs them (others, a recipe's own, follow).
# Seconds recorded inside another phase (flow_grpo's optimizer step is part of ``train``): in the
# record and the summary, not on the progress line, whose phases add up to the iteration.
SUB_PHASES = frozenset({"optimizer_s", "screen_s"})  # parts of train_s and rollout_s
PHASE_ORDER = ("rollout", "reward", "release", "train", "resume", "push")


def duration(seconds: float) -> str:
    """``46s``, ``2m46s``, ``1h02m``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _number(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return f"{x:.2f}" if 100 <= abs(x) < 1e6 else f"{x:.4g}"


def progress_line(
    record: Mapping[str, Any], total: int, exactness_key: str, seconds_per_iteration: float
) -> str:
    """``iter 3/20  reward -212.41 ± 6.19  |ratio-1| 0  rollout 7.05s ... push 0.38s  10.4 s/it  ETA 2m46s``

    The iteration counts from 1 (the record's ``iteration`` is 0-based); ``s/it`` is this iteration's
    seconds, the ETA ``seconds_per_iteration`` times the iterations left.
    """
    it = int(record["iteration"]) + 1
    phases = [
        k.removesuffix("_s")
        for k in record
        if k.endswith("_s") and k != "iteration_s" and k not in SUB_PHASES
    ]
    phases.sort(key=lambda k: PHASE_ORDER.index(k) if k in PHASE_ORDER else len(PHASE_ORDER))
    label = EXACTNESS_LABELS.get(exactness_key, exactness_key)
    parts = [
        f"iter {it}/{total}",
        f"reward {_number(record['reward_mean'])} ± {_number(record['reward_std'])}",
        f"{label} {_number(record.get(exactness_key))}",
        " ".join(f"{k} {record[f'{k}_s']:.2f}s" for k in phases),
        f"{record['iteration_s']:.3g} s/it",
        f"ETA {duration(seconds_per_iteration * max(total - it, 0))}",
    ]
    if record.get("recovered"):  # a lost server waited for, re-pushed, the rollouts redone (recovery.py)
        parts.append("recovered " + ",".join(record["recovered"]))
    return "  ".join(parts)


class Report:
    """What rank 0 shows of each iteration: one progress line on stdout (``--print-json``: the
    record as one JSON line, without its per-sample lists, instead), and ``--log-to``'s scalars and
    sample images (``run_logger.RunLogger``, imported only then). Ranks other than 0 (``enabled``
    false) show nothing. The ETA's seconds per iteration are the mean over this process's
    iterations after its first (the warm-up, left out as in :func:`summarize`; alone it is used).
    """

    def __init__(self, args: argparse.Namespace, recipe: str, exactness_key: str, *, enabled: bool = True):
        self.enabled = enabled
        self.total = args.iterations
        self.exactness_key = exactness_key
        self.print_json = getattr(args, "print_json", False)
        self.seconds: list[float] = []
        self.logger = None
        if enabled and getattr(args, "log_to", None):
            from diffusion_rollout.recipes.run_logger import RunLogger

            self.logger = RunLogger(args.log_to, log_dir(args, recipe), recipe=recipe, config=vars(args))

    def iteration(self, record: Mapping[str, Any], outputs: Sequence[RolloutOutput] = ()) -> None:
        if not self.enabled:
            return
        self.seconds.append(record["iteration_s"])
        if self.print_json:
            skip = ("rewards", "spans", "advantages", "rank_seconds")
            line = json.dumps({k: v for k, v in record.items() if k not in skip})
        else:
            timed = self.seconds[1:] or self.seconds
            line = _printable(progress_line(record, self.total, self.exactness_key, sum(timed) / len(timed)))
        print(line, flush=True)
        if self.logger is not None:
            from diffusion_rollout.recipes.run_logger import SAMPLE_IMAGES

            shown = [o for o in outputs[:SAMPLE_IMAGES] if o.generated_output is not None]
            self.logger.log_iteration(record, uint8_images(shown) if shown else None)

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()
            self.logger = None

    def __enter__(self) -> Report:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def log_dir(args: argparse.Namespace, recipe: str) -> Path:
    """``--log-dir``, else ``RUN-logs`` next to ``--out RUN.json``, else ``runs/RECIPE-TIME``."""
    if args.log_dir:
        return Path(args.log_dir)
    if args.out:
        out = Path(args.out)
        return out.with_name(f"{out.stem}-logs")
    return Path("runs") / f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"


def _printable(line: str) -> str:
    """``line``, with ``+-`` for ``±`` where stdout cannot encode it (an ASCII locale)."""
    try:
        line.encode(getattr(sys.stdout, "encoding", None) or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return line.replace("±", "+-")
    return line
