"""Tables and reward curves of the multi-GPU training layouts: ``python -m benchmarks.scale_report DIR``.

    python -m benchmarks.scale_report DIR --md scale.md --png scale_rewards.png

``DIR`` holds the JSON run records that ``examples/flow_grpo.py --out X.json`` writes (the ``scale-*``
runs of ``python -m benchmarks.train_recipes``). Prints, and with ``--md`` writes, one markdown table
row per run and an advice table; ``--png`` draws the reward curves.

Design decisions:

- **Only what the records measured.** Every number is computed from the iterations' own fields;
  nothing is typed in. The advice table compares the runs that are there and names the slowest phase
  of each; it does not extrapolate to layouts that were not run.
- **Steady state.** Seconds per iteration and the phase means skip the first iteration, which also
  loads, compiles and warms up (as ``summarize`` in ``diffusion_rollout.recipes.records`` does); the min–max of the
  same iterations is shown beside the mean, so a slow straggler is visible rather than averaged away.
- **GPUs counted, not ranks.** Colocated layouts put a server replica and a trainer rank on the same
  GPU; throughput per GPU divides by the distinct GPUs the run occupied (trainer and server together).
- **Async rollout time is the server's.** With ``--async-depth`` the trainer's ``rollout_s`` is only
  its wait for a batch that was made during the previous iteration; the rollout's own duration is the
  batch's ``server_span`` (request sent to answer received), which the advice uses instead.
- **The recipes' own helpers** (``learning_stats``, ``plot_reward_curves``) are imported from
  ``diffusion_rollout.recipes.records``, so the table's reward numbers are the ones in each record's ``summary``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

BASELINE = "scale-in-process"


def _common():
    """``diffusion_rollout.recipes.records``, imported on first use: it pulls in torch, which a bare
    import should not."""
    from diffusion_rollout.recipes import records

    return records


def _is_run(obj: Any) -> bool:
    return isinstance(obj, dict) and "recipe" in obj and isinstance(obj.get("history"), list)


def load_runs(directory: str | Path) -> dict[str, dict[str, Any]]:
    """Every run record in ``directory`` by file stem, in name order.

    Skipped: JSON that is not a run record (other benchmarks' output share the results folders), and
    records with no iteration yet (a run stopped before its first iteration has nothing to time).
    """
    runs = {}
    for path in sorted(Path(directory).glob("*.json")):
        try:
            obj = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if _is_run(obj) and obj["history"]:
            runs[path.stem] = obj
    return runs


def _cuda_index(device: str) -> int | None:
    kind, _, index = str(device).partition(":")
    return int(index) if kind == "cuda" and index.isdigit() else None


def gpus_used(record: Mapping[str, Any]) -> int:
    """Distinct GPUs of the run: the trainer ranks' ``cuda:N`` and the server's GPUs; a CPU run counts 1.

    A server the recipe started on CUDA without ``--server-gpus`` runs on GPU 0 (``_start_rollout_server``),
    which the record leaves as ``server_gpus: null``. A ``--url`` server ran elsewhere: not counted.
    """
    trainer = {i for d in record.get("trainer_devices") or [] if (i := _cuda_index(d)) is not None}
    gpus = set(trainer) | {int(g) for g in record.get("server_gpus") or []}
    args = record.get("args") or {}
    if record.get("layout") == "server" and not record.get("server_gpus") and not args.get("url") and trainer:
        gpus.add(0)
    return max(1, len(gpus))


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _phase_mean(timed: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Mean of a phase over the iterations that recorded it; None where none did (no push in process)."""
    return _mean([h[key] for h in timed if h.get(key) is not None])


def _peak_gb(history: Sequence[Mapping[str, Any]]) -> float | None:
    """The most GPU memory in use that any rank saw (every process on its GPU, server included)."""
    values = []
    for h in history:
        per_rank = [v for v in h.get("rank_device_used_max_gb") or [] if v is not None]
        values += per_rank or ([h["device_used_max_gb"]] if h.get("device_used_max_gb") is not None else [])
    return max(values, default=None)


def _split(record: Mapping[str, Any]) -> str | None:
    servers = {int(g) for g in record.get("server_gpus") or []}
    trainers = {i for d in record.get("trainer_devices") or [] if (i := _cuda_index(d)) is not None}
    if record.get("layout") != "server" or not servers or not trainers:
        return None
    if servers == trainers:
        return f"colocated {len(servers)}"
    return f"{len(servers)} + {len(trainers - servers)}"


def is_async(record: Mapping[str, Any]) -> bool:
    """Rollouts of iteration it + k made while the trainer trains on it (``--async-depth k``, server only)."""
    depth = (record.get("args") or {}).get("async_depth") or 0
    return record.get("layout") == "server" and (
        depth > 0 or any("staleness" in h for h in record["history"])
    )


def layout_rows(runs: Mapping[str, Mapping[str, Any]], baseline: str = BASELINE) -> list[dict[str, Any]]:
    """One row of measured numbers per run.

    Seconds (per iteration and per phase) are means over the iterations after the first: the first
    iteration also loads the server's adapter, compiles and warms up caches, which a long run pays
    once. ``s_per_it_min``/``s_per_it_max`` are the spread over those same iterations.
    ``vs_baseline`` is seconds per iteration over ``baseline``'s (None without that run).
    """
    learning_stats = _common().learning_stats
    rows = []
    for name, run in runs.items():
        history = run["history"]
        timed = history[1:] or history  # a one-iteration run has only its warm-up to show
        seconds = [h["iteration_s"] for h in timed]
        # An async run's batches for the first `depth` iterations after the warm-up were asked for
        # during it (they queue behind its compile), so their spans start with the warm-up too.
        depth = ((run.get("args") or {}).get("async_depth") or 0) if is_async(run) else 0
        spanned = history[1 + depth :] or timed
        spans = [h["server_span"][1] - h["server_span"][0] for h in spanned if h.get("server_span")]
        gpus = gpus_used(run)
        images_per_s = sum(h["images"] for h in timed) / sum(seconds)
        learning = learning_stats(history)
        rows.append(
            {
                "name": name,
                "layout": run.get("layout"),
                "mode": "async" if is_async(run) else "sync",
                "trainable": run.get("trainable", "lora"),
                "ranks": run.get("ranks", 1),
                "gpus": gpus,
                "server_gpus": len(run.get("server_gpus") or []) or None,
                # "colocated 4" or "2 + 2" (server GPUs + trainer-only GPUs), for split_advice
                "split": _split(run),
                "iterations": len(history),
                "images_per_iteration": _mean([h["images"] for h in timed]),
                "s_per_it": _mean(seconds),
                "s_per_it_min": min(seconds),
                "s_per_it_max": max(seconds),
                "rollout_s": _phase_mean(timed, "rollout_s"),
                "reward_s": _phase_mean(timed, "reward_s"),
                "train_s": _phase_mean(timed, "train_s"),
                "push_s": _phase_mean(timed, "push_s"),
                "server_span_s": _mean(spans),
                "images_per_s": images_per_s,
                "images_per_s_per_gpu": images_per_s / gpus,
                "peak_gb": _peak_gb(history),
                "reward_first_k": learning.get("reward_first_k"),
                "reward_last_k": learning.get("reward_last_k"),
                "learning_k": learning.get("k"),
                "first_ratio_max_dev": max(
                    (h["first_ratio_max_dev"] for h in history if h.get("first_ratio_max_dev") is not None),
                    default=None,
                ),
                # None is "not checked" (in process: nothing pushed), only False is a failed check.
                "checksums_ok": all(h.get("checksum_ok") is not False for h in history),
            }
        )
    base = next((r["s_per_it"] for r in rows if r["name"] == baseline), None)
    for r in rows:
        r["vs_baseline"] = r["s_per_it"] / base if base else None
    return rows


def _f(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out) + "\n"


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The layout rows as markdown; seconds are steady-state means (first iteration left out)."""
    header = [
        "run", "layout", "ranks", "GPUs", "iters", "s/iter (min–max)", "rollout s", "reward s", "train s",
        "push s", "img/s", "img/s/GPU", "peak GB", "reward first→last k", "max \\|ratio−1\\| 1st step",
        "checksums", "vs baseline",
    ]  # fmt: skip
    lines = []
    for r in rows:
        reward = (
            f"{r['reward_first_k']:.3f} → {r['reward_last_k']:.3f} (k={r['learning_k']})"
            if r["reward_first_k"] is not None
            else "–"
        )
        lines.append([
            r["name"], f"{r['layout']}, {r['mode']}", _f(r["ranks"]), _f(r["gpus"]), _f(r["iterations"]),
            f"{r['s_per_it']:.2f} ({r['s_per_it_min']:.2f}–{r['s_per_it_max']:.2f})", _f(r["rollout_s"]),
            _f(r["reward_s"]), _f(r["train_s"]), _f(r["push_s"]), _f(r["images_per_s"]),
            _f(r["images_per_s_per_gpu"]), _f(r["peak_gb"], 1), reward, _f(r["first_ratio_max_dev"], 4),
            _f(r["checksums_ok"]), _f(r["vs_baseline"], 3),
        ])  # fmt: skip
    return _table(header, lines)


def advice_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What bounds each measured layout, and which one was fastest, from the layout rows alone.

    ``rollout_work_s`` is the rollout's duration: the trainer's rollout phase when synchronous (it
    waits for the whole batch), the server's span of the batch when async (``rollout_s`` is only the
    wait). ``trainer_s`` is reward + train, which the trainer does in series. ``model_s`` is the simple
    pipeline model: synchronous ``rollout + trainer + push``, async ``max(rollout, trainer + push)``;
    ``measured_over_model`` far from 1 says the model does not describe that layout (e.g. colocated
    async: the server's span also counts the time it shared its GPU with training, and a push may
    overlap a rollout). ``bound`` is the larger of rollout and trainer work (async: trainer + push). ``fastest`` marks the
    lowest seconds per iteration, ``best_per_gpu`` the most images per second per GPU.
    """
    out = []
    for r in rows:
        asynchronous = r["mode"] == "async"
        rollout = r["server_span_s"] if asynchronous and r["server_span_s"] is not None else r["rollout_s"]
        trainer = (r["reward_s"] or 0.0) + (r["train_s"] or 0.0)
        push = r["push_s"] or 0.0
        # Async: the push waits for the rollout in flight (the server applies it between batches),
        # so the trainer's side is reward + train + push, against the rollout.
        model = max(rollout, trainer + push) if asynchronous else rollout + trainer + push
        out.append(
            {
                "name": r["name"],
                "mode": r["mode"],
                "gpus": r["gpus"],
                "s_per_it": r["s_per_it"],
                "rollout_work_s": rollout,
                "trainer_s": trainer,
                "push_s": r["push_s"],
                "model_s": model,
                "measured_over_model": r["s_per_it"] / model if model else None,
                # Async, the trainer's side of the pipeline includes its push.
                "bound": "rollout" if rollout > (trainer + push if asynchronous else trainer) else "train",
                "images_per_s_per_gpu": r["images_per_s_per_gpu"],
            }
        )
    if out:
        fastest = min(out, key=lambda a: a["s_per_it"])
        best = max(out, key=lambda a: a["images_per_s_per_gpu"])
        for a in out:
            a["fastest"] = a is fastest
            a["best_per_gpu"] = a is best
    return out


def advice_table(advice: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]] = ()) -> str:
    """The advice rows as markdown, with one line naming the fastest layout and its bound."""
    header = [
        "run", "mode", "GPUs", "s/iter", "rollout work s", "reward+train s", "push s", "model s",
        "measured/model", "bound", "img/s/GPU",
    ]  # fmt: skip
    lines = [
        [
            a["name"] + (" (fastest)" if a["fastest"] else "") + (" (best per GPU)" if a["best_per_gpu"] else ""),
            a["mode"], _f(a["gpus"]), _f(a["s_per_it"]), _f(a["rollout_work_s"]), _f(a["trainer_s"]),
            _f(a["push_s"]), _f(a["model_s"]), _f(a["measured_over_model"]), a["bound"],
            _f(a["images_per_s_per_gpu"]),
        ]
        for a in advice
    ]  # fmt: skip
    text = _table(header, lines)
    if advice:
        f = next(a for a in advice if a["fastest"])
        text += (
            f"\nFastest measured: **{f['name']}**, {f['s_per_it']:.2f} s per iteration, {f['bound']}-bound.\n"
        )
        # Seconds per iteration only rank layouts that made the same batch; otherwise img/s does.
        if len({r["images_per_iteration"] for r in rows}) > 1:
            text += "The runs made different numbers of images per iteration: compare img/s, not s/iter.\n"
    return text


def rates(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Images per second per GPU of each side, from the measured rows: ``rollout`` (exact server),
    ``rollout_fast`` (a ``-fast`` run's server) and ``train`` (replay + backward + optimizer step).

    A synchronous server row gives its rollout rate as images / rollout seconds / server GPUs, and
    every server row its train rate as images / train seconds / trainer ranks; the largest sample
    of each kind is kept (the least disturbed by a neighbour on its GPU)."""
    out: dict[str, float] = {}

    def keep(key: str, value: float | None) -> None:
        if value:
            out[key] = max(out.get(key, 0.0), value)

    for r in rows:
        if r["layout"] != "server" or r["trainable"] != "lora":
            continue
        images = r["images_per_iteration"]
        servers = r.get("server_gpus") or r["gpus"]
        if r["mode"] == "sync" and r["rollout_s"]:
            keep("rollout_fast" if "fast" in r["name"] else "rollout", images / r["rollout_s"] / servers)
        if r["train_s"]:
            keep("train", images / r["train_s"] / r["ranks"])
    return out


def split_advice(
    rows: Sequence[Mapping[str, Any]], gpus: int, images: int, overhead_s: float | None = None
) -> list[dict[str, Any]]:
    """Seconds per iteration of every split of ``gpus`` for ``images`` per iteration, computed from
    the measured per-GPU rates (:func:`rates`): colocated synchronous, every GPU rolls out then
    trains, ``images / (gpus * r) + images / (gpus * t)``; disaggregated async with ``s`` server GPUs,
    ``max(images / (s * r), images / ((gpus - s) * t) + overhead_s)``. ``overhead_s`` (reward + push,
    default the measured colocated rows' mean) is paid in series by the colocated trainer, and by the
    async trainer on its side of the pipeline (its push waits for the rollout in flight).
    Rows whose layout was measured carry ``measured`` from the matching run."""
    rate = rates(rows)
    if overhead_s is None:
        colocated = [r for r in rows if r["layout"] == "server" and r["mode"] == "sync" and r["push_s"]]
        overhead_s = _mean([(r["reward_s"] or 0.0) + r["push_s"] for r in colocated]) or 0.0
    measured = {
        (r.get("split"), r["mode"], "fast" in r["name"]): r["s_per_it"] for r in rows if r.get("split")
    }
    out = []
    for tier in ("rollout", "rollout_fast"):
        r, t = rate.get(tier), rate.get("train")
        if not r or not t:
            continue
        fast = tier == "rollout_fast"
        out.append({
            "tier": "fast" if fast else "exact", "split": f"colocated {gpus}", "mode": "sync",
            "predicted_s": images / (gpus * r) + images / (gpus * t) + overhead_s,
            "measured_s": measured.get((f"colocated {gpus}", "sync", fast)),
        })  # fmt: skip
        for servers in range(1, gpus):
            out.append({
                "tier": "fast" if fast else "exact", "split": f"{servers} + {gpus - servers}", "mode": "async",
                "predicted_s": max(images / (servers * r), images / ((gpus - servers) * t) + overhead_s),
                "measured_s": measured.get((f"{servers} + {gpus - servers}", "async", fast)),
            })  # fmt: skip
    return out


def split_table(advice: Sequence[Mapping[str, Any]], baseline_s: float | None = None) -> str:
    header = [
        "tier",
        "split (servers + trainers)",
        "mode",
        "predicted s/iter",
        "measured s/iter",
        "vs baseline",
    ]
    lines = [
        [a["tier"], a["split"], a["mode"], _f(a["predicted_s"]), _f(a["measured_s"]),
         _f(a["predicted_s"] / baseline_s, 3) if baseline_s else "–"]
        for a in advice
    ]  # fmt: skip
    return _table(header, lines)


def plot(runs: Mapping[str, Mapping[str, Any]], png: str | Path, title: str = "") -> None:
    """Mean reward per iteration of every run (one standard error shaded), matplotlib Agg."""
    _common().plot_reward_curves(runs, str(png), title=title)


def main(argv: Sequence[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", help="folder of run records (flow_grpo.py --out)")
    p.add_argument("--md", help="write the tables here")
    p.add_argument("--png", help="draw the reward curves here")
    p.add_argument("--baseline", default=BASELINE, help="run that vs_baseline divides by")
    p.add_argument("--title", default="", help="title of the reward plot")
    args = p.parse_args(argv)
    runs = load_runs(args.directory)
    if not runs:
        raise SystemExit(f"no run records in {args.directory}")
    rows = layout_rows(runs, baseline=args.baseline)
    text = (
        "## Layouts\n\n" + markdown_table(rows) + "\n## What bounds each layout\n\n"
        + advice_table(advice_rows(rows), rows)
    )  # fmt: skip
    lora = [r for r in rows if r["trainable"] == "lora"]
    if lora:
        gpus = max(r["gpus"] for r in lora)
        images = int(max(r["images_per_iteration"] for r in lora))
        base = next((r["s_per_it"] for r in rows if r["name"] == args.baseline), None)
        text += (
            f"\n## Splits of {gpus} GPUs from the measured per-GPU rates ({images} images per iteration)\n\n"
            + split_table(split_advice(lora, gpus, images), base)
        )
    if args.md:
        Path(args.md).write_text(text)
    if args.png:
        plot(runs, args.png, title=args.title)
    print(text)
    return text


if __name__ == "__main__":
    main()
