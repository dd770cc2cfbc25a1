"""The recipes as N trainer ranks under ``torchrun`` on the CPU (gloo, tiny SD3), against a thread
server or a 2-replica Ray pool started by rank 0, as a user launches them.

What these check: the ranks split an iteration's groups so that their union is the 1-rank batch
(same rewards and advantages, bit for bit), every rank replays its groups exactly (first-step ratio
exactly 1 on every rank), the summed gradients give the 1-rank update up to float rounding, async
ranks agree on one weight version per batch, and a full-parameter (FSDP2) run reaches every replica
with each tensor's checksum verified.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SMALL = ["--iterations", "1", "--prompts", "2", "--group-size", "4"]


def torchrun(recipe: str, nproc: int, args: list[str], out: Path, timeout: int = 240) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(EXAMPLES / f"{recipe}.py"), *args, "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture
def examples(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module


def adapter(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint / "trainer.pt", weights_only=True)["adapters"]["default"]


@pytest.mark.slow
def test_two_ranks_make_the_one_rank_batch_and_update(examples, tmp_path):
    """Same seeds: the 2-rank iteration's rewards and advantages equal the 1-rank one's bit for bit,
    the first-step ratio is exactly 1 on both ranks, and the LoRA after the step equals the 1-rank
    LoRA within the rounding of the summed gradients."""
    args = [*SMALL, "--server", "thread", "--lr", "1e-2"]
    one = examples("flow_grpo").main(
        [*args, "--out", str(tmp_path / "one.json"), "--checkpoint", str(tmp_path / "c1")]
    )
    two = torchrun("flow_grpo", 2, [*args, "--checkpoint", str(tmp_path / "c2")], tmp_path / "two.json")
    h1, h2 = one["history"][0], two["history"][0]
    assert two["ranks"] == 2 and one["ranks"] == 1
    assert h2["rewards"] == h1["rewards"] and len(h2["rewards"]) == 8
    assert h2["advantages"] == h1["advantages"]
    assert h2["first_ratio_max_dev_per_rank"] == [0.0, 0.0] and h1["first_ratio_max_dev"] == 0.0
    assert h2["checksum_ok"] is True and two["final_adapter_checksum"] == two["server_adapter_checksum"]
    assert h2["rank_weight_versions"] == ["iter-0", "iter-0"]
    a1, a2 = adapter(tmp_path / "c1"), adapter(tmp_path / "c2")
    assert a1.keys() == a2.keys()
    lr = 1e-2
    moved = max(float(v.abs().max()) for k, v in a1.items() if "lora_B" in k)  # B starts at 0
    assert moved > 0.5 * lr  # the step is Adam's first: about lr per element, so the check below can fail
    # The two runs sum the same float32 gradient terms in another order ((g1 + g2) + (g3 + g4)
    # against g1 + g2 + g3 + g4) and clip by a norm computed from those sums: the gradients agree
    # to a few float32 ulps. Adam's first step is lr * g / (|g| + eps), which moves by at most
    # lr * |dg| / (4 eps) near |g| ~ eps and much less elsewhere; 1e-4 * lr bounds what a few ulps of
    # these gradients (|g| >= 1e-9 here) can do, while a missing or doubled rank's gradient moves
    # elements by O(lr).
    worst = max(float((a1[k] - a2[k]).abs().max()) for k in a1)
    assert worst <= 1e-4 * lr, worst


@pytest.mark.slow
def test_two_ranks_async_against_a_ray_pool_agree_on_every_batch_version(tmp_path):
    """--async-depth 1, two ranks, a 2-replica Ray pool started by rank 0 (`serve --replicas 2`):
    every iteration's batches come from one version on every rank, staleness 0 is exact."""
    run = torchrun(
        "flow_grpo", 2,
        [*SMALL, "--iterations", "3", "--async-depth", "1", "--server", "subprocess", "--replicas", "2"],
        tmp_path / "pool.json",
    )  # fmt: skip
    assert [h["iteration"] for h in run["history"]] == [0, 1, 2]
    for h in run["history"]:
        versions = h["rank_weight_versions"]
        assert len(versions) == 2 and len(set(versions)) == 1, h
        assert h["checksum_ok"] is True
        stats = h["ratio_by_staleness"][str(h["staleness"])]
        assert stats["count"] == 16  # both ranks' first-step ratios: 2 groups x 4 samples x 2 steps
        if h["staleness"] == 0:
            assert stats["max"] == 0.0
    assert run["history"][0]["staleness"] == 0
    assert run["final_adapter_checksum"] == run["server_adapter_checksum"]


@pytest.mark.slow
def test_full_finetune_fsdp2_syncs_every_replica_with_checksums(tmp_path):
    """--full-finetune on two ranks: the denoiser sharded with FSDP2 (gloo), its full weights
    broadcast to both replicas of a Ray pool after every step, each tensor's hash verified; the
    replicas then hold the trainer's weights, so the next iteration's ratio is exactly 1 again."""
    run = torchrun(
        "flow_grpo", 2,
        [*SMALL, "--iterations", "2", "--full-finetune", "--lr", "1e-3", "--server", "subprocess",
         "--replicas", "2"],
        tmp_path / "full.json",
    )  # fmt: skip
    assert run["trainable"] == "full" and run["full_sync"]["sync"] == "broadcast"
    assert run["full_sync"]["parameters"] > 0 and len(run["full_sync"]["sync_seconds"]) == 3  # start + 2
    for h in run["history"]:
        assert h["checksum_ok"] is True
        assert h["first_ratio_max_dev_per_rank"] == [0.0, 0.0]
    # The first step had a gradient, so the weights moved: a replica left on the old weights would
    # have shown a ratio off 1 in iteration 1.
    assert run["history"][0]["loss"] != 0.0


@pytest.mark.slow
def test_full_finetune_over_http_on_two_ranks(tmp_path):
    """--weight-sync http (a server on another host): push_weights of the gathered parameters."""
    run = torchrun(
        "flow_grpo", 2,
        [*SMALL, "--iterations", "2", "--full-finetune", "--server", "thread", "--weight-sync", "http"],
        tmp_path / "http.json",
    )  # fmt: skip
    assert run["full_sync"]["sync"] == "http"
    assert all(h["checksum_ok"] is True and h["first_ratio_max_dev"] == 0.0 for h in run["history"])


@pytest.mark.slow
def test_diffusion_nft_two_ranks_match_one_rank(examples, tmp_path):
    """DiffusionNFT's ranks draw the loss noise each group gets in a 1-rank run: same rewards, same
    loss up to float rounding, parity exact, both adapters verified."""
    args = [*SMALL, "--iterations", "2", "--server", "thread"]
    one = examples("diffusion_nft").main([*args, "--out", str(tmp_path / "one.json")])
    two = torchrun("diffusion_nft", 2, args, tmp_path / "two.json")
    assert two["ranks"] == 2
    assert two["history"][0]["rewards"] == one["history"][0]["rewards"]
    for a, b in zip(one["history"], two["history"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["old_policy_max_dev"] == 0.0 and b["checksum_ok"] is True


def test_groups_must_divide_over_the_ranks(examples):
    ranks = examples("diffusion_rollout.recipes.ranks").Ranks(rank=1, world=2)
    assert ranks.share([0, 1, 2, 3]) == [2, 3]
    with pytest.raises(SystemExit, match="multiple of the number of ranks"):
        ranks.share([0, 1, 2])


def test_gpu_lists_parse_and_refuse_repeats(examples):
    common = examples("diffusion_rollout.recipes.options")
    args = common.base_parser("x").parse_args(["--server-gpus", "0,1", "--trainer-gpus", "2,3"])
    assert args.server_gpu == [0, 1] and args.trainer_gpu == [2, 3]
    assert common.base_parser("x").parse_args(["--trainer-gpu", "1"]).trainer_gpu == [1]
    with pytest.raises(SystemExit):
        common.base_parser("x").parse_args(["--server-gpus", "0,0"])


def test_server_gpus_are_numbered_as_the_recipe_sees_them(examples):
    """Under CUDA_VISIBLE_DEVICES=2,3, --server-gpus 0 is physical GPU 2, not GPU 0 of the host."""
    visible = examples("diffusion_rollout.recipes.servers").server_visible_devices
    assert visible([0], None) == "0" and visible([0, 1], "") == "0,1"
    assert visible([0], "2,3") == "2" and visible([1, 0], "2, 3") == "3,2"
    assert visible([0], "GPU-aa,GPU-bb") == "GPU-aa"
    with pytest.raises(SystemExit, match="sees 2 GPU"):
        visible([2], "2,3")
