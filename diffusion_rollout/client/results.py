"""Typed results of the trainer client: one :class:`RolloutOutput` per generated output.

Design decisions:

- Field names are api.md's response fields (``rollout_log_probs``, ``dit_trajectory``, ...), so the
  spec is the documentation and nothing is renamed between the wire and the trainer. Tensors are
  torch tensors on the CPU, as decoded; nothing is moved or cast.
- The response does not echo the step kind, noise level and log-prob form, yet replay needs them.
  The client knows them from the request it sent, so it attaches them to every output as
  :class:`ReplaySettings`; an output therefore carries everything needed to recompute its
  log-probs, and a trainer cannot replay with settings other than the ones the server used.
- Fields a newer server adds are kept in ``extra`` rather than dropped or rejected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

__all__ = ["DitTrajectory", "ReplaySettings", "RolloutOutput", "UpdateResult"]

# api.md defaults of the request fields that decide the step math.
DEFAULT_SDE_TYPE = "sde"
DEFAULT_NOISE_LEVEL = 0.7


@dataclass(frozen=True)
class ReplaySettings:
    """The step math a request asked for: what replay must use to score the recorded transitions."""

    kind: str = DEFAULT_SDE_TYPE
    eta: float = DEFAULT_NOISE_LEVEL
    log_prob_form: str = "gaussian"

    @classmethod
    def from_request(cls, body: Mapping[str, Any]) -> ReplaySettings:
        """Resolve the settings the server applies to a request body (extra_sampling_params last)."""
        merged = dict(body)
        merged.update(body.get("extra_sampling_params") or {})
        form = merged.get("rollout_log_prob_form") or (
            "no_const" if merged.get("rollout_log_prob_no_const") else "gaussian"
        )
        eta = merged.get("rollout_noise_level")
        return cls(
            kind=merged.get("rollout_sde_type") or DEFAULT_SDE_TYPE,
            eta=float(DEFAULT_NOISE_LEVEL if eta is None else eta),
            log_prob_form=form,
        )


@dataclass
class DitTrajectory:
    """``dit_trajectory``: the latents entering each kept step (and the final one), and the schedule.

    ``latents[k]`` is the latent entering loop step ``latent_step_indices[k]`` (index ``T`` is the
    final latent); ``timesteps`` and ``sigmas`` are never filtered (``T + 1`` values each).
    ``streams`` (models that denoise several latents jointly, LTX-2): per stream name, its own
    ``latents`` (same entries) and per-step ``log_probs``; ``latents`` above is the first stream's.
    """

    latents: torch.Tensor
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    latent_step_indices: list[int]
    streams: dict[str, dict[str, torch.Tensor]] | None = None

    @property
    def num_steps(self) -> int:
        """``T``, the number of loop steps."""
        return int(self.sigmas.shape[0]) - 1

    def has(self, step: int) -> bool:
        """Whether the latent entering ``step`` (``T``: the final latent) was returned."""
        return step in self.latent_step_indices

    def latent(self, step: int) -> torch.Tensor:
        """The latent entering loop step ``step`` (no batch dimension)."""
        try:
            k = self.latent_step_indices.index(step)
        except ValueError:
            raise KeyError(
                f"trajectory entry {step} was not returned (rollout_return_step_indices kept "
                f"{self.latent_step_indices})"
            ) from None
        return self.latents[k]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DitTrajectory:
        return cls(
            latents=d["latents"],
            timesteps=d["timesteps"],
            sigmas=d["sigmas"],
            latent_step_indices=[int(i) for i in d["latent_step_indices"]],
            streams=d.get("streams"),
        )


@dataclass
class RolloutOutput:
    """One output of ``/rollout/generate`` (api.md's response object), plus the request's step math.

    ``rollout_log_probs`` is ``[T]`` float32 (0 at ODE steps); ``generated_output`` is ``[C, H, W]``
    (image) or ``[C, F, H, W]`` (video), or the latents with ``return_generated_output=False``.
    """

    request_id: str
    prompt: str
    seed: int
    weight_version: Any
    generated_output: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    rollout_debug_tensors: dict[str, torch.Tensor] | None = None
    denoising_env: dict[str, Any] | None = None
    dit_trajectory: DitTrajectory | None = None
    sde_step_indices: list[int] | None = None
    expert_per_step: list[str] | None = None
    inference_time_s: float | None = None
    peak_memory_mb: float | None = None
    nonfinite_output: bool = False
    batch_id: str | None = None
    batch_index: int | None = None
    batch_size: int | None = None
    # With ``rollout_branch``: this leaf's child index at each branch point, and the tree
    # ([[step, factor], ...]); the leaves of one tree replay as one batch, in order.
    branch_path: list[int] | None = None
    rollout_branch: list[list[int]] | None = None
    # With ``rewards`` asked for (serve --reward): {name: value, None when failed}, why each failed
    # one failed, and a reward's own outputs (a judge's reading).
    rewards: dict[str, float | None] | None = None
    reward_errors: dict[str, str] | None = None
    reward_extras: dict[str, Any] | None = None
    replay_settings: ReplaySettings = field(default_factory=ReplaySettings)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], settings: ReplaySettings | None = None) -> RolloutOutput:
        """From one decoded response object (``wire.decode``)."""
        known = {f.name for f in fields(cls)} - {"replay_settings", "extra"}
        values = {k: v for k, v in d.items() if k in known}
        if values.get("dit_trajectory") is not None:
            values["dit_trajectory"] = DitTrajectory.from_dict(values["dit_trajectory"])
        if values.get("sde_step_indices") is not None:
            values["sde_step_indices"] = [int(i) for i in values["sde_step_indices"]]
        values["nonfinite_output"] = bool(values.get("nonfinite_output") or False)
        return cls(
            **values,
            replay_settings=settings or ReplaySettings(),
            extra={k: v for k, v in d.items() if k not in known},
        )


@dataclass
class UpdateResult:
    """The answer to a weight, LoRA, memory or pause call (from every server it was sent to).

    ``weight_version`` is the first server's; ``responses`` maps each server URL to its answer.
    """

    success: bool
    message: str
    weight_version: Any
    responses: dict[str, dict[str, Any]]

    @classmethod
    def from_responses(cls, responses: Mapping[str, Mapping[str, Any]]) -> UpdateResult:
        items = list(responses.items())
        first = dict(items[0][1]) if items else {}
        return cls(
            success=all(bool(r.get("success", True)) for _, r in items),
            message=" | ".join(str(r.get("message", "")) for _, r in items)
            if len(items) > 1
            else str(first.get("message", "")),
            weight_version=first.get("weight_version"),
            responses={u: dict(r) for u, r in items},
        )


def group_by_server_batch(outputs: Sequence[RolloutOutput]) -> list[list[RolloutOutput]]:
    """Outputs regrouped as the server ran them: one list per pipeline call, in row order.

    Replaying each group as one batch (``ReplayBatch(group)``) gives the server's model outputs
    bit for bit; a group is complete only if every output of that call is among ``outputs``.
    """
    groups: dict[str, list[RolloutOutput]] = {}
    for o in outputs:
        groups.setdefault(o.batch_id or f"unbatched-{id(o)}", []).append(o)
    return [sorted(g, key=lambda o: o.batch_index or 0) for g in groups.values()]
