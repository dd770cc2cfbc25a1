"""Fewer, higher-order ODE steps outside the SDE window (MixGRPO-Flash's idea).

A Flow-GRPO rollout trains only its window's stochastic steps; the deterministic steps before and
after only carry the latent there and on to the image. Two opt-in request options make them cheaper:

- ``rollout_outside_window_stride = k``: outside the window only every k-th sigma of the request's
  schedule is kept (counted from the window's edges and from sigma_0), so a run of ``n`` ODE steps
  becomes ``ceil(n / k)``. The window's steps keep their sigmas: each window step ``i`` still runs
  from ``sigma_i`` to ``sigma_{i+1}`` of the full schedule. The loop then has ``T'`` steps, and every
  index in the answer (``sde_step_indices``, the trajectory's ``latent_step_indices``, the log-probs)
  is an index of those ``T'`` steps; the request's own indices are of the full ``T`` steps and are
  mapped (a kept trajectory entry must be one of the kept sigmas: 400 otherwise).
- ``rollout_ode_solver = "dpm2m"``: the ODE steps use DPM-Solver++(2M) in flow-matching form instead
  of Euler. Written with ``lambda = log((1 - s) / s)``, ``x0 = x - s * v``: the first step of a run
  (no history) and a step to ``s' = 0`` are first order, which for flow matching *is* the Euler
  step; the others combine this step's ``x0`` with the previous one's. A run starts afresh after the
  window (its stochastic steps are not on the ODE path).

Neither changes a stochastic step's arithmetic or its log-prob (the ODE steps score 0 as before), so
a trainer's replay of the window is exactly as on-policy as without them; what changes is the latent
entering the window and the image, i.e. the trajectory is a different (coarser) ODE path. That drift
is measured (``benchmarks``), not asserted. The default (stride 1, Euler) is the stock path untouched.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from diffusion_rollout.errors import RequestError

if TYPE_CHECKING:
    from .state import RolloutSettings

__all__ = ["ODE_SOLVERS", "coarse_keep", "coarse_settings", "dpm2m_next"]

ODE_SOLVERS: tuple[str, ...] = ("euler", "dpm2m")


def coarse_keep(num_steps: int, stochastic: list[int], stride: int) -> tuple[int, ...]:
    """The sigma indices (of ``0..num_steps``, ``num_steps`` being the terminal 0) kept by ``stride``.

    Always kept: ``0``, the terminal, and each window step's two ends. Between kept indices, runs of
    ODE sigmas keep every ``stride``-th, counted from the run's start."""
    anchors = {0, num_steps, *stochastic, *(i + 1 for i in stochastic)}
    keep: list[int] = []
    last_anchor = 0
    for i in range(num_steps + 1):
        if i in anchors:
            keep.append(i)
            last_anchor = i
        elif (i - last_anchor) % stride == 0:
            keep.append(i)
    return tuple(keep)


def remap(indices: tuple[int, ...] | None, keep: tuple[int, ...], field: str) -> tuple[int, ...] | None:
    """Full-schedule indices as indices of the kept schedule (a dropped one is a 400 naming ``field``)."""
    if indices is None:
        return None
    position = {index: k for k, index in enumerate(keep)}
    dropped = sorted(i for i in indices if i not in position)
    if dropped:
        raise RequestError(
            f"{field} names {dropped}, which rollout_outside_window_stride drops (kept: {list(keep)}); "
            "name the window's steps and their ends, or send stride 1",
            field=field,
        )
    return tuple(position[i] for i in indices)


def coarse_settings(settings: RolloutSettings, num_steps: int, stride: int) -> RolloutSettings:
    """``settings`` (indices of the full ``num_steps``) for the schedule ``stride`` keeps: its step
    and trajectory indices mapped, ``keep_sigma_indices`` set, validated for the kept steps."""
    if stride == 1:
        return settings
    keep = coarse_keep(num_steps, settings.stochastic_steps(num_steps), stride)
    out = dataclasses.replace(
        settings,
        sde_step_indices=remap(settings.sde_step_indices, keep, "rollout_sde_step_indices"),
        return_step_indices=remap(settings.return_step_indices, keep, "rollout_return_step_indices"),
        keep_sigma_indices=keep,
    )
    out.validate(len(keep) - 1)
    return out


def _lam(s: torch.Tensor) -> torch.Tensor:
    return torch.log((1 - s) / s)


def dpm2m_next(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    previous: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One DPM-Solver++(2M) ODE step from ``sigma`` to ``sigma_next`` (0-dim float32 tensors).

    ``previous`` is ``(sigma_prev, x0_prev)`` of the run's last step, or None (first order). Returns
    ``(stored next latent in v.dtype, float32 next latent, (sigma, x0) for the next step)``."""
    xf, vf = x.to(torch.float32), v.to(torch.float32)
    x0 = xf - sigma * vf
    if previous is None or not bool(sigma_next > 0) or not bool(sigma < 1):
        # First order: for flow matching DPM-Solver++'s first-order step is the Euler step.
        mean = xf + (sigma_next - sigma) * vf
    else:
        s_prev, x0_prev = previous
        h = _lam(sigma_next) - _lam(sigma)
        r = (_lam(sigma) - _lam(s_prev)) / h
        d = (1 + 1 / (2 * r)) * x0 - (1 / (2 * r)) * x0_prev
        mean = (sigma_next / sigma) * xf - (1 - sigma_next) * torch.expm1(-h) * d
    return mean.to(v.dtype), mean, (sigma, x0)
