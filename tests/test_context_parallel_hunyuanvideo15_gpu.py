"""HunyuanVideo 1.5 served with ``--context-parallel 2`` (Ulysses, the server's plan from
``server/cp_plans.py``) on two GPUs, against a one-GPU server, before and after a weight update.

Rank 0 is this process on cuda:0, its follower runs on cuda:1. Sharded attention sums in another
order than one GPU, so k = 2 is compared with k = 1 within a float32 bound, not bit for bit (the
test prints the distances it measured). Not run yet (no two-GPU machine at the time of writing).
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.conftest import ServedModel
from tests.test_context_parallel_gpu import BOUND, update
from tests.test_context_parallel_hunyuanvideo15 import BODY, CALLS_PER_ROLLOUT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def distances(a: dict, b: dict) -> dict[str, float]:
    """max |a - b| of the video, the log-probs and the trajectory's latents."""
    out = {k: (a[k] - b[k]).abs().max().item() for k in ("generated_output", "rollout_log_probs")}
    x, y = (o["dit_trajectory"]["latents"] for o in (a, b))
    out["latents"] = (x - y).abs().max().item()
    return out


def test_hunyuanvideo15_two_gpu_rollouts_match_one_gpu_and_follow_updates(tiny_model_path):
    path = tiny_model_path("hunyuanvideo15")
    ref = ServedModel(path, device="cuda:0")
    try:
        (base,) = ref.generate(BODY)
        update(ref, 1)
        (updated,) = ref.generate(BODY)
    finally:
        ref.close()
    moved = max(distances(updated, base).values())
    cp = ServedModel(path, device="cuda:0", context_parallel=2, context_parallel_mode="ulysses")
    try:
        (out,) = cp.generate(BODY)
        before = distances(out, base)
        update(cp, 1)
        (out_updated,) = cp.generate(BODY)
        after = distances(out_updated, updated)
        print(
            f"hunyuanvideo15 ulysses k=2 vs k=1: before update {before}, after {after}; update moved {moved:.3g}"
        )
        assert max(before.values()) <= BOUND and max(after.values()) <= BOUND
        assert out["exact"] is False  # sharded attention
        assert max(distances(out_updated, out).values()) > 0.5 * moved  # the update reached both ranks
        assert moved > 10 * BOUND
        deadline = time.monotonic() + 30
        while True:
            stats = cp.client.get("/server_info").json()["speed"]["context_parallel"]
            (follower,) = stats["followers"]
            if follower["forwards"] == stats["forwards"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert stats["mode"] == "ulysses" and stats["error"] is None
        assert follower["forwards"] == stats["forwards"] == 2 * CALLS_PER_ROLLOUT
        assert follower["weight_syncs"] == 2  # at start, and after the update
    finally:
        cp.close()
