"""``POST /rollout/generate`` on the tiny FLUX.2 [klein] model (base variant, CFG on), through the real
HTTP app.

Exactness is equality (``torch.equal``): the ODE path against the stock ``Flux2KleinPipeline`` (its
empirical-mu schedule, its CFG on the empty prompt), custom sigmas against the stock pipeline with
its shifts disabled, the SDE step against the shared transition function, replay of every step from
``denoising_env`` against the recorded model outputs and log-probs (ratio exactly 1).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import DiffusionPipeline

from tests import family_helpers
from tests.family_helpers import (
    REPLAY,
    assert_400_naming,
    assert_client_replay_ratio_is_one,
    assert_custom_sigmas_used_exactly,
    assert_no_cfg_matches_stock,
    assert_ode_path_matches_stock,
    assert_replay_matches_the_rollout,
    assert_steps_follow_the_shared_transition,
    default_schedule_output,
    ode_modes,
)

FAMILY = "flux2-klein"
T = 4
BASE = {
    "prompt": "a red cat",
    "guidance_scale": 4.0,
    "width": 32,
    "height": 32,
    "num_inference_steps": T,
    "max_sequence_length": 16,
}
# No static or dynamic shift: the stock scheduler uses sigmas as given.
UNSHIFTED = {"shift": 1.0, "use_dynamic_shifting": False}


def body(**kw) -> dict:
    return {**BASE, "seed": 7, **kw}


def stock(path, **kw):
    return family_helpers.stock_images(path, UNSHIFTED, BASE, T, **kw)


@ode_modes
def test_ode_path_is_bit_identical_to_stock_pipeline(served, tiny_model_path, mode):
    assert_ode_path_matches_stock(served(FAMILY), tiny_model_path(FAMILY), mode, body, stock)


def test_ode_path_without_cfg_is_bit_identical(served, tiny_model_path):
    """guidance_scale 1 turns CFG off in the pipeline: one transformer call per step."""
    assert_no_cfg_matches_stock(served(FAMILY), tiny_model_path(FAMILY), body, stock, 1.0)


def test_default_schedule_is_the_pipelines_empirical_mu(served, tiny_model_path):
    out, pipe = default_schedule_output(served(FAMILY), tiny_model_path(FAMILY), body, stock)
    sigmas = out["dit_trajectory"]["sigmas"]
    assert not torch.equal(sigmas[:T], torch.linspace(1.0, 1.0 / T, T))  # shifted, not the plain ladder
    # The trajectory reports the scheduler's timesteps, as SGLang does; the model sees t / 1000 in
    # the latents' dtype, which the env's timestep_map keeps for replay.
    assert torch.equal(out["dit_trajectory"]["timesteps"][:T], pipe.scheduler.timesteps.float())
    tmap = out["denoising_env"]["timestep_map"]
    assert torch.equal(tmap["model_timesteps"], (pipe.scheduler.timesteps / 1000).float())
    # Packed latents: 16 tokens of 4 x 16 patchified channels, T + 1 entries.
    assert out["dit_trajectory"]["latents"].shape == (T + 1, 16, 64)


def test_custom_sigmas_are_used_exactly(served, tiny_model_path):
    assert_custom_sigmas_used_exactly(served(FAMILY), tiny_model_path(FAMILY), body, stock)


@pytest.mark.parametrize("kind", ["sde", "dance", "cps"])
def test_stochastic_steps_follow_the_shared_transition(served, kind):
    assert_steps_follow_the_shared_transition(served(FAMILY), kind, body, T, cast_to_latents_dtype=True)


@pytest.mark.parametrize("fields", [{}, {"negative_prompt": "blurry"}], ids=["empty-negative", "negative"])
def test_replay_reproduces_model_output_and_log_prob(served, fields):
    srv = served(FAMILY)
    (out,) = srv.generate(body(**REPLAY, **fields))
    env = out["denoising_env"]
    assert env["guidance"]["rule"] == "true_cfg" and env["neg_cond_kwargs"] is not None
    assert {"encoder_hidden_states", "txt_ids"} <= set(env["pos_cond_kwargs"]) and "img_ids" in env[
        "image_kwargs"
    ]
    assert_replay_matches_the_rollout(srv.engine.pipe.transformer, out, T)


def test_negative_prompt_changes_the_unconditional_branch(served):
    srv = served(FAMILY)
    (empty,) = srv.generate(body(rollout=False))
    (neg,) = srv.generate(body(rollout=False, negative_prompt="blurry"))
    assert not torch.equal(empty["generated_output"], neg["generated_output"])


def test_client_replay_ratio_is_exactly_one(served, tiny_model_path):
    assert_client_replay_ratio_is_one(served(FAMILY), tiny_model_path(FAMILY), BASE, T)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"width": 36}, "width"),
        ({"height": 20}, "height"),
        ({"sigmas": [1.0, 0.5, 0.7]}, "sigmas"),
        ({"rollout_sde_type": "ode"}, "rollout_log_prob_no_const"),
    ],
)
def test_unservable_requests_get_400_naming_the_field(served, extra, needle):
    assert_400_naming(served(FAMILY), body(**extra), needle)


def test_distilled_checkpoint_runs_no_cfg_whatever_guidance_scale_says(tiny_model_path, tmp_path):
    """``is_distilled: true`` (FLUX.2-klein-4B): one call per step, 4 steps by default, as the stock pipeline."""
    import json
    import shutil

    from tests.conftest import ServedModel

    folder = tmp_path / "klein-distilled"
    shutil.copytree(tiny_model_path(FAMILY), folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["is_distilled"] = True
    (folder / "model_index.json").write_text(json.dumps(index))
    srv = ServedModel(folder)
    try:
        fields = {k: v for k, v in BASE.items() if k != "num_inference_steps"}
        (out,) = srv.generate(
            {**fields, "seed": 7, "rollout_sde_type": "ode", "rollout_log_prob_no_const": True, **REPLAY}
        )
        env = out["denoising_env"]
        assert env["guidance"] == {**env["guidance"], "rule": "none", "is_distilled": True}
        assert env["neg_cond_kwargs"] is None and out["rollout_log_probs"].shape == (4,)
        pipe = DiffusionPipeline.from_pretrained(str(folder), dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        ref = pipe(
            generator=[torch.Generator("cpu").manual_seed(7)],
            output_type="pt",
            num_inference_steps=4,
            **fields,
        )
        assert torch.equal(out["generated_output"], ref.images[0])
    finally:
        srv.close()
