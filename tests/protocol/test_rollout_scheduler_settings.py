"""RolloutSettings: step selection and the request errors of docs/math.md, each naming its HTTP field."""

from __future__ import annotations

import math

import pytest

from diffusion_rollout.errors import RequestError
from diffusion_rollout.scheduler_mixins import RolloutSettings

T = 6


@pytest.mark.parametrize(
    ("settings", "field", "words"),
    [
        (RolloutSettings(sde_step_indices=(0, T)), "rollout_sde_step_indices", "0..5"),
        (RolloutSettings(sde_step_indices=(-1,)), "rollout_sde_step_indices", "0..5"),
        (RolloutSettings(sde_step_indices=(2, 3, 2)), "rollout_sde_step_indices", "more than once"),
        (RolloutSettings(sde_step_indices=(1.0,)), "rollout_sde_step_indices", "integers"),
        (RolloutSettings(sde_step_indices=(True,)), "rollout_sde_step_indices", "integers"),
        (RolloutSettings(sde_step_indices=3), "rollout_sde_step_indices", "list of integers"),
        (RolloutSettings(return_step_indices=(T + 1,)), "rollout_return_step_indices", "0..6"),
        (RolloutSettings(return_step_indices=(0, 0)), "rollout_return_step_indices", "more than once"),
        (RolloutSettings(kind="ode"), "rollout_log_prob_no_const", "rollout_log_prob_no_const=true"),
        (RolloutSettings(sde_step_indices=()), "rollout_log_prob_no_const", "rollout_log_prob_no_const=true"),
        (RolloutSettings(eta=0.0), "rollout_noise_level", "divides"),
        (RolloutSettings(eta=0, log_prob_form="scaled"), "rollout_noise_level", "divides"),
        (RolloutSettings(eta=-0.1, log_prob_form="no_const"), "rollout_noise_level", ">= 0"),
        (RolloutSettings(eta=math.nan, log_prob_form="no_const"), "rollout_noise_level", "finite"),
        (RolloutSettings(eta=math.inf), "rollout_noise_level", "finite"),
        # cps's last step runs as ODE (std 0): with only that step asked for, none is stochastic.
        (
            RolloutSettings(kind="cps", sde_step_indices=(T - 1,)),
            "rollout_log_prob_no_const",
            "cps's last step",
        ),
        (RolloutSettings(kind="cps", eta=2.0, sde_step_indices=(0,)), "rollout_noise_level", "not positive"),
        (RolloutSettings(kind="flow_grpo"), "rollout_sde_type", "one of"),
        (RolloutSettings(log_prob_form="exact"), "rollout_log_prob_form", "one of"),
    ],
)
def test_validation_errors_name_the_field(settings, field, words):
    with pytest.raises(RequestError) as error:
        settings.validate(T)
    assert error.value.field == field
    assert error.value.status_code == 400
    assert field in error.value.message
    assert words in error.value.message


@pytest.mark.parametrize(
    "settings",
    [
        RolloutSettings(),
        RolloutSettings(kind="dance", eta=1.5, log_prob_form="scaled", sde_step_indices=(T - 1, 0)),
        RolloutSettings(kind="ode", log_prob_form="no_const"),
        RolloutSettings(kind="ode", log_prob_form="scaled"),  # every step contributes 0, nothing divides
        RolloutSettings(sde_step_indices=[], log_prob_form="no_const"),
        RolloutSettings(eta=0.0, log_prob_form="no_const"),
        RolloutSettings(kind="cps", log_prob_form="no_const"),
        RolloutSettings(kind="cps", sde_step_indices=tuple(range(T - 1))),
        RolloutSettings(kind="cps"),  # SGLang's default form: the last step runs as ODE
        RolloutSettings(kind="cps", log_prob_form="scaled", sde_step_indices=(0, T - 1)),
        RolloutSettings(return_step_indices=(T, 0)),
        RolloutSettings(record=False, kind="nonsense", eta=-1.0, sde_step_indices=(99,)),  # unused fields
    ],
)
def test_valid_settings_pass(settings):
    settings.validate(T)


def test_schedule_checks():
    with pytest.raises(RequestError) as error:
        RolloutSettings().validate(0)
    assert error.value.field == "num_inference_steps"
    with pytest.raises(RequestError) as error:
        RolloutSettings().validate(3, sigmas=[1.0, 0.5])
    assert error.value.field == "sigmas"
    RolloutSettings().validate(2, sigmas=[1.0, 0.5])
    # The schedule is checked for plain generation too.
    with pytest.raises(RequestError):
        RolloutSettings(record=False).validate(2, sigmas=[0.5, 1.0])


def test_step_selection():
    everything = RolloutSettings(kind="cps")
    # cps's last step has noise std 0 (s' = 0): deterministic, run and scored as ODE.
    assert [everything.kind_at(i, 3) for i in range(3)] == ["cps", "cps", "ode"]
    assert everything.stochastic_steps(3) == [0, 1]
    assert RolloutSettings(kind="sde").stochastic_steps(3) == [0, 1, 2]
    window = RolloutSettings(kind="dance", sde_step_indices=[4, 1])
    assert window.sde_step_indices == (4, 1)  # lists from JSON become tuples
    assert window.stochastic_steps(6) == [1, 4]
    assert window.kind_at(1, 6) == "dance" and window.kind_at(2, 6) == "ode"
    assert RolloutSettings(sde_step_indices=[]).stochastic_steps(6) == []
    assert RolloutSettings(kind="ode", sde_step_indices=(1,)).stochastic_steps(6) == []
    assert RolloutSettings().kept_trajectory_indices(3) == [0, 1, 2, 3]
    assert RolloutSettings(return_step_indices=[3, 1]).kept_trajectory_indices(3) == [1, 3]
    hash(window)  # frozen: shareable by the requests of a batch


def test_defaults():
    settings = RolloutSettings()
    assert (settings.kind, settings.eta, settings.log_prob_form) == ("sde", 0.7, "gaussian")
    assert settings.sde_step_indices is None and settings.return_step_indices is None
    assert settings.record is True and settings.debug is False
