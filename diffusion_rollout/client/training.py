"""Replay for training: recompute a rollout's steps with the trainer's transformer, under autograd.

Given the trainer's transformer (plain, PEFT-wrapped, FSDP-wrapped; ``{"transformer": ...,
"transformer_2": ...}`` for two experts) and rollout outputs that carry ``dit_trajectory`` and
``denoising_env``, :func:`replay_step` recomputes the guided model output of one loop step with the
family's guidance rule (:func:`~diffusion_rollout.client.replay.replay_model_output`) and scores
the recorded transition with the one shared transition function
(:func:`~diffusion_rollout.client.replay.replay_log_prob`). It returns what policy-gradient losses
need: ``log_prob`` (differentiable), the server's ``old_log_prob``, ``mean`` (mu), ``std``,
``sqrt_dt`` and ``g`` (Flow-GRPO, DanceGRPO, GRPO-Guard), so the loss code never re-derives the math.

Design decisions:

- **Exactness needs the server's batch.** A transformer's output depends in the last bits on the
  batch it runs in (kernel choice and summation order follow the batch size, on CPU as on GPU), so
  replay reproduces the server's model output, and the ratio is exactly 1, when it replays the
  samples the server ran together, in the same order, with the same weights, device and dtype.
  Replaying the outputs of one request together matches a server that ran that request as its own
  batch (``max_batch_size`` equal to the group size, or one request in flight); other
  micro-batches agree within float rounding. Nothing is cast or reordered behind the caller's back.
- **The step math comes from the rollout.** The kind, noise level and log-prob form are the ones
  the request used (:class:`~diffusion_rollout.client.results.ReplaySettings`, attached by the
  client); a step outside ``sde_step_indices`` is an ``ode`` step. The schedule is the response's
  ``sigmas``, never rebuilt from timesteps (docs/math.md).
- **Lazy, one step at a time.** :func:`replay_steps` yields step by step so a trainer can call
  ``backward()`` per step and keep one step's graph in memory (Flow-GRPO's timestep accumulation).
- The loss helpers (:func:`group_advantages`, :func:`clipped_policy_loss`, :func:`gaussian_kl`)
  are the common Flow-GRPO pieces, written plainly; trainers with their own losses ignore them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_rollout.client.replay import (
    replay_log_prob,
    replay_model_output,
    replay_stream_model_outputs,
    stack_envs,
)
from diffusion_rollout.client.results import ReplaySettings, RolloutOutput
from diffusion_rollout.protocol.row_sharing import branch_block, branch_path, shared_rows
from diffusion_rollout.scheduler_mixins import TransitionResult, joint_log_prob

__all__ = [
    "ReplayBatch",
    "ReplayedStep",
    "clipped_policy_loss",
    "gaussian_kl",
    "group_advantages",
    "replay_step",
    "replay_steps",
    "trainable_steps",
]

Transformer = torch.nn.Module | Mapping[str, torch.nn.Module]


@dataclass
class ReplayedStep:
    """One replayed loop step for a batch of samples.

    Attributes:
        step: the 0-based loop step.
        kind: the step kind used (``ode`` outside the rollout's stochastic steps).
        log_prob: ``[B]`` float32, the recomputed log-prob (differentiable through the model).
        old_log_prob: ``[B]`` float32, the server's ``rollout_log_probs[:, step]``.
        mean: ``mu`` ``[B, ...]`` float32; ``std``, ``sqrt_dt``, ``g``: 0-dim float32 (``std = g * sqrt_dt``).
        model_output: the guided velocity ``v`` the trainer's model gave.
        latents, next_latents: the recorded ``x`` and stored ``x'`` (on the model's device).
        streams: for models that denoise several latents jointly (LTX-2), each stream's scored
            transition; ``log_prob`` is then their joint value (``joint_log_prob``) and the other
            fields are the first stream's.
    """

    step: int
    kind: str
    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    sqrt_dt: torch.Tensor
    g: torch.Tensor
    model_output: torch.Tensor
    latents: torch.Tensor
    next_latents: torch.Tensor
    streams: dict[str, TransitionResult] | None = None

    @property
    def log_ratio(self) -> torch.Tensor:
        """``log_prob - old_log_prob`` ([B]); exactly 0 on-policy with the server's batch."""
        return self.log_prob - self.old_log_prob

    @property
    def ratio(self) -> torch.Tensor:
        """The PPO ratio ``exp(log_prob - old_log_prob)`` ([B])."""
        return torch.exp(self.log_ratio)


def _as_outputs(outputs: RolloutOutput | Mapping[str, Any] | Sequence[Any]) -> list[RolloutOutput]:
    items = [outputs] if isinstance(outputs, (RolloutOutput, Mapping)) else list(outputs)
    if not items:
        raise ValueError("no rollout outputs to replay")
    return [o if isinstance(o, RolloutOutput) else RolloutOutput.from_dict(o) for o in items]


def _device_of(transformer: Transformer) -> torch.device:
    module = transformer["transformer"] if isinstance(transformer, Mapping) else transformer
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


class ReplayBatch:
    """Outputs prepared once for replay: stacked conditioning, shared schedule, common settings.

    ``settings`` overrides the outputs' own :class:`ReplaySettings` (needed only for outputs built
    from raw dicts, which do not know the request).
    """

    def __init__(
        self,
        outputs: RolloutOutput | Mapping[str, Any] | Sequence[Any],
        *,
        settings: ReplaySettings | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.outputs = _as_outputs(outputs)
        first = self.outputs[0]
        for o in self.outputs:
            if o.dit_trajectory is None or o.denoising_env is None:
                raise ValueError(
                    "replay needs dit_trajectory and denoising_env: generate with "
                    "rollout_return_dit_trajectory=True and rollout_return_denoising_env=True"
                )
            if o.rollout_log_probs is None:
                raise ValueError("replay needs rollout_log_probs (rollout=True)")
        traj = first.dit_trajectory
        assert traj is not None
        for o in self.outputs[1:]:
            t = o.dit_trajectory
            assert t is not None
            if not (torch.equal(t.sigmas, traj.sigmas) and torch.equal(t.timesteps, traj.timesteps)):
                raise ValueError("outputs with different schedules cannot be replayed as one batch")
        self.settings = settings or first.replay_settings
        if settings is None and any(o.replay_settings != self.settings for o in self.outputs):
            raise ValueError("outputs with different step settings cannot be replayed as one batch")
        self.sigmas = traj.sigmas
        self.timesteps = traj.timesteps
        self.num_steps = traj.num_steps
        self.env = stack_envs([o.denoising_env for o in self.outputs])  # type: ignore[misc]
        self.device = torch.device(device) if device is not None else None
        stochastic = {tuple(o.sde_step_indices or ()) for o in self.outputs}
        if len(stochastic) != 1:
            raise ValueError("outputs with different stochastic steps cannot be replayed as one batch")
        self.sde_steps = set(next(iter(stochastic)))
        # A tree (rollout_branch): its steps ran on one row per node; replay narrows the same way.
        self.branch = _tree_of(self.outputs)

    def __len__(self) -> int:
        return len(self.outputs)

    def latents(self, step: int) -> torch.Tensor:
        """The stacked trajectory entry ``step`` ([B, ...])."""
        return torch.stack([o.dit_trajectory.latent(step) for o in self.outputs])  # type: ignore[union-attr]

    def stream_latents(self, name: str, step: int) -> torch.Tensor:
        """Stream ``name``'s stacked trajectory entry ``step`` ([B, ...]; jointly denoised models)."""
        rows = []
        for o in self.outputs:
            traj = o.dit_trajectory
            if traj is None or not traj.streams:
                raise ValueError("these outputs carry no dit_trajectory.streams")
            rows.append(traj.streams[name]["latents"][traj.latent_step_indices.index(step)])
        return torch.stack(rows)

    def old_log_probs(self, step: int) -> torch.Tensor:
        return torch.stack([o.rollout_log_probs[step] for o in self.outputs])  # type: ignore[index]

    def kind_at(self, step: int) -> str:
        return self.settings.kind if step in self.sde_steps else "ode"

    def trainable_steps(self) -> list[int]:
        """Stochastic steps whose latents before and after were both returned, ascending."""
        return [
            s
            for s in sorted(self.sde_steps)
            if all(o.dit_trajectory.has(s) and o.dit_trajectory.has(s + 1) for o in self.outputs)  # type: ignore[union-attr]
        ]


def _tree_of(outputs: Sequence[RolloutOutput]) -> list[list[int]] | None:
    """The tree a batch of leaves came from, checked whole and in order, or None (no tree)."""
    trees = {tuple(map(tuple, o.rollout_branch)) if o.rollout_branch else None for o in outputs}
    if trees == {None}:
        return None
    if len(trees) != 1 or None in trees:
        raise ValueError("outputs of different trees (or a tree and others) cannot be replayed as one batch")
    tree = [list(b) for b in next(iter(trees))]
    expected = [branch_path(r, tree) for r in range(math.prod(f for _, f in tree))]
    if [o.branch_path for o in outputs] != expected:
        raise ValueError("a tree replays as one batch: all of its leaves, in the order it answered them")
    return tree


def trainable_steps(outputs: RolloutOutput | Mapping[str, Any] | Sequence[Any]) -> list[int]:
    """The steps :func:`replay_step` can score for every one of ``outputs``."""
    return ReplayBatch(outputs).trainable_steps()


def replay_step(
    transformer: Transformer,
    outputs: RolloutOutput | Mapping[str, Any] | Sequence[Any] | ReplayBatch,
    step: int,
    *,
    settings: ReplaySettings | None = None,
) -> ReplayedStep:
    """Recompute loop step ``step`` of ``outputs`` (replayed together, as one batch, in order).

    Runs the transformer in the caller's autograd mode: under ``torch.no_grad()`` for a reference
    or old-policy pass, with grad for the loss.
    """
    batch = outputs if isinstance(outputs, ReplayBatch) else ReplayBatch(outputs, settings=settings)
    if not 0 <= step < batch.num_steps:
        raise ValueError(f"step {step} is outside 0..{batch.num_steps - 1}")
    device = batch.device or _device_of(transformer)
    if batch.env.get("streams"):
        return _replay_joint_step(transformer, batch, step, device)
    x = batch.latents(step).to(device)
    x_next = batch.latents(step + 1).to(device)
    block = 1 if batch.branch is None else branch_block(len(batch), batch.branch, step)
    with (
        shared_rows([transformer], len(batch), lambda: block, this_thread=False)
        if block > 1
        else nullcontext()
    ):
        v = replay_model_output(transformer, x, batch.timesteps[step], batch.env, step=step)
    kind = batch.kind_at(step)
    res = replay_log_prob(
        kind,
        x,
        v,
        x_next,
        batch.sigmas.to(device),
        step,
        eta=batch.settings.eta,
        log_prob_form=batch.settings.log_prob_form,
    )
    return ReplayedStep(
        step=step,
        kind=kind,
        log_prob=res.log_prob,
        old_log_prob=batch.old_log_probs(step).to(device),
        mean=res.mean,
        std=res.std,
        sqrt_dt=res.sqrt_dt,
        g=res.g,
        model_output=v,
        latents=x,
        next_latents=x_next,
    )


def _replay_joint_step(transformer: Transformer, batch: ReplayBatch, step: int, device) -> ReplayedStep:
    """:func:`replay_step` for jointly denoised streams: one model call, every stream scored."""
    module = transformer["transformer"] if isinstance(transformer, Mapping) else transformer
    names = list(batch.env["streams"])
    xs = {n: batch.stream_latents(n, step).to(device) for n in names}
    nexts = {n: batch.stream_latents(n, step + 1).to(device) for n in names}
    sigmas = batch.sigmas.to(device)
    v = replay_stream_model_outputs(module, xs, batch.timesteps[step], sigmas[step], batch.env)
    kind = batch.kind_at(step)
    results = {
        n: replay_log_prob(
            kind,
            xs[n],
            v[n],
            nexts[n],
            sigmas,
            step,
            eta=batch.settings.eta,
            log_prob_form=batch.settings.log_prob_form,
        )
        for n in names
    }
    numels = [xs[n][0].numel() for n in names]
    first = results[names[0]]
    return ReplayedStep(
        step=step,
        kind=kind,
        log_prob=joint_log_prob([results[n].log_prob for n in names], numels),
        old_log_prob=batch.old_log_probs(step).to(device),
        mean=first.mean,
        std=first.std,
        sqrt_dt=first.sqrt_dt,
        g=first.g,
        model_output=v[names[0]],
        latents=xs[names[0]],
        next_latents=nexts[names[0]],
        streams=results,
    )


def replay_steps(
    transformer: Transformer,
    outputs: RolloutOutput | Mapping[str, Any] | Sequence[Any] | ReplayBatch,
    steps: Sequence[int] | None = None,
    *,
    settings: ReplaySettings | None = None,
) -> Iterator[ReplayedStep]:
    """:func:`replay_step` for each of ``steps`` (default: every trainable step), lazily."""
    batch = outputs if isinstance(outputs, ReplayBatch) else ReplayBatch(outputs, settings=settings)
    for step in batch.trainable_steps() if steps is None else steps:
        yield replay_step(transformer, batch, step)


# ---------------------------------------------------------------------------- loss helpers
def group_advantages(
    rewards: torch.Tensor, group_size: int, *, eps: float = 1e-4, scale: bool = True
) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean (over its std when ``scale``).

    ``rewards`` is ``[N]`` with consecutive groups of ``group_size`` (one prompt each).
    """
    r = rewards.to(torch.float32)
    if r.ndim != 1 or r.numel() % group_size:
        raise ValueError(f"rewards must be [N] with N a multiple of group_size={group_size}")
    groups = r.view(-1, group_size)
    adv = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (groups.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def tree_advantages(
    rewards: torch.Tensor, branch: Sequence[Sequence[int]], *, eps: float = 1e-4, scale: bool = True
) -> dict[int, torch.Tensor]:
    """BranchGRPO-style advantages of one tree's leaves, per branch step: ``{step: [G]}``.

    A node's reward is the mean of its leaves' (``rewards`` ``[G]``, the leaves in the order the
    server answers them); at branch step ``s`` each leaf takes the advantage of the node it belongs to
    after ``s``, its reward minus the mean over that depth's nodes (over their std when ``scale``). At
    the last branch the nodes are the leaves: plain group advantages.
    """
    r = rewards.to(torch.float32)
    points = [(int(s), int(f)) for s, f in branch]
    leaves = math.prod(f for _, f in points)
    if r.ndim != 1 or r.numel() != leaves:
        raise ValueError(f"rewards must be [{leaves}], one per leaf of the tree, got {tuple(r.shape)}")
    out: dict[int, torch.Tensor] = {}
    nodes = 1
    for step, factor in points:
        nodes *= factor
        node_reward = r.view(nodes, leaves // nodes).mean(dim=1)
        adv = node_reward - node_reward.mean()
        if scale:
            adv = adv / (node_reward.std() + eps)
        out[step] = adv.repeat_interleave(leaves // nodes)
    return out


def _clipped_surrogate(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    adv_clip_max: float | None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Per-sample ``max(-A r, -A clip(r, 1 - c, 1 + c))``, the ratio ``r`` and its stats."""
    adv = advantages.to(log_prob.dtype).to(log_prob.device)
    if adv_clip_max is not None:
        adv = adv.clamp(-adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob.to(log_prob.device))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    with torch.no_grad():
        stats = {
            "ratio_mean": float(ratio.mean()),
            "ratio_min": float(ratio.min()),
            "ratio_max": float(ratio.max()),
            "clip_frac": float(((ratio - 1.0).abs() > clip_range).float().mean()),
        }
    return torch.maximum(unclipped, clipped), ratio, stats


def clipped_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    adv_clip_max: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Flow-GRPO's clipped surrogate ``mean(max(-A r, -A clip(r, 1 - c, 1 + c)))`` and its stats."""
    per_sample, _, stats = _clipped_surrogate(log_prob, old_log_prob, advantages, clip_range, adv_clip_max)
    return per_sample.mean(), stats


def tis_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    tis_cap: float = 2.0,
    adv_clip_max: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate for rollouts made by older weights, with truncated importance sampling.

    ``mean(w * max(-A r, -A clip(r, 1 - c, 1 + c)))`` with ``r = exp(log_prob - old_log_prob)``
    against the trainer's own policy before this update (``old_log_prob``, e.g. ``log_prob.detach()``
    on the first step) and the truncated importance weight ``w = min(exp(old_log_prob -
    behaviour_log_prob), tis_cap)`` (no gradient) correcting for the server's weights that made the
    sample (``behaviour_log_prob``, the rollout's log-prob). On-policy (``old == behaviour``) it is
    ``clipped_policy_loss``. Stats add ``tis_weight_mean``/``_min``/``_max`` and ``tis_capped_frac``.
    """
    per_sample, _, stats = _clipped_surrogate(log_prob, old_log_prob, advantages, clip_range, adv_clip_max)
    with torch.no_grad():
        behaviour = behaviour_log_prob.to(old_log_prob.device, old_log_prob.dtype)
        raw = torch.exp(old_log_prob.detach() - behaviour)
        weight = torch.clamp(raw, max=tis_cap)
        stats.update(
            tis_weight_mean=float(weight.mean()),
            tis_weight_min=float(weight.min()),
            tis_weight_max=float(weight.max()),
            tis_capped_frac=float((raw > tis_cap).float().mean()),
        )
    return (weight.to(per_sample.dtype) * per_sample).mean(), stats


def ratio_stats_by_staleness(records: Iterable[tuple[int, torch.Tensor]]) -> dict[int, dict[str, float]]:
    """``{staleness: {count, mean, min, max}}`` of ``|ratio - 1|`` over ``(staleness, ratios)`` pairs.

    The ratios are the first step's ``exp(log_prob - behaviour_log_prob)`` (trainer vs server): 0 at
    staleness 0 when replay is exact, growing with the number of pushes the batch is behind.
    """
    devs: dict[int, list[torch.Tensor]] = {}
    for staleness, ratios in records:
        devs.setdefault(int(staleness), []).append((ratios.detach().double().flatten() - 1.0).abs().cpu())
    out = {}
    for staleness in sorted(devs):
        d = torch.cat(devs[staleness])
        out[staleness] = {
            "count": int(d.numel()),
            "mean": float(d.mean()),
            "min": float(d.min()),
            "max": float(d.max()),
        }
    return out


def gaussian_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-sample KL between ``N(mean, std^2)`` and ``N(ref_mean, std^2)`` averaged over elements ([B]).

    Flow-GRPO's KL regulariser: ``mean((mu - mu_ref)^2) / (2 std^2)``, with ``mu_ref`` from a replay
    of the reference model (e.g. adapters disabled) under ``torch.no_grad()``.
    """
    diff = (mean - ref_mean.to(mean.dtype)) ** 2
    return diff.flatten(1).mean(dim=1) / (2 * std**2)
