"""Context parallelism on GPUs: diffusers' Ulysses, ring and hybrid attention behind a served engine.

Rank 0 is this process on cuda:0, its followers run on the next GPUs. Sharded attention sums in
another order than one GPU, so a k-rank rollout is compared with a k = 1 one within a bound, not bit
for bit (the tests print the distance they measured); the followers must still run every call.
Ulysses runs in float32 (bound 1e-3); ring and hybrid run ``_native_flash``, bfloat16 only, so they
are compared with a bfloat16 k = 1 server within a bfloat16 bound. The hybrid test needs 4 GPUs.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save

from tests.conftest import ServedModel
from tests.server.parallel.test_context_parallel import BODY as CPU_BODY
from tests.server.parallel.test_context_parallel import settled

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

# The CPU test's request, for the one-expert family served here.
BODY = {k: v for k, v in CPU_BODY.items() if k != "guidance_scale_2"}
BOUND = 1e-3  # float32 on the tiny model; measured distances are printed


def update(server, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    new = {
        n: p.detach().cpu() + 0.05 * torch.randn(p.shape, generator=g)
        for n, p in server.engine.pipe.transformer.named_parameters()
    }
    r = server.client.post(
        "/update_weights", content=save(new), headers={"Content-Type": "application/octet-stream"}
    )
    assert r.status_code == 200, r.text


def distance(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in ("generated_output", "rollout_log_probs"))


def served_k2_against_k1(path, body: dict, distances, calls_per_rollout: int, label: str) -> None:
    """A k = 2 Ulysses server against a one-GPU one, before and after the same weight update:
    within ``BOUND`` on every entry of ``distances(a, b)`` (a dict of max |a - b|), the update
    reaching both ranks, and the follower running every call (``calls_per_rollout`` per rollout)."""
    ref = ServedModel(path, device="cuda:0")
    try:
        (base,) = ref.generate(body)
        update(ref, 1)
        (updated,) = ref.generate(body)
    finally:
        ref.close()
    moved = max(distances(updated, base).values())
    cp = ServedModel(path, device="cuda:0", context_parallel=2, context_parallel_mode="ulysses")
    try:
        (out,) = cp.generate(body)
        before = distances(out, base)
        update(cp, 1)
        (out_updated,) = cp.generate(body)
        after = distances(out_updated, updated)
        print(f"{label} ulysses k=2 vs k=1: before update {before}, after {after}; update moved {moved:.3g}")
        assert max(before.values()) <= BOUND and max(after.values()) <= BOUND
        assert out["exact"] is False  # sharded attention
        # The update changed what both ranks compute, as much as it changed the k = 1 result.
        assert max(distances(out_updated, out).values()) > 0.5 * moved
        assert moved > 10 * BOUND  # the bound is far below what a weight change does
        stats = settled(lambda: cp.client.get("/server_info").json()["speed"]["context_parallel"])
        (follower,) = stats["followers"]
        assert stats["mode"] == "ulysses" and stats["error"] is None
        assert follower["forwards"] == stats["forwards"] == 2 * calls_per_rollout
        assert follower["weight_syncs"] == 2  # at start, and after the update
    finally:
        cp.close()


def test_two_gpu_rollouts_match_one_gpu_and_follow_updates(tiny_model_path):
    served_k2_against_k1(
        tiny_model_path("wan"), BODY, lambda a, b: {"output": distance(a, b)},
        2 * BODY["num_inference_steps"], "wan",
    )  # fmt: skip


@pytest.mark.parametrize("family", ["wan-i2v", "wan2.2-i2v", "wan2.2-ti2v-i2v"])
def test_two_gpu_image_to_video_rollouts_match_one_gpu(tiny_model_path, tmp_path, family):
    """Wan image-to-video under Ulysses: channel-concatenated image latents (I2V), CLIP image tokens
    in cross-attention (Wan 2.1 I2V, not sharded), two experts (Wan 2.2 I2V-A14B) and per-token
    timesteps sharded with the sequence (TI2V-5B)."""
    from tests.server.parallel.test_context_parallel_i2v import BODY as I2V_BODY
    from tests.server.parallel.test_context_parallel_i2v import save_wan22_i2v

    if family == "wan2.2-i2v":
        path = tmp_path / family
        save_wan22_i2v(path)
    else:
        path = tiny_model_path(family)
    body = {**I2V_BODY, "guidance_scale_2": 3.0} if family == "wan2.2-i2v" else I2V_BODY
    ref = ServedModel(path, device="cuda:0")
    try:
        (base,) = ref.generate(body)
    finally:
        ref.close()
    cp = ServedModel(path, device="cuda:0", context_parallel=2, context_parallel_mode="ulysses")
    try:
        (out,) = cp.generate(body)
        print(f"{family} ulysses: max |k=2 - k=1| {distance(out, base):.3g}")
        assert distance(out, base) <= BOUND and out["exact"] is False
        stats = cp.client.get("/server_info").json()["speed"]["context_parallel"]
        assert stats["mode"] == "ulysses" and stats["error"] is None and stats["followers"][0]["alive"]
    finally:
        cp.close()


# bfloat16 has 8 mantissa bits: one rounding step of the tiny model's outputs (|x| ~ 1) is 2^-8 to
# 2^-7; a ring merges partial attentions by their log-sum-exp (in float32) instead of one softmax,
# and the difference compounds over the steps. The single-call ring test measured 0.0078 on the CPU
# (tests/server/parallel/test_ring_attention_gpu.py bounds it by 0.05); a 3-step rollout gets twice that room.
BF16_BOUND = 0.1


def bf16_layout_against_k1(tiny_model_path, k: int, **layout) -> None:
    """A bfloat16 k-rank server in ``layout`` against a bfloat16 one-GPU server on the tiny Wan:
    finite, within ``BF16_BOUND`` (max |diff| in the message), every follower running every call."""
    path = tiny_model_path("wan")
    ref = ServedModel(path, device="cuda:0", dtype="bfloat16")
    try:
        (base,) = ref.generate(BODY)
    finally:
        ref.close()
    cp = ServedModel(path, device="cuda:0", dtype="bfloat16", context_parallel=k, **layout)
    try:
        (out,) = cp.generate(BODY)
        stats = settled(lambda: cp.client.get("/server_info").json()["speed"]["context_parallel"])
    finally:
        cp.close()
    diffs = {
        key: (out[key].float() - base[key].float()).abs().max().item()
        for key in ("generated_output", "rollout_log_probs")
    }
    label = f"{layout['context_parallel_mode']} k={k} bf16 vs k=1: max |diff| {diffs}"
    print(label)
    for key in diffs:
        assert torch.isfinite(out[key].float()).all(), f"{key} non-finite; {label}"
    assert max(diffs.values()) <= BF16_BOUND, label
    assert out["exact"] is False
    assert stats["error"] is None and stats["mode"] == layout["context_parallel_mode"], stats
    assert stats["attention_backend"] == "_native_flash", stats  # chosen for the ring: none was set
    assert stats["ring_degree"] * stats["ulysses_degree"] == k, stats
    calls = 2 * BODY["num_inference_steps"]
    assert stats["forwards"] == calls and len(stats["followers"]) == k - 1, stats
    assert all(f["forwards"] == calls and f["alive"] for f in stats["followers"]), stats


def test_two_gpu_ring_rollouts_in_bfloat16_are_finite_and_close_to_one_gpu(tiny_model_path):
    bf16_layout_against_k1(tiny_model_path, 2, context_parallel_mode="ring")


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA devices")
def test_four_gpu_hybrid_rollouts_in_bfloat16_are_finite_and_close_to_one_gpu(tiny_model_path):
    """2 Ulysses x 2 ring: the tiny Wan's 2 heads split over the Ulysses pairs, the rings pass the rest."""
    bf16_layout_against_k1(tiny_model_path, 4, context_parallel_mode="hybrid", context_parallel_ring_degree=2)
