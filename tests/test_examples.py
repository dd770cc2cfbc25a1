"""The example trainers run end to end against a real server (uvicorn on a thread, real HTTP)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def examples(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))

    def load(name: str):
        return importlib.import_module(name)

    return load


def test_flow_grpo_runs_on_policy_verifies_and_improves(examples, tmp_path):
    flow_grpo = examples("flow_grpo")
    out = tmp_path / "summary.json"
    summary = flow_grpo.main(["--server", "thread", "--iterations", "5", "--out", str(out)])
    assert summary["iterations"] == 5 and len(summary["history"]) == 5
    # Every first inner step replayed the server's policy exactly: ratio 1, to the last bit.
    assert summary["first_ratio_max_dev"] == 0.0
    assert all(h["first_ratio_max_dev"] == 0.0 for h in summary["history"])
    # Later inner steps are off-policy: the ratio moved.
    assert any(h["ratio_min"] < 1.0 or h["ratio_max"] > 1.0 for h in summary["history"])
    # Every pushed adapter's checksum matched the trainer's, and the last one is what the server holds.
    assert summary["checksums_ok"] and all(h["checksum_ok"] for h in summary["history"])
    assert summary["final_adapter_checksum"] == summary["server_adapter_checksum"]
    assert summary["weight_version"] == "iter-5"
    # The server's deterministic samples got closer to the target colour.
    assert summary["eval_reward_end"] > summary["eval_reward_start"]
    assert json.loads(out.read_text())["first_ratio_max_dev"] == 0.0


def test_diffusion_nft_samples_from_old_while_default_trains(examples):
    nft = examples("diffusion_nft")
    summary = nft.main(["--server", "thread", "--iterations", "2", "--prompts", "2", "--group-size", "4"])
    assert summary["iterations"] == 2 and summary["weight_version"] == "nft-2"
    assert summary["active_adapter"] == "old"
    for record in summary["history"]:
        assert record["active_during_rollouts"] == "old"
        assert record["adapters"] == ["default", "old"]
        assert record["loss"] > 0


def test_ray_trainer_places_replicas_and_trains_without_http(tmp_path):
    """The Ray example in its own process (it starts and stops its own Ray instance)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("ray")
    out = tmp_path / "summary.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "ray_colocated.py"), "--iterations", "2", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["replicas"] == 2 and len(summary["history"]) == 2
    # Groups ran on both trainer-placed replicas, and each replayed exactly (ratio 1 to the last bit).
    assert all(n > 0 for n in summary["served_requests_per_replica"])
    assert summary["first_ratio_max_dev"] == 0.0
    # Every push reached every replica: each actor's adapter checksum is the trainer's.
    assert summary["checksums_ok"] and all(h["replica_checksums_agree"] for h in summary["history"])
    assert summary["weight_versions"] == ["iter-2"]
