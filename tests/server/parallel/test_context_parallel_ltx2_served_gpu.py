"""LTX-2 served with ``--context-parallel 2`` (Ulysses, the server's plan from ``server/parallel/cp_plans.py``)
on two GPUs, against a one-GPU server: video and audio streams, before and after a weight update.

Rank 0 is this process on cuda:0, its follower runs on cuda:1. Sharded attention sums in another
order than one GPU, so k = 2 is compared with k = 1 within a float32 bound, not bit for bit (the
test prints the distances it measured per stream). Not run yet (no two-GPU machine at the time of
writing).
"""

from __future__ import annotations

import pytest
import torch

from tests.server.parallel.test_context_parallel_gpu import served_k2_against_k1
from tests.server.parallel.test_context_parallel_ltx2 import BODY

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def distances(a: dict, b: dict) -> dict[str, float]:
    """max |a - b| of the video output, the joint log-probs and each stream's trajectory."""
    out = {k: (a[k] - b[k]).abs().max().item() for k in ("generated_output", "rollout_log_probs")}
    for stream in ("video", "audio"):
        x, y = (o["dit_trajectory"]["streams"][stream]["latents"] for o in (a, b))
        out[f"{stream}_latents"] = (x - y).abs().max().item()
    return out


def test_ltx2_two_gpu_rollouts_match_one_gpu_in_both_streams_and_follow_updates(tiny_model_path):
    served_k2_against_k1(tiny_model_path("ltx2"), BODY, distances, BODY["num_inference_steps"], "ltx2")
