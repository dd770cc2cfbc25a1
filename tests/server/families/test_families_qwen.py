"""``POST /rollout/generate`` on the tiny Qwen-Image model, through the real HTTP app.

Exactness is equality (``torch.equal``): the ODE path against the stock ``QwenImagePipeline`` (its
true CFG with the norm rescale, its dynamic-shift schedule), custom sigmas against the stock pipeline
with its shifts disabled, replay of every step from ``denoising_env`` against the recorded model
outputs and log-probs.
"""

from __future__ import annotations

import pytest
import torch

from tests import family_helpers
from tests.batch_helpers import generate_together, settled_batches
from tests.family_helpers import (
    REPLAY,
    assert_400_naming,
    assert_another_rule_differs,
    assert_custom_sigmas_used_exactly,
    assert_ode_path_matches_stock,
    assert_replay_matches_the_rollout,
    default_schedule_output,
    ode_modes,
)

FAMILY = "qwenimage"
T = 4
# True CFG on: the pipeline runs it only with a negative prompt and true_cfg_scale > 1.
BASE = {
    "prompt": "a red cat",
    "negative_prompt": " ",
    "true_cfg_scale": 4.0,
    "width": 32,
    "height": 32,
    "num_inference_steps": T,
    "max_sequence_length": 16,
}


def body(**kw) -> dict:
    return {**BASE, "seed": 7, **kw}


# No static, dynamic or terminal shift: the stock scheduler uses sigmas as given.
UNSHIFTED = {"shift": 1.0, "use_dynamic_shifting": False, "shift_terminal": None}


def stock(path, **kw):
    return family_helpers.stock_images(path, UNSHIFTED, BASE, T, steps_with_sigmas=False, **kw)


@ode_modes
def test_ode_path_is_bit_identical_to_stock_pipeline(served, tiny_model_path, mode):
    assert_ode_path_matches_stock(served(FAMILY), tiny_model_path(FAMILY), mode, body, stock)


def test_default_schedule_is_the_pipelines_dynamic_shift(served, tiny_model_path):
    out, pipe = default_schedule_output(served(FAMILY), tiny_model_path(FAMILY), body, stock)
    sigmas = out["dit_trajectory"]["sigmas"]
    # Dynamic shift with shift_terminal: not the plain linspace, and stretched to end at 0.02.
    assert sigmas[-2].item() == pytest.approx(0.02) and sigmas[-1].item() == 0.0
    # The trajectory reports the scheduler's timesteps (0..1000), as SGLang does; the model was handed
    # t / 1000 in the latents' dtype, which the env's timestep_map keeps for replay.
    assert torch.equal(out["dit_trajectory"]["timesteps"][:T], pipe.scheduler.timesteps.float())
    tmap = out["denoising_env"]["timestep_map"]
    assert torch.equal(tmap["timesteps"], pipe.scheduler.timesteps.float())
    assert torch.equal(tmap["model_timesteps"], (pipe.scheduler.timesteps / 1000).float())


def test_custom_sigmas_are_used_exactly(served, tiny_model_path):
    assert_custom_sigmas_used_exactly(served(FAMILY), tiny_model_path(FAMILY), body, stock)


@pytest.mark.parametrize("form", ["gaussian", "no_const"])
def test_replay_reproduces_model_output_and_log_prob(served, form):
    srv = served(FAMILY)
    (out,) = srv.generate(body(**REPLAY, rollout_log_prob_form=form))
    env = out["denoising_env"]
    assert env["guidance"]["rule"] == "norm_rescale" and env["neg_cond_kwargs"] is not None
    assert "encoder_hidden_states" in env["pos_cond_kwargs"] and "img_shapes" in env["image_kwargs"]
    assert_replay_matches_the_rollout(srv.engine.pipe.transformer, out, T, log_prob_form=form)
    # The rescale matters: plain true CFG does not reproduce the recorded output.
    assert_another_rule_differs(srv.engine.pipe.transformer, out, "true_cfg")


def test_sde_log_probs_zero_exactly_at_ode_steps(served):
    (out,) = served(FAMILY).generate(
        body(rollout_sde_step_indices=[0, 2], rollout_return_dit_trajectory=True, rollout_debug_mode=False)
    )
    lp = out["rollout_log_probs"]
    assert lp.shape == (T,) and lp.dtype == torch.float32
    assert lp[1].item() == 0.0 and lp[3].item() == 0.0
    assert lp[0].item() != 0.0 and lp[2].item() != 0.0
    assert out["sde_step_indices"] == [0, 2]
    assert out["dit_trajectory"]["latents"].shape == (T + 1, 16, 64)  # packed 2x2 latent patches


def test_prompts_of_different_lengths_batch_apart(fresh_server):
    """Encodings of different text lengths cannot share a call; each still equals its solo run."""
    srv = fresh_server(FAMILY, max_batch_size=16)
    reqs = [
        body(prompt="a cat", seed=1),
        body(prompt="a very long prompt about a small red cat on a mat", seed=2),
        body(prompt="a dog", seed=3),  # the same token count as "a cat": batched with it
    ]
    alone = [srv.generate(r) for r in reqs]
    before = settled_batches(srv.engine.worker)
    results = generate_together(srv, reqs)
    assert settled_batches(srv.engine.worker) == before + 1, "the three requests should be taken as one batch"
    # The long prompt ran alone (batch 1, bitwise); the two short ones shared a call of batch 2,
    # where CPU GEMM blocking may move the last bits (test_rollout_api.BATCH_SIZE_BOUND).
    assert torch.equal(results[1][0]["generated_output"], alone[1][0]["generated_output"])
    for i in (0, 2):
        diff = (results[i][0]["generated_output"] - alone[i][0]["generated_output"]).abs().max().item()
        assert diff <= 1e-4


def test_uint8_output_is_quantised_float_output(served):
    (f,) = served(FAMILY).generate(body(rollout=False))
    (u,) = served(FAMILY).generate(body(rollout=False, output_dtype="uint8"))
    assert u["generated_output"].dtype == torch.uint8
    assert torch.equal(
        u["generated_output"], (f["generated_output"] * 255).round().clamp(0, 255).to(torch.uint8)
    )


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"width": 36}, "width"),
        ({"height": 20}, "height"),
        ({"max_sequence_length": 2048}, "max_sequence_length"),
    ],
)
def test_unservable_requests_get_400_naming_the_field(served, extra, needle):
    assert_400_naming(served(FAMILY), body(**extra), needle)
