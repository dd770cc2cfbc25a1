"""A training run survives its servers (issue #42): the recipe against a real ``serve`` subprocess,
through the chaos benchmark's fault-injecting proxy, the server and the trainer killed and restarted.

What these check: a server restarted with its base weights is found out (by the connection it drops,
or by the weight version of the rollouts it answers), waited for, re-pushed, verified, and the
iteration's rollouts redone; a batch from another version is rejected and counted, never trained on
(the first replay pass stays exactly on-policy); every recovery is in the run record with its cause
and seconds; and the run ends on the adapter of a fault-free run with the same seeds, bit for bit.
"""

from __future__ import annotations

import argparse
import re
import secrets
import time

import pytest

from benchmarks import chaos_train
from benchmarks.chaos_train import FULL_PART, GENERATE, LORA_LIST, Fault

# Each test starts `serve` and the trainer as processes, and restarts them: tens of seconds each.
# A run stops itself at its --deadline-s (up to 400 s) with a report of where it was; pytest's own
# 300 s timeout must not cut it short first (a loaded CI machine got past 300 s once).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from diffusion_rollout.models import save_tiny_model

    return save_tiny_model("sd3", tmp_path_factory.mktemp("chaos") / "tiny-sd3")


def _args(model, **over) -> argparse.Namespace:
    settings = dict(model=model, iterations=3, prompts=1, group_size=4, seed=0, ranks=1, async_depth=0,
                    request_timeout=10.0, recover_timeout=120.0)  # fmt: skip
    settings.update(over)
    return argparse.Namespace(**settings)


def test_chaos_run_recovers_every_fault_and_ends_on_the_fault_free_adapter(tmp_path):
    """One fault of each kind (chaos_train's default plan, 8 iterations): every one is injected and
    recovered, no batch is trained off-policy, at most the iteration in flight is redone after a
    trainer restart, and the final adapter equals the fault-free run's (torch.equal)."""
    doc = chaos_train.main(["--work", str(tmp_path), "--out", str(tmp_path / "out"), "--deadline-s", "400"])
    rows, summary = doc["results"], doc["summary"]
    assert [r["fault"] for r in rows] == [f.name for f in chaos_train.default_faults()]
    for r in rows:
        assert r["injected"] and r["recovered"], r
    causes = summary["recoveries_by_cause"]
    for cause in ("rollout_connection_lost", "push_connection_lost", "off_policy_batch", "rollout_timeout",
                  "trainer_killed", "checkpoint_disk_full"):  # fmt: skip
        assert causes[cause]["count"] >= 1, cause
    assert summary["completed"] and summary["iterations_completed"] == 8
    assert summary["off_policy_rejected_groups"] >= 1 and summary["trained_off_policy"] == 0
    assert summary["server_restarts"] == 2 and summary["trainer_restarts"] == 2
    assert all(n <= 1 for n in summary["iterations_redone"])
    assert summary["final_adapter_equals_fault_free"] and summary["rewards_equal_fault_free"]
    assert doc["ok"] is True


def test_a_replica_killed_behind_a_ray_pool_is_recovered_and_ends_on_the_fault_free_adapter(tmp_path):
    """`serve --replicas 2` (Ray, CPU): replica 1's process is SIGKILLed mid-rollout in iteration 1.
    Ray restarts it and the pool copies a peer's weights into it; the push that meets the dead
    replica is refused as `replicas_diverged`, which the trainer answers by pushing again. The run
    ends on the adapter of the same run without the fault."""
    doc = chaos_train.main(
        ["--work", str(tmp_path), "--faults", "none", "--ray", "--iterations", "3", "--deadline-s", "400"]
    )
    [row] = doc["results"]
    assert row["fault"] == chaos_train.ray_fault().name and row["injected"] and row["recovered"], row
    ray = doc["summary"]["ray"]
    assert ray["replicas"] == 2 and len(ray["replicas_killed"]) == 1 and ray["server_restarts"] == 0
    assert ray["completed"] and ray["iterations_completed"] == 3 and ray["trained_off_policy"] == 0
    assert ray["final_adapter_equals_fault_free"] and ray["ok"]


def test_the_asynchronous_loop_recovers_and_trains_only_on_batches_it_can_vouch_for(tmp_path):
    """--async-depth 1: the server SIGKILLed mid-rollout (with the next iteration's rollouts in
    flight) and restarted. The stream is reopened after the re-push, and every batch trained is
    either exactly on-policy or stale within the depth and TIS-weighted. (The final adapter is not
    compared: which batches come out stale depends on timing.)"""
    doc = chaos_train.main(
        ["--work", str(tmp_path), "--faults", "kill_server", "--async-depth", "1", "--iterations", "4",
         "--deadline-s", "300"]
    )  # fmt: skip
    [row] = doc["results"]
    assert row["injected"] and row["recovered"], row
    summary = doc["summary"]
    assert summary["completed"] and summary["iterations_completed"] == 4 and summary["server_restarts"] == 1
    assert summary["recoveries_by_cause"]["rollout_connection_lost"]["count"] >= 1
    assert summary["trained_off_policy"] == 0 and summary["final_adapter_equals_fault_free"] is None


def test_a_server_that_never_comes_back_stops_the_run_with_the_cause(tiny_model, tmp_path):
    """The server is SIGKILLed mid-rollout and nobody restarts it: the trainer waits up to
    --recover-timeout, then stops with an error naming the iteration, the cause and the remedy,
    and the record keeps the iteration it completed."""
    fault = Fault("server killed for good", "kill_server_for_good", GENERATE, 1, "none")
    args = _args(tiny_model, recover_timeout=4.0)
    run = chaos_train.run_training(
        args, tmp_path, "gone", [fault], secrets.token_hex(16), time.monotonic() + 120, max_trainer_restarts=0
    )
    assert not run["completed"] and [d["cause"] for d in run["trainer_deaths"]] == ["trainer_failed"]
    log = (tmp_path / "gone-trainer.log").read_text()
    assert re.search(
        r"RecoveryError: iteration 1: rollout_connection_lost: http://127\.0\.0\.1:\d+ did not hold weight "
        r"version 'iter-1' again within 4 s .* is `serve` supervised",
        log,
    ), log[-3000:]
    assert [h["iteration"] for h in run["record"]["history"]] == [0]


def test_two_ranks_recover_together_and_end_on_the_two_rank_fault_free_adapter(tmp_path):
    """torchrun, 2 trainer ranks (gloo): the server SIGKILLed mid-rollout and restarted in iteration 2
    fails one rank's request or both; rank 0 waits and re-pushes, every rank redoes its rollouts, and
    the run ends on the adapter of the same 2-rank run without the fault."""
    doc = chaos_train.main(
        ["--work", str(tmp_path), "--faults", "kill_server", "--ranks", "2", "--prompts", "2",
         "--iterations", "3", "--deadline-s", "300"]
    )  # fmt: skip
    [row] = doc["results"]
    assert row["injected"] and row["recovered"] and "re-pushed" in row["recovered_by"], row
    summary = doc["summary"]
    assert (
        summary["completed"] and summary["iterations_completed"] == 3 and summary["trained_off_policy"] == 0
    )
    assert summary["final_adapter_equals_fault_free"] and summary["rewards_equal_fault_free"]


def test_a_server_restarted_after_the_last_push_is_waited_for_and_the_run_ends_with_checksums(
    tiny_model, tmp_path
):
    """The server restarts (base weights, no adapter) between the last verified push and the run's
    final read of the server's adapter checksum: the recipe waits, re-pushes, and ends with exit 0
    and both checksums in its record, the recovery recorded with its cause."""
    # A push reads GET /lora twice (push_lora's check, the recipe's); the run's final read is the third.
    fault = Fault("server restarted after the last push", "restart_server_first", LORA_LIST, 1,
                  "final_weights_lost", nth=3)  # fmt: skip
    run = chaos_train.run_training(
        _args(tiny_model, iterations=1), tmp_path, "last", [fault], secrets.token_hex(16),
        time.monotonic() + 300, max_trainer_restarts=0,
    )  # fmt: skip
    log = (tmp_path / "last-trainer.log").read_text()
    assert fault.fired_at is not None and run["server_restarts"] == 1
    assert run["completed"] and run["trainer_deaths"] == [], log[-3000:]
    record = run["record"]
    assert record["final_adapter_checksum"] == record["server_adapter_checksum"], record
    assert len(record["final_adapter_checksum"]) == 64 and "final_check_error" not in record
    [event] = record["recoveries"]
    assert (event["cause"], event["action"], event["iteration"]) == ("final_weights_lost", "re-pushed", 1)


def test_two_full_finetune_ranks_recover_a_server_killed_mid_part(tiny_model, tmp_path, monkeypatch):
    """torchrun, 2 ranks, --full-finetune over HTTP in 8 KiB parts (about 50): the server is
    SIGKILLed (and restarted) while the third part of the first push is on its way. Rank 0 finishes
    the gathers rank 1 is still in, every rank hears of the loss, and rank 0 waits and pushes again:
    the run completes, where it once hung in the gather until the process group's timeout."""
    monkeypatch.setenv("CHAOS_MAX_PART_BYTES", str(8 * 1024))
    fault = Fault("server killed mid-part of a full push", "kill_server", FULL_PART, 0,
                  "push_connection_lost", nth=3)  # fmt: skip
    args = _args(tiny_model, iterations=1, ranks=2, prompts=2, full=True, recover_timeout=60.0)
    t0 = time.monotonic()
    run = chaos_train.run_training(
        args, tmp_path, "full", [fault], secrets.token_hex(16), t0 + 240, max_trainer_restarts=0
    )
    log = (tmp_path / "full-trainer.log").read_text()
    assert fault.fired_at is not None and run["server_restarts"] == 1
    assert run["completed"] and run["trainer_deaths"] == [], log[-4000:]
    left = re.search(
        r"push failed after \d+ of \d+ parameters were gathered; finishing the (\d+) gathers", log
    )
    assert left is not None and int(left.group(1)) > 0, log[-4000:]  # the fault came mid-gather
    record = run["record"]
    assert record["trainable"] == "full" and record["ranks"] == 2
    [event] = record["recoveries"]
    assert (event["cause"], event["action"], event["iteration"]) == ("push_connection_lost", "re-pushed", 0)
    assert record["history"][0]["checksum_ok"] is True
