"""Context parallelism for LTX-2 (video and audio denoised jointly) on the CPU: ``context_parallel=2``.

On the CPU the server runs in mirror mode (``server/parallel/context_parallel.py``): the follower runs the whole
transformer on rank 0's inputs and nothing is sharded, so these tests check the serving mechanics for
LTX-2's call (two latent streams, text masks, video and audio coordinates): the follower runs every
call with rank 0's inputs and weights (equal output checksums and weight digests), rank 0's rollouts
equal a one-process server's bit for bit in both streams, a weight update reaches the follower, and a
dead follower fails the engine with a 503 instead of hanging it; plus the LTX-2 refusals (head counts
at start-up, a video token count that does not divide by k per request).

The plan itself (``server/parallel/cp_plans.py``, through the server's ``enable_layout``) is run sharded on two gloo
ranks against k = 1 by ``tests/server/parallel/test_ltx2_cp_plan.py`` (``server_*`` cases), and through a served
engine on two GPUs by ``tests/server/parallel/test_context_parallel_ltx2_served_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.server.parallel.test_context_parallel import (
    Servers,
    assert_dead_follower_fails_with_503,
    assert_follower_ran_every_call,
    both,
    settled_stats,
    update_both,
)

T = 2
BODY = {
    "prompt": "a red cat",
    "seed": 7,
    "width": 32,
    "height": 32,
    "num_frames": 9,  # 5 latent frames x 16 x 16 = 1280 video tokens, 9 audio frames
    "num_inference_steps": T,
    "guidance_scale": 3.0,
    "max_sequence_length": 16,
    "rollout_sde_step_indices": [0],
    "rollout_return_dit_trajectory": True,
    "rollout_debug_mode": False,
}
CALLS_PER_ROLLOUT = T  # one batched [uncond; cond] transformer call per step


@pytest.fixture(scope="module")
def servers(tiny_model_path):
    s = Servers(tiny_model_path("ltx2"))
    yield s
    s.close()


def assert_same_streams(ref: dict, cp: dict) -> None:
    for key in ("generated_output", "rollout_log_probs"):
        assert torch.equal(ref[key], cp[key]), key
    for stream in ("video", "audio"):
        for key in ("latents", "log_probs"):
            a, b = ref["dit_trajectory"]["streams"][stream][key], cp["dit_trajectory"]["streams"][stream][key]
            assert torch.equal(a, b), (stream, key)


def test_ltx2_rollouts_equal_one_process_in_both_streams_and_the_follower_runs_every_call(servers):
    assert servers.cp.engine.adapter.name == "ltx2"
    before = settled_stats(servers.cp)["forwards"]
    ref, cp = both(servers, BODY)
    assert_same_streams(ref, cp)
    assert cp["exact"] is True  # mirror mode: rank 0 computes alone
    # The follower got rank 0's inputs (both streams, text masks, coordinates) and weights.
    assert_follower_ran_every_call(servers.cp, before + CALLS_PER_ROLLOUT)


def test_ltx2_sizes_the_model_cannot_run_get_400_before_anything_runs(servers):
    # The pipeline wants height and width divisible by 32, which give the tiny model (spatial factor
    # 2) an even video token count, so the served token rule cannot be reached with it: 34 x 34 (1445
    # tokens, odd) is refused by the size rule first. The token rule itself is checked against the
    # real geometry below (480 x 736 x 17 frames: 15 x 23 x 3 tokens, odd).
    before = settled_stats(servers.cp)["forwards"]
    r = servers.cp.generate({**BODY, "width": 34, "height": 34}, expect=400)
    err = r.json()["error"]
    assert err["code"] == 400 and "divisible by 32" in err["message"], err
    assert settled_stats(servers.cp)["forwards"] == before
    assert servers.cp.client.get("/health_generate").status_code == 200


def test_ltx2_token_rule_follows_k_and_the_real_geometry():
    """``check_call``'s count and rule on an adapter with the real LTX-2's compression (32, 8)."""
    from types import SimpleNamespace

    from diffusion_rollout.errors import RequestError
    from diffusion_rollout.server.families.base import CallSettings
    from diffusion_rollout.server.families.ltx2 import LTX2Adapter
    from diffusion_rollout.server.parallel.cp_plans import check_call

    pipe = SimpleNamespace(
        vae_spatial_compression_ratio=32, vae_temporal_compression_ratio=8,
        transformer_spatial_patch_size=1, transformer_temporal_patch_size=1,
        transformer=SimpleNamespace(config=SimpleNamespace(in_channels=128)),
    )  # fmt: skip
    adapter = LTX2Adapter(pipe)

    def engine(k):
        return SimpleNamespace(config=SimpleNamespace(context_parallel=k), adapter=adapter)

    def call(h, w, f):
        return CallSettings(
            height=h, width=w, num_inference_steps=1, guidance_scale=3.0, true_cfg_scale=None,
            guidance_scale_2=None, num_frames=f, max_sequence_length=None, has_negative_prompt=False,
        )  # fmt: skip

    check_call(engine(2), call(512, 768, 121))  # 16 x 24 x 16 tokens
    check_call(engine(3), call(480, 736, 17))  # 15 x 23 x 3 = 1035 = 3 x 345
    with pytest.raises(RequestError, match="1035 video tokens, not divisible by context_parallel=2") as exc:
        check_call(engine(2), call(480, 736, 17))
    assert exc.value.field == "num_frames"


def test_ltx2_update_reaches_the_follower_before_the_next_rollout(servers):
    old, ref, cp = update_both(servers, BODY)
    audio = [out["dit_trajectory"]["streams"]["audio"]["latents"] for out in (cp, old)]
    assert not torch.equal(*audio)  # in the audio stream too
    assert_same_streams(ref, cp)


@pytest.mark.timeout(60)
def test_ltx2_dead_follower_fails_the_engine_with_503(servers):
    assert_dead_follower_fails_with_503(servers.cp, BODY)


def test_ltx2_head_counts_not_divisible_by_k_are_refused_at_start_up(tiny_model_path):
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.errors import ContextParallelError
    from diffusion_rollout.server.core.engine import Engine

    # The tiny LTX-2 has 2 video and 2 audio heads: k = 3 cannot split them.
    engine = Engine(ServerConfig(model=str(tiny_model_path("ltx2")), device="cpu", context_parallel=3))
    with pytest.raises(
        ContextParallelError, match=r"num_attention_heads=2, audio_num_attention_heads=2.*by 3"
    ):
        engine.load()
    assert engine.context_parallel is None  # refused before any follower was spawned


def test_the_plan_shards_only_the_video_and_keeps_four_attentions_local():
    """What ``enable_plan`` does to an LTX-2 transformer, without ranks: the plan and the routing."""
    from diffusion_rollout.models.tiny_video import ltx2_components
    from diffusion_rollout.server.parallel.cp_plans import (
        LTX2_LOCAL_ATTENTIONS,
        LTX2_ULYSSES_ATTENTIONS,
        ltx2_plan,
    )

    model = ltx2_components(0)["transformer"]
    plan = ltx2_plan(model)
    assert set(plan[""]) == {"hidden_states"}  # text, its mask and audio stay whole
    for name in ("rope", "cross_attn_rope"):  # split RoPE: (B, heads, tokens, r)
        assert {i: (s.split_dim, s.expected_dims) for i, s in plan[name].items()} == {0: (2, 4), 1: (2, 4)}
    assert plan["proj_out"].gather_dim == 1 and "audio_proj_out" not in plan
    assert set(LTX2_LOCAL_ATTENTIONS) | set(LTX2_ULYSSES_ATTENTIONS) == {
        "attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn"
    }  # fmt: skip
