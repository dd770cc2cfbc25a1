"""The one transition function: a rollout step of a flow-matching sampler and its log-probability.

The server's scheduler and the client's replay helpers both call :func:`transition`, so the
log-probs a trainer recomputes cannot drift from the ones the server emitted. The formulas are those
of ``docs/math.md``; the names below follow it (``x`` the latent entering the step, ``v`` the model
output after guidance, ``s``/``s'`` the sigmas of this and the next step, ``dt = s' - s < 0``).

Design decisions:

- **Scalars.** ``sigma``, ``sigma_next``, ``sigma_max`` and ``eta`` may be Python floats or 0-dim
  tensors; all become 0-dim float32 tensors on the latent's device. float32 because the scheduler
  keeps its sigmas in float32 (a float from a response is the exact value of such a float32), and the
  latent's device so that the server and a replay on the same device compute every scalar the same way.
- **dtype of the stochastic kinds.** ``sde``, ``dance`` and ``cps`` cast ``x`` and ``v`` to float32
  first. Without the cast a 0-dim float32 tensor times a bf16 tensor is computed in bf16 (PyTorch's
  type promotion lets a 0-dim tensor never widen a dimensioned one of the same category), and the mean
  and the log-prob lose precision.
- **dtype of ``ode``.** The ``ode`` kind is diffusers' ``FlowMatchEulerDiscreteScheduler.step``
  default path, operation for operation: ``(x.to(float32) + dt * v).to(v.dtype)``. Here the bf16
  product ``dt * v`` *is* wanted: it is what the stock scheduler computes, and exactness target 1
  (rollout with every step ODE equals the stock pipeline) depends on it. Adding ``v.float()`` would
  change the bits.
- **Stored latent.** The next latent is cast to ``v.dtype``, the dtype pipelines keep their latents
  in, as the stock scheduler does. The log-prob scores that *stored* value (``r = stored.float() - mu``
  in float32), so a trainer recomputing ``mu`` from the trajectory gets the same bits; the stored
  latent is a sample, so it is detached in the residual and gradients flow through ``mu`` only.
- **Log-prob forms.** ``gaussian`` is written with the operation order of
  ``torch.distributions.Normal.log_prob`` so the two agree bit for bit, element by element;
  ``no_const`` is ``-r^2`` (SGLang, CPS users); ``scaled`` is ``-r^2 / (2 std^2)``.
- **Batch-invariant mean.** Each sample's elements are averaged by their own reduction
  (``values[i].mean()``), not by one batched ``mean(dim=...)``, whose summation order depends on the
  batch size: the server batches requests as it likes and a trainer replays in micro-batches of its
  own, and both must get the same bits for a sample (exactness target 2).
- **Autograd.** No ``.item()``, no in-place ops, and ``torch.where`` (not a Python branch) for the
  ``s = 1`` rule, so a trainer can backpropagate a loss through ``log_prob`` and ``mean`` into ``v``.
- ``std == g * sqrt_dt`` for every kind (GRPO-Guard's pieces): ``g = std / sqrt(-dt)`` for ``cps``,
  ``g = 0`` for ``ode``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["LOG_PROB_FORMS", "STEP_KINDS", "TransitionResult", "transition"]

STEP_KINDS: tuple[str, ...] = ("sde", "dance", "cps", "ode")
"""Step kinds of ``rollout_sde_type``: Flow-GRPO SDE, DanceGRPO SDE, coefficients-preserving, Euler ODE."""

LOG_PROB_FORMS: tuple[str, ...] = ("gaussian", "no_const", "scaled")
"""Log-prob forms: full Gaussian density, ``-r^2``, and ``-r^2 / (2 std^2)``."""

_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


@dataclass
class TransitionResult:
    """What one step produced.

    Attributes:
        next_sample: the stored next latent in ``model_output.dtype`` (sampled, or the one given to
            score; for ``ode`` the deterministic Euler step).
        mean: ``mu``, float32 (for ``ode`` the float32 Euler step before the cast).
        std: 0-dim float32 noise std (0 for ``ode``).
        log_prob: ``[B]`` float32, per sample the mean over its latent elements of the chosen form
            (0 for ``ode``); a sample's value does not depend on the rest of the batch.
        g: 0-dim float32 diffusion coefficient, ``std = g * sqrt_dt``.
        sqrt_dt: 0-dim float32 ``sqrt(-dt)``.
    """

    next_sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    log_prob: torch.Tensor
    g: torch.Tensor
    sqrt_dt: torch.Tensor


def _scalar(value: float | torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.ndim != 0:
            raise ValueError(f"{name} must be a float or a 0-dim tensor, got shape {tuple(value.shape)}")
        # A no-op (same tensor, same autograd node) when already float32 on the right device.
        return value.to(device=like.device, dtype=torch.float32)
    return torch.tensor(float(value), dtype=torch.float32, device=like.device)


def _per_sample_mean(values: torch.Tensor) -> torch.Tensor:
    # One full reduction per sample rather than values.mean(dim=non-batch dims): the kernel a batched
    # reduction picks (its summation order) depends on the batch size, on CPU as on CUDA, so a sample
    # scored alone or in a replay micro-batch would differ in the last bits from the server's batch.
    # Each sample is reduced in its logical (contiguous) order: a full reduction sums in memory
    # order, and a pipeline's latents can be a permuted view (FLUX.2's packing) where the trainer's
    # trajectory tensors are contiguous, which moved the log-prob by one ulp.
    if values.shape[0] == 0:
        return values.new_zeros(0)
    return torch.stack([values[index].contiguous().mean() for index in range(values.shape[0])])


def _log_prob(stored_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, form: str) -> torch.Tensor:
    value = stored_next.detach().to(torch.float32)
    if form == "no_const":
        return _per_sample_mean(-((value - mean) ** 2))
    var = std**2
    if form == "scaled":
        return _per_sample_mean(-((value - mean) ** 2) / (2 * var))
    # Same expression, same order as torch.distributions.Normal.log_prob: equal bits.
    log_scale = std.log()
    return _per_sample_mean(-((value - mean) ** 2) / (2 * var) - log_scale - _LOG_SQRT_2PI)


def _flow_sde_mean(
    x: torch.Tensor, v: torch.Tensor, s: torch.Tensor, dt: torch.Tensor, g: torch.Tensor
) -> torch.Tensor:
    # docs/math.md's expression as written; x and v are float32 here.
    return x * (1 + g**2 * dt / (2 * s)) + v * (1 + g**2 * (1 - s) / (2 * s)) * dt


def transition(
    kind: str,
    sample: torch.Tensor,
    model_output: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    eta: float | torch.Tensor,
    sigma_max: float | torch.Tensor,
    noise: torch.Tensor | None = None,
    next_sample: torch.Tensor | None = None,
    log_prob_form: str = "gaussian",
) -> TransitionResult:
    """One rollout step: sample the next latent (``noise`` given) or score a stored one (``next_sample``).

    Args:
        kind: one of :data:`STEP_KINDS`.
        sample: ``x``, the latent entering the step, ``[B, ...]``, any float dtype.
        model_output: ``v``, the guided velocity, same shape; its dtype is the stored latent dtype.
        sigma, sigma_next: ``s`` and ``s'`` (floats or 0-dim tensors); ``s' = 0`` at the last step.
        eta: the noise level (``rollout_noise_level``).
        sigma_max: the schedule's second entry ``sigmas[min(1, len(sigmas) - 1)]`` (terminal included),
            used for ``s~`` by the ``sde`` kind where ``s`` is 1.
        noise: standard-normal ``eps`` with the latent's shape (sampling mode).
        next_sample: the stored next latent to score (scoring mode, e.g. a trajectory entry).
        log_prob_form: one of :data:`LOG_PROB_FORMS`.

    Exactly one of ``noise`` / ``next_sample`` must be given for a stochastic kind; ``ode`` ignores both
    (it is deterministic), so a replay loop can pass the same arguments at every step.

    The ``gaussian`` and ``scaled`` forms divide by ``std^2``: with ``std = 0`` (``eta = 0``, or ``cps``
    at the last step) they are not finite. Requests are screened for that by
    :meth:`RolloutSettings.validate`; this function does not synchronise the device to check.
    """
    if kind not in STEP_KINDS:
        raise ValueError(f"unknown step kind {kind!r}; expected one of {STEP_KINDS}")
    if log_prob_form not in LOG_PROB_FORMS:
        raise ValueError(f"unknown log-prob form {log_prob_form!r}; expected one of {LOG_PROB_FORMS}")
    if sample.ndim < 2:
        raise ValueError(
            f"sample must be batched, [B, ...] with at least 2 dims; got shape {tuple(sample.shape)}"
        )
    if model_output.shape != sample.shape:
        raise ValueError(
            f"model_output shape {tuple(model_output.shape)} differs from sample shape {tuple(sample.shape)}"
        )

    s = _scalar(sigma, sample, "sigma")
    s_next = _scalar(sigma_next, sample, "sigma_next")
    dt = s_next - s
    sqrt_dt = torch.sqrt(-dt)

    if kind == "ode":
        # diffusers' default path, no extra cast (see the module docstring).
        mean = sample.to(torch.float32) + dt * model_output
        zero = torch.zeros((), dtype=torch.float32, device=sample.device)
        return TransitionResult(
            next_sample=mean.to(model_output.dtype),
            mean=mean,
            std=zero,
            log_prob=torch.zeros(sample.shape[0], dtype=torch.float32, device=sample.device),
            g=zero,
            sqrt_dt=sqrt_dt,
        )

    if (noise is None) == (next_sample is None):
        raise ValueError("pass exactly one of noise (to sample the next latent) or next_sample (to score it)")
    eta_t = _scalar(eta, sample, "eta")
    # float32 before any arithmetic: a 0-dim float32 scalar times a bf16 tensor stays bf16.
    x = sample.to(torch.float32)
    v = model_output.to(torch.float32)

    if kind == "sde":
        s_max = _scalar(sigma_max, sample, "sigma_max")
        # s~ = sigma_max where s is 1, so the first step of a schedule starting at 1 does not divide by 0.
        s_tilde = torch.where(torch.isclose(s, torch.ones_like(s)), s_max, s)
        g = eta_t * torch.sqrt(s / (1 - s_tilde))
        std = g * sqrt_dt
        mean = _flow_sde_mean(x, v, s, dt, g)
    elif kind == "dance":
        g = eta_t
        std = g * sqrt_dt
        mean = _flow_sde_mean(x, v, s, dt, g)
    else:  # cps
        std = s_next * torch.sin(eta_t * math.pi / 2)
        g = std / sqrt_dt
        mean = (x - s * v) * (1 - s_next) + (x + (1 - s) * v) * torch.sqrt(s_next**2 - std**2)

    if noise is not None:
        if noise.shape != sample.shape:
            raise ValueError(
                f"noise shape {tuple(noise.shape)} differs from sample shape {tuple(sample.shape)}"
            )
        stored_next = (mean + std * noise).to(model_output.dtype)
    else:
        stored_next = next_sample
        if next_sample.shape != sample.shape:
            raise ValueError(
                f"next_sample shape {tuple(next_sample.shape)} differs from sample shape {tuple(sample.shape)}"
            )

    return TransitionResult(
        next_sample=stored_next,
        mean=mean,
        std=std,
        log_prob=_log_prob(stored_next, mean, std, log_prob_form),
        g=g,
        sqrt_dt=sqrt_dt,
    )
