"""``POST /rollout/generate`` on the tiny HunyuanVideo 1.5 text-to-video model, through HTTP.

Exactness is equality (``torch.equal``): ``rollout=false`` and all-ODE rollouts against the stock
``HunyuanVideo15Pipeline`` (its guider's CFG, its shifted flow-match Euler schedule), custom sigmas
against the stock pipeline with the shift disabled, and replay of every step from ``denoising_env``
(the guider's rule, the channel-concatenated model input) against the recorded model outputs and
log-probs, for every stochastic step kind.

Each transformer call of the tiny model still sees the pipeline's fixed 1985 text tokens, so these
tests keep steps and batches small.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import ClassifierFreeGuidance, DiffusionPipeline, FlowMatchEulerDiscreteScheduler

from diffusion_rollout.client.replay import replay_log_prob, replay_model_output, stack_envs
from diffusion_rollout.scheduler_mixins import transition
from tests.family_helpers import REPLAY, assert_400_naming, assert_model_info_names

FAMILY = "hunyuanvideo15"
T = 2
SHIFT = 5.0  # HunyuanVideo-1.5 480p's scheduler shift, and the tiny model's
BASE = {"prompt": "a red cat", "width": 32, "height": 32, "num_frames": 5, "num_inference_steps": T}
LATENT = (16, 2, 2, 2)  # 5 frames -> 2 latent frames, 32 px -> 2 latent px (16x VAE)
VIDEO = (3, 5, 32, 32)  # [C, F, H, W]
ODE = {"rollout_sde_type": "ode", "rollout_log_prob_no_const": True}


def body(**kw) -> dict:
    return {**BASE, "seed": 7, **kw}


_stock: dict = {}
_stock_outputs: dict = {}


def stock(path, *, seeds, output_type, sigmas=None, guidance_scale=None, negative_prompt=None):
    """The stock pipeline from the same folder, one prompt per sample (its batch rule for
    ``num_videos_per_prompt`` > 1 breaks on its own image embeddings). Results are memoised: the
    stock pipeline is deterministic, and several tests share a reference."""
    call = (str(path), tuple(seeds), output_type, tuple(sigmas or ()), guidance_scale, negative_prompt)
    if call not in _stock_outputs:
        _stock_outputs[call] = _run_stock(path, seeds, output_type, sigmas, guidance_scale, negative_prompt)
    return _stock_outputs[call]


def _run_stock(path, seeds, output_type, sigmas, guidance_scale, negative_prompt):
    key = (str(path), sigmas is not None)
    if key not in _stock:
        pipe = DiffusionPipeline.from_pretrained(str(path), dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        if sigmas is not None:
            pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=1.0)
        _stock[key] = pipe
    pipe = _stock[key]
    loaded_guider = pipe.guider
    if guidance_scale is not None:
        pipe.guider = ClassifierFreeGuidance(guidance_scale=guidance_scale)
    args = {k: v for k, v in BASE.items() if k != "prompt"}
    if sigmas is not None:
        args["sigmas"] = sigmas
    n = len(seeds)
    try:
        out = pipe(
            prompt=[BASE["prompt"]] * n,
            negative_prompt=[negative_prompt] * n if negative_prompt is not None else None,
            generator=[torch.Generator("cpu").manual_seed(s) for s in seeds],
            output_type=output_type,
            **args,
        ).frames
    finally:
        pipe.guider = loaded_guider
    return out if output_type == "latent" else out.permute(0, 2, 1, 3, 4)  # -> [B, C, F, H, W]


def stack(outs, key="generated_output"):
    return torch.stack([o[key] for o in outs])


# --------------------------------------------------------------------------- bit-exact ODE paths
def test_rollout_false_is_the_stock_pipeline(served, tiny_model_path):
    srv, path = served(FAMILY), tiny_model_path(FAMILY)
    lat = srv.generate(body(rollout=False, num_outputs_per_prompt=2, return_generated_output=False))
    assert lat[0]["generated_output"].shape == LATENT
    assert torch.equal(stack(lat), stock(path, seeds=[7, 8], output_type="latent"))
    (vid,) = srv.generate(body(rollout=False))
    assert vid["generated_output"].shape == VIDEO
    assert torch.equal(vid["generated_output"], stock(path, seeds=[7], output_type="pt")[0])
    # The stock VAE cannot decode two videos at once (it raises); the server decodes each alone,
    # from the same latents the batch of two produced.
    vids = srv.generate(body(rollout=False, num_outputs_per_prompt=2))
    decode = srv.engine.adapter.decode
    for i, v in enumerate(vids):
        assert torch.equal(v["generated_output"], decode(lat[i]["generated_output"][None])[0])


@pytest.mark.parametrize(
    "mode", [ODE, {"rollout_sde_step_indices": [], "rollout_log_prob_no_const": True}], ids=["ode", "no_sde"]
)
def test_ode_rollout_is_the_stock_pipeline(served, tiny_model_path, mode):
    srv, path = served(FAMILY), tiny_model_path(FAMILY)
    lat = srv.generate(body(num_outputs_per_prompt=2, return_generated_output=False, **mode))
    assert torch.equal(stack(lat), stock(path, seeds=[7, 8], output_type="latent"))
    for o in lat:
        assert torch.equal(o["rollout_log_probs"], torch.zeros(T))


def test_guidance_scale_and_negative_prompt_reach_the_guider(served, tiny_model_path):
    srv, path = served(FAMILY), tiny_model_path(FAMILY)
    (out,) = srv.generate(
        body(guidance_scale=3.5, negative_prompt="blurry", return_generated_output=False, **ODE)
    )
    ref = stock(path, seeds=[7], output_type="latent", guidance_scale=3.5, negative_prompt="blurry")
    assert torch.equal(out["generated_output"], ref[0])
    # ...and the request's scale was not left on the loaded guider.
    assert srv.engine.pipe.guider.guidance_scale == 6.0
    assert not torch.equal(out["generated_output"], stock(path, seeds=[7, 8], output_type="latent")[0])
    # guidance_scale=1 runs no CFG at all (one call per step), as the guider decides.
    (plain,) = srv.generate(body(guidance_scale=1.0, rollout=False, return_generated_output=False))
    assert torch.equal(
        plain["generated_output"], stock(path, seeds=[7], output_type="latent", guidance_scale=1.0)[0]
    )


@pytest.mark.parametrize("rollout", [False, True], ids=["rollout_false", "ode_rollout"])
def test_custom_sigmas_are_used_exactly(served, tiny_model_path, rollout):
    sigmas = [1.0, 0.4]
    mode = {"rollout": False} if not rollout else {**ODE, "rollout_return_dit_trajectory": True}
    (out,) = served(FAMILY).generate(body(sigmas=sigmas, return_generated_output=False, **mode))
    ref = stock(tiny_model_path(FAMILY), seeds=[7], output_type="latent", sigmas=sigmas)
    assert torch.equal(out["generated_output"], ref[0])
    if rollout:
        assert torch.equal(out["dit_trajectory"]["sigmas"], torch.tensor([*sigmas, 0.0]))


def test_default_and_unshifted_schedules_carry_the_checkpoint_shift(served):
    srv = served(FAMILY)
    (default,) = srv.generate(body(rollout_return_dit_trajectory=True, return_generated_output=False, **ODE))
    linear = [1 - i / T for i in range(T)]  # the pipeline's own linspace(1, 0, T + 1)[:-1]
    reference = FlowMatchEulerDiscreteScheduler(shift=SHIFT)
    reference.set_timesteps(sigmas=linear)
    assert torch.equal(default["dit_trajectory"]["sigmas"], reference.sigmas)
    assert default["dit_trajectory"]["sigmas"][1].item() == pytest.approx(
        SHIFT * 0.5 / (1 + (SHIFT - 1) * 0.5)
    )
    (given,) = srv.generate(
        body(sigmas=linear, sigmas_are_shifted=False, rollout_return_dit_trajectory=True, **ODE)
    )
    assert torch.equal(given["dit_trajectory"]["sigmas"], default["dit_trajectory"]["sigmas"])


# --------------------------------------------------------------------------- SDE math and replay
@pytest.mark.parametrize("kind", ["sde", "dance", "cps"])
def test_every_step_kind_is_the_shared_transition_and_replays_exactly(served, kind):
    srv = served(FAMILY)
    steps = [0] if kind == "cps" else None  # cps has no density at the last step (sigma' = 0)
    (out,) = srv.generate(
        body(
            rollout_sde_type=kind,
            rollout_sde_step_indices=steps,
            rollout_noise_level=0.5,
            **REPLAY,
            return_generated_output=False,
        )
    )
    traj, env, debug = out["dit_trajectory"], out["denoising_env"], out["rollout_debug_tensors"]
    assert env["guidance"] == {"rule": "true_cfg", "guidance_scale": 6.0, "true_cfg_scale": None}
    assert env["model_input_concat"].shape == (1, 17, 2, 2, 2)  # image-condition latent + mask
    assert not env["model_input_concat"].any()  # zeros: text-to-video
    pos = env["pos_cond_kwargs"]
    assert set(pos) == {
        "encoder_hidden_states",
        "encoder_attention_mask",
        "encoder_hidden_states_2",
        "encoder_attention_mask_2",
        "image_embeds",
    }
    assert pos["encoder_hidden_states"].shape == (1, 1000, 32) and env["neg_cond_kwargs"] is not None
    sigmas = traj["sigmas"]
    for step in range(T):
        x, x_next = traj["latents"][step : step + 1], traj["latents"][step + 1 : step + 2]
        with torch.no_grad():
            v = replay_model_output(srv.engine.pipe.transformer, x, traj["timesteps"][step], env, step=step)
        assert torch.equal(v[0], debug["rollout_model_outputs"][step]), f"model output differs at {step}"
        step_kind = kind if step in out["sde_step_indices"] else "ode"
        # The server's step is the shared transition: same noise in, same stored latent out.
        sampled = transition(
            step_kind,
            x,
            v,
            sigmas[step],
            sigmas[step + 1],
            eta=0.5,
            sigma_max=sigmas[1],
            noise=debug["rollout_variance_noises"][step : step + 1],
        )
        assert torch.equal(sampled.next_sample, x_next), f"next latent differs at {step}"
        assert torch.equal(sampled.mean[0], debug["rollout_prev_sample_means"][step])
        scored = replay_log_prob(step_kind, x, v, x_next, sigmas, step, eta=0.5)
        assert torch.equal(scored.log_prob[0], out["rollout_log_probs"][step]), f"log-prob differs at {step}"
    # The concatenated channels matter: the bare latent is not the model's input.
    bare = {k: v for k, v in env.items() if k != "model_input_concat"}
    with pytest.raises(RuntimeError), torch.no_grad():
        replay_model_output(srv.engine.pipe.transformer, traj["latents"][:1], traj["timesteps"][0], bare)


def test_batched_replay_of_stacked_envs_matches_the_server_batch(served):
    srv = served(FAMILY)
    outs = srv.generate(
        body(
            num_outputs_per_prompt=2,
            **REPLAY,
            return_generated_output=False,
        )
    )
    env = stack_envs([o["denoising_env"] for o in outs])
    assert env["model_input_concat"].shape[0] == 2
    x = torch.stack([o["dit_trajectory"]["latents"][1] for o in outs])
    with torch.no_grad():
        v = replay_model_output(
            srv.engine.pipe.transformer, x, outs[0]["dit_trajectory"]["timesteps"][1], env
        )
    for i, o in enumerate(outs):
        assert torch.equal(v[i], o["rollout_debug_tensors"]["rollout_model_outputs"][1])
        x_next = o["dit_trajectory"]["latents"][2:3]
        lp = replay_log_prob(
            "sde", x[i : i + 1], v[i : i + 1], x_next, o["dit_trajectory"]["sigmas"], 1, eta=0.7
        )
        ratio = torch.exp(lp.log_prob[0] - o["rollout_log_probs"][1])
        assert ratio.item() == 1.0


def test_sde_trajectory_shapes_and_repeatability(served):
    srv = served(FAMILY)
    req = body(
        rollout_sde_step_indices=[1],
        rollout_return_dit_trajectory=True,
        rollout_return_step_indices=[0, 2],
    )
    a, b = srv.generate(req), srv.generate(req)
    (out,) = a
    lp = out["rollout_log_probs"]
    assert lp.shape == (T,) and lp[0].item() == 0.0 and lp[1].item() != 0.0
    assert out["sde_step_indices"] == [1]
    traj = out["dit_trajectory"]
    assert traj["latents"].shape == (2, *LATENT) and traj["latent_step_indices"] == [0, 2]
    assert out["generated_output"].shape == VIDEO
    assert torch.equal(stack(a), stack(b)) and torch.equal(lp, b[0]["rollout_log_probs"])


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"num_frames": 6}, "num_frames"),
        ({"width": 40}, "width"),
        ({"height": 24}, "height"),
        ({"max_sequence_length": 64}, "max_sequence_length"),
        ({"true_cfg_scale": 4.0}, "true_cfg_scale"),
        ({"guidance_scale_2": 3.0}, "guidance_scale_2"),
    ],
)
def test_unservable_requests_get_400_naming_the_field(served, extra, needle):
    assert_400_naming(served(FAMILY), body(**extra), needle, then_healthy=True)


def test_model_info_names_the_family(served):
    assert_model_info_names(served(FAMILY), FAMILY, "HunyuanVideo15Pipeline")


def test_bf16_replay_uses_the_timestep_in_the_models_dtype(fresh_server):
    # The pipeline hands the model its timestep cast to the latents' (model's) dtype.
    srv = fresh_server(FAMILY, dtype="bfloat16")
    (out,) = srv.generate(
        body(
            **REPLAY,
            return_generated_output=False,
        )
    )
    traj, env = out["dit_trajectory"], out["denoising_env"]
    assert env["timestep_dtype"] == "torch.bfloat16" and traj["latents"].dtype == torch.bfloat16
    recorded = out["rollout_debug_tensors"]["rollout_model_outputs"]
    for step in range(T):
        with torch.no_grad():
            v = replay_model_output(
                srv.engine.pipe.transformer, traj["latents"][step : step + 1], traj["timesteps"][step], env
            )
        assert torch.equal(v[0], recorded[step]), step
        x_next = traj["latents"][step + 1 : step + 2]
        lp = replay_log_prob(
            "sde", traj["latents"][step : step + 1], v, x_next, traj["sigmas"], step, eta=0.7
        )
        assert torch.equal(lp.log_prob[0], out["rollout_log_probs"][step]), step
