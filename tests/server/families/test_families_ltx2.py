"""``POST /rollout/generate`` on the tiny LTX-2 model (video and audio denoised jointly), through HTTP.

Exactness is equality (``torch.equal``): ``rollout=false`` and all-ODE rollouts against the stock
``LTX2Pipeline`` (plain CFG on both streams, its dynamic-shift schedule), custom sigmas against the
stock pipeline with the shifts disabled, and every stochastic step of both streams against the one
shared ``transition`` with the recorded noise and model outputs; the joint log-prob replays with
``joint_log_prob`` at a ratio of exactly 1.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from diffusion_rollout.client.replay import (
    replay_log_prob,
    replay_model_output,
    replay_stream_model_outputs,
)
from diffusion_rollout.client.results import RolloutOutput
from diffusion_rollout.scheduler_mixins import joint_log_prob, transition
from tests.family_helpers import REPLAY, assert_400_naming, assert_model_info_names

FAMILY = "ltx2"
T = 2
BASE = {
    "prompt": "a red cat",
    "width": 32,
    "height": 32,
    "num_frames": 9,
    "num_inference_steps": T,
    "guidance_scale": 3.0,
    "max_sequence_length": 16,
}
# What the server runs: plain CFG on both streams, the other guidance terms off.
STOCK_GUIDANCE = {
    "audio_guidance_scale": 3.0,
    "stg_scale": 0.0,
    "audio_stg_scale": 0.0,
    "modality_scale": 1.0,
    "audio_modality_scale": 1.0,
    "guidance_rescale": 0.0,
    "audio_guidance_rescale": 0.0,
    "spatio_temporal_guidance_blocks": None,
}
VIDEO_TOKENS, AUDIO_TOKENS = (1280, 4), (9, 4)  # packed: 5 x 16 x 16 video tokens; 9 audio frames
ODE = {"rollout_sde_type": "ode", "rollout_log_prob_no_const": True}


def body(**kw) -> dict:
    return {**BASE, "seed": 7, **kw}


_stock: dict = {}
_outputs: dict = {}


def stock(path, *, seeds, output_type, sigmas=None):
    key = (str(path), tuple(seeds), output_type, tuple(sigmas or ()))
    if key not in _outputs:
        pk = (str(path), sigmas is not None)
        if pk not in _stock:
            pipe = DiffusionPipeline.from_pretrained(str(path), dtype=torch.float32)
            pipe.set_progress_bar_config(disable=True)
            if sigmas is not None:  # no dynamic shift, no terminal stretch: sigmas used as given
                pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
                    pipe.scheduler.config, use_dynamic_shifting=False, shift_terminal=None, shift=1.0
                )
            _stock[pk] = pipe
        args = {k: v for k, v in BASE.items() if k != "prompt"}
        if sigmas is not None:
            args["sigmas"] = sigmas
        out = _stock[pk](
            prompt=[BASE["prompt"]] * len(seeds),
            generator=[torch.Generator("cpu").manual_seed(s) for s in seeds],
            output_type=output_type,
            **args,
            **STOCK_GUIDANCE,
        ).frames
        _outputs[key] = out if output_type == "latent" else out.permute(0, 2, 1, 3, 4)
    return _outputs[key]


def stack(outs, key="generated_output"):
    return torch.stack([o[key] for o in outs])


@pytest.mark.parametrize("mode", [{"rollout": False}, ODE], ids=["rollout_false", "ode_rollout"])
def test_rollout_false_and_ode_rollouts_are_the_stock_pipeline(served, tiny_model_path, mode):
    srv, path = served(FAMILY), tiny_model_path(FAMILY)
    lat = srv.generate(body(num_outputs_per_prompt=2, return_generated_output=False, **mode))
    assert lat[0]["generated_output"].shape == (4, 5, 16, 16)
    assert torch.equal(stack(lat), stock(path, seeds=[7, 8], output_type="latent"))
    (vid,) = srv.generate(body(**mode))
    assert vid["generated_output"].shape == (3, 9, 32, 32)
    assert torch.equal(vid["generated_output"], stock(path, seeds=[7], output_type="pt")[0])
    if "rollout_sde_type" in mode:
        assert torch.equal(vid["rollout_log_probs"], torch.zeros(T))


@pytest.mark.parametrize("rollout", [False, True], ids=["rollout_false", "ode_rollout"])
def test_custom_sigmas_run_exactly_in_both_streams(served, tiny_model_path, rollout):
    sigmas = [1.0, 0.45]
    mode = {"rollout": False} if not rollout else {**ODE, "rollout_return_dit_trajectory": True}
    (out,) = served(FAMILY).generate(body(sigmas=sigmas, return_generated_output=False, **mode))
    assert torch.equal(
        out["generated_output"],
        stock(tiny_model_path(FAMILY), seeds=[7], output_type="latent", sigmas=sigmas)[0],
    )
    if rollout:
        assert torch.equal(out["dit_trajectory"]["sigmas"], torch.tensor([*sigmas, 0.0]))


@pytest.mark.parametrize("kind", ["sde", "dance", "cps"])
def test_both_streams_step_with_the_shared_transition_and_the_joint_log_prob_replays(served, kind):
    srv = served(FAMILY)
    (out,) = srv.generate(
        body(
            rollout_sde_type=kind,
            rollout_sde_step_indices=[0] if kind == "cps" else None,
            rollout_noise_level=0.5,
            rollout_return_dit_trajectory=True,
            rollout_debug_mode=True,
            return_generated_output=False,
        )
    )
    traj, debug = out["dit_trajectory"], out["rollout_debug_tensors"]
    sigmas = traj["sigmas"]
    streams = traj["streams"]
    assert streams["video"]["latents"].shape == (T + 1, *VIDEO_TOKENS)
    assert streams["audio"]["latents"].shape == (T + 1, *AUDIO_TOKENS)
    assert torch.equal(traj["latents"], streams["video"]["latents"])  # the primary stream
    per_stream = {}
    for name in ("video", "audio"):
        lat, dbg = streams[name]["latents"], debug["streams"][name]
        scores = []
        for step in range(T):
            step_kind = kind if step in out["sde_step_indices"] else "ode"
            x, x_next = lat[step : step + 1], lat[step + 1 : step + 2]
            v = dbg["rollout_model_outputs"][step : step + 1]
            sampled = transition(
                step_kind,
                x,
                v,
                sigmas[step],
                sigmas[step + 1],
                eta=0.5,
                sigma_max=sigmas[1],
                noise=dbg["rollout_variance_noises"][step : step + 1],
            )
            assert torch.equal(sampled.next_sample, x_next), (name, step)
            scored = replay_log_prob(step_kind, x, v, x_next, sigmas, step, eta=0.5)
            assert torch.equal(scored.log_prob[0], streams[name]["log_probs"][step]), (name, step)
            scores.append(scored.log_prob[0])
        per_stream[name] = torch.stack(scores)
    numels = [VIDEO_TOKENS[0] * VIDEO_TOKENS[1], AUDIO_TOKENS[0] * AUDIO_TOKENS[1]]
    joint = joint_log_prob([per_stream["video"], per_stream["audio"]], numels)
    assert torch.equal(joint, out["rollout_log_probs"])
    assert torch.equal(torch.exp(joint - out["rollout_log_probs"]), torch.ones(T))  # ratio exactly 1
    assert out["rollout_log_probs"][0].item() != 0.0


def test_replay_reproduces_both_streams_model_outputs_and_the_joint_log_prob(served):
    srv = served(FAMILY)
    (out,) = srv.generate(
        body(
            **REPLAY,
            return_generated_output=False,
        )
    )
    traj, env, debug = out["dit_trajectory"], out["denoising_env"], out["rollout_debug_tensors"]
    assert env["streams"] == ["video", "audio"] and env["guidance"]["rule"] == "ltx2_cfg_x0"
    with pytest.raises(ValueError, match="replay_stream_model_outputs"):  # the one-stream helper refuses
        replay_model_output(srv.engine.pipe.transformer, traj["latents"][:1], traj["timesteps"][0], env)
    parsed = RolloutOutput.from_dict(out).dit_trajectory  # the typed client keeps every stream
    assert torch.equal(parsed.streams["audio"]["latents"], traj["streams"]["audio"]["latents"])
    assert env["neg_cond_kwargs"] is not None and "audio_encoder_hidden_states" in env["pos_cond_kwargs"]
    streams = traj["streams"]
    numels = [VIDEO_TOKENS[0] * VIDEO_TOKENS[1], AUDIO_TOKENS[0] * AUDIO_TOKENS[1]]
    for step in range(T):
        x = {name: streams[name]["latents"][step : step + 1] for name in ("video", "audio")}
        with torch.no_grad():
            v = replay_stream_model_outputs(
                srv.engine.pipe.transformer, x, traj["timesteps"][step], traj["sigmas"][step], env
            )
        scores = []
        for name in ("video", "audio"):
            assert torch.equal(v[name][0], debug["streams"][name]["rollout_model_outputs"][step]), (
                name,
                step,
            )
            x_next = streams[name]["latents"][step + 1 : step + 2]
            scores.append(
                replay_log_prob("sde", x[name], v[name], x_next, traj["sigmas"], step, eta=0.7).log_prob
            )
        joint = joint_log_prob(scores, numels)
        assert torch.equal(joint[0], out["rollout_log_probs"][step]), step
    # The guidance scale enters the combination: another one gives other outputs (not vacuous).
    x = {name: streams[name]["latents"][:1] for name in ("video", "audio")}
    wrong = {**env, "guidance": {**env["guidance"], "guidance_scale": 2.0, "audio_guidance_scale": 2.0}}
    with torch.no_grad():
        v = replay_stream_model_outputs(
            srv.engine.pipe.transformer, x, traj["timesteps"][0], traj["sigmas"][0], wrong
        )
    assert not torch.equal(v["video"][0], debug["streams"]["video"]["rollout_model_outputs"][0])


def test_training_replay_step_gives_a_ratio_of_exactly_one_for_a_batch(served):
    from diffusion_rollout.client import ReplaySettings, replay_steps

    req = body(
        num_outputs_per_prompt=2,
        rollout_sde_step_indices=[0],
        rollout_return_dit_trajectory=True,
        rollout_return_denoising_env=True,
        return_generated_output=False,
    )
    outs = [
        RolloutOutput.from_dict(o, ReplaySettings.from_request(req)) for o in served(FAMILY).generate(req)
    ]
    (replayed,) = list(replay_steps(served(FAMILY).engine.pipe.transformer, outs))
    assert replayed.step == 0 and set(replayed.streams) == {"video", "audio"}
    assert torch.equal(replayed.log_prob, replayed.old_log_prob)
    assert torch.equal(replayed.ratio, torch.ones(2))


def test_noise_is_drawn_video_then_audio_from_each_outputs_generator(served):
    (out,) = served(FAMILY).generate(
        body(rollout_sde_step_indices=[0], rollout_debug_mode=True, return_generated_output=False)
    )
    g = torch.Generator().manual_seed(7)
    randn_tensor((1, *VIDEO_TOKENS), generator=g)  # x_T, video
    randn_tensor((1, 2, 9, 2), generator=g)  # x_T, audio (unpacked [C, L, M])
    noise = out["rollout_debug_tensors"]["streams"]
    assert torch.equal(
        noise["video"]["rollout_variance_noises"][0], randn_tensor((1, *VIDEO_TOKENS), generator=g)[0]
    )
    assert torch.equal(
        noise["audio"]["rollout_variance_noises"][0], randn_tensor((1, *AUDIO_TOKENS), generator=g)[0]
    )


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"num_frames": 8}, "num_frames"),
        ({"width": 33}, "width"),
        ({"true_cfg_scale": 4.0}, "true_cfg_scale"),
        ({"guidance_scale_2": 3.0}, "guidance_scale_2"),
    ],
)
def test_unservable_requests_get_400_naming_the_field(served, extra, needle):
    assert_400_naming(served(FAMILY), body(**extra), needle, then_healthy=True)


def test_model_info_names_the_family(served):
    assert_model_info_names(served(FAMILY), FAMILY, "LTX2Pipeline")


def test_bf16_replay_casts_the_float32_latents_like_the_pipeline(fresh_server):
    # The latents stay float32; the model input is cast to the text embeddings' dtype.
    srv = fresh_server(FAMILY, dtype="bfloat16")
    (out,) = srv.generate(
        body(
            **REPLAY,
            return_generated_output=False,
        )
    )
    traj, env, debug = out["dit_trajectory"], out["denoising_env"], out["rollout_debug_tensors"]
    assert env["model_input_dtype"] == "torch.bfloat16" and traj["latents"].dtype == torch.float32
    streams = traj["streams"]
    x = {name: streams[name]["latents"][1:2] for name in ("video", "audio")}
    with torch.no_grad():
        v = replay_stream_model_outputs(
            srv.engine.pipe.transformer, x, traj["timesteps"][1], traj["sigmas"][1], env
        )
    for name in ("video", "audio"):
        assert torch.equal(v[name][0], debug["streams"][name]["rollout_model_outputs"][1]), name
