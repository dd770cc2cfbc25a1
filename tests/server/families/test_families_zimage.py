"""``POST /rollout/generate`` on the tiny Z-Image model, through the real HTTP app.

Z-Image calls its transformer positionally on lists of per-sample tensors, batches CFG as
``[cond; uncond]`` combined ``pos + s * (pos - neg)`` in float32, and hands the scheduler the negated
prediction. Exactness is equality (``torch.equal``): the ODE path against the stock ``ZImagePipeline``,
custom sigmas against the stock pipeline with its shift disabled, the SDE step against the shared
transition function, replay of every step from ``denoising_env`` (ratio exactly 1).
"""

from __future__ import annotations

import pytest
import torch

from diffusion_rollout.client.replay import replay_model_output
from tests import family_helpers
from tests.batch_helpers import generate_together, settled_batches
from tests.family_helpers import (
    REPLAY,
    assert_400_naming,
    assert_another_rule_differs,
    assert_client_replay_ratio_is_one,
    assert_custom_sigmas_used_exactly,
    assert_no_cfg_matches_stock,
    assert_ode_path_matches_stock,
    assert_replay_matches_the_rollout,
    assert_steps_follow_the_shared_transition,
    default_schedule_output,
    ode_modes,
    stock_pipe,
)

FAMILY = "zimage"
T = 4
BASE = {
    "prompt": "a red cat",
    "guidance_scale": 4.0,
    "width": 32,
    "height": 32,
    "num_inference_steps": T,
    "max_sequence_length": 16,
}
# No shift: the stock scheduler uses sigmas as given.
UNSHIFTED = {"shift": 1.0}


def body(**kw) -> dict:
    return {**BASE, "seed": 7, **kw}


def stock(path, **kw):
    return family_helpers.stock_images(path, UNSHIFTED, BASE, T, **kw)


@ode_modes
def test_ode_path_is_bit_identical_to_stock_pipeline(served, tiny_model_path, mode):
    assert_ode_path_matches_stock(served(FAMILY), tiny_model_path(FAMILY), mode, body, stock)


def test_turbo_settings_without_cfg_are_bit_identical(served, tiny_model_path):
    """guidance_scale 0 (how Z-Image-Turbo runs) turns CFG off: one call per step, on B samples."""
    assert_no_cfg_matches_stock(served(FAMILY), tiny_model_path(FAMILY), body, stock, 0.0)


def test_default_schedule_is_the_checkpoints_static_shift(served, tiny_model_path):
    out, pipe = default_schedule_output(served(FAMILY), tiny_model_path(FAMILY), body, stock)
    traj = out["dit_trajectory"]
    lin = torch.linspace(1.0, 1.0 / T, T)
    assert torch.allclose(traj["sigmas"][:T], 3 * lin / (1 + 2 * lin))  # shift 3, no dynamic shift
    # The trajectory reports the scheduler's timesteps, as SGLang does; the model sees (1000 - t) / 1000,
    # which the env's timestep_map keeps for replay.
    assert torch.equal(traj["timesteps"][:T], pipe.scheduler.timesteps.float())
    tmap = out["denoising_env"]["timestep_map"]
    assert torch.equal(tmap["model_timesteps"], ((1000 - pipe.scheduler.timesteps) / 1000).float())
    assert traj["latents"].shape == (T + 1, 16, 8, 8) and traj["latents"].dtype == torch.float32


def test_custom_sigmas_are_used_exactly(served, tiny_model_path):
    assert_custom_sigmas_used_exactly(served(FAMILY), tiny_model_path(FAMILY), body, stock)


def test_unshifted_sigmas_get_the_checkpoints_shift(served, tiny_model_path):
    sigmas = [1.0, 0.8, 0.45, 0.2]
    (out,) = served(FAMILY).generate(
        body(rollout=False, return_generated_output=False, sigmas=sigmas, sigmas_are_shifted=False)
    )
    ref = stock(tiny_model_path(FAMILY), seeds=[7], output_type="latent", sigmas=None)
    pipe = stock_pipe(tiny_model_path(FAMILY))
    shifted = pipe(
        prompt=BASE["prompt"], height=32, width=32, guidance_scale=4.0, max_sequence_length=16,
        sigmas=sigmas, num_inference_steps=T, output_type="latent",
        generator=[torch.Generator("cpu").manual_seed(7)],
    ).images  # fmt: skip
    assert torch.equal(out["generated_output"], shifted[0])
    assert not torch.equal(out["generated_output"], ref[0])


@pytest.mark.parametrize("kind", ["sde", "dance", "cps"])
def test_stochastic_steps_follow_the_shared_transition(served, kind):
    assert_steps_follow_the_shared_transition(served(FAMILY), kind, body, T)


def test_replay_reproduces_model_output_and_log_prob(served):
    srv = served(FAMILY)
    # A length bound both texts stay under: each branch keeps its own token count.
    (out,) = srv.generate(body(negative_prompt="blurry", max_sequence_length=64, **REPLAY))
    env = out["denoising_env"]
    assert env["guidance"]["rule"] == "cfg_batched_cond_first"
    assert env["model_call"] == {
        "latent_arg": "x",
        "timestep_arg": "t",
        "latent_layout": "frame_list",
        "negate": True,
    }
    (pos,), (neg,) = env["pos_cond_kwargs"]["cap_feats"], env["neg_cond_kwargs"]["cap_feats"]
    assert pos.shape[1] == neg.shape[1] == 32 and pos.shape[0] != neg.shape[0]  # each text's own length
    assert_replay_matches_the_rollout(srv.engine.pipe.transformer, out, T)
    # The rule matters: SD3's [uncond; cond] arithmetic does not reproduce Z-Image's output.
    assert_another_rule_differs(srv.engine.pipe.transformer, out, "true_cfg")


def test_client_replay_ratio_is_exactly_one(served, tiny_model_path):
    """The trainer's own transformer replays a batch of 3 prompts of different lengths: ratio exactly 1."""
    assert_client_replay_ratio_is_one(served(FAMILY), tiny_model_path(FAMILY), BASE, T)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"width": 36}, "width"),
        ({"height": 20}, "height"),
        ({"sigmas": [1.0, 0.5, 0.7]}, "sigmas"),
        ({"rollout_sde_type": "ode"}, "rollout_log_prob_no_const"),
        ({"max_sequence_length": 1536}, "max_sequence_length"),  # the tiny model's RoPE: 1536 text positions
        ({"width": 2048, "height": 32}, "width"),  # and 256 image columns (of 8 pixels)
    ],
)
def test_unservable_requests_get_400_naming_the_field(served, extra, needle):
    assert_400_naming(served(FAMILY), body(**extra), needle)


def test_prompts_of_different_lengths_share_one_call(fresh_server, tiny_model_path):
    """Z-Image takes a list of per-sample text features, so different lengths batch in one call; the
    call equals the stock pipeline handed the same per-prompt features as a list."""
    srv = fresh_server(FAMILY, max_batch_size=8)
    prompts = ["a cat", "a very long prompt about a small red cat sitting on a mat at night"]
    reqs = [
        body(prompt=p, seed=s, rollout=False, max_sequence_length=64)
        for p, s in zip(prompts, (1, 2), strict=True)
    ]
    before = settled_batches(srv.engine.worker)
    results = generate_together(srv, reqs)
    assert settled_batches(srv.engine.worker) == before + 1, "the two requests should share one pipeline call"
    pipe = stock_pipe(tiny_model_path(FAMILY))
    encs = [pipe.encode_prompt(p, max_sequence_length=64) for p in prompts]
    assert encs[0][0][0].shape[0] != encs[1][0][0].shape[0]
    ref = pipe(
        prompt_embeds=[e[0][0] for e in encs], negative_prompt_embeds=[e[1][0] for e in encs],
        height=32, width=32, num_inference_steps=T, guidance_scale=4.0, output_type="pt",
        generator=[torch.Generator("cpu").manual_seed(s) for s in (1, 2)],
    ).images  # fmt: skip
    for i in range(2):
        assert torch.equal(results[i][0]["generated_output"], ref[i])


def test_bfloat16_replay_casts_the_float32_latents_as_the_pipeline(fresh_server):
    """Z-Image keeps float32 latents and casts the model input; replay does the same: bit for bit."""
    srv = fresh_server(FAMILY, dtype="bfloat16")
    (out,) = srv.generate(body(**REPLAY))
    traj, env = out["dit_trajectory"], out["denoising_env"]
    assert traj["latents"].dtype == torch.float32 and env["model_input_dtype"] == "torch.bfloat16"
    recorded = out["rollout_debug_tensors"]["rollout_model_outputs"]
    assert recorded.dtype == torch.float32  # the pipeline hands the scheduler float32 predictions
    for step in range(T):
        with torch.no_grad():
            v = replay_model_output(
                srv.engine.pipe.transformer, traj["latents"][step : step + 1], traj["timesteps"][step], env
            )
        assert torch.equal(v[0], recorded[step]), f"model output differs at step {step}"
