"""benchmarks/scale_report.py on synthetic run records (CPU, no model): the numbers it derives are the
ones the records imply, computed here by hand from the same made-up histories."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import scale_report

ITERATIONS = 12  # learning_stats compares the first 5 with the last 5: it needs 2 * 5 iterations


def _history(*, seconds, rollout, train, push, rewards_from, async_span=None, images=8):
    """``ITERATIONS`` records; iteration 0 is 100 s (warm-up), the others cycle through ``seconds``."""
    history = []
    for it in range(ITERATIONS):
        rewards = [rewards_from + 0.1 * it + 0.01 * j for j in range(images)]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
        h = {
            "iteration": it,
            "rewards": rewards,
            "reward_mean": mean,
            "reward_std": std,
            "first_ratio_max_dev": 0.0 if async_span is None else 0.01 * (it % 3),
            "ratio_mean": 1.0,
            "ratio_min": 1.0,
            "ratio_max": 1.0,
            "checksum_ok": None if push is None else True,
            "images": images,
            "rollout_s": rollout,
            "reward_s": 0.5,
            "train_s": train,
            "iteration_s": 100.0 if it == 0 else seconds[(it - 1) % len(seconds)],
            "trainer_peak_gb": 30.0,
            "device_used_max_gb": 40.0,
            "rank_peak_gb": [30.0, 31.0],
            "rank_device_used_max_gb": [40.0, 44.0 + it],
            "server_peak_gb": None,
        }
        if push is not None:
            h["push_s"] = push
        if async_span is not None:
            h["staleness"] = 0 if it == 0 else 1
            h["server_span"] = [10.0 * it, 10.0 * it + async_span]
        history.append(h)
    return history


def _record(layout, ranks, trainer_devices, server_gpus, history, async_depth=0):
    return {
        "recipe": "flow_grpo",
        "layout": layout,
        "ranks": ranks,
        "trainable": "lora",
        "trainer_devices": trainer_devices,
        "server_gpus": server_gpus,
        "args": {"async_depth": async_depth, "url": None, "prompts": 16, "group_size": 8},
        "environment": {"device": "NVIDIA H100 80GB HBM3", "commit": "abc1234"},
        "history": history,
        "summary": {},
    }


IN_PROCESS = _record(
    "in-process", 4, [f"cuda:{i}" for i in range(4)], None,
    _history(seconds=[20.0, 22.0], rollout=15.0, train=5.0, push=None, rewards_from=1.0),
)  # fmt: skip
DISAGG_ASYNC = _record(
    "server", 2, ["cuda:2", "cuda:3"], [0, 1],
    _history(seconds=[9.0, 11.0, 10.0], rollout=0.01, train=6.0, push=1.0, rewards_from=2.0, async_span=8.0),
    async_depth=1,
)  # fmt: skip
COLOCATED = _record(
    "server", 4, [f"cuda:{i}" for i in range(4)], [0, 1, 2, 3],
    _history(seconds=[12.0], rollout=7.0, train=4.0, push=0.5, rewards_from=3.0),
)  # fmt: skip


@pytest.fixture
def run_dir(tmp_path):
    for name, rec in [("scale-in-process", IN_PROCESS), ("scale-disagg-async", DISAGG_ASYNC),
                      ("scale-colocated", COLOCATED)]:  # fmt: skip
        (tmp_path / f"{name}.json").write_text(json.dumps(rec))
    # Not run records: another benchmark's JSON, a list, broken JSON, a run stopped before iteration 0.
    (tmp_path / "weight_sync.json").write_text(json.dumps({"rows": [1, 2]}))
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "empty-run.json").write_text(json.dumps({**COLOCATED, "history": []}))
    return tmp_path


def _by_name(rows):
    return {r["name"]: r for r in rows}


def test_load_runs_keeps_only_run_records(run_dir):
    assert sorted(scale_report.load_runs(run_dir)) == [
        "scale-colocated",
        "scale-disagg-async",
        "scale-in-process",
    ]


def test_gpus_used_counts_distinct_gpus():
    assert scale_report.gpus_used(IN_PROCESS) == 4
    assert scale_report.gpus_used(DISAGG_ASYNC) == 4  # 2 trainer GPUs + 2 server GPUs
    assert scale_report.gpus_used(COLOCATED) == 4  # the server shares the trainers' GPUs
    assert (
        scale_report.gpus_used({"layout": "in-process", "trainer_devices": ["cpu"], "server_gpus": None}) == 1
    )
    # A server started on CUDA without --server-gpus runs on GPU 0: with a trainer on GPU 1, two GPUs.
    default_server = {"layout": "server", "trainer_devices": ["cuda:1"], "server_gpus": None, "args": {}}
    assert scale_report.gpus_used(default_server) == 2


def test_layout_rows_are_the_records_numbers(run_dir):
    rows = _by_name(scale_report.layout_rows(scale_report.load_runs(run_dir)))
    base, dis, col = rows["scale-in-process"], rows["scale-disagg-async"], rows["scale-colocated"]

    # Iteration 0 (100 s of warm-up) is left out: 11 iterations cycling through the given seconds.
    base_seconds = [[20.0, 22.0][i % 2] for i in range(ITERATIONS - 1)]
    dis_seconds = [[9.0, 11.0, 10.0][i % 3] for i in range(ITERATIONS - 1)]
    assert base["s_per_it"] == pytest.approx(sum(base_seconds) / len(base_seconds), rel=1e-12)
    assert dis["s_per_it"] == pytest.approx(sum(dis_seconds) / len(dis_seconds), rel=1e-12)
    assert col["s_per_it"] == 12.0
    assert (base["s_per_it_min"], base["s_per_it_max"]) == (20.0, 22.0)
    assert (dis["s_per_it_min"], dis["s_per_it_max"]) == (9.0, 11.0)

    assert base["vs_baseline"] == 1.0
    assert dis["vs_baseline"] == dis["s_per_it"] / base["s_per_it"]
    assert col["vs_baseline"] == 12.0 / base["s_per_it"]

    assert [r["gpus"] for r in (base, dis, col)] == [4, 4, 4]
    assert [r["ranks"] for r in (base, dis, col)] == [4, 2, 4]
    assert (base["mode"], dis["mode"], col["mode"]) == ("sync", "async", "sync")
    assert base["iterations"] == ITERATIONS
    assert base["push_s"] is None and dis["push_s"] == 1.0
    assert dis["server_span_s"] == pytest.approx(8.0) and base["server_span_s"] is None
    assert base["images_per_s"] == pytest.approx(8 * len(base_seconds) / sum(base_seconds))
    assert base["images_per_s_per_gpu"] == pytest.approx(base["images_per_s"] / 4)
    assert base["peak_gb"] == 44.0 + ITERATIONS - 1  # the largest rank's, in the last iteration
    assert dis["first_ratio_max_dev"] == 0.02 and base["first_ratio_max_dev"] == 0.0
    assert base["checksums_ok"] and dis["checksums_ok"]
    # learning_stats: mean of iterations 0-4 vs 7-11 (rewards rise 0.1 per iteration): +0.7.
    assert base["reward_last_k"] - base["reward_first_k"] == pytest.approx(0.7)
    assert base["reward_first_k"] == pytest.approx(1.0 + 0.2 + 0.035)


def test_async_spans_skip_the_batches_queued_behind_the_warm_up():
    """With depth 1, iteration 1's batch was asked for during iteration 0 and waited behind its
    compile: its server span is warm-up, not rollout work, and is left out like iteration 0's."""
    history = _history(
        seconds=[9.0, 10.0], rollout=0.01, train=6.0, push=1.0, rewards_from=0.0, async_span=8.0
    )
    history[0]["server_span"] = [0.0, 400.0]
    history[1]["server_span"] = [0.0, 408.0]
    rec = _record("server", 2, ["cuda:2", "cuda:3"], [0, 1], history, async_depth=1)
    (row,) = scale_report.layout_rows({"fast": rec})
    assert row["server_span_s"] == pytest.approx(8.0)


def test_no_baseline_and_failed_checksum(run_dir):
    runs = scale_report.load_runs(run_dir)
    bad = json.loads(json.dumps(runs["scale-colocated"]))
    bad["history"][5]["checksum_ok"] = False
    rows = _by_name(scale_report.layout_rows({"bad": bad}))
    assert rows["bad"]["vs_baseline"] is None
    assert rows["bad"]["checksums_ok"] is False
    assert "**no**" in scale_report.markdown_table(list(rows.values()))


def test_advice_from_the_rows(run_dir):
    rows = scale_report.layout_rows(scale_report.load_runs(run_dir))
    advice = _by_name(scale_report.advice_rows(rows))
    base, dis, col = advice["scale-in-process"], advice["scale-disagg-async"], advice["scale-colocated"]
    # Synchronous: rollout + reward + train (+ push); async: max(server span, reward + train) + push.
    assert base["model_s"] == pytest.approx(15.0 + 0.5 + 5.0)
    assert col["model_s"] == pytest.approx(7.0 + 0.5 + 4.0 + 0.5)
    assert dis["rollout_work_s"] == pytest.approx(8.0)  # the server's span, not the 0.01 s wait
    assert dis["model_s"] == pytest.approx(max(8.0, 6.5 + 1.0))
    assert dis["measured_over_model"] == pytest.approx(_by_name(rows)["scale-disagg-async"]["s_per_it"] / 8.0)
    assert (base["bound"], dis["bound"], col["bound"]) == ("rollout", "rollout", "rollout")
    assert [a["name"] for a in advice.values() if a["fastest"]] == ["scale-disagg-async"]
    assert [a["name"] for a in advice.values() if a["best_per_gpu"]] == ["scale-disagg-async"]

    # A trainer slower than the rollout flips the bound.
    slow_train = [{**_by_name(rows)["scale-disagg-async"], "train_s": 20.0}]
    assert scale_report.advice_rows(slow_train)[0]["bound"] == "train"
    # Async, the push is on the trainer's side: 6.5 + 1.0 s of trainer work against an 8 s rollout
    # is rollout-bound, 7.2 + 1.0 s is train-bound although 7.2 alone is below 8.
    pushing = [{**_by_name(rows)["scale-disagg-async"], "train_s": 6.7}]
    assert scale_report.advice_rows(pushing)[0]["bound"] == "train"


def test_main_writes_markdown_and_png(run_dir, tmp_path, capsys):
    md, png = tmp_path / "out" / "scale.md", tmp_path / "out" / "scale.png"
    md.parent.mkdir()
    text = scale_report.main([str(run_dir), "--md", str(md), "--png", str(png), "--title", "scale"])
    assert md.read_text() == text
    assert text in capsys.readouterr().out
    for name in ("scale-in-process", "scale-disagg-async", "scale-colocated"):
        assert text.count(f"| {name} ") == 2  # one layout row, one advice row
    assert "empty-run" not in text and "weight_sync" not in text
    assert "Fastest measured: **scale-disagg-async**" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 5000  # axes, three curves and a legend, not an empty canvas


def test_split_advice_from_the_measured_rates(run_dir):
    """Per-GPU rates from the rows (colocated: 8 images / 7 s rollout / 4 server GPUs; train: 8 images
    / 4 s / 4 ranks and 8 / 6 / 2 -- the larger kept), then every split of 4 GPUs."""
    rows = scale_report.layout_rows(scale_report.load_runs(run_dir))
    rate = scale_report.rates(rows)
    assert rate["rollout"] == pytest.approx(8 / 7.0 / 4)
    assert rate["train"] == pytest.approx(max(8 / 4.0 / 4, 8 / 6.0 / 2))
    assert "rollout_fast" not in rate
    advice = {a["split"]: a for a in scale_report.split_advice(rows, 4, 8, overhead_s=1.0)}
    r, t = rate["rollout"], rate["train"]
    assert advice["colocated 4"]["predicted_s"] == pytest.approx(8 / (4 * r) + 8 / (4 * t) + 1.0)
    assert advice["colocated 4"]["measured_s"] == pytest.approx(12.0)
    assert advice["2 + 2"]["predicted_s"] == pytest.approx(max(8 / (2 * r), 8 / (2 * t) + 1.0))
    assert advice["2 + 2"]["measured_s"] == pytest.approx(10.0)  # the async run: 2 servers + 2 trainers
    assert advice["1 + 3"]["measured_s"] is None
