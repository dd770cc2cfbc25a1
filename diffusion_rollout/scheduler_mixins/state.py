"""Rollout settings and the per-call rollout state: step selection, per-sample RNG and recordings.

Design decisions:

- **Nothing request-specific lives on the scheduler.** A :class:`RolloutState` belongs to one
  pipeline call (one request, or one batch of requests that share settings); the scheduler finds it
  through :func:`~diffusion_rollout.scheduler_mixins.rollout_context`. A state records one denoising
  loop and is not reused.
- **The loop index is counted here**, 0 at the first ``step()`` that runs. The scheduler's
  ``_step_index`` is offset when a pipeline starts part-way (image-to-image ``strength``), so ``T``
  is the number of steps that actually run: ``len(scheduler.timesteps) - first step index``, known at
  the first step. Step indices of the settings are loop indices.
- **RNG order.** Sample ``i`` owns ``generators[i]``. At a stochastic step each sample draws one
  ``eps`` of shape ``[1, *latent_shape]`` in float32 from its own generator (diffusers' ``randn_tensor``,
  so a CPU generator draws on the CPU and the result moves to the latent's device), and the draws
  are concatenated. An ODE step draws nothing: the generator does not advance. A sample's result
  therefore depends only on its own generator, never on the rest of the batch.
- **Recordings** are preallocated at the first step on the latent's device and written in place step
  by step (no final ``torch.stack`` copy); the engine moves them. Tensors are batch first;
  :meth:`RolloutState.per_sample` returns views without a batch dimension. Values are recorded
  detached: they are data for the response, not part of a graph.
- **Trajectory dtype**: ``promote_types(latent dtype, model output dtype)``, which is the stored
  dtype whenever the pipeline keeps its latents in the model's dtype (every diffusers flow pipeline),
  and is lossless otherwise.
- **Validation** of a request's rollout fields is :meth:`RolloutSettings.validate`, raising
  :class:`~diffusion_rollout.errors.RequestError` with the HTTP field name; the engine calls it before
  starting the pipeline, and the state calls it again at the first step as a guard.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor

from diffusion_rollout.errors import RequestError

from .sigmas import validate_sigmas
from .transition import LOG_PROB_FORMS, STEP_KINDS, TransitionResult

__all__ = ["RolloutSettings", "RolloutState"]


def _as_index_tuple(value: Any) -> Any:
    # Lists arrive from JSON; keep the dataclass hashable and immutable. Anything odd is left for
    # validate() to reject with the field name.
    if isinstance(value, (list, range)):
        return tuple(value)
    return value


def _check_indices(indices: Any, upper: int, field: str) -> None:
    if not isinstance(indices, tuple):
        raise RequestError(f"{field} must be a list of integers or null, got {indices!r}", field=field)
    seen: set[int] = set()
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, int):
            raise RequestError(f"{field} must hold integers, got {index!r}", field=field)
        if not 0 <= index <= upper:
            raise RequestError(
                f"{field} must lie within 0..{upper} for this schedule, got {index}",
                field=field,
            )
        if index in seen:
            raise RequestError(f"{field} lists step {index} more than once", field=field)
        seen.add(index)


@dataclass(frozen=True)
class RolloutSettings:
    """What a request asks of the rollout (immutable, shareable by requests batched together).

    Attributes:
        kind: step kind for the stochastic steps, one of ``STEP_KINDS`` (``rollout_sde_type``).
        eta: noise level (``rollout_noise_level``).
        log_prob_form: one of ``LOG_PROB_FORMS`` (``rollout_log_prob_form`` /
            ``rollout_log_prob_no_const``, resolved by the engine).
        sde_step_indices: loop steps that are stochastic; ``None`` = all, ``()`` = none.
        return_step_indices: trajectory entries to keep (``0..T``, ``T`` = final latent); ``None`` =
            all ``T+1``. Kept entries are stored in increasing index order.
        debug: also record noise, mean, std and model output per step (``rollout_debug_mode``).
        record: ``False`` for plain generation: the stock step runs and nothing is recorded.
        ode_solver: the ODE steps' solver, ``"euler"`` (stock) or ``"dpm2m"`` (``outside_window.py``).
        keep_sigma_indices: the full schedule's sigma indices the loop runs on (``outside_window.py``;
            the step indices above are then of the kept schedule); ``None`` = all.
    """

    kind: str = "sde"
    eta: float = 0.7
    log_prob_form: str = "gaussian"
    sde_step_indices: tuple[int, ...] | None = None
    return_step_indices: tuple[int, ...] | None = None
    debug: bool = False
    record: bool = True
    ode_solver: str = "euler"
    keep_sigma_indices: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "sde_step_indices", _as_index_tuple(self.sde_step_indices))
        object.__setattr__(self, "return_step_indices", _as_index_tuple(self.return_step_indices))

    def kind_at(self, index: int, num_steps: int) -> str:
        """The kind loop step ``index`` (of ``num_steps``) runs: ``kind`` if it is stochastic, else
        ``"ode"``. cps's last step is deterministic: its noise std ``s' * sin(eta * pi / 2)`` is 0
        there (``s' = 0``), so it runs and is scored as an ODE step (log-prob 0 in every form, left
        out of ``sde_step_indices``) instead of giving a non-finite gaussian log-prob (docs/math.md)."""
        if self.sde_step_indices is not None and index not in self.sde_step_indices:
            return "ode"
        if self.kind == "cps" and index == num_steps - 1:
            return "ode"
        return self.kind

    def stochastic_steps(self, num_steps: int) -> list[int]:
        """The loop steps (of ``num_steps``) that run a stochastic kind, in increasing order."""
        return [index for index in range(num_steps) if self.kind_at(index, num_steps) != "ode"]

    def kept_trajectory_indices(self, num_steps: int) -> list[int]:
        """The trajectory entries (of ``num_steps + 1``) that are recorded, in increasing order."""
        if self.return_step_indices is None:
            return list(range(num_steps + 1))
        return sorted(self.return_step_indices)

    def validate(self, num_steps: int, sigmas: Sequence[float] | None = None) -> None:
        """Reject what docs/math.md forbids for a schedule of ``num_steps`` loop steps.

        Raises ``RequestError`` whose ``field`` is the HTTP field to fix. ``sigmas`` (a custom schedule,
        without the terminal 0) is validated too when given. With ``record=False`` only the schedule
        is checked: plain generation does not use the rollout fields.
        """
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise RequestError(
                f"num_inference_steps must be an integer >= 1, got {num_steps!r}", field="num_inference_steps"
            )
        if sigmas is not None:
            validate_sigmas(sigmas, num_steps)
        if not self.record:
            return
        if self.kind not in STEP_KINDS:
            raise RequestError(
                f"rollout_sde_type must be one of {list(STEP_KINDS)}, got {self.kind!r}",
                field="rollout_sde_type",
            )
        if self.log_prob_form not in LOG_PROB_FORMS:
            raise RequestError(
                f"rollout_log_prob_form must be one of {list(LOG_PROB_FORMS)}, got {self.log_prob_form!r}",
                field="rollout_log_prob_form",
            )
        eta = self.eta
        if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not math.isfinite(eta) or eta < 0:
            raise RequestError(
                f"rollout_noise_level must be a finite number >= 0, got {eta!r}", field="rollout_noise_level"
            )
        if self.sde_step_indices is not None:
            _check_indices(self.sde_step_indices, num_steps - 1, "rollout_sde_step_indices")
        if self.return_step_indices is not None:
            _check_indices(self.return_step_indices, num_steps, "rollout_return_step_indices")

        stochastic = self.stochastic_steps(num_steps)
        divides_by_std = self.log_prob_form in ("gaussian", "scaled")
        if not stochastic and self.log_prob_form == "gaussian":
            cps_note = (
                " (cps's last step has noise std 0 and runs as an ODE step)" if self.kind == "cps" else ""
            )
            raise RequestError(
                "every step is ODE (rollout_sde_type='ode' or an empty rollout_sde_step_indices)"
                f"{cps_note}, and an ODE step has no density, so the gaussian log-prob is undefined: send "
                "rollout_log_prob_no_const=true (every step then contributes 0)",
                field="rollout_log_prob_no_const",
            )
        if stochastic and divides_by_std and eta == 0:
            raise RequestError(
                f"rollout_noise_level=0 makes the noise std of the stochastic steps 0, and the "
                f"{self.log_prob_form} log-prob divides by it: send rollout_noise_level > 0, or "
                "rollout_log_prob_no_const=true",
                field="rollout_noise_level",
            )
        if self.kind == "cps" and stochastic and divides_by_std and eta >= 2:
            raise RequestError(
                f"rollout_sde_type='cps' has noise std sigma_next * sin(eta * pi / 2), which is not positive "
                f"for rollout_noise_level={eta}: send a value in (0, 2) (usually <= 1), or "
                "rollout_log_prob_no_const=true",
                field="rollout_noise_level",
            )


class RolloutState:
    """Per-call rollout state: settings, the samples' generators, an exact schedule, the recordings.

    Args:
        settings: the rollout settings.
        generators: one ``torch.Generator`` per sample of the batch (``generators[i]`` drives sample
            ``i``), or ``None`` to draw from torch's global RNG (not reproducible; tests and tools only).
        step_generators: per sample, ``None`` or a function of the loop step returning the generator
            that step's noise is drawn from (``denoise_seeds``); ``None``: every sample uses its own.
        sigmas: ``T`` floats ``sigma_0 .. sigma_{T-1}`` to use *exactly* (no shift, dynamic shift or
            ``shift_terminal`` on top); the terminal 0 is appended. ``None``: the pipeline's own schedule.
            Validated here (``RequestError(field="sigmas")``).

    Recordings (``None`` until the first step; tensors batch first, on the latent's device):

    - ``num_steps`` (``T``), ``finished`` (the last step ran), ``step_offset`` (scheduler step index
      of loop step 0; nonzero when the pipeline starts part-way), ``sigma_max`` (0-dim, the value
      the ``sde`` kind used for ``s~``).
    - ``log_probs`` ``[B, T]`` float32, exactly 0 at ODE steps.
    - ``trajectory_latents`` ``[B, K, *latent_shape]``: entry ``k`` is the latent entering loop step
      ``latent_step_indices[k]`` (index ``T``: the final latent); ``K = T + 1`` by default.
    - ``latent_step_indices`` ``list[int]``; ``sde_step_indices`` ``list[int]`` (stochastic steps).
    - ``timesteps`` ``[T + 1]`` float32: the timesteps handed to ``step()``, then a terminal 0.
    - ``sigmas`` ``[T + 1]`` float32: the schedule used, ending with 0.
    - with ``settings.debug``: ``variance_noises`` ``[B, T, *latent_shape]`` float32 (zeros at ODE
      steps), ``prev_sample_means`` ``[B, T, *latent_shape]`` float32, ``noise_std_devs`` ``[T, 1]``
      float32 (the same for every sample), ``model_outputs`` ``[B, T, *latent_shape]`` in the model
      output's dtype.
    """

    def __init__(
        self,
        settings: RolloutSettings,
        generators: Sequence[torch.Generator] | None,
        *,
        sigmas: Sequence[float] | None = None,
        step_generators: Sequence[Callable[[int], torch.Generator] | None] | None = None,
    ) -> None:
        self.settings = settings
        self.generators: list[torch.Generator] | None = None if generators is None else list(generators)
        # Per sample, optionally: loop step -> the generator that step's noise comes from (a
        # trainer's denoise_seeds), instead of the sample's own generator.
        self.step_generators = None if step_generators is None else list(step_generators)
        self.exact_sigmas: tuple[float, ...] | None = (
            None if sigmas is None else tuple(validate_sigmas(sigmas, None))
        )

        self.num_steps: int | None = None
        self.finished = False
        self.step_offset: int | None = None
        self.sigma_max: torch.Tensor | None = None
        self.log_probs: torch.Tensor | None = None
        self.trajectory_latents: torch.Tensor | None = None
        self.latent_step_indices: list[int] = []
        self.timesteps: torch.Tensor | None = None
        self.sigmas: torch.Tensor | None = None
        self.sde_step_indices: list[int] = []
        self.variance_noises: torch.Tensor | None = None
        self.prev_sample_means: torch.Tensor | None = None
        self.noise_std_devs: torch.Tensor | None = None
        self.model_outputs: torch.Tensor | None = None

        self._loop_index = 0
        self._kept_position: dict[int, int] = {}
        # dpm2m: (sigma, x0) of the current ODE run's last step; None at a run's start.
        self.ode_history: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def loop_index(self) -> int:
        """The loop index of the next step to run (0 before the first)."""
        return self._loop_index

    def for_step(self) -> RolloutState:
        """The state a scheduler's ``step`` call records into: this one (see ``streams.py``)."""
        return self

    @property
    def started(self) -> bool:
        return self.num_steps is not None

    def _check_can_step(self) -> None:
        if self.finished:
            raise RuntimeError(
                "this RolloutState already recorded a whole denoising loop; create one per pipeline call"
            )

    # -- used by the scheduler -------------------------------------------------------------------

    def begin(
        self,
        *,
        sample: torch.Tensor,
        model_output: torch.Tensor,
        scheduler_sigmas: torch.Tensor,
        start_index: int,
    ) -> None:
        """Size and allocate the recordings at the first step (``scheduler_sigmas`` includes the terminal)."""
        num_steps = len(scheduler_sigmas) - 1 - start_index
        self.settings.validate(num_steps)
        if self.exact_sigmas is not None:
            # Catches a state bound after the pipeline set its own schedule: the request's sigmas
            # would be silently ignored. One small comparison per call.
            wanted = torch.tensor([*self.exact_sigmas, 0.0], dtype=torch.float32)
            if self.settings.keep_sigma_indices is not None:
                wanted = wanted[list(self.settings.keep_sigma_indices)]
            if not torch.equal(scheduler_sigmas.detach().to("cpu", torch.float32), wanted):
                raise RuntimeError(
                    "the scheduler is not running the state's exact sigmas: enter rollout_context(state) "
                    "before the pipeline calls set_timesteps"
                )
        batch = sample.shape[0]
        if self.generators is not None and len(self.generators) != batch:
            raise ValueError(
                f"RolloutState has {len(self.generators)} generators for a batch of {batch} latents; "
                "pass one generator per sample"
            )
        device = sample.device
        latent_shape = tuple(sample.shape[1:])
        settings = self.settings

        self.num_steps = num_steps
        self.step_offset = start_index
        self.sigma_max = scheduler_sigmas[min(1, len(scheduler_sigmas) - 1)].clone()
        self.sigmas = scheduler_sigmas[start_index:].to(device=device, dtype=torch.float32).clone()
        # The step's scalars on the latent's device, copied once here: diffusers keeps its sigmas on
        # the CPU, and a per-step host-to-device copy of a scalar synchronises the stream, stalling
        # the GPU between steps. The values are the same float32 numbers, so the math is unchanged.
        self._device_sigmas = scheduler_sigmas.to(device=device, dtype=torch.float32)
        self._device_sigma_max = self.sigma_max.to(device=device, dtype=torch.float32)
        self._device_eta = torch.tensor(float(settings.eta), dtype=torch.float32).to(device)
        self.timesteps = torch.zeros(num_steps + 1, dtype=torch.float32, device=device)
        self.sde_step_indices = settings.stochastic_steps(num_steps)
        self.latent_step_indices = settings.kept_trajectory_indices(num_steps)
        self._kept_position = {index: k for k, index in enumerate(self.latent_step_indices)}
        self.log_probs = torch.zeros(batch, num_steps, dtype=torch.float32, device=device)
        self.trajectory_latents = torch.empty(
            (batch, len(self.latent_step_indices), *latent_shape),
            dtype=torch.promote_types(sample.dtype, model_output.dtype),
            device=device,
        )
        if settings.debug:
            per_step = (batch, num_steps, *latent_shape)
            self.variance_noises = torch.zeros(per_step, dtype=torch.float32, device=device)
            self.prev_sample_means = torch.empty(per_step, dtype=torch.float32, device=device)
            self.noise_std_devs = torch.zeros(num_steps, 1, dtype=torch.float32, device=device)
            self.model_outputs = torch.empty(per_step, dtype=model_output.dtype, device=device)

    def current_kind(self) -> str:
        """The kind of the step about to run."""
        self._check_can_step()
        return self.settings.kind_at(self._loop_index, self.num_steps)

    def step_scalars(
        self, scheduler_index: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sigma, sigma_next, sigma_max, eta) of the scheduler's step ``scheduler_index``, on device."""
        return (
            self._device_sigmas[scheduler_index],
            self._device_sigmas[scheduler_index + 1],
            self._device_sigma_max,
            self._device_eta,
        )

    def draw_noise(self, latent: torch.Tensor) -> torch.Tensor:
        """One float32 ``eps`` per sample from its own generator, concatenated (see the module docstring)."""
        if self.generators is None:
            return randn_tensor(
                tuple(latent.shape), generator=None, device=latent.device, dtype=torch.float32
            )
        shape = (1, *latent.shape[1:])
        generators = self.generators
        if self.step_generators is not None:
            step = self._loop_index
            generators = [
                own if per_step is None else per_step(step)
                for own, per_step in zip(self.generators, self.step_generators, strict=True)
            ]
        return torch.cat(
            [
                randn_tensor(shape, generator=generator, device=latent.device, dtype=torch.float32)
                for generator in generators
            ]
        )

    def record_step(
        self,
        *,
        timestep: float | torch.Tensor,
        sample: torch.Tensor,
        model_output: torch.Tensor,
        result: TransitionResult,
        noise: torch.Tensor | None,
    ) -> None:
        """Record loop step ``loop_index`` and advance the loop index."""
        self._check_can_step()
        if self.num_steps is None:
            raise RuntimeError("record_step() before begin(): the scheduler sizes the recordings first")
        index = self._loop_index
        if not isinstance(timestep, torch.Tensor):
            timestep = torch.tensor(float(timestep), dtype=torch.float32)
        elif timestep.ndim > 0:
            # Some pipelines expand the timestep to the batch; every entry is the same.
            timestep = timestep.reshape(-1)[0]
        self.timesteps[index] = timestep.detach()
        self.log_probs[:, index] = result.log_prob.detach()
        position = self._kept_position.get(index)
        if position is not None:
            self.trajectory_latents[:, position] = sample.detach()
        if self.settings.debug:
            if noise is not None:
                self.variance_noises[:, index] = noise.detach()
            self.prev_sample_means[:, index] = result.mean.detach()
            self.noise_std_devs[index, 0] = result.std.detach()
            self.model_outputs[:, index] = model_output.detach()
        self._loop_index += 1
        if self._loop_index == self.num_steps:
            final = self._kept_position.get(self.num_steps)
            if final is not None:
                self.trajectory_latents[:, final] = result.next_sample.detach()
            self.finished = True

    def note_stock_step(self, *, num_scheduler_steps: int, step_index: int) -> None:
        """Count a step run by the stock scheduler (``record=False``): only ``num_steps``/``finished``."""
        self._check_can_step()
        if self.num_steps is None:
            self.num_steps = num_scheduler_steps - step_index
            self.step_offset = step_index
        self._loop_index += 1
        if self._loop_index == self.num_steps:
            self.finished = True

    # -- used by the engine ----------------------------------------------------------------------

    def per_sample(self, index: int) -> dict[str, Any]:
        """Sample ``index``'s recordings without the batch dimension (views, no copies).

        Keys: ``log_probs`` ``[T]``, ``trajectory_latents`` ``[K, ...]``, ``latent_step_indices``,
        ``timesteps`` ``[T+1]``, ``sigmas`` ``[T+1]``, ``sde_step_indices``, and with ``debug``:
        ``variance_noises`` ``[T, ...]``, ``prev_sample_means`` ``[T, ...]``, ``noise_std_devs``
        ``[T, 1]``, ``model_outputs`` ``[T, ...]``. Timesteps, sigmas and ``noise_std_devs`` are shared
        by all samples (the same tensor). A view keeps the whole batch's storage alive and serialises
        it with ``torch.save``: copy (``.clone()``/``.cpu()``) what leaves the process.
        """
        if not self.settings.record:
            raise RuntimeError("nothing was recorded: settings.record is False (plain generation)")
        if self.log_probs is None:
            raise RuntimeError("nothing was recorded yet: the denoising loop has not run a step")
        batch = self.log_probs.shape[0]
        if not -batch <= index < batch:
            raise IndexError(f"sample index {index} out of range for a batch of {batch}")
        view: dict[str, Any] = {
            "log_probs": self.log_probs[index],
            "trajectory_latents": self.trajectory_latents[index],
            "latent_step_indices": list(self.latent_step_indices),
            "timesteps": self.timesteps,
            "sigmas": self.sigmas,
            "sde_step_indices": list(self.sde_step_indices),
        }
        if self.settings.debug:
            view["variance_noises"] = self.variance_noises[index]
            view["prev_sample_means"] = self.prev_sample_means[index]
            view["noise_std_devs"] = self.noise_std_devs
            view["model_outputs"] = self.model_outputs[index]
        return view
