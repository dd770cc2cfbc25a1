"""Pure rollout math for flow-matching schedulers, independent of HTTP and of any pipeline.

- ``transition``: the one step function (kinds ``sde``/``dance``/``cps``/``ode``, log-prob forms),
  shared by the server's scheduler and the client's replay.
- ``state``: ``RolloutSettings`` (what a request asks) and ``RolloutState`` (per-call generators,
  exact schedule, recordings).
- ``scheduler``: ``RolloutFlowMatchEulerScheduler`` and ``rollout_context``, which binds a state to the
  current context so the shared scheduler object holds no request state.
- ``sigmas``: custom-schedule validation and the ``flow_shift`` schedule.
- ``streams``: ``MultiStreamRolloutState`` for pipelines that step several latents jointly (one
  scheduler per stream, LTX-2's video and audio) and ``joint_log_prob``.

Each module's docstring states its design decisions (dtype rules, RNG order, why a ContextVar).
"""

from .scheduler import (
    RolloutFlowMatchEulerScheduler,
    RolloutSchedulerMixin,
    active_rollout_state,
    rollout_context,
)
from .sigmas import flow_shift_sigmas, shift_sigmas, validate_sigmas
from .state import RolloutSettings, RolloutState
from .streams import MultiStreamRolloutState, joint_log_prob, make_rollout_state
from .transition import LOG_PROB_FORMS, STEP_KINDS, TransitionResult, transition

__all__ = [
    "LOG_PROB_FORMS",
    "STEP_KINDS",
    "MultiStreamRolloutState",
    "RolloutFlowMatchEulerScheduler",
    "RolloutSchedulerMixin",
    "RolloutSettings",
    "RolloutState",
    "TransitionResult",
    "active_rollout_state",
    "flow_shift_sigmas",
    "joint_log_prob",
    "make_rollout_state",
    "rollout_context",
    "shift_sigmas",
    "transition",
    "validate_sigmas",
]
