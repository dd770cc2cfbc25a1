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
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

from diffusion_rollout.client import RolloutClient, replay_steps
from diffusion_rollout.client.replay import replay_log_prob, replay_model_output
from diffusion_rollout.scheduler_mixins import transition
from tests.test_client_weights import trainer_transformer

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
REPLAY = {
    "rollout_return_dit_trajectory": True,
    "rollout_return_denoising_env": True,
    "rollout_debug_mode": True,
}


def body(**kw) -> dict:
    return {**BASE, "seed": 7, **kw}


_stock: dict = {}


def stock_pipe(path, *, unshifted: bool = False):
    key = (str(path), unshifted)
    if key not in _stock:
        pipe = DiffusionPipeline.from_pretrained(str(path), dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        if unshifted:  # no static or dynamic shift: the stock scheduler uses sigmas as given
            pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
                pipe.scheduler.config, shift=1.0, use_dynamic_shifting=False
            )
        _stock[key] = pipe
    return _stock[key]


def stock(path, *, seeds, output_type, sigmas=None, **kw):
    """The stock pipeline from the same folder, called the way a user would."""
    pipe = stock_pipe(path, unshifted=sigmas is not None)
    args = {k: v for k, v in BASE.items() if k != "num_inference_steps"}
    args.update(num_images_per_prompt=len(seeds), **kw)
    if sigmas is not None:
        args["sigmas"] = sigmas
    args["num_inference_steps"] = T
    gens = [torch.Generator("cpu").manual_seed(s) for s in seeds]
    return pipe(generator=gens, output_type=output_type, **args).images


def stack(outs, key="generated_output"):
    return torch.stack([o[key] for o in outs])


@pytest.mark.parametrize(
    "mode",
    [
        {"rollout": False},
        {"rollout_sde_type": "ode", "rollout_log_prob_no_const": True},
        {"rollout_sde_step_indices": [], "rollout_log_prob_no_const": True},
    ],
    ids=["rollout_false", "ode_kind", "no_sde_steps"],
)
def test_ode_path_is_bit_identical_to_stock_pipeline(served, tiny_model_path, mode):
    srv, path = served(FAMILY), tiny_model_path(FAMILY)
    lat = srv.generate(body(num_outputs_per_prompt=2, return_generated_output=False, **mode))
    assert torch.equal(stack(lat), stock(path, seeds=[7, 8], output_type="latent"))
    img = srv.generate(body(num_outputs_per_prompt=2, **mode))
    assert torch.equal(stack(img), stock(path, seeds=[7, 8], output_type="pt"))
    assert img[0]["generated_output"].shape == (3, 32, 32)


def test_ode_path_without_cfg_is_bit_identical(served, tiny_model_path):
    """guidance_scale 1 turns CFG off in the pipeline: one transformer call per step."""
    srv, path = served(FAMILY), tiny_model_path(FAMILY)
    (out,) = srv.generate(
        body(guidance_scale=1.0, rollout_sde_type="ode", rollout_log_prob_no_const=True, **REPLAY)
    )
    assert out["denoising_env"]["guidance"]["rule"] == "none"
    assert out["denoising_env"]["neg_cond_kwargs"] is None
    assert torch.equal(
        out["generated_output"], stock(path, seeds=[7], output_type="pt", guidance_scale=1.0)[0]
    )


def test_default_schedule_is_the_pipelines_empirical_mu(served, tiny_model_path):
    (out,) = served(FAMILY).generate(
        body(rollout_sde_type="ode", rollout_log_prob_no_const=True, rollout_return_dit_trajectory=True)
    )
    pipe = stock_pipe(tiny_model_path(FAMILY))
    stock(tiny_model_path(FAMILY), seeds=[7], output_type="latent")  # sets the stock schedule
    sigmas = out["dit_trajectory"]["sigmas"]
    assert torch.equal(sigmas, pipe.scheduler.sigmas.float())
    assert not torch.equal(sigmas[:T], torch.linspace(1.0, 1.0 / T, T))  # shifted, not the plain ladder
    # The model sees t / 1000 in the latents' dtype; the trajectory reports it as passed.
    assert torch.equal(out["dit_trajectory"]["timesteps"][:T], (pipe.scheduler.timesteps / 1000).float())
    # Packed latents: 16 tokens of 4 x 16 patchified channels, T + 1 entries.
    assert out["dit_trajectory"]["latents"].shape == (T + 1, 16, 64)


def test_custom_sigmas_are_used_exactly(served, tiny_model_path):
    sigmas = [1.0, 0.8, 0.45, 0.2]
    srv, path = served(FAMILY), tiny_model_path(FAMILY)
    (plain,) = srv.generate(body(rollout=False, return_generated_output=False, sigmas=sigmas))
    ref = stock(path, seeds=[7], output_type="latent", sigmas=sigmas)
    assert torch.equal(plain["generated_output"], ref[0])
    (ode,) = srv.generate(
        body(
            rollout_sde_type="ode",
            rollout_log_prob_no_const=True,
            return_generated_output=False,
            rollout_return_dit_trajectory=True,
            extra_sampling_params={"sigmas": sigmas},
        )
    )
    assert torch.equal(ode["generated_output"], ref[0])
    assert torch.equal(ode["dit_trajectory"]["sigmas"], torch.tensor([*sigmas, 0.0]))


@pytest.mark.parametrize("kind", ["sde", "dance", "cps"])
def test_stochastic_steps_follow_the_shared_transition(served, kind):
    """Each recorded step is the shared transition of the recorded model output, bit for bit."""
    (out,) = served(FAMILY).generate(
        body(
            rollout_sde_type=kind, rollout_noise_level=0.8, rollout_log_prob_no_const=kind == "cps", **REPLAY
        )
    )
    traj, dbg = out["dit_trajectory"], out["rollout_debug_tensors"]
    sig = traj["sigmas"]
    for i in range(T):
        res = transition(
            kind,
            traj["latents"][i : i + 1],
            dbg["rollout_model_outputs"][i : i + 1],
            sig[i],
            sig[i + 1],
            eta=torch.tensor(0.8),  # a float32 scalar, as the server holds it
            sigma_max=sig[1],
            noise=dbg["rollout_variance_noises"][i : i + 1],
            log_prob_form="no_const" if kind == "cps" else "gaussian",
        )
        assert torch.equal(res.next_sample.to(traj["latents"].dtype)[0], traj["latents"][i + 1])
        assert torch.equal(res.log_prob[0], out["rollout_log_probs"][i])
        # CPS's noise std is s' sin(eta pi / 2): its last step (s' = 0) is deterministic.
        assert (out["rollout_log_probs"][i].item() == 0.0) == (kind == "cps" and i == T - 1)


@pytest.mark.parametrize("fields", [{}, {"negative_prompt": "blurry"}], ids=["empty-negative", "negative"])
def test_replay_reproduces_model_output_and_log_prob(served, fields):
    srv = served(FAMILY)
    (out,) = srv.generate(body(**REPLAY, **fields))
    traj, env = out["dit_trajectory"], out["denoising_env"]
    assert env["guidance"]["rule"] == "true_cfg" and env["neg_cond_kwargs"] is not None
    assert {"encoder_hidden_states", "txt_ids"} <= set(env["pos_cond_kwargs"]) and "img_ids" in env[
        "image_kwargs"
    ]
    recorded = out["rollout_debug_tensors"]["rollout_model_outputs"]
    transformer = srv.engine.pipe.transformer
    for step in range(T):
        x = traj["latents"][step : step + 1]
        with torch.no_grad():
            v = replay_model_output(transformer, x, traj["timesteps"][step], env, step=step)
        assert torch.equal(v[0], recorded[step]), f"model output differs at step {step}"
        res = replay_log_prob(
            "sde", x, v, traj["latents"][step + 1 : step + 2], traj["sigmas"], step, eta=0.7
        )
        assert torch.equal(res.log_prob[0], out["rollout_log_probs"][step]), f"log-prob differs at {step}"


def test_negative_prompt_changes_the_unconditional_branch(served):
    srv = served(FAMILY)
    (empty,) = srv.generate(body(rollout=False))
    (neg,) = srv.generate(body(rollout=False, negative_prompt="blurry"))
    assert not torch.equal(empty["generated_output"], neg["generated_output"])


def test_client_replay_ratio_is_exactly_one(served, tiny_model_path):
    """The trainer's own transformer (loaded from the folder) replays a batch of 3: ratio exactly 1."""
    srv = served(FAMILY)
    c = RolloutClient("http://testserver", http_client=srv.client)
    fields = {k: v for k, v in BASE.items() if k != "prompt"}
    outs = c.generate("a red cat", seed=21, num_outputs_per_prompt=3, **fields, **REPLAY)
    trainer = trainer_transformer(tiny_model_path(FAMILY)).requires_grad_(True)
    steps = list(replay_steps(trainer, outs))
    assert [s.step for s in steps] == list(range(T))
    for s in steps:
        server_v = torch.stack([o.rollout_debug_tensors["rollout_model_outputs"][s.step] for o in outs])
        assert torch.equal(s.model_output.detach(), server_v)
        assert torch.equal(s.ratio.detach(), torch.ones(3))
        assert s.log_prob.requires_grad


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
    r = served(FAMILY).generate(body(**extra), expect=400)
    err = r.json()["error"]
    assert err["code"] == 400 and needle in err["message"], err


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
