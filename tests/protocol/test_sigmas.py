"""Custom schedules (validation, exact use) and the flow_shift schedule."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from diffusion_rollout.errors import RequestError
from diffusion_rollout.scheduler_mixins import (
    RolloutFlowMatchEulerScheduler,
    RolloutSettings,
    RolloutState,
    flow_shift_sigmas,
    rollout_context,
    shift_sigmas,
    validate_sigmas,
)


def test_a_valid_schedule_comes_back_as_floats():
    values = validate_sigmas([1, 0.5, np.float32(0.25)], 3)
    assert values == [1.0, 0.5, 0.25]
    assert all(type(value) is float for value in values)


@pytest.mark.parametrize(
    ("sigmas", "num_steps", "rule"),
    [
        ([1.0, 0.5], 3, "one value per inference step"),
        ([1.0, 0.5, 0.25, 0.1], 3, "one value per inference step"),
        ([], None, "at least one value"),
        ([1.0, math.nan, 0.1], 3, "finite"),
        ([math.inf, 0.5, 0.1], 3, "finite"),
        ([1.0, 0.5, 0.0], 3, "(0, 1]"),
        ([1.0, 0.5, -0.1], 3, "(0, 1]"),
        ([1.2, 0.5, 0.1], 3, "(0, 1]"),
        ([1.0, 0.5, 0.5], 3, "strictly decreasing"),
        ([0.5, 0.7, 0.1], 3, "strictly decreasing"),
        ([1.0, 0.5, 1e-50], 3, "rounds to 0"),
        ([1.0, 1.0 - 1e-12, 0.5], 3, "same float32 value"),
        ([1.0, "0.5", 0.1], 3, "not a number"),
        ([1.0, True, 0.1], 3, "not a number"),
        ("1.0", 1, "list of numbers"),
    ],
)
def test_invalid_schedules_name_the_rule(sigmas, num_steps, rule):
    with pytest.raises(RequestError) as error:
        validate_sigmas(sigmas, num_steps)
    assert error.value.field == "sigmas"
    assert rule in error.value.message


def test_the_state_validates_its_schedule():
    with pytest.raises(RequestError) as error:
        RolloutState(RolloutSettings(), None, sigmas=[0.5, 0.6])
    assert error.value.field == "sigmas"


def test_flow_shift_is_the_shift_formula_on_the_linear_schedule():
    for steps in (1, 4, 28):
        linear = np.linspace(1.0, 1.0 / steps, steps)
        assert flow_shift_sigmas(steps, 1.0) == linear.tolist()
        for shift in (0.5, 3.0, 7.0):
            expected = [shift * s / (1 + (shift - 1) * s) for s in linear]
            assert flow_shift_sigmas(steps, shift) == pytest.approx(expected, rel=1e-15)
            validate_sigmas(flow_shift_sigmas(steps, shift), steps)
    assert flow_shift_sigmas(1, 3.0) == [1.0]
    assert shift_sigmas([0.5], 3.0) == [0.75]


def test_flow_shift_agrees_with_diffusers_static_shift():
    """diffusers' scheduler with shift S, given the pipelines' linear sigmas, shifts them the same way
    (in float32 numpy, hence the float32 tolerance)."""
    steps, shift = 10, 3.0
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / steps, steps).tolist())
    ours = torch.tensor(flow_shift_sigmas(steps, shift), dtype=torch.float32)
    torch.testing.assert_close(scheduler.sigmas[:-1], ours, rtol=1e-6, atol=0)


@pytest.mark.parametrize("shift", [0.0, -1.0, math.nan, math.inf, "3"])
def test_flow_shift_rejects_bad_shifts(shift):
    with pytest.raises(RequestError) as error:
        flow_shift_sigmas(4, shift)
    assert error.value.field == "flow_shift"


def test_flow_shift_rejects_bad_step_counts():
    with pytest.raises(RequestError) as error:
        flow_shift_sigmas(0, 3.0)
    assert error.value.field == "num_inference_steps"


def test_a_flow_shift_schedule_is_used_exactly_on_a_dynamic_shifting_model():
    sigmas = flow_shift_sigmas(5, 2.5)
    scheduler = RolloutFlowMatchEulerScheduler(shift=3.0, use_dynamic_shifting=True)
    with rollout_context(RolloutState(RolloutSettings(), None, sigmas=sigmas)):
        scheduler.set_timesteps(num_inference_steps=5, sigmas=np.linspace(1.0, 0.2, 5).tolist(), mu=1.1)
    assert torch.equal(scheduler.sigmas, torch.tensor([*sigmas, 0.0], dtype=torch.float32))
    assert scheduler.num_inference_steps == 5
