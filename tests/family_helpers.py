"""Checks the per-family HTTP tests (``tests/server/families/test_families_*.py``) make alike, written once.

Each helper asserts exactly what the family tests asserted inline; a family passes its own request
``body`` builder, its stock-pipeline caller and its step count ``T``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

from diffusion_rollout.client import RolloutClient, replay_steps
from diffusion_rollout.client.replay import replay_log_prob, replay_model_output
from diffusion_rollout.scheduler_mixins import transition
from tests.client.test_client_weights import trainer_transformer

# What a replay needs back: the trajectory, the denoising env, the recorded model outputs and noise.
REPLAY = {
    "rollout_return_dit_trajectory": True,
    "rollout_return_denoising_env": True,
    "rollout_debug_mode": True,
}

# The three ways to ask for a deterministic run; each must equal the stock pipeline bit for bit.
ode_modes = pytest.mark.parametrize(
    "mode",
    [
        {"rollout": False},
        {"rollout_sde_type": "ode", "rollout_log_prob_no_const": True},
        {"rollout_sde_step_indices": [], "rollout_log_prob_no_const": True},
    ],
    ids=["rollout_false", "ode_kind", "no_sde_steps"],
)

_pipes: dict = {}


def stock_pipe(path, unshifted_scheduler: dict | None = None):
    """The stock pipeline from ``path`` (float32, loaded once); with ``unshifted_scheduler``, its
    scheduler rebuilt with those settings, so that it uses sigmas as given."""
    key = (str(path), tuple(sorted((unshifted_scheduler or {}).items())))
    if key not in _pipes:
        pipe = DiffusionPipeline.from_pretrained(str(path), dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        if unshifted_scheduler is not None:
            pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
                pipe.scheduler.config, **unshifted_scheduler
            )
        _pipes[key] = pipe
    return _pipes[key]


def stock_images(
    path,
    unshifted_scheduler: dict,
    base: dict,
    T: int,
    *,
    seeds,
    output_type,
    sigmas=None,
    steps_with_sigmas: bool = True,
    **kw,
):
    """The stock pipeline from the same folder, called the way a user would: ``base`` with one image
    per seed, ``T`` steps, custom ``sigmas`` on the unshifted scheduler (with the step count too
    unless ``steps_with_sigmas`` is off), ``kw`` on top."""
    pipe = stock_pipe(path, unshifted_scheduler if sigmas is not None else None)
    args = {k: v for k, v in base.items() if k != "num_inference_steps"}
    args.update(num_images_per_prompt=len(seeds), **kw)
    if sigmas is not None:
        args["sigmas"] = sigmas
    if sigmas is None or steps_with_sigmas:
        args["num_inference_steps"] = T
    gens = [torch.Generator("cpu").manual_seed(s) for s in seeds]
    return pipe(generator=gens, output_type=output_type, **args).images


def stack(outs, key="generated_output"):
    return torch.stack([o[key] for o in outs])


def assert_ode_path_matches_stock(srv, path, mode: dict, body: Callable, stock: Callable) -> None:
    """Latents and images of two outputs (seeds 7, 8) equal the stock pipeline's."""
    lat = srv.generate(body(num_outputs_per_prompt=2, return_generated_output=False, **mode))
    assert torch.equal(stack(lat), stock(path, seeds=[7, 8], output_type="latent"))
    img = srv.generate(body(num_outputs_per_prompt=2, **mode))
    assert torch.equal(stack(img), stock(path, seeds=[7, 8], output_type="pt"))
    assert img[0]["generated_output"].shape == (3, 32, 32)


def assert_no_cfg_matches_stock(srv, path, body: Callable, stock: Callable, guidance_scale: float) -> dict:
    """A guidance scale that turns CFG off (one transformer call per step): the env says so and the
    image equals the stock pipeline's at that scale. Returns the output."""
    (out,) = srv.generate(
        body(guidance_scale=guidance_scale, rollout_sde_type="ode", rollout_log_prob_no_const=True, **REPLAY)
    )
    assert out["denoising_env"]["guidance"]["rule"] == "none"
    assert out["denoising_env"]["neg_cond_kwargs"] is None
    ref = stock(path, seeds=[7], output_type="pt", guidance_scale=guidance_scale)
    assert torch.equal(out["generated_output"], ref[0])
    return out


def default_schedule_output(srv, path, body: Callable, stock: Callable) -> tuple[dict, object]:
    """An ODE rollout with its trajectory and env at the default schedule, whose sigmas equal those
    the stock pipeline set for the same call; returns (output, the stock pipeline) for the family's
    own checks of that schedule."""
    (out,) = srv.generate(
        body(
            rollout_sde_type="ode",
            rollout_log_prob_no_const=True,
            rollout_return_dit_trajectory=True,
            rollout_return_denoising_env=True,
        )
    )
    pipe = stock_pipe(path)
    stock(path, seeds=[7], output_type="latent")  # sets the stock schedule
    assert torch.equal(out["dit_trajectory"]["sigmas"], pipe.scheduler.sigmas.float())
    return out, pipe


def assert_custom_sigmas_used_exactly(srv, path, body: Callable, stock: Callable) -> None:
    """``sigmas`` and ``extra_sampling_params.sigmas`` both give the stock latents of those sigmas."""
    sigmas = [1.0, 0.8, 0.45, 0.2]
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


def assert_steps_follow_the_shared_transition(
    srv, kind: str, body: Callable, T: int, *, cast_to_latents_dtype: bool = False
) -> None:
    """Each recorded step is the shared transition of the recorded model output, bit for bit.

    ``cast_to_latents_dtype``: compare the transition's sample cast to the latents' dtype (a family
    whose latents are kept in another dtype than the scheduler's arithmetic)."""
    (out,) = srv.generate(
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
        sample = res.next_sample.to(traj["latents"].dtype) if cast_to_latents_dtype else res.next_sample
        assert torch.equal(sample[0], traj["latents"][i + 1])
        assert torch.equal(res.log_prob[0], out["rollout_log_probs"][i])
        # CPS's noise std is s' sin(eta pi / 2): its last step (s' = 0) is deterministic.
        assert (out["rollout_log_probs"][i].item() == 0.0) == (kind == "cps" and i == T - 1)


def assert_replay_matches_the_rollout(transformer, out: dict, T: int, **log_prob_kw) -> None:
    """Every step replayed from ``denoising_env`` gives the recorded model output and log-prob."""
    traj, env = out["dit_trajectory"], out["denoising_env"]
    recorded = out["rollout_debug_tensors"]["rollout_model_outputs"]
    for step in range(T):
        x = traj["latents"][step : step + 1]
        with torch.no_grad():
            v = replay_model_output(transformer, x, traj["timesteps"][step], env, step=step)
        assert torch.equal(v[0], recorded[step]), f"model output differs at step {step}"
        res = replay_log_prob(
            "sde", x, v, traj["latents"][step + 1 : step + 2], traj["sigmas"], step, eta=0.7, **log_prob_kw
        )
        assert torch.equal(res.log_prob[0], out["rollout_log_probs"][step]), f"log-prob differs at {step}"


def assert_another_rule_differs(transformer, out: dict, rule: str) -> None:
    """The recorded guidance rule matters: replayed with ``rule`` instead, step 0's output differs."""
    traj, env = out["dit_trajectory"], out["denoising_env"]
    other = {**env, "guidance": {**env["guidance"], "rule": rule}}
    with torch.no_grad():
        v = replay_model_output(transformer, traj["latents"][:1], traj["timesteps"][0], other, step=0)
    assert not torch.equal(v[0], out["rollout_debug_tensors"]["rollout_model_outputs"][0])


def assert_client_replay_ratio_is_one(srv, path, base: dict, T: int) -> None:
    """The trainer's own transformer (loaded from the folder) replays a batch of 3: ratio exactly 1."""
    c = RolloutClient("http://testserver", http_client=srv.client)
    fields = {k: v for k, v in base.items() if k != "prompt"}
    outs = c.generate("a red cat", seed=21, num_outputs_per_prompt=3, **fields, **REPLAY)
    trainer = trainer_transformer(path).requires_grad_(True)
    steps = list(replay_steps(trainer, outs))
    assert [s.step for s in steps] == list(range(T))
    for s in steps:
        server_v = torch.stack([o.rollout_debug_tensors["rollout_model_outputs"][s.step] for o in outs])
        assert torch.equal(s.model_output.detach(), server_v)
        assert torch.equal(s.ratio.detach(), torch.ones(3))
        assert s.log_prob.requires_grad


def assert_400_naming(srv, request: dict, needle: str, *, then_healthy: bool = False) -> None:
    """The request is refused with 400 and an error message that names ``needle``; with
    ``then_healthy``, the server still answers ``/health_generate`` with 200 afterwards."""
    r = srv.generate(request, expect=400)
    err = r.json()["error"]
    assert err["code"] == 400 and needle in err["message"], err
    if then_healthy:
        assert srv.client.get("/health_generate").status_code == 200


def assert_model_info_names(srv, family: str, pipeline_class: str) -> None:
    info = srv.client.get("/model_info").json()
    assert info["family"] == family and info["pipeline_class"] == pipeline_class


@contextlib.contextmanager
def transformer_rows(srv):
    """The batch size of every call of ``srv``'s transformer made inside the block, in order."""
    transformer = srv.engine.adapter.transformers()["transformer"]
    rows: list[int] = []
    forward = transformer.forward

    def counting(*args, **kwargs):
        rows.append((kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[0])
        return forward(*args, **kwargs)

    transformer.forward = counting  # an instance attribute: what nn.Module.__call__ runs
    try:
        yield rows
    finally:
        del transformer.forward

