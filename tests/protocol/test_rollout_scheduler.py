"""The rollout scheduler driven by hand with a toy model: stock equality, step selection, RNG,
recordings, replay, exact schedules.

The toy "model" is elementwise, so sample ``i``'s velocity depends on sample ``i`` only; it stands
in for a transformer whose output for one sample does not depend on the rest of the batch.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from diffusion_rollout.errors import RequestError
from diffusion_rollout.scheduler_mixins import (
    RolloutFlowMatchEulerScheduler,
    RolloutSettings,
    RolloutState,
    active_rollout_state,
    rollout_context,
    transition,
)

LATENT_SHAPE = (4, 6, 6)
STEPS = 6

SHIFT_CONFIG = {"shift": 3.0}
FLUX_CONFIG = {
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
TERMINAL_CONFIG = {"shift": 5.0, "shift_terminal": 0.1}


def pipeline_timestep_kwargs(config: dict, steps: int = STEPS) -> dict:
    """What a diffusers pipeline hands to set_timesteps for this scheduler config."""
    if config.get("use_dynamic_shifting"):
        return {"sigmas": np.linspace(1.0, 1 / steps, steps).tolist(), "mu": 0.93}
    return {"num_inference_steps": steps}


def toy_velocity(latents: torch.Tensor) -> torch.Tensor:
    x = latents.float()
    return (torch.tanh(1.3 * x) - 0.7 * x + 0.1).to(latents.dtype)


def initial_latents(seeds: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Generator]]:
    """x_T drawn as a diffusers pipeline does with a list of generators, which then drive the steps."""
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    latents = randn_tensor((len(seeds), *LATENT_SHAPE), generator=generators, dtype=torch.float32).to(dtype)
    return latents, generators


def denoise(scheduler, latents, *, timestep_kwargs: dict, begin_index: int | None = None, between_steps=None):
    """The denoising loop of a flow pipeline. Returns the final latent and the per-step outputs."""
    scheduler.set_timesteps(**timestep_kwargs)
    timesteps = scheduler.timesteps
    if begin_index is not None:
        scheduler.set_begin_index(begin_index)
        timesteps = timesteps[begin_index:]
    outputs = []
    for loop_index, timestep in enumerate(timesteps):
        if between_steps is not None:
            between_steps(loop_index, "before")
        latents = scheduler.step(toy_velocity(latents), timestep, latents, return_dict=False)[0]
        outputs.append(latents)
        if between_steps is not None:
            between_steps(loop_index, "after")
    return latents, outputs


def rollout(
    settings: RolloutSettings,
    seeds=(0, 1),
    dtype=torch.float32,
    config: dict | None = None,
    sigmas=None,
    timestep_kwargs=None,
    **kwargs,
):
    config = SHIFT_CONFIG if config is None else config
    scheduler = RolloutFlowMatchEulerScheduler.from_config(FlowMatchEulerDiscreteScheduler(**config).config)
    latents, generators = initial_latents(list(seeds), dtype)
    state = RolloutState(settings, generators, sigmas=sigmas)
    with rollout_context(state):
        final, outputs = denoise(
            scheduler, latents, timestep_kwargs=timestep_kwargs or pipeline_timestep_kwargs(config), **kwargs
        )
    return state, final, outputs, generators, scheduler


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", [SHIFT_CONFIG, FLUX_CONFIG], ids=["shift3", "flux_dynamic"])
def test_without_rollout_the_mixin_is_the_stock_scheduler(config, dtype):
    stock = FlowMatchEulerDiscreteScheduler(**config)
    ours = RolloutFlowMatchEulerScheduler.from_config(stock.config)
    assert isinstance(ours, FlowMatchEulerDiscreteScheduler)
    latents, _ = initial_latents([3, 4], dtype)
    kwargs = pipeline_timestep_kwargs(config)
    expected_final, expected = denoise(stock, latents, timestep_kwargs=kwargs)
    for bound in (None, RolloutState(RolloutSettings(record=False), None)):
        with rollout_context(bound):
            final, outputs = denoise(ours, latents, timestep_kwargs=kwargs)
        assert torch.equal(ours.timesteps, stock.timesteps)
        assert torch.equal(ours.sigmas, stock.sigmas)
        for got, want in zip(outputs, expected, strict=True):
            assert torch.equal(got, want)
        assert torch.equal(final, expected_final)
    # record=False still counts the loop, and records nothing.
    assert bound.finished and bound.num_steps == STEPS and bound.log_probs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "settings",
    [
        RolloutSettings(kind="sde", sde_step_indices=(), log_prob_form="no_const"),
        RolloutSettings(kind="ode", log_prob_form="no_const", debug=True),
        RolloutSettings(kind="cps", sde_step_indices=[], log_prob_form="scaled"),
    ],
    ids=["empty_indices", "ode_kind", "cps_empty_scaled"],
)
def test_rollout_with_every_step_ode_is_the_stock_scheduler(settings, dtype):
    stock = FlowMatchEulerDiscreteScheduler(**FLUX_CONFIG)
    latents, _ = initial_latents([5, 6], dtype)
    expected_final, expected = denoise(stock, latents, timestep_kwargs=pipeline_timestep_kwargs(FLUX_CONFIG))
    state, final, outputs, generators, _ = rollout(settings, seeds=(5, 6), dtype=dtype, config=FLUX_CONFIG)
    assert torch.equal(final, expected_final)
    for got, want in zip(outputs, expected, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(state.log_probs, torch.zeros(2, STEPS))
    assert state.sde_step_indices == []
    # x_T was drawn from each generator; no step drew anything after that.
    after_initial = initial_latents([5, 6], dtype)[1]
    for generator, reference in zip(generators, after_initial, strict=True):
        assert torch.equal(generator.get_state(), reference.get_state())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("kind", "form"),
    [("sde", "gaussian"), ("sde", "no_const"), ("dance", "scaled"), ("cps", "gaussian"), ("cps", "no_const")],
)
def test_replaying_recorded_steps_reproduces_the_log_probs_bit_for_bit(kind, form, dtype):
    # cps with a density form must leave out the last step (std = 0 there); keep a gap too.
    indices = (0, 1, 3, 4) if (kind == "cps" and form != "no_const") else None
    settings = RolloutSettings(kind=kind, eta=0.8, log_prob_form=form, sde_step_indices=indices, debug=True)
    state, final, outputs, _, _ = rollout(settings, dtype=dtype)
    sigmas = state.sigmas.tolist()  # as a client decodes the response
    trajectory = state.trajectory_latents
    assert trajectory.dtype == dtype
    assert torch.equal(trajectory[:, -1], final)
    for step in range(STEPS):
        step_kind = settings.kind_at(step, STEPS)
        for model_output in (state.model_outputs[:, step], toy_velocity(trajectory[:, step])):
            replay = transition(
                step_kind,
                trajectory[:, step],
                model_output,
                sigmas[step],
                sigmas[step + 1],
                eta=settings.eta,
                sigma_max=sigmas[1],
                next_sample=trajectory[:, step + 1],
                log_prob_form=form,
            )
            assert torch.equal(replay.log_prob, state.log_probs[:, step])
            assert torch.equal(replay.mean, state.prev_sample_means[:, step])
        assert torch.equal(replay.std.reshape(1), state.noise_std_devs[step])
        # The recorded noise is the eps of the step: x' = (mu + std * eps) stored.
        stored = (
            state.prev_sample_means[:, step] + state.noise_std_devs[step] * state.variance_noises[:, step]
        )
        assert torch.equal(stored.to(dtype), trajectory[:, step + 1])
        assert torch.equal(trajectory[:, step + 1], outputs[step])
    # Stochastic steps with noise have a nonzero log-prob (cps has std = 0 at the last step).
    noisy = [step for step in range(STEPS) if state.noise_std_devs[step].item() > 0]
    assert noisy == [step for step in range(STEPS) if settings.kind_at(step, STEPS) != "ode"][: len(noisy)]
    assert len(noisy) >= 4 and (state.log_probs[:, noisy] != 0).all()


def test_ode_steps_draw_no_noise_and_contribute_zero():
    sde_steps = (1, 4, 5)  # non-contiguous
    settings = RolloutSettings(kind="sde", sde_step_indices=sde_steps, debug=True)
    latents, generators = initial_latents([21, 22, 23], torch.float32)
    state = RolloutState(settings, generators)
    scheduler = RolloutFlowMatchEulerScheduler(**SHIFT_CONFIG)
    before: list[torch.Tensor] = []

    def check(loop_index, moment):
        states = [generator.get_state() for generator in generators]
        if moment == "before":
            before[:] = states
            return
        changed = [not torch.equal(a, b) for a, b in zip(before, states, strict=True)]
        assert changed == [loop_index in sde_steps] * 3

    with rollout_context(state):
        denoise(scheduler, latents, timestep_kwargs={"num_inference_steps": 7}, between_steps=check)

    assert state.sde_step_indices == list(sde_steps)
    ode_steps = [step for step in range(7) if step not in sde_steps]
    assert torch.equal(state.log_probs[:, ode_steps], torch.zeros(3, len(ode_steps)))
    assert (state.log_probs[:, list(sde_steps)] != 0).all()
    assert torch.equal(state.variance_noises[:, ode_steps], torch.zeros(3, len(ode_steps), *LATENT_SHAPE))
    assert torch.equal(state.noise_std_devs[ode_steps], torch.zeros(len(ode_steps), 1))
    # RNG order: after x_T, each generator drew exactly one [1, *latent] float32 eps per stochastic step.
    _, replayed = initial_latents([21, 22, 23], torch.float32)
    for sample, generator in enumerate(replayed):
        for step in sde_steps:
            eps = torch.randn((1, *LATENT_SHAPE), generator=generator, dtype=torch.float32)
            assert torch.equal(state.variance_noises[sample, step], eps[0])
        assert torch.equal(generator.get_state(), generators[sample].get_state())


def test_trajectory_keeps_all_entries_by_default_and_the_listed_ones_otherwise():
    full, _, outputs, _, _ = rollout(RolloutSettings(), seeds=(8, 9))
    latents, _ = initial_latents([8, 9], torch.float32)
    assert full.latent_step_indices == list(range(STEPS + 1))
    assert full.trajectory_latents.shape == (2, STEPS + 1, *LATENT_SHAPE)
    entering = [latents, *outputs]
    for index in range(STEPS + 1):
        assert torch.equal(full.trajectory_latents[:, index], entering[index])

    kept = (STEPS, 0, 3)  # any order; stored in trajectory order
    part, *_ = rollout(RolloutSettings(return_step_indices=kept), seeds=(8, 9))
    assert part.latent_step_indices == [0, 3, STEPS]
    assert torch.equal(part.trajectory_latents, full.trajectory_latents[:, [0, 3, STEPS]])
    # Log-probs, timesteps and sigmas are never filtered.
    assert torch.equal(part.log_probs, full.log_probs)
    assert torch.equal(part.timesteps, full.timesteps) and torch.equal(part.sigmas, full.sigmas)

    none, *_ = rollout(RolloutSettings(return_step_indices=()), seeds=(8, 9))
    assert none.latent_step_indices == [] and none.trajectory_latents.shape == (2, 0, *LATENT_SHAPE)


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_a_sample_depends_only_on_its_own_generator(kind):
    settings = RolloutSettings(kind=kind, log_prob_form="no_const", debug=True)
    batch, *_ = rollout(settings, seeds=(40, 41, 42, 43), dtype=torch.bfloat16)
    alone, *_ = rollout(settings, seeds=(42,), dtype=torch.bfloat16)
    in_batch, single = batch.per_sample(2), alone.per_sample(0)
    assert in_batch.keys() == single.keys()
    for key, value in single.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(in_batch[key], value), key
        else:
            assert in_batch[key] == value, key
    assert not torch.equal(batch.per_sample(1)["log_probs"], single["log_probs"])


def test_recordings_layout_and_per_sample_views():
    settings = RolloutSettings(kind="dance", sde_step_indices=(0, 2), return_step_indices=(0, 1), debug=True)
    state, *_ = rollout(settings, seeds=(1, 2, 3), dtype=torch.bfloat16)
    assert state.finished and state.num_steps == STEPS and state.step_offset == 0
    assert state.log_probs.shape == (3, STEPS) and state.log_probs.dtype == torch.float32
    assert state.trajectory_latents.shape == (3, 2, *LATENT_SHAPE)
    assert state.timesteps.shape == (STEPS + 1,) and state.timesteps.dtype == torch.float32
    assert state.timesteps[-1].item() == 0.0 and state.sigmas[-1].item() == 0.0
    assert state.variance_noises.shape == (3, STEPS, *LATENT_SHAPE)
    assert state.variance_noises.dtype == torch.float32
    assert state.prev_sample_means.dtype == torch.float32
    assert state.noise_std_devs.shape == (STEPS, 1)
    assert state.model_outputs.shape == (3, STEPS, *LATENT_SHAPE)
    assert state.model_outputs.dtype == torch.bfloat16
    view = state.per_sample(1)
    assert view["log_probs"].shape == (STEPS,)
    assert view["trajectory_latents"].shape == (2, *LATENT_SHAPE)
    assert view["variance_noises"].shape == (STEPS, *LATENT_SHAPE)
    assert view["noise_std_devs"].shape == (STEPS, 1)
    assert view["sde_step_indices"] == [0, 2] and view["latent_step_indices"] == [0, 1]
    assert view["log_probs"].data_ptr() == state.log_probs[1].data_ptr()  # a view, not a copy
    with pytest.raises(IndexError):
        state.per_sample(3)

    plain, *_ = rollout(RolloutSettings(), seeds=(1,))
    assert set(plain.per_sample(0)) == {
        "log_probs",
        "trajectory_latents",
        "latent_step_indices",
        "timesteps",
        "sigmas",
        "sde_step_indices",
    }
    assert plain.variance_noises is None


@pytest.mark.parametrize(
    "config", [SHIFT_CONFIG, FLUX_CONFIG, TERMINAL_CONFIG], ids=["shift3", "flux_dynamic", "shift_terminal"]
)
def test_custom_sigmas_are_used_exactly_as_given(config):
    given = [0.97, 0.8, 0.61, 0.4, 0.23, 0.05]
    state, _, _, _, scheduler = rollout(RolloutSettings(), config=config, sigmas=given)
    expected_sigmas = torch.tensor([*given, 0.0], dtype=torch.float32)
    assert torch.equal(scheduler.sigmas, expected_sigmas)
    assert torch.equal(state.sigmas, expected_sigmas)
    # Timesteps exactly as diffusers computes them for shift 1 without dynamic shifting.
    plain = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False, shift_terminal=None)
    plain.set_timesteps(sigmas=given)
    assert torch.equal(scheduler.timesteps, plain.timesteps)
    assert torch.equal(plain.sigmas, expected_sigmas)
    assert torch.equal(state.timesteps, torch.cat([plain.timesteps, torch.zeros(1)]))
    # The same scheduler without a state is stock again.
    stock = FlowMatchEulerDiscreteScheduler(**config)
    stock.set_timesteps(**pipeline_timestep_kwargs(config))
    scheduler.set_timesteps(**pipeline_timestep_kwargs(config))
    assert torch.equal(scheduler.sigmas, stock.sigmas)
    assert not torch.equal(stock.sigmas, expected_sigmas)


def test_exact_sigmas_with_plain_generation_run_the_stock_step():
    given = [1.0, 0.7, 0.45, 0.2]
    reference = FlowMatchEulerDiscreteScheduler(shift=1.0)
    latents, _ = initial_latents([2], torch.bfloat16)
    expected, _ = denoise(reference, latents, timestep_kwargs={"sigmas": given})
    state, final, *_ = rollout(RolloutSettings(record=False), seeds=(2,), dtype=torch.bfloat16, sigmas=given)
    assert torch.equal(final, expected)
    assert state.finished and state.log_probs is None
    with pytest.raises(RuntimeError, match="record is False"):
        state.per_sample(0)


def test_sigma_max_is_the_second_sigma_of_the_schedule():
    eta = 0.6
    settings = RolloutSettings(kind="sde", eta=eta, debug=True)
    state, *_ = rollout(settings, sigmas=[1.0, 0.75, 0.5, 0.25])
    assert state.sigma_max.item() == 0.75
    # First step, s = 1: g = eta * sqrt(1 / (1 - 0.75)) = 2 eta, std = g * sqrt(0.25) = eta.
    assert state.noise_std_devs[0].item() == pytest.approx(eta, rel=1e-6)
    assert torch.isfinite(state.log_probs).all()


def test_the_loop_index_starts_at_the_first_step_that_runs():
    """Image-to-image starts part-way: the scheduler's step index starts at 3, the loop index at 0."""
    settings = RolloutSettings(sde_step_indices=(0,), debug=True)
    state, _, outputs, _, scheduler = rollout(
        settings, timestep_kwargs={"num_inference_steps": 8}, begin_index=3
    )
    assert state.step_offset == 3 and state.num_steps == 5 and len(outputs) == 5
    assert state.log_probs.shape == (2, 5)
    assert (state.log_probs[:, 0] != 0).all() and (state.log_probs[:, 1:] == 0).all()
    assert torch.equal(state.sigmas, scheduler.sigmas[3:])
    assert torch.equal(state.timesteps[:5], scheduler.timesteps[3:])
    assert state.trajectory_latents.shape[1] == 6


def test_invalid_settings_are_rejected_at_the_first_step():
    settings = RolloutSettings(sde_step_indices=(9,))
    with pytest.raises(RequestError) as error:
        rollout(settings)
    assert error.value.field == "rollout_sde_step_indices"


def test_unsupported_scheduler_configs_fail_clearly_in_rollout_mode():
    latents, generators = initial_latents([0], torch.float32)
    stochastic = RolloutFlowMatchEulerScheduler(stochastic_sampling=True)
    stochastic.set_timesteps(4)
    with (
        rollout_context(RolloutState(RolloutSettings(), generators)),
        pytest.raises(ValueError, match="stochastic_sampling"),
    ):
        stochastic.step(toy_velocity(latents), stochastic.timesteps[0], latents)
    stochastic.set_timesteps(4)
    stochastic.step(toy_velocity(latents), stochastic.timesteps[0], latents)  # stock without a rollout

    scheduler = RolloutFlowMatchEulerScheduler()
    scheduler.set_timesteps(4)
    per_token = torch.full(latents.shape[:2], 900.0)
    with (
        rollout_context(RolloutState(RolloutSettings(), generators)),
        pytest.raises(ValueError, match="per_token_timesteps"),
    ):
        scheduler.step(toy_velocity(latents), scheduler.timesteps[0], latents, per_token_timesteps=per_token)


def test_generator_count_must_match_the_batch():
    latents, generators = initial_latents([0, 1], torch.float32)
    scheduler = RolloutFlowMatchEulerScheduler()
    scheduler.set_timesteps(3)
    with (
        rollout_context(RolloutState(RolloutSettings(), generators[:1])),
        pytest.raises(ValueError, match="one generator per sample"),
    ):
        scheduler.step(toy_velocity(latents), scheduler.timesteps[0], latents)


def test_a_state_records_one_loop():
    state, final, _, _, scheduler = rollout(RolloutSettings())
    scheduler.set_timesteps(STEPS)
    with rollout_context(state), pytest.raises(RuntimeError, match="one per pipeline call"):
        scheduler.step(toy_velocity(final), scheduler.timesteps[0], final)


def test_the_bound_state_is_per_context_and_per_thread():
    state = RolloutState(RolloutSettings(), None)
    seen_in_thread: list = []
    with rollout_context(state):
        assert active_rollout_state() is state
        with rollout_context(None):
            assert active_rollout_state() is None
        assert active_rollout_state() is state
        worker = threading.Thread(target=lambda: seen_in_thread.append(active_rollout_state()))
        worker.start()
        worker.join()
    assert seen_in_thread == [None]
    assert active_rollout_state() is None
    with pytest.raises(KeyError), rollout_context(state):
        raise KeyError("boom")
    assert active_rollout_state() is None


def test_concurrent_rollouts_in_threads_do_not_mix():
    settings = RolloutSettings(kind="sde", debug=False)
    expected = {seed: rollout(settings, seeds=(seed,))[0].log_probs for seed in (60, 61, 62, 63)}
    results: dict[int, torch.Tensor] = {}
    barrier = threading.Barrier(4)

    def work(seed):
        barrier.wait()
        results[seed] = rollout(settings, seeds=(seed,))[0].log_probs

    threads = [threading.Thread(target=work, args=(seed,)) for seed in expected]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for seed, log_probs in expected.items():
        assert torch.equal(results[seed], log_probs)


def test_a_state_bound_after_set_timesteps_cannot_silently_drop_its_sigmas():
    latents, generators = initial_latents([0], torch.float32)
    scheduler = RolloutFlowMatchEulerScheduler(shift=3.0)
    scheduler.set_timesteps(4)  # the pipeline's own schedule, set outside the context
    state = RolloutState(RolloutSettings(), generators, sigmas=[1.0, 0.6, 0.3, 0.1])
    with rollout_context(state), pytest.raises(RuntimeError, match="before the pipeline calls set_timesteps"):
        scheduler.step(toy_velocity(latents), scheduler.timesteps[0], latents)
