"""Cheaper ODE steps outside the SDE window (scheduler_mixins/outside_window.py):
the kept schedule, the window's sigmas and log-probs unchanged in meaning, DPM-Solver++(2M) against
diffusers' own implementation, the recipe's first-step ratio exactly 1, and what the options refuse."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from diffusion_rollout.scheduler_mixins.outside_window import coarse_keep, dpm2m_next

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BODY = {
    "prompt": "a red square",
    "seed": 5,
    "initial_noise_seed": 9,
    "num_outputs_per_prompt": 2,
    "num_inference_steps": 10,
    "rollout_sde_step_indices": [3, 4],
    "rollout_return_dit_trajectory": True,
    "rollout_debug_mode": False,
}


def test_the_kept_schedule_keeps_the_window_and_every_kth_sigma_outside():
    assert coarse_keep(10, [3, 4], 2) == (0, 2, 3, 4, 5, 7, 9, 10)
    assert coarse_keep(10, [0, 1], 3) == (0, 1, 2, 5, 8, 10)
    assert coarse_keep(10, [], 1) == tuple(range(11))


@pytest.mark.parametrize("family", ["sd3", "qwenimage"])
def test_a_strided_rollout_runs_the_windows_sigmas_on_fewer_steps(served, family):
    server = served(family)
    full = server.generate(BODY)
    for solver in ("euler", "dpm2m"):
        coarse = server.generate({**BODY, "rollout_outside_window_stride": 2, "rollout_ode_solver": solver})
        keep = [0, 2, 3, 4, 5, 7, 9, 10]
        for f, c in zip(full, coarse, strict=True):
            # The loop ran 7 steps on the full schedule's own sigmas; the window is steps 2 and 3 now.
            assert torch.equal(c["dit_trajectory"]["sigmas"], f["dit_trajectory"]["sigmas"][keep])
            assert c["sde_step_indices"] == [2, 3] and c["rollout_log_probs"].shape == (7,)
            assert c["dit_trajectory"]["latents"].shape[0] == 8
            # ODE steps score 0; the window's steps are scored as always.
            lp = c["rollout_log_probs"]
            assert torch.count_nonzero(lp[[0, 1, 4, 5, 6]]) == 0 and bool(torch.isfinite(lp[[2, 3]]).all())
            assert not torch.equal(c["generated_output"], f["generated_output"])  # a coarser ODE path


def test_dpm2m_after_the_window_differs_from_euler_and_the_default_is_untouched(served):
    server = served("sd3")
    base = server.generate(BODY)
    again = server.generate({**BODY, "rollout_ode_solver": "euler", "rollout_outside_window_stride": 1})
    assert all(
        torch.equal(a["generated_output"], b["generated_output"]) for a, b in zip(base, again, strict=True)
    )
    dpm = server.generate({**BODY, "rollout_ode_solver": "dpm2m"})
    for a, d in zip(base, dpm, strict=True):
        # Steps 0-2 are a first-order start, then second order: the latents part from step 2 on.
        ta, td = a["dit_trajectory"]["latents"], d["dit_trajectory"]["latents"]
        assert torch.equal(ta[:2], td[:2]) and not torch.equal(ta[3], td[3])


def test_dpm2m_equals_diffusers_dpm_solver_multistep_on_one_schedule():
    from diffusers import DPMSolverMultistepScheduler

    ref = DPMSolverMultistepScheduler(
        use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=1.0, algorithm_type="dpmsolver++",
        solver_order=2, final_sigmas_type="zero", lower_order_final=True,
    )  # fmt: skip
    ref.set_timesteps(8)

    def model(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:  # any smooth velocity field
        return torch.tanh(x) * (0.5 + s) - 0.3 * x

    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64)
    ours, theirs, history = x0.float(), x0.float(), None
    for i, t in enumerate(ref.timesteps):
        s, s_next = ref.sigmas[i].float(), ref.sigmas[i + 1].float()
        ours, _, history = dpm2m_next(ours, model(ours, s), s, s_next, history)
        theirs = ref.step(model(theirs, s), t, theirs).prev_sample
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5), (ours - theirs).abs().max()


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"rollout_outside_window_stride": 2, "rollout_share_prefix": True}, "rollout_outside_window_stride"),
        ({"rollout_ode_solver": "dpm2m", "denoise_seeds": [1, 2]}, "rollout_ode_solver"),
        (
            {"rollout_outside_window_stride": 2, "rollout_return_step_indices": [1, 3]},
            "rollout_return_step_indices",
        ),
        ({"rollout_outside_window_stride": 0}, "rollout_outside_window_stride"),
    ],
)
def test_what_the_options_do_not_go_with_is_a_4xx_naming_the_field(served, patch, field):
    r = served("sd3").client.post("/rollout/generate", json={**BODY, **patch})
    assert r.status_code in (400, 422), r.text
    assert field in r.text


@pytest.mark.parametrize(
    ("solver", "layout"), [("euler", "server"), ("dpm2m", "server"), ("dpm2m", "in-process")]
)
def test_the_recipe_replays_the_window_exactly_with_a_coarse_outside(monkeypatch, solver, layout):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    flow_grpo = importlib.import_module("flow_grpo")
    argv = ["--server", "thread", "--iterations", "2", "--prompts", "2", "--group-size", "4", "--steps", "8",
            "--outside-window-stride", "2", "--ode-solver", solver, "--layout", layout]  # fmt: skip
    run = flow_grpo.main(argv)
    for h in run["history"]:
        assert h["first_ratio_max_dev"] == 0.0
        assert h["checksum_ok"] is (None if layout == "in-process" else True)  # in-process pushes nothing
        assert len(h["sde_steps"]) == 2
