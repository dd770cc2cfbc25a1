"""Flow-GRPO's rollouts: what each iteration asks for, and where the answers come from.

- **The request.** One request per prompt with ``num_outputs_per_prompt = G`` (a GRPO group, one
  shared x_T per group as in Flow-GRPO-Fast), stochastic steps only in a window of ``--sde-window``
  steps drawn per iteration (:func:`sde_window`); the trajectory and the conditioning come back for
  replay, the images as uint8 (:func:`request_fields`, :meth:`Rollouts.jobs`).
- **The source** (:class:`Rollouts`): the server, synchronously, where only a batch made under the
  pushed version is trained on (a lost server is recovered from and the rollouts redone); the
  server's stream (``--async-depth``), whose batches may be a bounded number of pushes stale; or the
  trainer's own process (``--layout in-process``).
- **Screening** (``--screen``): candidates made cheaply, scored, and the chosen ones regenerated
  exactly (:func:`screened_groups`).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_rollout.client import RolloutClient
from diffusion_rollout.recipes.options import PROMPTS
from diffusion_rollout.recipes.ranks import Ranks
from diffusion_rollout.recipes.recovery import Recovery
from diffusion_rollout.recipes.timing import Phases, clock


def sde_window(args: argparse.Namespace, iteration: int) -> list[int] | None:
    """This iteration's stochastic steps: a window drawn from a per-iteration seeded RNG (with
    --branch, the branch steps)."""
    if args.branch:
        return [p["step"] for p in args.branch]
    if args.sde_window <= 0:
        return None
    # The last step ends at sigma 0 and has no density in the gaussian form: never in the window.
    upper = min(args.sde_window_range or max(args.steps // 2, args.sde_window), args.steps - 1)
    start = random.Random(args.seed * 100_003 + iteration).randint(0, max(upper - args.sde_window, 0))
    return list(range(start, min(start + args.sde_window, args.steps - 1)))


def prompt_set(name: str) -> list[str]:
    """``--prompt-set``'s prompts."""
    if name == "ocr":
        from diffusion_rollout.rewards import OCR_PROMPTS

        return list(OCR_PROMPTS)
    return list(PROMPTS)


def guidance_record(output) -> dict[str, Any] | None:
    """The guidance the replay applied (the rule and its scale), from the rollout's conditioning."""
    guidance = (output.denoising_env or {}).get("guidance")
    if not guidance:
        return None
    return {k: v for k, v in guidance.items() if isinstance(v, (str, int, float, bool)) or v is None}


def extremes(scores: torch.Tensor, keep: int) -> list[int]:
    """The ``keep`` candidates with the highest and lowest scores (the upper half rounded up), in
    candidate order: a group whose rewards spread wide gives its advantages the most to say."""
    order = scores.argsort(descending=True).tolist()
    high = (keep + 1) // 2
    return sorted(order[:high] + order[len(order) - (keep - high) :] if keep > high else order[:high])


def screened_groups(
    client: RolloutClient, jobs: list[dict[str, Any]], shared: dict[str, Any], args: argparse.Namespace,
    reward_fn: Any, phases: Any,
) -> list[list[Any]]:  # fmt: skip
    """Screen then regenerate (Sol-RL's idea): ``--screen`` candidates per group made cheaply
    (``--screen-cache``, no trajectory), scored, and the chosen ``--group-size`` regenerated exactly
    (``client.regenerate.regenerate_body``: the same x_T and step noise, exact numbers)."""
    from diffusion_rollout.client.regenerate import regenerate_body

    screen = {"num_outputs_per_prompt": args.screen, "rollout_return_dit_trajectory": False,
              "rollout_return_denoising_env": False, "rollout_return_step_indices": None}  # fmt: skip
    if args.screen_cache != "none":
        screen.update(feature_cache={"kind": args.screen_cache}, allow_inexact=True)
    bodies = [{**shared, **job, **screen} for job in jobs]
    with phases("screen"):
        candidates = client.generate_many(bodies)
        chosen = [extremes(reward_fn(c), args.group_size) for c in candidates]
    keep = {k: shared[k] for k in ("rollout_return_dit_trajectory", "rollout_return_denoising_env")}
    again = [
        regenerate_body(b, c, ch, rollout_return_step_indices=job.get("rollout_return_step_indices"), **keep)
        for b, c, ch, job in zip(bodies, candidates, chosen, jobs, strict=True)
    ]
    return client.generate_many(again)


def request_fields(
    args: argparse.Namespace, width: int, height: int, device: torch.device, reward_fn: Any
) -> dict[str, Any]:
    """The fields every request of the run shares (the per-group ones are :meth:`Rollouts.jobs`')."""
    shared = dict(
        num_outputs_per_prompt=args.group_size, num_inference_steps=args.steps,
        width=width, height=height, num_frames=args.frames, guidance_scale=args.guidance_scale,
        rollout_sde_type=args.step_kind, rollout_noise_level=args.noise_level,
        rollout_return_dit_trajectory=True, rollout_return_denoising_env=True, rollout_debug_mode=False,
        output_dtype="uint8", generator_device="cuda" if device.type == "cuda" else "cpu",
    )  # fmt: skip
    # Sent only when set, so the families that take no such field are asked exactly as before.
    shared.update({k: v for k, v in (("true_cfg_scale", args.true_cfg_scale), ("negative_prompt", args.negative_prompt),
                                     ("max_sequence_length", args.max_sequence_length)) if v is not None})  # fmt: skip
    if args.share_prefix:
        shared["rollout_share_prefix"] = True
    if args.branch:  # a tree per group: its leaves are the group (server/core/branch_tree.py)
        shared["rollout_branch"] = args.branch
    if args.outside_window_stride != 1 or args.ode_solver != "euler":  # fewer, cheaper ODE steps
        shared.update(
            rollout_outside_window_stride=args.outside_window_stride, rollout_ode_solver=args.ode_solver
        )
    shared.update(reward_fn.request_fields())  # --reward-on server: the server scores, no pixels travel
    return shared


@dataclass
class Batch:
    """One iteration's groups on this rank, and how they were made."""

    groups: list[list[Any]]
    staleness: int | None = None  # pushes behind the trainer (--async-depth; None: synchronous)
    server_span: list[float] | None = None  # when the stream sent the batch and had its answer
    regenerated: bool = False  # remade under the current version (the ranks' stale batches disagreed)


class Rollouts:
    """Each iteration's groups for this rank, from the server (synchronously, or ``--async-depth``
    iterations ahead through ``RolloutClient.rollout_stream``) or from the in-process ``sampler``.

    ``sync`` is the run's :class:`~diffusion_rollout.recipes.weight_sync.ServedLora` (None in-process):
    a lost server is waited for, the weights re-pushed and the rollouts redone through ``recovery``.
    """

    def __init__(
        self, args: argparse.Namespace, client: RolloutClient | None, sampler: Any, shared: dict[str, Any],
        ranks: Ranks, recovery: Recovery, sync: Any, reward_fn: Any, *, first_iteration: int, version: str,
    ) -> None:  # fmt: skip
        self.args, self.client, self.sampler, self.shared = args, client, sampler, shared
        self.ranks, self.recovery, self.sync, self.reward_fn = ranks, recovery, sync, reward_fn
        self.prompts = prompt_set(args.prompt_set)
        self.stream = None
        if args.async_depth > 0 and client is not None:
            self.stream = self._open_stream(first_iteration, version)

    def jobs(self, it: int) -> list[dict[str, Any]]:
        """This rank's groups of iteration ``it``: its block of the iteration's ``--prompts`` groups,
        each seeded by its index in the whole iteration (so N ranks make the 1-rank batch)."""
        args = self.args
        window = sde_window(args, it)
        jobs = []
        for k in range(args.prompts):
            seed = (it * args.prompts + k) * 1000 + args.seed * 10_000_000
            # One x_T per group (Flow-GRPO-Fast): samples of a group differ only by the noise of the
            # steps being trained, which sharpens the credit assignment.
            jobs.append({"prompt": self.prompts[(it * args.prompts + k) % len(self.prompts)], "seed": seed,
                         "initial_noise_seed": seed + 999, "rollout_sde_step_indices": window,
                         # Replay needs the latents entering and leaving each stochastic step, nothing else.
                         "rollout_return_step_indices":
                             None if window is None else sorted({*window, *(s + 1 for s in window)})})  # fmt: skip
        return self.ranks.share(jobs)

    def make(self, it: int, version: str, phases: Phases) -> Batch:
        """Iteration ``it``'s batch, made under ``version`` (the stream's: at most ``--async-depth``
        pushes older)."""
        if self.stream is not None:
            return self._from_stream(it, version)
        if self.client is None:
            return Batch(self.sampler.generate_many(self.jobs(it), **self.shared))

        # Only a batch made under the pushed version is trained on.
        def make() -> list[list[Any]]:
            if self.args.screen:
                return screened_groups(
                    self.client, self.jobs(it), self.shared, self.args, self.reward_fn, phases
                )
            return self.client.generate_many(self.jobs(it), **self.shared)

        return Batch(self.recovery.rollouts(it, version, make, self.sync.push, self.sync.holds))

    def pushed(self, version: str) -> None:
        """The trainer pushed ``version``: the stream's later requests are made under it."""
        if self.stream is not None:
            self.stream.pushed(version)

    def close(self) -> None:
        """Aborts what the stream has in flight; closes the in-process engine and its loopback port."""
        if self.stream is not None:
            self.stream.close()
        if self.client is None and hasattr(self.sampler, "close"):
            self.sampler.close()

    def _open_stream(self, first_it: int, version: str):
        """Iteration it + k is sent while the trainer trains on iteration it (k = --async-depth)."""
        opened = self.client.rollout_stream(
            lambda i: self.jobs(first_it + i), max_staleness=self.args.async_depth, on_stale="regenerate",
            max_batches=self.args.iterations - first_it, **self.shared,
        )  # fmt: skip
        opened.pushed(version)
        return opened

    def _from_stream(self, it: int, version: str) -> Batch:
        """The stream's next batch. A lost server fails the stream: every rank recovers, then opens a
        new stream from iteration ``it`` (its first batch made under the re-pushed version)."""

        def reopen() -> None:
            self.stream.close()
            self.stream = self._open_stream(it, version)

        # Staleness, not the version, is the stream's rule (stale batches are trained with TIS).
        made = self.recovery.rollouts(
            it, version, lambda: next(self.stream), self.sync.push, self.sync.holds,
            expect_version=False, reset=reopen,
        )  # fmt: skip
        batch = Batch(made.outputs, made.staleness, [clock(made.sent_at), clock(made.answered_at)])
        # One version per iteration on every rank: where the ranks' batches disagree (a push landed
        # between their requests), the older ones are made again now, under the version every rank holds.
        if len(set(self.ranks.gather(batch.staleness))) > 1 and batch.staleness != 0:
            batch = Batch(self.client.generate_many(self.jobs(it), **self.shared), 0, batch.server_span, True)
        return batch
