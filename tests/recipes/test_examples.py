"""The training recipes end to end on the CPU: a tiny SD3 model, a real server (uvicorn on a thread,
real HTTP), the recipe's own ``main``. Each run is a few seconds.

What these check is the plumbing, not learning (CPU noise on a random model does not "learn"): the
first inner pass replays the server's policy exactly (ratio 1, to the last bit), every push is
verified (the server's adapter checksum is the trainer's), the reward plug-in sees the images and
prompts the server returned and its values are what the recipe trains on, and resuming continues
the run exactly. Negative controls show that those checks fail when the server and the trainer do
not hold the same weights.
"""

from __future__ import annotations

import importlib
import json
import math
import types
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# Small: 2 groups of 4 images per iteration, 2 iterations (the recipe's defaults otherwise: 4 steps, 32x32).
SMALL = ["--server", "thread", "--iterations", "2", "--prompts", "2", "--group-size", "4"]
PHASE_KEYS = ("rollout_s", "reward_s", "train_s", "push_s", "iteration_s", "images_per_second")


@pytest.fixture
def examples(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))

    def load(name: str):
        return importlib.import_module(name)

    return load


def recipe_module(name: str):
    """A module of the recipes' machinery (``diffusion_rollout.recipes``), which the examples run."""
    return importlib.import_module(f"diffusion_rollout.recipes.{name}")


def _rewards(run) -> list[list[float]]:
    return [h["rewards"] for h in run["history"]]


# ---------------------------------------------------------------------------------------------- Flow-GRPO
def test_flow_grpo_on_policy_ratio_verified_pushes_and_records(examples, tmp_path):
    flow_grpo = examples("flow_grpo")
    out = tmp_path / "run.json"
    run = flow_grpo.main([*SMALL, "--inner-epochs", "2", "--out", str(out)])
    history = run["history"]
    assert run["layout"] == "server" and len(history) == 2
    for i, h in enumerate(history):
        # The first inner pass replayed the server's policy exactly: ratio 1, to the last bit.
        assert h["first_ratio_max_dev"] == 0.0
        # The second pass runs after an optimizer step: its ratio moved (so the check above can fail).
        assert h["ratio_min"] < 1.0 or h["ratio_max"] > 1.0, h
        # The pushed adapter's checksum (read back from the server) is the trainer's.
        assert h["checksum_ok"] is True
        assert h["weight_version"] == f"iter-{i + 1}" and h["iteration"] == i
        assert h["images"] == 8 and len(h["rewards"]) == 8
        assert len(h["sde_steps"]) == 2  # --sde-window 2 (default)
        for key in PHASE_KEYS:
            assert h[key] > 0, key
    summary = run["summary"]
    assert summary["iterations"] == 2 and summary["first_ratio_max_dev"] == 0.0 and summary["checksums_ok"]
    assert {"rollout_s", "reward_s", "train_s", "push_s", "iteration_s"} <= set(summary["mean_seconds"])
    assert summary["images_per_second"] > 0
    assert run["final_adapter_checksum"] == run["server_adapter_checksum"]
    # The --out file is the whole returned record.
    written = json.loads(out.read_text())
    assert len(written["history"]) == len(history) == 2
    assert written == run


def test_flow_grpo_share_prefix_keeps_the_first_ratio_exactly_1(examples):
    """--share-prefix: each group's ODE steps before its window run once; the trainer replays the
    window's steps (run at the group's batch), so its first ratio is still exactly 1."""
    run = examples("flow_grpo").main(
        [*SMALL, "--share-prefix", "--sde-window", "1", "--sde-window-range", "3"]
    )
    history = run["history"]
    for h in history:
        assert h["first_ratio_max_dev"] == 0.0 and h["checksum_ok"] is True
        assert h["shared_prefix_steps"] == h["sde_steps"][0]
    # Some iteration's window starts after step 0, so something was shared (seeded windows).
    assert max(h["shared_prefix_steps"] for h in history) > 0


def test_flow_grpo_async_depth_trains_on_batches_at_most_one_push_stale(examples):
    """--async-depth 1: the next iteration's rollouts run while the trainer trains; staleness <= 1,
    |ratio - 1| exactly 0 on staleness-0 batches and above 0 on stale ones (so the check can fail)."""
    run = examples("flow_grpo").main([*SMALL, "--iterations", "3", "--async-depth", "1"])
    history = run["history"]
    assert [h["iteration"] for h in history] == [0, 1, 2]
    assert history[0]["staleness"] == 0  # the first batch is made under the initial push
    for h in history:
        assert h["staleness"] in (0, 1) and list(h["ratio_by_staleness"]) == [h["staleness"]]
        stats = h["ratio_by_staleness"][h["staleness"]]
        assert stats["count"] > 0
        if h["staleness"] == 0:
            assert stats["max"] == 0.0
        else:
            assert stats["max"] > 0.0
        assert h["checksum_ok"] is True
    assert run["final_adapter_checksum"] == run["server_adapter_checksum"]


def test_flow_grpo_recompute_old_log_probs_matches_the_plain_loss_on_the_exact_tier(examples):
    """--recompute-old-log-probs (for the fast tier) trains against the trainer's own log-probs with
    a TIS weight to the server's; on the exact tier both are the same bits, so the weight is 1 and
    the run follows the plain clipped loss: same first rewards, same losses, ratio exactly 1."""
    flow_grpo = examples("flow_grpo")
    plain = flow_grpo.main([*SMALL, "--iterations", "2"])
    tis = flow_grpo.main([*SMALL, "--iterations", "2", "--recompute-old-log-probs"])
    assert tis["history"][0]["rewards"] == plain["history"][0]["rewards"]
    for a, b in zip(tis["history"], plain["history"], strict=True):
        assert a["tis_weighted"] and not b["tis_weighted"]
        assert a["first_ratio_max_dev"] == 0.0 and a["checksum_ok"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert tis["final_adapter_checksum"] == tis["server_adapter_checksum"]


def test_flow_grpo_reward_plugin_gets_the_served_images_and_prompts(examples, tmp_path):
    flow_grpo, recipe_prompts = examples("flow_grpo"), recipe_module("options").PROMPTS
    calls = tmp_path / "calls.json"
    plugin = tmp_path / "myreward.py"
    plugin.write_text(
        "import json\n"
        "from pathlib import Path\n"
        "import torch\n"
        f"CALLS = Path({str(calls)!r})\n"
        "def score(images, prompts):\n"
        "    r = images.float().mean(dim=(1, 2, 3))\n"
        "    done = json.loads(CALLS.read_text()) if CALLS.exists() else []\n"
        "    done.append({'dtype': str(images.dtype), 'shape': list(images.shape),\n"
        "                 'prompts': list(prompts), 'returned': r.tolist()})\n"
        "    CALLS.write_text(json.dumps(done))\n"
        "    return r\n"
    )
    run = flow_grpo.main([*SMALL, "--reward", f"{plugin}:score"])
    seen = json.loads(calls.read_text())
    assert len(seen) == 2  # once per iteration
    for it, (call, h) in enumerate(zip(seen, run["history"], strict=True)):
        assert call["dtype"] == "torch.uint8" and call["shape"] == [2 * 4, 3, 32, 32]
        # One prompt per sample: each group's prompt, group_size times, in the order of the groups.
        assert call["prompts"] == [recipe_prompts[it * 2 + k] for k in range(2) for _ in range(4)]
        # What the recipe recorded (and normalised into advantages) is what the plug-in returned.
        assert h["rewards"] == [round(r, 5) for r in call["returned"]]
        assert min(call["returned"]) > 0 and max(call["returned"]) < 255
    assert run["summary"]["checksums_ok"] and run["summary"]["first_ratio_max_dev"] == 0.0


def test_flow_grpo_reward_on_server_trains_on_the_same_values_without_the_pixels(examples, tmp_path):
    # The same plug-in scored in the trainer and on the server (serve --reward): the runs are the
    # same run, and the server's answers are smaller by the images.
    flow_grpo = examples("flow_grpo")
    plugin = tmp_path / "myreward.py"
    plugin.write_text("def score(images, prompts):\n    return images.float().mean(dim=(1, 2, 3))\n")
    spec = f"mine={plugin}:score"
    trainer = flow_grpo.main([*SMALL, "--reward", spec])
    server = flow_grpo.main([*SMALL, "--reward", spec, "--reward-on", "server"])
    for t, s in zip(trainer["history"], server["history"], strict=True):
        assert s["rewards"] == t["rewards"] and s["advantages"] == t["advantages"]
        assert s["first_ratio_max_dev"] == 0.0
        # The uint8 images, and per output a tensor envelope less a rewards field (under 200 bytes).
        images = 2 * 4 * 3 * 32 * 32
        assert images <= t["answer_bytes"] - s["answer_bytes"] < images + 8 * 200
    assert server["final_adapter_checksum"] == trainer["final_adapter_checksum"]
    # Each run names where it scored; a CPU reward holds no GPU memory.
    assert trainer["trainer_reward"] == {"name": "mine", "where": "trainer", "resident_bytes": None}
    assert server["server_reward"]["calls"] >= 1 and "trainer_reward" not in server


def test_reward_on_server_refuses_a_server_that_does_not_serve_it(examples, fresh_server):
    from diffusion_rollout.client import RolloutClient
    from tests.reliability_helpers import live_server

    common = recipe_module("reward")
    args = types.SimpleNamespace(reward="ocr=vlm_ocr_judge", reward_on="server", log_to=[])
    refused = pytest.raises(SystemExit, match=r"does not serve a reward named 'ocr' .*--reward ocr=SPEC")
    # A private server: live_server drains its engine at the end (the shared one must live on).
    with live_server(fresh_server("sd3")) as (url, _), RolloutClient(url) as client, refused:
        common.RecipeReward(args, client)
    with pytest.raises(SystemExit, match="needs a rollout server"):
        common.RecipeReward(args, None)


def test_flow_grpo_screens_then_trains_on_exact_regenerations(examples):
    # Sol-RL's screen: 8 cheap candidates per group (TaylorSeer, inexact), the 4 at the reward's two
    # extremes regenerated exactly and trained on, the first-step ratio exactly 1.
    flow_grpo = examples("flow_grpo")
    run = flow_grpo.main([*SMALL, "--screen", "8", "--reward-on", "server"])
    for h in run["history"]:
        assert h["first_ratio_max_dev"] == 0.0 and h["checksum_ok"] is True
        assert h["screen_s"] > 0 and len(h["rewards"]) == 2 * 4
    extremes = recipe_module("flow_grpo_rollouts").extremes
    assert extremes(torch.tensor([0.5, 0.9, 0.1, 0.7, 0.3]), 3) == [1, 2, 3]
    assert extremes(torch.tensor([0.5, 0.9, 0.1, 0.7]), 4) == [0, 1, 2, 3]
    with pytest.raises(SystemExit, match="--screen K needs"):
        flow_grpo.main([*SMALL, "--screen", "2"])


def test_flow_grpo_trains_on_trees_with_ratio_exactly_1(examples):
    # BranchGRPO's rollout: each group a tree of 4 leaves (branching at steps 1 and 3), its nodes'
    # steps computed once on the server and replayed the same way by the trainer.
    flow_grpo = examples("flow_grpo")
    run = flow_grpo.main([*SMALL, "--steps", "6", "--branch", "1:2,3:2"])
    for h in run["history"]:
        assert h["first_ratio_max_dev"] == 0.0 and h["checksum_ok"] is True and h["sde_steps"] == [1, 3]
    with pytest.raises(SystemExit, match="--group-size equal to the product"):
        flow_grpo.main([*SMALL, "--branch", "1:3"])


def test_dance_grpo_replays_exactly(examples):
    run = examples("flow_grpo").main([*SMALL, "--step-kind", "dance"])
    for h in run["history"]:
        assert h["first_ratio_max_dev"] == 0.0 and h["ratio_min"] == 1.0 and h["ratio_max"] == 1.0
        assert h["checksum_ok"] is True
    assert run["final_adapter_checksum"] == run["server_adapter_checksum"]


def test_flow_grpo_kl_to_the_base_model(examples):
    run = examples("flow_grpo").main([*SMALL, "--kl-beta", "0.1"])
    kls = [h["kl"] for h in run["history"]]
    assert all(math.isfinite(k) and k >= 0 for k in kls), kls
    # The adapter starts at zero (the policy is the base model: KL 0) and has moved by iteration 2.
    assert kls[0] == 0.0 and kls[1] > 0, kls
    for h in run["history"]:  # the reference pass (adapter disabled) leaves the ratio exactly 1
        assert h["first_ratio_max_dev"] == 0.0 and h["ratio_min"] == 1.0 and h["ratio_max"] == 1.0
        assert h["checksum_ok"] is True


def test_in_process_layout_samples_what_the_server_samples(examples):
    """The stock pipeline in the trainer and the server, same seeds: the same images, bit for bit."""
    flow_grpo = examples("flow_grpo")
    served = flow_grpo.main(SMALL)
    local = flow_grpo.main([*SMALL, "--layout", "in-process"])
    assert served["layout"] == "server" and local["layout"] == "in-process"
    assert _rewards(local) == _rewards(served)
    assert len(set(_rewards(served)[0])) > 1  # the samples of a group differ (the check is not vacuous)
    assert all(h["first_ratio_max_dev"] == 0.0 for h in served["history"] + local["history"])
    assert all(h["checksum_ok"] is None for h in local["history"])  # nothing to push in process
    assert "final_adapter_checksum" not in local


def test_flow_grpo_resumes_from_its_checkpoint(examples, tmp_path):
    flow_grpo = examples("flow_grpo")
    ckpt = tmp_path / "ckpt"
    first = flow_grpo.main([*SMALL, "--checkpoint", str(ckpt)])
    assert (ckpt / "trainer.pt").exists() and json.loads((ckpt / "state.json").read_text())[
        "next_iteration"
    ] == 2
    resumed = flow_grpo.main([*SMALL, "--iterations", "3", "--checkpoint", str(ckpt)])
    assert len(resumed["history"]) == 3 and resumed["history"][:2] == first["history"]
    third = resumed["history"][2]
    # The resumed adapter went to a fresh server (weight version iter-2) and the replay was exact.
    assert third["iteration"] == 2 and third["weight_version"] == "iter-3"
    assert third["first_ratio_max_dev"] == 0.0 and third["checksum_ok"] is True
    assert resumed["final_adapter_checksum"] == resumed["server_adapter_checksum"]
    # Adapter and optimizer state came back whole: the same as three iterations in one go.
    straight = flow_grpo.main([*SMALL, "--iterations", "3"])
    assert _rewards(straight) == _rewards(resumed)
    assert straight["final_adapter_checksum"] == resumed["final_adapter_checksum"]


def test_a_checkpoint_write_that_fails_leaves_the_previous_checkpoint(examples, tmp_path, monkeypatch):
    """A full disk (or a kill) during the write of iteration 2's checkpoint: the one of iteration 1
    stays whole, nothing half-written is left, and the rerun continues to the straight run's records."""
    import torch

    flow_grpo = examples("flow_grpo")
    ckpt = tmp_path / "ckpt"
    first = flow_grpo.main([*SMALL, "--checkpoint", str(ckpt)])
    before = {name: (ckpt / name).read_bytes() for name in ("trainer.pt", "state.json")}

    def full_disk(obj, f, *args, **kwargs):
        f.write(b"the first bytes of a checkpoint")
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(torch, "save", full_disk)
        with pytest.raises(OSError, match="No space left"):
            flow_grpo.main([*SMALL, "--iterations", "3", "--checkpoint", str(ckpt)])
    assert {name: (ckpt / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in ckpt.iterdir()) == ["state.json", "trainer.pt"]  # no .tmp left
    resumed = flow_grpo.main([*SMALL, "--iterations", "3", "--checkpoint", str(ckpt)])
    assert resumed["history"][:2] == first["history"] and resumed["history"][2]["checksum_ok"] is True
    straight = flow_grpo.main([*SMALL, "--iterations", "3"])
    assert _rewards(straight) == _rewards(resumed)


@pytest.mark.slow
def test_flow_grpo_stops_when_the_server_never_takes_its_weights(examples, monkeypatch, tmp_path):
    """Negative control: pushes after the first only relabel the server's adapter (its weights stay at
    the initial zero adapter). The checksum check catches it, the push is repeated a bounded number of
    times, and the run stops with an error naming the cause, having trained on nothing it could not
    vouch for."""
    flow_grpo = examples("flow_grpo")
    sync = recipe_module("weight_sync")
    real_push, versions = sync.push_lora, []

    def stale_push(client, model, *, name="default", weight_version=None, **kw):
        versions.append(weight_version)
        if len(versions) == 1:
            return real_push(client, model, name=name, weight_version=weight_version, **kw)
        return client.lora_activate(name, weight_version=weight_version)

    monkeypatch.setattr(sync, "push_lora", stale_push)
    out = tmp_path / "run.json"
    with pytest.raises(RuntimeError, match=r"iteration 0: push_not_verified: .* does not take the trainer's"):
        flow_grpo.main([*SMALL, "--out", str(out), "--recover-timeout", "30"])
    assert versions[0] == "iter-0" and len(versions) > 2 and set(versions[1:]) == {"iter-1"}
    assert not out.exists()  # iteration 0 never completed: its push was never verified


def test_flow_grpo_repushes_a_lost_push_and_ends_where_a_clean_run_ends(examples, monkeypatch, tmp_path):
    """The push after iteration 0 never reaches the server (it claims success, sends nothing): the
    checksum check sees it, the adapter is pushed again and verified, and the run ends with the same
    rewards and the same adapter as a run without the fault; the recovery is in the record."""
    flow_grpo = examples("flow_grpo")
    clean = flow_grpo.main(SMALL)
    sync = recipe_module("weight_sync")
    real_push, calls = sync.push_lora, []

    def lost_push(client, model, *, name="default", weight_version=None, **kw):
        calls.append(weight_version)
        if len(calls) == 2:
            return types.SimpleNamespace(weight_version=weight_version)  # claims success, sent nothing
        return real_push(client, model, name=name, weight_version=weight_version, **kw)

    monkeypatch.setattr(sync, "push_lora", lost_push)
    out = tmp_path / "run.json"
    run = flow_grpo.main([*SMALL, "--out", str(out)])
    assert calls == ["iter-0", "iter-1", "iter-1", "iter-2"]
    [event] = run["recoveries"]
    assert (
        event["iteration"] == 0 and event["cause"] == "push_not_verified" and event["action"] == "re-pushed"
    )
    assert run["recoveries_by_cause"]["push_not_verified"]["count"] == 1 and run["off_policy_rejected"] == 0
    assert [h["recovered"] for h in run["history"]] == [["push_not_verified"], []]
    assert all(h["checksum_ok"] and h["first_ratio_max_dev"] == 0.0 for h in run["history"])
    assert _rewards(run) == _rewards(clean)
    assert run["final_adapter_checksum"] == clean["final_adapter_checksum"] == run["server_adapter_checksum"]
    assert json.loads(out.read_text())["recoveries"] == run["recoveries"]


# ---------------------------------------------------------------------------------------------- DiffusionNFT
def test_diffusion_nft_samples_from_old_and_holds_the_servers_old_policy(examples):
    nft = examples("diffusion_nft")
    run = nft.main(SMALL)
    assert run["active_adapter"] == "old" and len(run["history"]) == 2
    for i, h in enumerate(run["history"]):
        # The trainer's `old` adapter recomputes the server's ODE step bit for bit.
        assert h["old_policy_max_dev"] == 0.0
        assert h["checksum_ok"] is True  # both adapters, read back from the server
        assert h["weight_version"] == f"nft-{i + 1}"
        assert math.isfinite(h["loss"]) and h["loss"] > 0
        assert len(h["rewards"]) == 8
        for key in PHASE_KEYS:
            assert h[key] > 0, key
    assert run["summary"]["old_policy_max_dev"] == 0.0 and run["summary"]["checksums_ok"]


def test_diffusion_nft_repushes_an_old_adapter_that_did_not_arrive(examples, monkeypatch):
    """The push of `old` after iteration 0 is skipped: the checksum check sees that the server's `old`
    is not the trainer's, both adapters are pushed again, and iteration 1 samples from the trainer's
    `old` (parity exactly 0) instead of the previous one; the recovery is recorded."""
    nft = examples("diffusion_nft")
    sync = recipe_module("weight_sync")
    real_push, names = sync.push_lora, []

    def push_skipping_old_once(client, model, *, name, **kw):
        names.append(name)
        if name == "old" and names.count("old") == 2:
            return None
        return real_push(client, model, name=name, **kw)

    monkeypatch.setattr(sync, "push_lora", push_skipping_old_once)
    run = nft.main(SMALL)
    assert names == ["default", "old"] * 4
    [event] = run["recoveries"]
    assert (event["iteration"], event["cause"], event["action"]) == (0, "push_not_verified", "re-pushed")
    first, second = run["history"]
    assert first["recovered"] == ["push_not_verified"] and second["recovered"] == []
    for h in (first, second):
        assert h["old_policy_max_dev"] == 0.0 and h["checksum_ok"] is True


def test_diffusion_nft_waits_for_a_server_that_lost_its_adapters_after_the_last_push(examples, monkeypatch):
    """Right after the last push was verified, the server loses both adapters (what a restart does):
    the run's final read finds it not holding them, pushes both again, and ends with the server's
    checksums equal to the trainer's and the recovery recorded, where it once raised KeyError."""
    nft = examples("diffusion_nft")
    sync = recipe_module("weight_sync")
    real_checksums, calls = sync.adapter_checksums, []

    def checksums_then_lose(client):
        served = real_checksums(client)
        calls.append(served)
        if len(calls) == 3:  # the verification of the last push (start + 2 iterations)
            client.lora_unload(None)
        return served

    monkeypatch.setattr(sync, "adapter_checksums", checksums_then_lose)
    run = nft.main(SMALL)
    [event] = run["recoveries"]
    assert (event["iteration"], event["cause"], event["action"]) == (2, "final_weights_lost", "re-pushed")
    assert "final_check_error" not in run and run["active_adapter"] == "old"
    assert run["server_adapter_checksums"] == run["final_adapter_checksums"]
    assert sorted(run["final_adapter_checksums"]) == ["default", "old"]


# ---------------------------------------------------------------------------------------------- plots
def test_plot_reward_curves_writes_a_png(examples, tmp_path):
    common = recipe_module("records")

    def fake_run(offset: float) -> dict:
        history = [
            {"iteration": i, "rewards": [offset + i, offset + i + 1.0], "reward_mean": offset + i + 0.5,
             "reward_std": 0.7}
            for i in range(4)
        ]  # fmt: skip
        return {"history": history}

    png = tmp_path / "curves.png"
    common.plot_reward_curves({"server": fake_run(0.0), "in-process": fake_run(1.0)}, str(png), "test")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


# ---------------------------------------------------------------------------------------------- Ray
@pytest.mark.slow
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
