"""Rollout state for pipelines that denoise several latent streams jointly, one scheduler per stream.

LTX-2 samples a video latent and an audio latent together: every loop step calls the video
scheduler's ``step`` and then the audio scheduler's ``step`` (a deep copy of the first), each with its
own latent and velocity. :class:`MultiStreamRolloutState` is bound with
:func:`~diffusion_rollout.scheduler_mixins.rollout_context` like a :class:`RolloutState`; every
rollout scheduler asks the bound state for the state of *its* call (``for_step``), so the schedulers
need no stream names.

Design decisions:

- **One plain RolloutState per stream**, chosen by call order: the ``k``-th ``step`` call of a loop
  step belongs to ``streams[k]``. Each stream therefore has its own trajectory, log-probs and debug
  tensors, with exactly the single-stream layout, step kinds and sigma rules (every stream runs the
  same schedule, as the pipeline's schedulers do). Every stream's step is the one shared
  :func:`~diffusion_rollout.scheduler_mixins.transition`.
- **RNG order.** The streams share the samples' generators. At a stochastic loop step, sample ``i``
  draws its ``eps`` for ``streams[0]`` first, then for ``streams[1]``, ... (the call order); ODE steps
  draw nothing in any stream. A sample's numbers still depend on its own generator only. Per-step
  generators (``denoise_seeds``) are made once per sample and loop step and shared by the streams in
  the same order, so the audio ``eps`` continues the video's draw instead of repeating it.
- **Joint log-prob.** A joint step's density is the product of the streams' densities; with
  docs/math.md's mean-over-elements rule its per-sample value is the mean over *all* elements of all
  streams, which :func:`joint_log_prob` computes from the per-stream means as
  ``sum_k(lp_k * n_k) / sum_k(n_k)`` in float32, in stream order (``n_k`` the elements per sample of
  stream ``k``). A trainer replays each stream's step with ``transition`` and combines them with the
  same function, so the ratio is exactly 1; per-stream log-probs stay available for trainers that
  weight the streams themselves.
- The first stream is the primary one: ``loop_index``, ``timesteps``, ``sigmas``, the step indices
  and ``per_sample``'s single-stream keys are its; ``per_sample`` adds the joint ``log_probs`` and a
  ``streams`` mapping of every stream's own view.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .state import RolloutSettings, RolloutState

__all__ = ["MultiStreamRolloutState", "joint_log_prob", "make_rollout_state"]


def joint_log_prob(per_stream: Sequence[torch.Tensor], numels: Sequence[int]) -> torch.Tensor:
    """Per-sample log-prob over all streams' elements, from each stream's per-sample mean.

    ``per_stream[k]`` is stream ``k``'s log-prob (``[B]`` or ``[B, T]``, float32, a mean over its
    ``numels[k]`` elements per sample). Returns ``sum_k(lp_k * n_k) / sum_k(n_k)``, summed in stream
    order, in float32; works under autograd.
    """
    if len(per_stream) != len(numels) or not per_stream:
        raise ValueError("pass one element count per stream, for at least one stream")
    total = float(sum(numels))
    acc = per_stream[0].to(torch.float32) * float(numels[0])
    for values, n in zip(per_stream[1:], numels[1:], strict=True):
        acc = acc + values.to(torch.float32) * float(n)
    return acc / total


def make_rollout_state(
    settings: RolloutSettings,
    generators: Sequence[torch.Generator] | None,
    *,
    streams: Sequence[str] = (),
    sigmas: Sequence[float] | None = None,
    step_generators: Sequence[Callable[[int], torch.Generator] | None] | None = None,
) -> RolloutState | MultiStreamRolloutState:
    """A :class:`RolloutState`, or a :class:`MultiStreamRolloutState` for two or more ``streams``."""
    if len(streams) > 1:
        return MultiStreamRolloutState(
            settings, generators, streams=streams, sigmas=sigmas, step_generators=step_generators
        )
    return RolloutState(settings, generators, sigmas=sigmas, step_generators=step_generators)


def _once_per_step(make: Callable[[int], torch.Generator]) -> Callable[[int], torch.Generator]:
    """``make`` called once per loop step; every stream of that step gets the same generator."""
    current: dict[int, torch.Generator] = {}

    def get(step: int) -> torch.Generator:
        if step not in current:
            current.clear()  # steps only move forward: keep the one in use
            current[step] = make(step)
        return current[step]

    return get


class MultiStreamRolloutState:
    """Per-call rollout state of a pipeline that steps ``len(streams)`` schedulers per loop step.

    Args:
        settings, generators, sigmas, step_generators: as for :class:`RolloutState`, shared by every
            stream.
        streams: the streams' names in the order the pipeline steps them each loop step (LTX-2:
            ``("video", "audio")``).
    """

    def __init__(
        self,
        settings: RolloutSettings,
        generators: Sequence[torch.Generator] | None,
        *,
        streams: Sequence[str],
        sigmas: Sequence[float] | None = None,
        step_generators: Sequence[Callable[[int], torch.Generator] | None] | None = None,
    ) -> None:
        names = tuple(streams)
        if len(names) < 2 or len(set(names)) != len(names):
            raise ValueError(f"streams must name two or more distinct streams, got {names!r}")
        self.streams = names
        self.settings = settings
        if step_generators is not None:
            step_generators = [None if fn is None else _once_per_step(fn) for fn in step_generators]
        self.by_stream: dict[str, RolloutState] = {
            name: RolloutState(settings, generators, sigmas=sigmas, step_generators=step_generators)
            for name in names
        }
        self.exact_sigmas = self.primary.exact_sigmas
        self._calls = 0

    @property
    def primary(self) -> RolloutState:
        return self.by_stream[self.streams[0]]

    def for_step(self) -> RolloutState:
        """The state of the ``step`` call being made: streams in turn, in the pipeline's order."""
        state = self.by_stream[self.streams[self._calls % len(self.streams)]]
        self._calls += 1
        return state

    # -- the primary stream's schedule and counters -----------------------------------------------
    @property
    def loop_index(self) -> int:
        return self.primary.loop_index

    @property
    def num_steps(self) -> int | None:
        return self.primary.num_steps

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.by_stream.values())

    @property
    def timesteps(self) -> torch.Tensor | None:
        return self.primary.timesteps

    @property
    def sigmas(self) -> torch.Tensor | None:
        return self.primary.sigmas

    @property
    def sde_step_indices(self) -> list[int]:
        return self.primary.sde_step_indices

    @property
    def latent_step_indices(self) -> list[int]:
        return self.primary.latent_step_indices

    def numels(self) -> list[int]:
        """Elements per sample of each stream's latent, in stream order."""
        out = []
        for name in self.streams:
            traj = self.by_stream[name].trajectory_latents
            if traj is None:
                raise RuntimeError(f"stream {name!r} has not stepped yet")
            out.append(math.prod(traj.shape[2:]))  # [B, K, *latent_shape]; K may be 0
        return out

    def per_sample(self, index: int) -> dict[str, Any]:
        """The primary stream's view, with ``log_probs`` the joint value ``[T]`` and ``streams``
        mapping every stream's name to its own :meth:`RolloutState.per_sample` view."""
        views = {name: self.by_stream[name].per_sample(index) for name in self.streams}
        view = dict(views[self.streams[0]])
        view["log_probs"] = joint_log_prob([views[n]["log_probs"] for n in self.streams], self.numels())
        view["streams"] = views
        return view
