"""Sigma schedules a request can ask for: a custom list used exactly as given, and ``flow_shift``.

Design decisions:

- A custom schedule is ``T`` values ``sigma_0 .. sigma_{T-1}``; the terminal 0 is appended by the
  scheduler. It is checked both as given (float64) and after rounding to float32, because the
  scheduler stores float32 sigmas: two distinct doubles that round to the same float32 would give
  ``dt = 0`` (a zero noise std, a division by zero in the log-prob), and a tiny positive double can
  round to 0.
- Errors are :class:`~diffusion_rollout.errors.RequestError` with ``field="sigmas"`` (or
  ``"flow_shift"``) and a message naming the broken rule, so the HTTP layer answers 400 with it.
- Schedules are returned as plain Python floats; :class:`RolloutState` turns them into the float32
  tensors the scheduler uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from diffusion_rollout.errors import RequestError

__all__ = ["flow_shift_sigmas", "shift_sigmas", "validate_sigmas"]


def validate_sigmas(sigmas: Sequence[float], num_steps: int | None, *, field: str = "sigmas") -> list[float]:
    """Check a custom schedule and return it as a list of floats.

    Rules (each violation raises ``RequestError(field=field)`` naming the rule): a list of ``num_steps``
    real numbers (``num_steps=None``: any length >= 1), all finite, within ``(0, 1]``, strictly
    decreasing, still strictly decreasing and positive once rounded to float32 (the dtype the scheduler
    keeps them in).
    """
    if isinstance(sigmas, (str, bytes)) or not isinstance(sigmas, Sequence):
        raise RequestError(f"{field} must be a list of numbers", field=field)
    values: list[float] = []
    for position, value in enumerate(sigmas):
        # bool is an int subclass; a JSON true in a schedule is a client bug, not sigma=1.
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
            raise RequestError(f"{field}[{position}] is not a number: {value!r}", field=field)
        values.append(float(value))
    if num_steps is None and not values:
        raise RequestError(f"{field} must hold at least one value", field=field)
    if num_steps is not None and len(values) != num_steps:
        raise RequestError(
            f"{field} must have one value per inference step: got {len(values)} values for "
            f"num_inference_steps={num_steps} (the terminal 0 is appended by the server, do not send it)",
            field=field,
        )
    for position, value in enumerate(values):
        if not math.isfinite(value):
            raise RequestError(f"{field} must be finite: {field}[{position}] = {value}", field=field)
        if not 0.0 < value <= 1.0:
            raise RequestError(
                f"{field} must lie within (0, 1]: {field}[{position}] = {value}",
                field=field,
            )
    for position in range(1, len(values)):
        if not values[position] < values[position - 1]:
            raise RequestError(
                f"{field} must be strictly decreasing: {field}[{position - 1}] = {values[position - 1]} "
                f"is not greater than {field}[{position}] = {values[position]}",
                field=field,
            )
    as_float32 = np.asarray(values, dtype=np.float32)
    if values and not as_float32[-1] > 0:
        raise RequestError(
            f"{field} must lie within (0, 1] in float32: {field}[{len(values) - 1}] = {values[-1]} rounds to 0",
            field=field,
        )
    for position in range(1, len(values)):
        if not as_float32[position] < as_float32[position - 1]:
            raise RequestError(
                f"{field} must be strictly decreasing in float32 (the scheduler's dtype): "
                f"{field}[{position - 1}] = {values[position - 1]} and {field}[{position}] = {values[position]} "
                "round to the same float32 value",
                field=field,
            )
    return values


def shift_sigmas(sigmas: Sequence[float], shift: float) -> list[float]:
    """Apply the flow-matching shift ``S*s / (1 + (S-1)*s)`` to each sigma (float64 arithmetic).

    This is the static shift of diffusers' ``FlowMatchEulerDiscreteScheduler`` (``shift`` in its
    config); an engine can use it for ``sigmas_are_shifted=false`` on models without dynamic shifting.
    """
    s = np.asarray(sigmas, dtype=np.float64)
    return [float(v) for v in shift * s / (1.0 + (shift - 1.0) * s)]


def flow_shift_sigmas(num_steps: int, shift: float) -> list[float]:
    """The ``flow_shift`` schedule: shift ``S`` applied to the default linear schedule.

    The linear schedule is ``numpy.linspace(1.0, 1.0 / T, T)``, the one the diffusers flow-matching
    pipelines (FLUX, SD3-style, Qwen-Image) build and pass to ``set_timesteps(sigmas=...)``. It ends at
    ``1/T`` rather than at the scheduler's training ``sigma_min`` (``1/num_train_timesteps``), so
    the schedule depends only on ``T`` and ``S``, not on a model's scheduler config. The result is
    meant to be used as a custom schedule (exactly, with no model shift on top).

    Raises ``RequestError(field="flow_shift")`` unless ``S`` is finite and positive.
    """
    if (
        isinstance(shift, bool)
        or not isinstance(shift, (int, float))
        or not math.isfinite(shift)
        or shift <= 0
    ):
        raise RequestError(f"flow_shift must be a finite number > 0, got {shift!r}", field="flow_shift")
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise RequestError(
            f"num_inference_steps must be an integer >= 1, got {num_steps!r}", field="num_inference_steps"
        )
    return shift_sigmas(np.linspace(1.0, 1.0 / num_steps, num_steps), float(shift))
