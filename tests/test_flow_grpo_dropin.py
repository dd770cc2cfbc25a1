"""flow_grpo's ``pipeline_with_logprob`` served by the rollout server (``client.flow_grpo``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from diffusion_rollout.client import RolloutClient
from diffusion_rollout.client.flow_grpo import pipeline_with_logprob
from diffusion_rollout.models import TINY_CALL_DEFAULTS
from tests.test_examples import examples  # noqa: F401  (the fixture that imports an example)

SD3 = dict(TINY_CALL_DEFAULTS["sd3"])  # 32x32, 4 steps, CFG 4.5, max_sequence_length 16
PROMPTS = ["a red square", "a blue circle"]


def client_of(server) -> RolloutClient:
    return RolloutClient("http://testserver", http_client=server.client)


def gens(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def flow_grpo_log_prob(x, v, x_next, sigmas, i, eta):
    """flow_grpo's published SDE step, written out: the log-prob of ``x_next`` given ``x`` and ``v``."""
    x, v, x_next = x.float(), v.float(), x_next.float()
    sigma, sigma_next = sigmas[i].float(), sigmas[i + 1].float()
    sigma_max = sigmas[1].item()
    dt = sigma_next - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_dev_t * torch.sqrt(-dt)
    log_prob = (
        -((x_next - mean) ** 2) / (2 * std**2)
        - torch.log(std)
        - torch.log(torch.sqrt(torch.as_tensor(2 * math.pi)))
    )
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def test_layout_prompt_major_order_and_repeatable_seeds(fresh_server):
    # One pipeline batch per prompt (max_batch_size = images per prompt): a repeat runs the same batches.
    client = client_of(fresh_server("sd3", max_batch_size=2))
    kwargs = dict(SD3, prompt=PROMPTS, num_images_per_prompt=2, output_type="pt", return_outputs=True)
    images, latents, log_probs, outs = pipeline_with_logprob(client, generator=gens(11, 12, 13, 14), **kwargs)
    steps = SD3["num_inference_steps"]
    assert images.shape == (4, 3, 32, 32) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1
    assert len(latents) == steps + 1 and all(x.shape == (4, 16, 8, 8) for x in latents)
    assert len(log_probs) == steps and all(lp.shape == (4,) for lp in log_probs)
    assert all(torch.isfinite(lp).all() and (lp != 0).all() for lp in log_probs)  # every step stochastic
    # Prompt-major, each image with its generator's seed; rows are the outputs'.
    assert [o.prompt for o in outs] == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    assert [o.seed for o in outs] == [11, 12, 13, 14]
    for k, o in enumerate(outs):
        assert torch.equal(images[k], o.generated_output)
        assert torch.equal(latents[0][k], o.dit_trajectory.latents[0])
        assert torch.equal(log_probs[-1][k], o.rollout_log_probs[-1])
    assert o.replay_settings.kind == "sde" and o.replay_settings.eta == 0.7

    again = pipeline_with_logprob(client, generator=gens(11, 12, 13, 14), **kwargs)
    assert torch.equal(again[0], images)
    assert all(torch.equal(a, b) for a, b in zip(again[1], latents, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(again[2], log_probs, strict=True))

    # One generator: seed + k for image k. PIL output is diffusers' rounding of the same floats.
    pil, *_ = pipeline_with_logprob(client, generator=gens(11)[0], **{**kwargs, "output_type": "pil"})
    assert len(pil) == 4 and pil[0].size == (32, 32)
    assert torch.equal(
        torch.from_numpy(np.array(pil[3])),
        (images[3].permute(1, 2, 0) * 255).round().to(torch.uint8),
    )


@pytest.mark.parametrize("window", [None, (1, 3)], ids=["every-step", "sde-window"])
def test_log_probs_are_flow_grpos_formula_on_the_stored_latents(served, window):
    """What flow_grpo's trainer recomputes from (latents[i], v, latents[i + 1]) is the returned log-prob.

    ``v`` is the server's guided model output (its debug tensors). The formula is flow_grpo's, written
    independently of the project's ``transition``. Both compute in float32, but the grouping differs
    (flow_grpo: ``std**2 / (2 sigma) * dt``, the project: ``g**2 * dt / (2 s)``; its ``log sqrt(2 pi)``
    is a Python constant, flow_grpo's a float32 tensor op), so only float rounding is promised. (On
    this CPU the two happen to agree bit for bit.)
    """
    eta = 0.9
    _, latents, log_probs, outs = pipeline_with_logprob(
        client_of(served("sd3")), prompt=PROMPTS, num_images_per_prompt=2, output_type="pt", **SD3,
        generator=gens(5, 6, 7, 8), noise_level=eta, sde_window=window,
        extra_fields={"rollout_debug_mode": True}, return_outputs=True,
    )  # fmt: skip
    sigmas = outs[0].dit_trajectory.sigmas
    stochastic = list(range(*window)) if window else list(range(len(log_probs)))
    assert outs[0].sde_step_indices == stochastic
    for i, returned in enumerate(log_probs):
        if i not in stochastic:
            assert torch.equal(returned, torch.zeros(4))  # an ODE step contributes exactly 0
            continue
        v = torch.stack([o.rollout_debug_tensors["rollout_model_outputs"][i] for o in outs])
        recomputed = flow_grpo_log_prob(latents[i], v, latents[i + 1], sigmas, i, eta)
        torch.testing.assert_close(recomputed, returned, rtol=1e-5, atol=1e-6)


def test_sigmas_mean_what_diffusers_makes_of_them_and_noise_level_zero_is_ode(served, tiny_model_path):
    from diffusers import FlowMatchEulerDiscreteScheduler

    client = client_of(served("sd3"))
    custom = [1.0, 0.75, 0.5, 0.25]
    *_, outs = pipeline_with_logprob(
        client, prompt="a cat", **SD3, sigmas=custom, output_type="pt", return_outputs=True
    )
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_model_path("sd3"), subfolder="scheduler")
    scheduler.set_timesteps(sigmas=custom)  # diffusers shifts custom sigmas; so does the drop-in
    assert torch.equal(outs[0].dit_trajectory.sigmas, scheduler.sigmas)

    # The default schedule is the pipeline's own: what flow_grpo's trainer reads from its scheduler.
    *_, outs = pipeline_with_logprob(client, prompt="a cat", **SD3, output_type="pt", return_outputs=True)
    scheduler.set_timesteps(SD3["num_inference_steps"])
    assert torch.equal(outs[0].dit_trajectory.sigmas, scheduler.sigmas)
    assert torch.equal(outs[0].dit_trajectory.timesteps[:-1], scheduler.timesteps)

    # flow_grpo's evaluation call: noise_level=0 runs every step deterministically.
    images, latents, log_probs = pipeline_with_logprob(
        client, prompt="a cat", **SD3, noise_level=0, output_type="np"
    )
    assert images.shape == (1, 32, 32, 3) and len(latents) == 5
    assert all(torch.equal(lp, torch.zeros(1)) for lp in log_probs)


NO_SERVER = RolloutClient("http://127.0.0.1:9")  # nothing listens; refusals happen before any request


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt": None}, "prompt or prompt_embeds is required"),
        ({"prompt": None, "prompt_embeds": torch.zeros(1, 3, 8)}, "pooled_prompt_embeds is required"),
        (
            {"prompt": None, "prompt_embeds": torch.zeros(1, 3, 8), "pooled_prompt_embeds": torch.zeros(1, 8)},
            "negative_prompt_embeds and negative_pooled_prompt_embeds are required",
        ),
        ({"latents": torch.zeros(1, 16, 8, 8)}, "latents"),
        ({"callback_on_step_end": lambda *a: {}}, "callback_on_step_end"),
        ({"joint_attention_kwargs": {"scale": 0.5}}, "joint_attention_kwargs"),
        ({"clip_skip": 1}, "clip_skip"),
        ({"skip_guidance_layers": [7]}, "skip_guidance_layers"),
        ({"prompt_2": "x"}, "prompt_2"),
        ({"negative_prompt_3": "x"}, "negative_prompt_3"),
        ({"prompt_embeds": torch.zeros(1, 3, 8)}, "not both"),
        ({"generator": gens(1, 1)}, "2 generators for 1 images"),
        ({"solver": "dpm2"}, "solver='dpm2' is not supported: .*rollout_sde_type"),
        ({"model_type": "flux"}, "model_type='flux' is not supported: .*flow_grpo_flux"),
        ({"sde_window_size": 2}, r"sde_window_size is not supported .*sde_window=\(start, stop\)"),
        ({"process_index": 0}, "process_index is not supported"),
        ({"sde_window": (0, 2), "rollout_sde_step_indices": [0]}, "not both"),
        ({"output_type": "latents"}, "output_type"),
        ({"extra_fields": {"num_outputs_per_prompt": 3}}, "num_outputs_per_prompt"),
    ],
)
def test_what_the_server_cannot_honour_is_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pipeline_with_logprob(NO_SERVER, **{"prompt": "a cat", **kwargs})


def test_the_pipeline_itself_is_not_a_client():
    with pytest.raises(TypeError, match=r"ServedPipeline\(pipeline, client\)"):
        pipeline_with_logprob(object(), prompt="a cat")  # type: ignore[arg-type]


def test_example_trains_flow_grpo_style_with_ratio_exactly_one(examples):  # noqa: F811
    dropin = examples("flow_grpo_dropin")
    summary = dropin.main(
        ["--cpu", "--server", "thread", "--prompts", "2", "--group-size", "2", "--steps", "3"]
    )
    assert summary["images"] == [4, 3, 32, 32] and summary["latents"] == [4, 4, 16, 8, 8]
    assert summary["log_probs"] == [4, 3]
    assert summary["on_policy_ratio_max_dev"] == 0.0  # replayed as the server ran it: every bit
    low, high = summary["ratio_after_update"]
    assert low < 1.0 or high > 1.0  # the update moved the policy: the check above is not vacuous
