"""The rollout mixin for diffusers' flow-match Euler scheduler, and the context that attaches a state.

Design decisions:

- **A subclass, not a patch.** ``RolloutFlowMatchEulerScheduler`` is
  ``(RolloutSchedulerMixin, FlowMatchEulerDiscreteScheduler)``: build it with
  ``RolloutFlowMatchEulerScheduler.from_config(pipe.scheduler.config)`` and hand it to the pipeline.
  It keeps the stock ``set_timesteps``/``step`` signatures (pipelines inspect ``set_timesteps`` for
  ``sigmas``/``timesteps`` support) and the stock ``_step_index`` bookkeeping.
- **Why a ContextVar.** The scheduler object is shared by every call of a pipeline, so it must hold no
  request state. :func:`rollout_context` binds a :class:`RolloutState` to the current context
  (thread, or asyncio task); ``step()`` looks it up there. Two threads each running a pipeline
  cannot see each other's state, and an exception inside the block unbinds it. Note that a new thread
  starts with an empty context: enter ``rollout_context`` in the thread that runs the pipeline (or
  use ``asyncio.to_thread``/``contextvars.copy_context().run``, which carry the context over).
- **Stock when not in rollout mode.** With no state bound, or with ``settings.record=False`` and no
  exact schedule, ``set_timesteps`` and ``step`` are the parent's, so plain generation is the stock
  pipeline bit for bit. With every step ODE the rollout path calls :func:`transition`'s ``ode``
  kind, which is the stock arithmetic, so it is bit-identical as well.
- **Exact schedules.** With ``state.exact_sigmas`` the scheduler uses the given sigmas unchanged,
  whatever its config (shift, dynamic shifting, ``shift_terminal``, Karras...), ignoring the
  pipeline's own ``num_inference_steps``/``sigmas``/``mu``/``timesteps``: sigmas are the given values
  in float32 plus a terminal 0, timesteps are ``sigmas * num_train_timesteps``, which is what the
  stock scheduler computes for ``shift=1`` without dynamic shifting.
- ``sigma_max`` for the ``sde`` kind is ``self.sigmas[min(1, len(self.sigmas) - 1)]``, read at the
  first step, after the pipeline set the schedule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteSchedulerOutput

from .outside_window import dpm2m_next
from .state import RolloutState
from .transition import transition

__all__ = [
    "RolloutFlowMatchEulerScheduler",
    "RolloutSchedulerMixin",
    "active_rollout_state",
    "rollout_context",
]

_ACTIVE_STATE: ContextVar[RolloutState | None] = ContextVar("diffusion_rollout_active_state", default=None)


@contextmanager
def rollout_context(state: RolloutState | None) -> Iterator[RolloutState | None]:
    """Bind ``state`` to the current context for the duration of the block (``None`` unbinds).

    Every rollout scheduler stepped inside the block records into ``state``. Blocks nest; leaving one
    restores the previous binding, also when the block raises.
    """
    token = _ACTIVE_STATE.set(state)
    try:
        yield state
    finally:
        _ACTIVE_STATE.reset(token)


def active_rollout_state() -> RolloutState | None:
    """The state bound by the innermost :func:`rollout_context` of this context, or ``None``."""
    return _ACTIVE_STATE.get()


class RolloutSchedulerMixin:
    """Rollout behaviour for a flow-match Euler scheduler; list it before the diffusers class."""

    def check_rollout_supported(self, per_token_timesteps: torch.Tensor | None = None) -> None:
        """Raise ``ValueError`` if this scheduler's config cannot run the rollout math.

        The engine may call it once after loading a model, to fail at start-up rather than per request.
        """
        config = self.config
        if per_token_timesteps is not None:
            raise ValueError(
                "rollout mode does not support per_token_timesteps (each token at its own sigma): the step "
                "math and its log-prob assume one sigma per step"
            )
        if getattr(config, "stochastic_sampling", False):
            raise ValueError(
                "rollout mode does not support a scheduler configured with stochastic_sampling=True: its "
                "step re-noises with the pipeline's generator; load the scheduler with stochastic_sampling=False"
            )
        if getattr(config, "invert_sigmas", False):
            raise ValueError(
                "rollout mode does not support invert_sigmas=True: the step math assumes sigmas decreasing to 0"
            )

    def set_timesteps(
        self,
        num_inference_steps: int | None = None,
        device: str | torch.device | None = None,
        sigmas: list[float] | None = None,
        mu: float | None = None,
        timesteps: list[float] | None = None,
    ) -> None:
        """Stock ``set_timesteps``, unless the bound state carries an exact schedule (then that one)."""
        state = _ACTIVE_STATE.get()
        if state is None or state.exact_sigmas is None:
            super().set_timesteps(
                num_inference_steps=num_inference_steps,
                device=device,
                sigmas=sigmas,
                mu=mu,
                timesteps=timesteps,
            )
        else:
            self._set_exact_timesteps(state, device)
        keep = None if state is None else state.settings.keep_sigma_indices
        if keep is not None:
            self._keep_sigmas(keep)

    def _keep_sigmas(self, keep: tuple[int, ...]) -> None:
        """Run on the kept sigmas only (``outside_window.py``): the values are the schedule's own."""
        if keep[-1] != len(self.sigmas) - 1:
            raise ValueError(
                f"the request was planned for {keep[-1]} steps but the pipeline set {len(self.sigmas) - 1}"
            )
        rows = torch.tensor(keep, dtype=torch.long)
        self.sigmas = self.sigmas[rows.to(self.sigmas.device)]
        self.timesteps = self.timesteps[rows[:-1].to(self.timesteps.device)]
        self.num_inference_steps = len(keep) - 1

    def _set_exact_timesteps(self, state: RolloutState, device: str | torch.device | None) -> None:
        if getattr(self.config, "invert_sigmas", False):
            raise ValueError(
                "exact sigmas are not supported with invert_sigmas=True: they would not be inverted"
            )
        # The same conversions as the stock scheduler (float64 -> float32 numpy, then torch), minus the
        # shift, dynamic shift, terminal stretch and sigma-family conversions.
        exact = torch.from_numpy(np.array(state.exact_sigmas).astype(np.float32)).to(
            dtype=torch.float32, device=device
        )
        self.num_inference_steps = len(state.exact_sigmas)
        self.timesteps = exact * self.config.num_train_timesteps
        self.sigmas = torch.cat([exact, torch.zeros(1, device=exact.device)])
        self._step_index = None
        self._begin_index = None

    def step(
        self,
        model_output: torch.Tensor,
        timestep: float | torch.Tensor,
        sample: torch.Tensor,
        s_churn: float = 0.0,
        s_tmin: float = 0.0,
        s_tmax: float = float("inf"),
        s_noise: float = 1.0,
        generator: torch.Generator | None = None,
        per_token_timesteps: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> FlowMatchEulerDiscreteSchedulerOutput | tuple:
        """Stock ``step`` without a rollout; with one, the step kind of this loop step, recorded.

        ``generator`` and the ``s_*`` arguments are ignored in rollout mode: the noise comes from the
        state's per-sample generators.
        """
        state = _ACTIVE_STATE.get()
        if state is not None:
            # A multi-stream state hands each scheduler's call its own stream (streams.py).
            state = state.for_step()
        if state is None or not state.settings.record:
            output = super().step(
                model_output,
                timestep,
                sample,
                s_churn=s_churn,
                s_tmin=s_tmin,
                s_tmax=s_tmax,
                s_noise=s_noise,
                generator=generator,
                per_token_timesteps=per_token_timesteps,
                return_dict=return_dict,
            )
            if state is not None:
                state.note_stock_step(num_scheduler_steps=len(self.timesteps), step_index=self.step_index - 1)
            return output

        self.check_rollout_supported(per_token_timesteps)
        if isinstance(timestep, int) or (
            isinstance(timestep, torch.Tensor) and not torch.is_floating_point(timestep)
        ):
            raise ValueError(
                "Passing integer indices (e.g. from `enumerate(timesteps)`) as timesteps to `step()` is not "
                "supported. Make sure to pass one of the `scheduler.timesteps` as a timestep."
            )
        if self.step_index is None:
            self._init_step_index(timestep)
        index = self.step_index
        if not state.started:
            state.begin(
                sample=sample,
                model_output=model_output,
                scheduler_sigmas=self.sigmas,
                start_index=index,
            )

        kind = state.current_kind()
        # ODE steps draw nothing, so a sample's generator advances only at its stochastic steps.
        noise = None if kind == "ode" else state.draw_noise(sample)
        sigma, sigma_next, sigma_max, eta = state.step_scalars(index)
        result = transition(
            kind,
            sample,
            model_output,
            sigma,
            sigma_next,
            eta=eta,
            sigma_max=sigma_max,
            noise=noise,
            log_prob_form=state.settings.log_prob_form,
        )
        if kind != "ode":
            state.ode_history = None  # an ODE run after the window starts afresh
        elif state.settings.ode_solver == "dpm2m":
            stored, mean, state.ode_history = dpm2m_next(
                sample, model_output, sigma, sigma_next, state.ode_history
            )
            result = dataclasses.replace(result, next_sample=stored, mean=mean)
        state.record_step(
            timestep=timestep, sample=sample, model_output=model_output, result=result, noise=noise
        )
        self._step_index += 1

        if not return_dict:
            return (result.next_sample,)
        return FlowMatchEulerDiscreteSchedulerOutput(prev_sample=result.next_sample)


class RolloutFlowMatchEulerScheduler(RolloutSchedulerMixin, FlowMatchEulerDiscreteScheduler):
    """``FlowMatchEulerDiscreteScheduler`` with the rollout mixin (same config, same stock behaviour)."""
