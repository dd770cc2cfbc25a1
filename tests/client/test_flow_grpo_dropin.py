"""flow_grpo's ``pipeline_with_logprob`` served by the rollout server (``client.flow_grpo``)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from diffusion_rollout.client import RolloutClient
from diffusion_rollout.client.flow_grpo import pipeline_with_logprob
from diffusion_rollout.models import TINY_CALL_DEFAULTS
from tests.recipes.test_examples import examples  # noqa: F401  (the fixture that imports an example)

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
            {
                "prompt": None,
                "prompt_embeds": torch.zeros(1, 3, 8),
                "pooled_prompt_embeds": torch.zeros(1, 8),
            },
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


def test_example_runs_train_sd3_with_the_weights_following_the_trainer(examples, tmp_path):  # noqa: F811
    dropin = examples("flow_grpo_dropin")
    args = [
        "--cpu",
        "--server",
        "thread",
        "--prompts",
        "2",
        "--group-size",
        "2",
        "--steps",
        "3",
        "--iterations",
        "2",
    ]
    summary = dropin.main([*args, "--compare-replay", "--out", str(tmp_path / "run.json")])
    assert summary["images"] == [4, 3, 32, 32] and summary["latents"] == [4, 4, 16, 8, 8]
    assert summary["log_probs"] == [4, 3]
    # Every iteration's first pass is on-policy to the bit: the LoRA updated by the previous
    # iteration's optimizer step was pushed before sampling (once per iteration).
    assert summary["first_step_ratio_max_dev"] == [0.0, 0.0]
    assert summary["weight_pushes"] == 2
    history = json.loads((tmp_path / "run.json").read_text())["history"]
    assert [r["first_step_ratio_max_dev"] for r in history] == [0.0, 0.0]
    # --compare-replay: flow_grpo's recompute ran on exactly the inputs the server recorded, its model
    # output is the server's own (debug tensors), and the recipes' replay of the same rows is on-policy.
    clean = {"replay_ratio_max_dev": 0.0, "model_output_mismatches": 0, "timestep_mismatches": 0,
             "embeds_mismatches": 0, "latent_mismatches": 0, "compared": 6,
             "server_model_output_mismatches": 0, "server_model_output_max_abs_diff": 0.0}  # fmt: skip
    assert [r["compare_replay"] for r in history] == [clean, clean]
    # Without the sync the second iteration samples with the old adapter: the checks above are not
    # vacuous, and the comparison puts the drift in the weights, not in the inputs.
    stale_out = tmp_path / "stale.json"
    stale = dropin.main([*args, "--no-sync-weights", "--compare-replay", "--out", str(stale_out)])
    assert stale["weight_pushes"] == 0
    assert stale["first_step_ratio_max_dev"][0] == 0.0 and stale["first_step_ratio_max_dev"][1] > 1e-5
    second = json.loads(stale_out.read_text())["history"][1]["compare_replay"]
    assert second["replay_ratio_max_dev"] > 1e-5
    inputs = ("model_output_mismatches", "timestep_mismatches", "embeds_mismatches", "latent_mismatches")
    assert {k: second[k] for k in inputs} == dict.fromkeys(inputs, 0)
    # The server sampled with other weights: its own model output is not the trainer's.
    assert second["server_model_output_mismatches"] > 0 and second["server_model_output_max_abs_diff"] > 0


# ---------------------------------------------------------------------------- ServedPipeline
# flow_grpo's train_sd3, written out at tiny scale: its own pipeline encodes the prompts (128 T5
# tokens; the server's default is 16 here), the batch repeats each prompt (its K-repeat sampler), and
# same_latent gives a prompt's images one seed.
TRAIN_SD3 = {"num_inference_steps": 4, "guidance_scale": 4.5, "height": 32, "width": 32, "noise_level": 0.7}


def trainer_pipeline(path, family: str = "sd3"):
    """The trainer's own diffusers pipeline (float32, its own copy of every component)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(path), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.requires_grad_(False)
    return pipe


def train_sd3_embeddings(pipe, prompts: list[str], tokens: int = 128) -> dict[str, torch.Tensor]:
    """train_sd3's compute_text_embeddings: prompts and the "" negative, each without CFG pairing."""
    pe, _, ppe, _ = pipe.encode_prompt(
        prompts, None, None, do_classifier_free_guidance=False, max_sequence_length=tokens
    )
    npe, _, nppe, _ = pipe.encode_prompt(
        [""], None, None, do_classifier_free_guidance=False, max_sequence_length=tokens
    )
    n = len(prompts)
    return {
        "prompt_embeds": pe,
        "pooled_prompt_embeds": ppe,
        "negative_prompt_embeds": npe.repeat(n, 1, 1),
        "negative_pooled_prompt_embeds": nppe.repeat(n, 1),
    }


def recompute_sd3(pipe, latents, embeds, guidance_scale: float, eta: float) -> list[torch.Tensor]:
    """flow_grpo's training-side log-prob: the trainer's transformer on its own embeddings (batched
    CFG), its scheduler's schedule, the shared transition on the stored latents."""
    from diffusion_rollout.scheduler_mixins import transition

    sched = pipe.scheduler
    cond = torch.cat([embeds["negative_prompt_embeds"], embeds["prompt_embeds"]])
    pooled = torch.cat([embeds["negative_pooled_prompt_embeds"], embeds["pooled_prompt_embeds"]])
    out = []
    for j, t in enumerate(sched.timesteps):
        x = latents[j]
        with torch.no_grad():
            pred = pipe.transformer(
                hidden_states=torch.cat([x, x]), timestep=t.expand(2 * len(x)), encoder_hidden_states=cond,
                pooled_projections=pooled, return_dict=False,
            )[0]  # fmt: skip
        uncond, text = pred.chunk(2)
        v = uncond + guidance_scale * (text - uncond)
        step = transition(
            "sde", x, v, sched.sigmas[j], sched.sigmas[j + 1], eta=eta, sigma_max=sched.sigmas[1],
            next_sample=latents[j + 1],
        )  # fmt: skip
        out.append(step.log_prob)
    return out


def assert_on_policy(recomputed, returned, clip: float = 1e-4) -> None:
    for new, old in zip(recomputed, returned, strict=True):
        assert (new - old).abs().max() <= 1e-6
        assert (torch.exp(new - old) - 1).abs().max() <= clip  # no ratio outside the clip range


def test_train_sd3_call_runs_unchanged_through_the_served_pipeline(fresh_server, tiny_model_path):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from diffusion_rollout.client.served_pipeline import ServedPipeline

    pipe = trainer_pipeline(tiny_model_path("sd3"))
    # One request per pipeline call, so that a repeat runs the same batches (the last bits of a
    # transformer's output depend on its batch).
    pipeline = ServedPipeline(pipe, client_of(fresh_server("sd3", max_batch_size=1)))
    assert pipeline.transformer is pipe.transformer and pipeline.scheduler is pipe.scheduler
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    embeds = train_sd3_embeddings(pipe, prompts)
    assert embeds["prompt_embeds"].shape == (4, 77 + 128, 32)
    generator = gens(7, 7, 8, 8)  # same_latent: one seed per prompt

    images, latents, log_probs = pipeline_with_logprob(
        pipeline, **embeds, output_type="pt", generator=generator, **TRAIN_SD3
    )
    device = pipe._execution_device
    assert images.shape == (4, 3, 32, 32) and images.dtype == torch.float32 and images.device == device
    assert len(latents) == 5 and all(x.shape == (4, 16, 8, 8) and x.dtype == torch.float32 for x in latents)
    assert all(x.device == device for x in latents + log_probs)
    assert len(log_probs) == 4 and all(lp.shape == (4,) and lp.dtype == torch.float32 for lp in log_probs)
    # What train_sd3 reads after the call: the trainer's scheduler holds the schedule sampled with.
    stock = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_model_path("sd3"), subfolder="scheduler")
    stock.set_timesteps(4)
    assert torch.equal(pipeline.scheduler.timesteps, stock.timesteps)
    assert torch.equal(pipeline.scheduler.sigmas, stock.sigmas)
    # Repeated seeds share x_T (the x_T a lone image of that seed gets), not the step noise.
    lone = pipe.prepare_latents(1, 16, 32, 32, torch.float32, device, torch.Generator().manual_seed(7))
    assert torch.equal(latents[0][0], lone[0]) and torch.equal(latents[0][1], lone[0])
    assert torch.equal(latents[0][2], latents[0][3]) and not torch.equal(latents[0][0], latents[0][2])
    assert not torch.equal(latents[1][0], latents[1][1])
    # flow_grpo's recomputation from the trainer's own 128-token embeddings: on-policy.
    assert_on_policy(recompute_sd3(pipe, latents, embeds, 4.5, 0.7), log_probs)
    # The same generators again: the same rollout, bit for bit.
    again = pipeline_with_logprob(
        pipeline, **embeds, output_type="pt", generator=gens(7, 7, 8, 8), **TRAIN_SD3
    )
    assert all(torch.equal(a, b) for a, b in zip(again[1] + again[2], latents + log_probs, strict=True))
    assert pipeline.follower.pushes == 0  # the server already held the trainer's weights


def test_eval_call_noise_level_zero_is_the_stock_pipeline(served, tiny_model_path):
    """train_sd3's evaluation call (noise_level=0, return_dict=False) is the stock ODE, bit for bit."""
    from diffusion_rollout.client.served_pipeline import ServedPipeline

    pipe = trainer_pipeline(tiny_model_path("sd3"))
    pipeline = ServedPipeline(pipe, client_of(served("sd3")), sync_weights=False)
    embeds = train_sd3_embeddings(pipe, [PROMPTS[1]])
    images, _, log_probs = pipeline_with_logprob(
        pipeline, **embeds, num_images_per_prompt=2, output_type="pt", return_dict=False, generator=gens(3, 4),
        **{**TRAIN_SD3, "noise_level": 0},
    )  # fmt: skip
    assert all(torch.equal(lp, torch.zeros(2)) for lp in log_probs)
    rows = {k: v.repeat(2, *[1] * (v.ndim - 1)) for k, v in embeds.items()}
    settings = {k: v for k, v in TRAIN_SD3.items() if k != "noise_level"}
    stock = pipe(**rows, **settings, generator=gens(3, 4), output_type="pt").images
    assert torch.equal(images, stock)
    # deterministic=True (another flow_grpo version's evaluation switch) is the same ODE.
    det, *_ = pipeline_with_logprob(
        pipeline, **embeds, num_images_per_prompt=2, output_type="pt", generator=gens(3, 4), deterministic=True,
        **TRAIN_SD3,
    )  # fmt: skip
    assert torch.equal(det, stock)


def test_weights_follow_the_trainers_lora(fresh_server, tiny_model_path):
    from peft import LoraConfig

    from diffusion_rollout.client import lora_checksum
    from diffusion_rollout.client.served_pipeline import ServedPipeline

    server = fresh_server("sd3")
    pipe = trainer_pipeline(tiny_model_path("sd3"))
    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"]))
    client = client_of(server)
    pipeline = ServedPipeline(pipe, client)
    embeds = train_sd3_embeddings(pipe, PROMPTS)

    def step_and_sample(generator_seeds):
        _, latents, log_probs = pipeline_with_logprob(
            pipeline, **embeds, output_type="pt", generator=gens(*generator_seeds), **TRAIN_SD3
        )
        return latents, log_probs

    def optimizer_step(scale: float) -> None:  # an in-place update of the adapter, as AdamW's
        with torch.no_grad():
            for n, p in pipe.transformer.named_parameters():
                if "lora_B" in n:
                    p.add_(torch.randn_like(p) * scale)

    optimizer_step(0.3)
    latents, log_probs = step_and_sample([1, 2])
    assert pipeline.follower.pushes == 1
    adapters = client.lora_list()["modules"]["transformer"]
    assert adapters["active"] == "default"
    assert adapters["adapters"]["default"]["checksum"] == lora_checksum(pipe.transformer)
    assert_on_policy(recompute_sd3(pipe, latents, embeds, 4.5, 0.7), log_probs)

    step_and_sample([1, 2])
    assert pipeline.follower.pushes == 1  # unchanged adapter: no push

    optimizer_step(0.3)
    latents, log_probs = step_and_sample([3, 4])
    assert pipeline.follower.pushes == 2
    assert_on_policy(recompute_sd3(pipe, latents, embeds, 4.5, 0.7), log_probs)

    # sync_weights=False: the server keeps what it has, and the trainer's recomputation sees it.
    before = client.lora_list()["modules"]["transformer"]["adapters"]["default"]["checksum"]
    optimizer_step(0.3)
    unsynced = ServedPipeline(pipe, client, sync_weights=False)
    _, latents, log_probs = pipeline_with_logprob(
        unsynced, **embeds, output_type="pt", generator=gens(3, 4), **TRAIN_SD3
    )
    assert client.lora_list()["modules"]["transformer"]["adapters"]["default"]["checksum"] == before
    recomputed = recompute_sd3(pipe, latents, embeds, 4.5, 0.7)
    assert max(float((new - old).abs().max()) for new, old in zip(recomputed, log_probs, strict=True)) > 1e-4


def test_full_weights_follow_the_trainer(fresh_server, tiny_model_path):
    from diffusion_rollout.client.served_pipeline import ServedPipeline
    from diffusion_rollout.protocol.checksums import module_checksum

    server = fresh_server("sd3")
    pipe = trainer_pipeline(tiny_model_path("sd3"))
    pipeline = ServedPipeline(pipe, client_of(server))
    embeds = train_sd3_embeddings(pipe, PROMPTS)
    pipeline_with_logprob(pipeline, **embeds, output_type="pt", generator=gens(1, 2), **TRAIN_SD3)
    assert pipeline.follower.pushes == 0  # the same weights: compared once by checksum
    with torch.no_grad():
        pipe.transformer.proj_out.weight.add_(0.05)  # an optimizer step on the full weights
    _, latents, log_probs = pipeline_with_logprob(
        pipeline, **embeds, output_type="pt", generator=gens(1, 2), **TRAIN_SD3
    )
    assert pipeline.follower.pushes == 1
    assert module_checksum(server.engine.pipe.transformer) == module_checksum(pipe.transformer)
    assert_on_policy(recompute_sd3(pipe, latents, embeds, 4.5, 0.7), log_probs)
    pipeline_with_logprob(pipeline, **embeds, output_type="pt", generator=gens(1, 2), **TRAIN_SD3)
    assert pipeline.follower.pushes == 1  # unchanged since: no push


def test_a_bf16_server_still_hands_a_float32_trainer_float32(fresh_server, tiny_model_path):
    from diffusion_rollout.client.served_pipeline import ServedPipeline

    pipe = trainer_pipeline(tiny_model_path("sd3"))
    pipeline = ServedPipeline(pipe, client_of(fresh_server("sd3", dtype="bfloat16")), sync_weights=False)
    embeds = train_sd3_embeddings(pipe, PROMPTS)
    images, latents, log_probs, outs = pipeline_with_logprob(
        pipeline, **embeds, output_type="pt", generator=gens(1, 2), return_outputs=True, **TRAIN_SD3
    )
    assert outs[0].dit_trajectory.latents.dtype == torch.bfloat16  # what the server kept
    assert images.dtype == torch.float32
    assert all(x.dtype == torch.float32 for x in latents + log_probs)
    assert torch.equal(latents[1][0], outs[0].dit_trajectory.latents[1].float())  # exact values


# FLUX: train_flux passes prompt_embeds and pooled_prompt_embeds (no negatives) and the distilled guidance.
TRAIN_FLUX = {"num_inference_steps": 4, "guidance_scale": 3.5, "height": 32, "width": 32, "noise_level": 0.7}


def test_train_flux_call_runs_unchanged_through_the_served_pipeline(served, tiny_model_path):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from diffusion_rollout.client.flow_grpo_flux import pipeline_with_logprob as flux_with_logprob
    from diffusion_rollout.client.served_pipeline import ServedPipeline
    from diffusion_rollout.scheduler_mixins import transition

    pipe = trainer_pipeline(tiny_model_path("flux"))
    pipeline = ServedPipeline(pipe, client_of(served("flux")))
    pe, ppe, text_ids = pipe.encode_prompt(PROMPTS, None, max_sequence_length=24)
    images, latents, log_probs = flux_with_logprob(
        pipeline,
        prompt_embeds=pe,
        pooled_prompt_embeds=ppe,
        output_type="pt",
        generator=gens(5, 6),
        **TRAIN_FLUX,
    )
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert len(latents) == 5 and all(x.shape == (2, 16, 64) and x.dtype == torch.float32 for x in latents)
    assert len(log_probs) == 4 and all(lp.shape == (2,) and lp.dtype == torch.float32 for lp in log_probs)
    # The trainer's scheduler: FLUX's own schedule (its sigmas, shifted by the image's mu).
    sched = pipeline.scheduler
    stock = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_model_path("flux"), subfolder="scheduler")
    c = stock.config
    tokens = 16  # image tokens of a 32x32 image
    mu = calculate_shift(tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    stock.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4), mu=mu)  # as FluxPipeline (and flow_grpo) set it
    assert torch.equal(sched.sigmas, stock.sigmas) and torch.equal(sched.timesteps, stock.timesteps)

    # train_flux's recomputation: the trainer's transformer on its own embeddings and ids.
    img_ids = pipe._prepare_latent_image_ids(2, 4, 4, "cpu", torch.float32)
    guidance = torch.full([2], 3.5)
    for j, t in enumerate(sched.timesteps):
        with torch.no_grad():
            v = pipe.transformer(
                hidden_states=latents[j], timestep=t.expand(2) / 1000, guidance=guidance, pooled_projections=ppe,
                encoder_hidden_states=pe, txt_ids=text_ids, img_ids=img_ids, return_dict=False,
            )[0]  # fmt: skip
        step = transition(
            "sde", latents[j], v, sched.sigmas[j], sched.sigmas[j + 1], eta=0.7, sigma_max=sched.sigmas[1],
            next_sample=latents[j + 1],
        )  # fmt: skip
        assert_on_policy([step.log_prob], [log_probs[j]])


def test_rows_with_one_conditioning_travel_once_and_repeated_seeds_share_x_t():
    from diffusion_rollout.client.flow_grpo_seeds import plan_requests, step_seed

    # train_sd3's batch: each prompt repeated over its group, same_latent seeds, in any order.
    plan = plan_requests(["a", "b", "a", "b"], [7, 8, 7, 8], 1)
    assert plan == [
        (
            0,
            {
                "initial_noise_seed": 7,
                "seeds": [step_seed(7, 0), step_seed(7, 1)],
                "num_outputs_per_prompt": 2,
            },
            [0, 2],
        ),
        (
            1,
            {
                "initial_noise_seed": 8,
                "seeds": [step_seed(8, 0), step_seed(8, 1)],
                "num_outputs_per_prompt": 2,
            },
            [1, 3],
        ),
    ]
    assert len({step_seed(7, 0), step_seed(7, 1), step_seed(8, 0)}) == 3
    # Distinct seeds: one request per conditioning, each output its own seed.
    assert plan_requests(["a", "a"], [1, 2, 3, 4], 2) == [
        (0, {"seeds": [1, 2, 3, 4], "num_outputs_per_prompt": 4}, [0, 1, 2, 3])
    ]
    assert plan_requests(["a", "a"], None, 1) == [(0, {"num_outputs_per_prompt": 2}, [0, 1])]
    # One seed over two prompts, or a group that mixes seeds: an image per request, x_T still shared.
    split = plan_requests(["a", "b"], [5, 5], 1)
    assert [p[1]["initial_noise_seed"] for p in split] == [5, 5] and [p[2] for p in split] == [[0], [1]]
    assert split[0][1]["seeds"] != split[1][1]["seeds"]
    mixed = plan_requests(["a", "a", "a"], [1, 1, 2], 1)
    assert [p[1].get("initial_noise_seed") for p in mixed] == [1, 1, None] and mixed[2][1]["seeds"] == [2]


def test_served_pipeline_forwards_attributes_and_refuses_a_local_call(served, tiny_model_path):
    import copy

    from diffusion_rollout.client.served_pipeline import ServedPipeline

    pipe = trainer_pipeline(tiny_model_path("sd3"))
    pipeline = ServedPipeline(pipe, client_of(served("sd3")))
    pipeline.custom_flag = 3  # written through to the trainer's pipeline, as flow_grpo's script would
    assert pipe.custom_flag == 3 and pipeline.vae is pipe.vae
    assert copy.copy(pipeline).pipeline is pipe
    with pytest.raises(TypeError, match="pipeline_with_logprob"):
        pipeline(prompt="a cat")
    with pytest.raises(TypeError, match="already a ServedPipeline"):
        ServedPipeline(pipeline, pipeline.client)
