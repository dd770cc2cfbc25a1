"""The transition function against plainly written references of docs/math.md, and diffusers' ODE step.

The references below are written independently of the implementation, in float64 from the same
float32/bf16 inputs. The implementation computes in float32 (as docs/math.md requires), so they agree up
to float32 rounding, and the tolerances are sized for that (a few float32 ulps of the quantities
compared); everything the spec calls bit-identical is checked with ``torch.equal``.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from diffusion_rollout.scheduler_mixins import LOG_PROB_FORMS, STEP_KINDS, TransitionResult, transition

STOCHASTIC = ("sde", "dance", "cps")
DTYPES = (torch.float32, torch.bfloat16)
SHAPE = (3, 4, 6, 6)
SEEDS = range(16)


def as_f32(value: float) -> float:
    """The float32 value nearest ``value``, as the exact Python float the scheduler's sigmas hold."""
    return float(torch.tensor(value, dtype=torch.float32))


def random_case(seed: int, dtype: torch.dtype) -> dict:
    """Inputs of one step. Seed 0 starts at s = 1 (the sigma_max rule), seed 1 ends at s' = 0."""
    gen = torch.Generator().manual_seed(seed)
    uniform = torch.rand(4, generator=gen, dtype=torch.float64).tolist()
    sigma = 1.0 if seed == 0 else as_f32(0.05 + 0.95 * uniform[0])
    sigma_next = 0.0 if seed == 1 else as_f32(sigma * (0.1 + 0.85 * uniform[1]))
    return {
        "sample": torch.randn(SHAPE, generator=gen).to(dtype),
        "model_output": torch.randn(SHAPE, generator=gen).to(dtype),
        "noise": torch.randn(SHAPE, generator=gen),
        "sigma": sigma,
        "sigma_next": sigma_next,
        "eta": as_f32(0.1 + 0.9 * uniform[2]),
        "sigma_max": as_f32(0.8 + 0.15 * uniform[3]),
    }


def reference_mean_std(kind, x, v, s, s_next, eta, sigma_max):
    """docs/math.md's table, in float64 with Python scalars."""
    x, v = x.double(), v.double()
    dt = s_next - s
    if kind == "cps":
        std = s_next * math.sin(eta * math.pi / 2)
        mean = (x - s * v) * (1 - s_next) + (x + (1 - s) * v) * math.sqrt(s_next**2 - std**2)
        return mean, std
    if kind == "sde":
        s_tilde = sigma_max if abs(s - 1.0) <= 1e-8 + 1e-5 else s  # torch.isclose(s, 1) defaults
        g = eta * math.sqrt(s / (1 - s_tilde))
    else:  # dance: g = eta
        g = eta
    mean = x * (1 + g**2 * dt / (2 * s)) + v * (1 + g**2 * (1 - s) / (2 * s)) * dt
    return mean, g * math.sqrt(-dt)


def reference_log_prob(form, stored, mean, std):
    r = stored.double() - mean
    if form == "no_const":
        element = -(r**2)
    elif form == "scaled":
        element = -(r**2) / (2 * std**2)
    else:
        element = -(r**2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))
    return element.mean(dim=tuple(range(1, element.ndim)))


def per_sample_mean(values: torch.Tensor) -> torch.Tensor:
    """The log-prob's reduction: each sample averaged on its own. transition() does not use a batched
    ``mean(dim=...)``, whose summation order depends on the batch size (see its module docstring)."""
    return torch.stack([value.mean() for value in values])


def forms_for(kind: str, sigma_next: float) -> tuple[str, ...]:
    # cps has std = 0 at s' = 0: only no_const is defined there (settings reject the others).
    if kind == "cps" and sigma_next == 0.0:
        return ("no_const",)
    return LOG_PROB_FORMS


def run(kind, case, **overrides) -> TransitionResult:
    args = {**case, **overrides}
    return transition(
        kind,
        args["sample"],
        args["model_output"],
        args["sigma"],
        args["sigma_next"],
        eta=args["eta"],
        sigma_max=args["sigma_max"],
        noise=args.get("noise"),
        next_sample=args.get("next_sample"),
        log_prob_form=args.get("log_prob_form", "gaussian"),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", STOCHASTIC)
def test_each_kind_and_form_matches_the_float64_reference(kind, dtype):
    for seed in SEEDS:
        case = random_case(seed, dtype)
        for form in forms_for(kind, case["sigma_next"]):
            result = run(kind, case, log_prob_form=form)
            mean, std = reference_mean_std(
                kind,
                case["sample"],
                case["model_output"],
                case["sigma"],
                case["sigma_next"],
                case["eta"],
                case["sigma_max"],
            )
            # float32 arithmetic vs float64: |x|, |v| ~ 1, so a few ulps of 1 absolute.
            torch.testing.assert_close(result.mean.double(), mean, rtol=2e-6, atol=2e-6)
            assert result.std.item() == pytest.approx(std, rel=2e-6, abs=1e-7)
            expected = reference_log_prob(form, result.next_sample, mean, std)
            # The residual r = stored - mu inherits mu's float32 rounding (~1e-7); the scaled and
            # gaussian forms divide it by std (>= ~0.01 here), hence a looser absolute bound.
            atol = 1e-6 if form == "no_const" else 5e-5
            torch.testing.assert_close(result.log_prob.double(), expected, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", STOCHASTIC)
def test_sampling_rule_and_dtypes(kind, dtype):
    for seed in SEEDS:
        case = random_case(seed, dtype)
        for form in forms_for(kind, case["sigma_next"]):
            result = run(kind, case, log_prob_form=form)
            # x' = mu + std * eps, stored in the model output's dtype.
            assert torch.equal(result.next_sample, (result.mean + result.std * case["noise"]).to(dtype))
            assert result.next_sample.dtype == dtype
            assert result.mean.dtype == torch.float32
            assert result.log_prob.dtype == torch.float32
            assert result.log_prob.shape == (SHAPE[0],)
            for scalar in (result.std, result.g, result.sqrt_dt):
                assert scalar.dtype == torch.float32 and scalar.ndim == 0
            assert torch.isfinite(result.log_prob).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", STOCHASTIC)
def test_gaussian_is_normal_log_prob_bit_for_bit(kind, dtype):
    for seed in SEEDS:
        case = random_case(seed, dtype)
        if kind == "cps" and case["sigma_next"] == 0.0:
            continue
        result = run(kind, case, log_prob_form="gaussian")
        stored = result.next_sample.float()
        expected = per_sample_mean(torch.distributions.Normal(result.mean, result.std).log_prob(stored))
        assert torch.equal(result.log_prob, expected)


@pytest.mark.parametrize("kind", STOCHASTIC)
def test_a_samples_log_prob_does_not_depend_on_the_batch(kind):
    """Server batches and replay micro-batches differ; at a realistic latent size a batched reduction
    would make the last bits depend on the batch."""
    gen = torch.Generator().manual_seed(7)
    shape = (4, 16, 64, 64)
    case = {
        "sample": torch.randn(shape, generator=gen).to(torch.bfloat16),
        "model_output": torch.randn(shape, generator=gen).to(torch.bfloat16),
        "noise": torch.randn(shape, generator=gen),
        "sigma": 0.8,
        "sigma_next": 0.6,
        "eta": 0.7,
        "sigma_max": 0.9,
    }
    for form in LOG_PROB_FORMS:
        batch = run(kind, case, log_prob_form=form)
        for index in range(shape[0]):
            alone = {
                name: value[index : index + 1]
                for name, value in case.items()
                if isinstance(value, torch.Tensor)
            }
            single = run(kind, case, log_prob_form=form, **alone)
            assert torch.equal(single.log_prob, batch.log_prob[index : index + 1])
            assert torch.equal(single.next_sample, batch.next_sample[index : index + 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", STOCHASTIC)
def test_scoring_the_stored_latent_reproduces_the_sampled_log_prob(kind, dtype):
    for seed in SEEDS:
        case = random_case(seed, dtype)
        for form in forms_for(kind, case["sigma_next"]):
            sampled = run(kind, case, log_prob_form=form)
            scored = run(kind, case, noise=None, next_sample=sampled.next_sample, log_prob_form=form)
            assert torch.equal(scored.log_prob, sampled.log_prob)
            assert torch.equal(scored.mean, sampled.mean)
            assert scored.next_sample is sampled.next_sample


def test_bf16_log_prob_scores_the_rounded_latent_not_the_raw_sample():
    case = random_case(3, torch.bfloat16)
    result = run("sde", case)
    raw = result.mean + result.std * case["noise"]
    from_raw = per_sample_mean(torch.distributions.Normal(result.mean, result.std).log_prob(raw))
    assert not torch.equal(result.log_prob, from_raw)  # the bf16 rounding of the stored latent shows
    torch.testing.assert_close(result.log_prob, from_raw, rtol=0.05, atol=0.05)


def test_scalars_may_be_floats_or_0_dim_tensors():
    case = random_case(5, torch.bfloat16)
    as_tensors = {
        name: torch.tensor(case[name], dtype=torch.float32)
        for name in ("sigma", "sigma_next", "sigma_max", "eta")
    }
    for kind in STEP_KINDS:
        a = run(kind, case)
        b = run(kind, case, **as_tensors)
        assert torch.equal(a.next_sample, b.next_sample)
        assert torch.equal(a.log_prob, b.log_prob)
        assert torch.equal(a.std, b.std)


def test_std_is_g_times_sqrt_dt_for_every_kind():
    for seed in SEEDS:
        case = random_case(seed, torch.float32)
        dt = case["sigma_next"] - case["sigma"]
        for kind in STEP_KINDS:
            result = run(kind, case, log_prob_form="no_const")
            assert result.sqrt_dt.item() == pytest.approx(math.sqrt(-dt), rel=1e-6)
            # sde/dance: std is computed as g * sqrt_dt (equal); cps: g = std / sqrt_dt (one rounding).
            assert (result.g * result.sqrt_dt).item() == pytest.approx(result.std.item(), rel=1e-6, abs=0)


def test_sde_uses_sigma_max_where_sigma_is_one():
    case = random_case(2, torch.float32)
    eta, sigma_max = 0.7, 0.75
    for sigma in (1.0, as_f32(1.0 - 1e-7)):  # exactly 1, and the float32 just below (isclose)
        result = run("sde", case, sigma=sigma, sigma_next=0.5, eta=eta, sigma_max=sigma_max)
        assert result.g.item() == pytest.approx(eta * math.sqrt(sigma / (1 - sigma_max)), rel=1e-6)
    result = run("sde", case, sigma=0.9, sigma_next=0.5, eta=eta, sigma_max=sigma_max)
    assert result.g.item() == pytest.approx(eta * math.sqrt(0.9 / 0.1), rel=1e-6)


def dance_grpo_mean(x, v, s, s_next, eta):
    """DanceGRPO's own expression of its mean (Euler step plus a score term), in float64."""
    x, v = x.double(), v.double()
    dsigma = s_next - s
    pred_original = x - s * v
    score = -(x - pred_original * (1 - s)) / s**2
    return x + dsigma * v + (-0.5 * eta**2 * score) * dsigma


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dance_is_sde_with_g_fixed_to_eta(dtype):
    for seed in SEEDS:
        case = random_case(seed, dtype)
        dance = run("dance", case)
        assert dance.g.item() == pytest.approx(case["eta"], rel=1e-7)
        # The score form of DanceGRPO is algebraically the sde mean with g = eta; they differ only by
        # rounding (the score form divides by s^2).
        expected = dance_grpo_mean(
            case["sample"], case["model_output"], case["sigma"], case["sigma_next"], case["eta"]
        )
        torch.testing.assert_close(dance.mean.double(), expected, rtol=1e-5, atol=1e-5)
        # Where the sde coefficient is exactly eta (s / (1 - s) = 1, i.e. s = 0.5) the two kinds agree
        # bit for bit.
        at_half = {"sigma": 0.5, "sigma_next": 0.25}
        sde, dance_half = run("sde", case, **at_half), run("dance", case, **at_half)
        assert torch.equal(sde.g, dance_half.g)
        assert torch.equal(sde.next_sample, dance_half.next_sample)
        assert torch.equal(sde.log_prob, dance_half.log_prob)


def test_cps_preserves_signal_and_noise_energy():
    """With x on the flow path between x0 and x1 and v = x1 - x0 exact, the cps step is
    (1 - s') x0 + c x1 + std eps with c^2 + std^2 = s'^2: signal weight (1 - s'), total noise energy s'^2."""
    gen = torch.Generator().manual_seed(0)
    shape = (1, 4, 128, 128)
    for s, s_next, eta in ((0.9, 0.7, 0.5), (0.6, 0.3, 1.0), (0.3, 0.1, 0.2)):
        s, s_next = as_f32(s), as_f32(s_next)
        x0 = torch.randn(shape, generator=gen, dtype=torch.float64)
        x1 = torch.randn(shape, generator=gen, dtype=torch.float64)
        x = ((1 - s) * x0 + s * x1).float()
        v = (x1 - x0).float()
        result = transition(
            "cps", x, v, s, s_next, eta=eta, sigma_max=1.0, noise=torch.randn(shape, generator=gen)
        )
        std = result.std.item()
        assert std == pytest.approx(s_next * math.sin(eta * math.pi / 2), rel=1e-6)
        # The mean is linear in (x0, x1): least squares recovers its two coefficients up to float32
        # rounding of the inputs.
        basis = torch.stack([x0.flatten(), x1.flatten()], dim=1)
        signal, noise_coef = torch.linalg.lstsq(
            basis, result.mean.double().flatten()[:, None]
        ).solution.flatten()
        assert signal.item() == pytest.approx(1 - s_next, abs=1e-5)
        assert noise_coef.item() ** 2 + std**2 == pytest.approx(s_next**2, abs=1e-5)
        # The sampled latent's noise part (c x1 + std eps) has total energy s'^2; statistical, 2^16 draws.
        noise_part = result.next_sample.double() - (1 - s_next) * x0
        assert noise_part.var().item() == pytest.approx(s_next**2, rel=0.03)


def stock_ode_schedule(dtype):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(6)
    gen = torch.Generator().manual_seed(11)
    sample = torch.randn(SHAPE, generator=gen).to(dtype)
    return scheduler, sample, gen


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ode_is_diffusers_step_bit_for_bit(dtype):
    stock, sample, gen = stock_ode_schedule(dtype)
    for index, timestep in enumerate(stock.timesteps):
        model_output = torch.randn(SHAPE, generator=gen).to(dtype)
        expected = stock.step(model_output, timestep, sample).prev_sample
        for sigma, sigma_next in (
            (stock.sigmas[index], stock.sigmas[index + 1]),
            (stock.sigmas[index].item(), stock.sigmas[index + 1].item()),
        ):
            for form in LOG_PROB_FORMS:
                result = transition(
                    "ode", sample, model_output, sigma, sigma_next, eta=0.7, sigma_max=1.0, log_prob_form=form
                )
                assert torch.equal(result.next_sample, expected)
                assert result.next_sample.dtype == dtype
                assert torch.equal(result.log_prob, torch.zeros(SHAPE[0]))
                assert result.std.item() == 0.0 and result.g.item() == 0.0
        sample = expected


def test_an_extra_cast_would_break_ode_exactness():
    """Guards the test above: upcasting v before the product changes the bf16 bits."""
    stock, sample, gen = stock_ode_schedule(torch.bfloat16)
    model_output = torch.randn(SHAPE, generator=gen).to(torch.bfloat16)
    dt = stock.sigmas[1] - stock.sigmas[0]
    expected = stock.step(model_output, stock.timesteps[0], sample).prev_sample
    with_extra_cast = (sample.float() + dt * model_output.float()).to(torch.bfloat16)
    assert not torch.equal(with_extra_cast, expected)
    ours = transition("ode", sample, model_output, stock.sigmas[0], stock.sigmas[1], eta=0.7, sigma_max=1.0)
    assert torch.equal(ours.next_sample, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", STOCHASTIC)
def test_gradients_flow_to_the_model_output(kind, dtype):
    for seed in (0, 4):  # seed 0 starts at s = 1: the torch.where branch must not make NaN gradients
        case = random_case(seed, dtype)
        for form in LOG_PROB_FORMS:
            model_output = case["model_output"].clone().requires_grad_(True)
            stored = run(kind, case).next_sample  # a trajectory entry: data, no graph
            result = run(
                kind, case, model_output=model_output, noise=None, next_sample=stored, log_prob_form=form
            )
            (grad,) = torch.autograd.grad(result.log_prob.sum(), model_output)
            assert grad.dtype == dtype
            assert torch.isfinite(grad).all()
            assert grad.abs().sum() > 0


def test_argument_errors():
    case = random_case(0, torch.float32)
    with pytest.raises(ValueError, match="unknown step kind"):
        run("flow", case)
    with pytest.raises(ValueError, match="unknown log-prob form"):
        run("sde", case, log_prob_form="exact")
    with pytest.raises(ValueError, match="exactly one of noise"):
        run("sde", case, next_sample=case["sample"])
    with pytest.raises(ValueError, match="exactly one of noise"):
        run("cps", case, noise=None)
    with pytest.raises(ValueError, match="batched"):
        run("sde", case, sample=case["sample"].flatten(), model_output=case["model_output"].flatten())
    with pytest.raises(ValueError, match="0-dim"):
        run("sde", case, sigma=torch.tensor([0.5]))
    # ODE ignores noise / next_sample: a replay loop may pass the same arguments at every step.
    assert torch.equal(run("ode", case).next_sample, run("ode", case, noise=None).next_sample)
