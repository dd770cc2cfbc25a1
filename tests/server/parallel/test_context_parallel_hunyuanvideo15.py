"""Context parallelism for HunyuanVideo 1.5 on the CPU: ``context_parallel=2``.

On the CPU the server runs in mirror mode (``server/parallel/context_parallel.py``): the follower runs the whole
transformer on rank 0's inputs and nothing is sharded, so these tests check the serving mechanics for
HunyuanVideo 1.5's call (channel-concatenated input, two text encodings with masks, image embeddings,
sequential CFG): the follower runs every call with rank 0's inputs and weights (equal output
checksums and weight digests), rank 0's rollouts equal a one-process server's bit for bit, a weight
update reaches the follower, and a dead follower fails the engine with a 503 instead of hanging it;
plus the refusals (heads not divisible by k at start-up, a video token count not divisible by k per
request).

The plan itself (``server/parallel/cp_plans.py``, through the server's ``enable_layout``) is run sharded on two gloo
ranks against k = 1 by ``tests/server/parallel/test_hunyuanvideo15_cp_plan.py``, and through a served engine on two
GPUs by ``tests/server/parallel/test_context_parallel_hunyuanvideo15_served_gpu.py``.
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
    "num_frames": 5,  # 2 latent frames x 2 x 2 = 8 video tokens
    "num_inference_steps": T,
    "rollout_sde_step_indices": [0],
    "rollout_return_dit_trajectory": True,
    "rollout_debug_mode": False,
}
CALLS_PER_ROLLOUT = 2 * T  # the guider's CFG: a cond and an uncond call per step


@pytest.fixture(scope="module")
def servers(tiny_model_path):
    s = Servers(tiny_model_path("hunyuanvideo15"))
    yield s
    s.close()


def assert_same_tensors(ref, cp, where="") -> int:
    """Every tensor of the two responses equal bit for bit (walks dicts and lists); returns how many."""
    if isinstance(ref, torch.Tensor):
        assert torch.equal(ref, cp), where
        return 1
    if isinstance(ref, dict):
        assert set(ref) == set(cp), where
        return sum(assert_same_tensors(ref[k], cp[k], f"{where}.{k}") for k in ref if k != "timings")
    if isinstance(ref, (list, tuple)):
        return sum(
            assert_same_tensors(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(ref, cp, strict=True))
        )
    return 0


def test_hunyuanvideo15_rollouts_equal_one_process_and_the_follower_runs_every_call(servers):
    assert servers.cp.engine.adapter.name == "hunyuanvideo15"
    before = settled_stats(servers.cp)["forwards"]
    ref, cp = both(servers, BODY)
    assert assert_same_tensors(ref, cp) >= 3  # output, log-probs, the trajectory
    assert cp["exact"] is True  # mirror mode: rank 0 computes alone
    # The follower got rank 0's inputs (latents with the condition channels, both text encodings and masks, image embeddings) and weights.
    assert_follower_ran_every_call(servers.cp, before + CALLS_PER_ROLLOUT)


def test_hunyuanvideo15_odd_video_token_count_gets_400_naming_the_field(servers):
    # 48 x 48 px x 9 frames: 3 latent frames x 3 x 3 = 27 video tokens, odd (the tiny model: 16x VAE,
    # 4x in time, patch 1).
    before = settled_stats(servers.cp)["forwards"]
    r = servers.cp.generate({**BODY, "width": 48, "height": 48, "num_frames": 9}, expect=400)
    err = r.json()["error"]
    assert err["code"] == 400 and "27 video tokens, not divisible by context_parallel=2" in err["message"], (
        err
    )
    assert "height=48, width=48, num_frames=9" in err["message"], err  # names the fields to change
    assert settled_stats(servers.cp)["forwards"] == before  # refused before any transformer call
    assert servers.cp.client.get("/health_generate").status_code == 200
    # The one-process server serves the same size (the rule is context parallelism's alone).
    (out,) = servers.ref.generate({**BODY, "width": 48, "height": 48, "num_frames": 9})
    assert out["generated_output"].shape[-2:] == (48, 48)


def test_hunyuanvideo15_update_reaches_the_follower_before_the_next_rollout(servers):
    _, ref, cp = update_both(servers, BODY)
    assert_same_tensors(ref, cp)


@pytest.mark.timeout(60)
def test_hunyuanvideo15_dead_follower_fails_the_engine_with_503(servers):
    assert_dead_follower_fails_with_503(servers.cp, BODY)


def test_hunyuanvideo15_heads_not_divisible_by_k_are_refused_at_start_up(tiny_model_path):
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.errors import ContextParallelError
    from diffusion_rollout.server.core.engine import Engine

    # The tiny HunyuanVideo 1.5 has 2 heads: k = 3 cannot split them.
    engine = Engine(
        ServerConfig(model=str(tiny_model_path("hunyuanvideo15")), device="cpu", context_parallel=3)
    )
    with pytest.raises(ContextParallelError, match=r"num_attention_heads=2.*divisible by 3"):
        engine.load()
    assert engine.context_parallel is None  # refused before any follower was spawned


def test_hunyuanvideo15_token_rule_follows_k_and_the_real_geometry():
    """``check_call``'s count on an adapter with the real model's compression (16x, 4x in time, patch 1)."""
    from types import SimpleNamespace

    from diffusion_rollout.errors import RequestError
    from diffusion_rollout.server.families.base import CallSettings
    from diffusion_rollout.server.parallel.cp_plans import check_call, hunyuanvideo15_video_tokens

    adapter = SimpleNamespace(
        name="hunyuanvideo15",
        pipe=SimpleNamespace(
            transformer=SimpleNamespace(config=SimpleNamespace(patch_size=1, patch_size_t=1))
        ),
        noise_shape=lambda c: (32, (c.num_frames - 1) // 4 + 1, c.height // 16, c.width // 16),
    )

    def engine(k):
        return SimpleNamespace(config=SimpleNamespace(context_parallel=k), adapter=adapter)

    def call(h, w, f):
        return CallSettings(
            height=h, width=w, num_inference_steps=1, guidance_scale=6.0, true_cfg_scale=None,
            guidance_scale_2=None, num_frames=f, max_sequence_length=None, has_negative_prompt=False,
        )  # fmt: skip

    assert hunyuanvideo15_video_tokens(adapter, call(480, 848, 121)) == 31 * 30 * 53
    check_call(engine(2), call(480, 848, 121))  # 31 x 30 x 53 = 49290
    check_call(engine(3), call(480, 848, 121))
    with pytest.raises(RequestError, match="49290 video tokens, not divisible by context_parallel=4") as exc:
        check_call(engine(4), call(480, 848, 121))
    assert exc.value.field == "num_frames"
    check_call(engine(1), call(48, 48, 9))  # k = 1: no rule
