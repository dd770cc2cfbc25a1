"""A run's JSON record: one object per iteration, the run at a glance, the environment, the curves.

The whole run is rewritten after every iteration (atomically: a run cut short keeps what it did),
with :func:`learning_stats` (first vs last iterations' rewards, in standard errors) in its summary;
:func:`plot_reward_curves` draws runs side by side (matplotlib, the optional extra ``plot``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from diffusion_rollout.client import RolloutOutput
from diffusion_rollout.recipes.timing import Phases


def server_peak_gb(outputs: Sequence[RolloutOutput]) -> float | None:
    peaks = [o.peak_memory_mb for o in outputs if o.peak_memory_mb is not None]
    return round(max(peaks) / 1024, 3) if peaks else None


# ---------------------------------------------------------------------------------------------- records
def iteration_record(
    iteration: int, version: Any, rewards: torch.Tensor, outputs: Sequence[RolloutOutput], phases: Phases,
    started: float, *, images: int | None = None, server_peak: float | None = None, **fields: Any,
) -> dict[str, Any]:  # fmt: skip
    """One iteration's JSON record: rewards, the recipe's ``fields``, seconds per phase, memory, rate.

    ``images`` and ``server_peak`` (GB) default to those of ``outputs``; a rank of several passes the
    whole iteration's (every rank's). :class:`Report` shows it.
    """
    record = {
        "iteration": iteration,
        "weight_version": version,
        "rewards": [round(float(r), 5) for r in rewards],
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        **fields,
        "images": len(outputs) if images is None else images,
        **phases.record(),
        "server_peak_gb": server_peak_gb(outputs) if server_peak is None else server_peak,
    }
    record["iteration_s"] = round(time.perf_counter() - started, 4)
    record["images_per_second"] = round(record["images"] / record["iteration_s"], 4)
    return record


def summarize(history: Sequence[Mapping[str, Any]], exactness_key: str) -> dict[str, Any]:
    """The run at a glance; phase seconds are means over iterations after the first (warm-up).

    ``exactness_key`` is the recipe's on-policy check (``first_ratio_max_dev``, ``old_policy_max_dev``):
    its largest value over the run, which must be 0.
    """
    timed = history[1:] or history
    phases = sorted({k for h in timed for k in h if k.endswith("_s")})
    return {
        "iterations": len(history),
        exactness_key: max((h[exactness_key] for h in history), default=None),
        "checksums_ok": all(h["checksum_ok"] is not False for h in history),
        "mean_seconds": {k: sum(h.get(k, 0.0) for h in timed) / len(timed) for k in phases},
        "images_per_second": sum(h["images"] for h in timed) / sum(h["iteration_s"] for h in timed),
        "trainer_peak_gb": max((h.get("trainer_peak_gb", 0.0) for h in history), default=None),
        "device_used_max_gb": max((h.get("device_used_max_gb", 0.0) for h in history), default=None),
        "server_peak_gb": max((h.get("server_peak_gb") or 0.0 for h in history), default=None),
        "learning": learning_stats(history),
        **({"ratio_by_staleness": by_staleness} if (by_staleness := staleness_summary(history)) else {}),
    }


def staleness_summary(history: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """The first step's ``|ratio - 1|`` per staleness over the run (``--async-depth``): batches,
    ratios, their mean and max. Staleness 0 must give max 0; staleness 1 gives the spread."""
    acc: dict[str, dict[str, float]] = {}
    for h in history:
        for staleness, st in (h.get("ratio_by_staleness") or {}).items():
            a = acc.setdefault(str(staleness), {"batches": 0, "count": 0, "sum": 0.0, "max": 0.0})
            a["batches"] += 1
            a["count"] += st["count"]
            a["sum"] += st["mean"] * st["count"]
            a["max"] = max(a["max"], st["max"])
    return {
        k: {"batches": a["batches"], "count": a["count"], "mean": a["sum"] / a["count"], "max": a["max"]}
        for k, a in sorted(acc.items())
    }


def learning_stats(history: Sequence[Mapping[str, Any]], k: int = 5) -> dict[str, Any]:
    """First ``k`` vs last ``k`` iterations' rewards: the difference in standard errors, and Cohen's d.

    ``z_samples`` treats every sample as one observation (the SE of a difference of two means,
    Welch); ``z_iterations`` treats each iteration's mean as one (more conservative: samples of an
    iteration share prompts and weights).
    """
    if len(history) < 2 * k:
        return {}

    def pooled(rows):
        return torch.tensor([r for h in rows for r in h["rewards"]], dtype=torch.float64)

    first, last = pooled(history[:k]), pooled(history[-k:])
    diff = float(last.mean() - first.mean())
    se = math.sqrt(float(first.var() / first.numel() + last.var() / last.numel()))
    it_first = torch.tensor([h["reward_mean"] for h in history[:k]], dtype=torch.float64)
    it_last = torch.tensor([h["reward_mean"] for h in history[-k:]], dtype=torch.float64)
    se_it = math.sqrt(float(it_first.var() / k + it_last.var() / k))
    sd = math.sqrt(float((first.var() + last.var()) / 2))
    return {
        "k": k,
        "reward_first_k": float(first.mean()),
        "reward_last_k": float(last.mean()),
        "difference": diff,
        "z_samples": diff / se if se > 0 else math.inf,
        "z_iterations": diff / se_it if se_it > 0 else math.inf,
        "cohens_d": diff / sd if sd > 0 else math.inf,
    }


def write_run(path: str | None, run: Mapping[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(run, indent=1))
        os.replace(tmp, path)


def environment() -> dict[str, Any]:
    import diffusers
    import peft

    info: dict[str, Any] = {
        "torch": torch.__version__, "diffusers": diffusers.__version__, "peft": peft.__version__,
        "python": sys.version.split()[0],
    }  # fmt: skip
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    # A copied tree (the GPU machine's) may carry stale git metadata: the caller may name the commit.
    info["commit"] = os.environ.get("RECIPE_COMMIT")
    with contextlib.suppress(Exception):
        info["commit"] = (
            info["commit"]
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
            ).stdout.strip()
        )
    return info


def plot_reward_curves(runs: Mapping[str, Mapping[str, Any]], png: str, title: str = "") -> None:
    """Mean reward per iteration (with one standard error) of each run, on one plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, run in runs.items():
        hist = run["history"]
        x = [h["iteration"] for h in hist]
        mean = [h["reward_mean"] for h in hist]
        se = [h["reward_std"] / math.sqrt(len(h["rewards"])) for h in hist]
        ax.plot(x, mean, label=label)
        low = [m - s for m, s in zip(mean, se, strict=True)]
        high = [m + s for m, s in zip(mean, se, strict=True)]
        ax.fill_between(x, low, high, alpha=0.25)
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110, metadata={"Software": None})  # no version in the file: same JSON, same bytes
    plt.close(fig)
