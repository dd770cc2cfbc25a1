"""Shared ODE prefixes (``rollout_share_prefix``): a group's deterministic start, once.

A request whose ``G`` outputs share x_T (``initial_noise_seed``) and whose first stochastic step is
``k`` runs steps ``0..k-1`` as ODE steps on ``G`` identical rows: the same latent, the same prompt,
the same timestep. Those rows need one transformer evaluation, not ``G``.

How, and why this way:

- **One stock pipeline call.** The pipeline runs its own loop at batch ``G`` as always; only the
  transformer calls of the prefix steps are narrowed. A forward pre-hook keeps one row of each
  guidance chunk (the pipeline stacks ``[uncond, cond]`` for CFG, so a batch of ``m * G`` rows has
  ``m`` chunks) and a forward hook repeats the model output back to ``m * G`` rows. The scheduler,
  the trajectory, the step indices, the log-probs and ``denoising_env`` are recorded exactly as
  without sharing (the recorder's hooks run first and see the full batch), so every answer field
  keeps its meaning; the prefix latents are recorded once per output (identical copies).
- **What is exact.** The ODE step is elementwise and the rows are identical, so the branch point
  ``x_k`` is the latent a batch-1 run of the prefix computes, bit for bit, and the steps from ``k``
  on run at batch ``G`` as before. So each output equals, bit for bit, the output of two stock
  calls: the prefix alone at batch 1, then the group at batch ``G`` from that ``x_k`` with the
  remaining sigmas (tests/server/core/test_shared_prefix.py proves it on the CPU for SD3 and Qwen-Image, with
  and without guidance). It is **not** in general equal to the same group run without sharing: a
  transformer's last bits depend on its batch size (measured on the CPU, float32, tiny SD3 and
  Qwen-Image: batch 1 and batch 4 rows differ), so the option is opt-in, and the answer says it
  ran (``shared_prefix_steps``).
- Stochastic steps are never narrowed: they run at batch ``G`` as the trainer's replay does, so
  the PPO ratio stays exactly 1 (prefix steps are ODE steps, log-prob 0, never replayed).
- The narrowing itself is ``row_sharing.shared_rows`` (one implementation with the trees'). Only
  calls from the thread that attached the hooks are changed (pipeline lanes share modules).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from diffusion_rollout.errors import RequestError
from diffusion_rollout.protocol.row_sharing import shared_rows

# Families whose transformer calls have been checked to take the batch on dimension 0 of every
# per-row argument (tensors and per-row lists such as Qwen-Image's img_shapes), and tested.
SUPPORTED_FAMILIES = ("sd3", "qwenimage")


def prefix_steps(settings: Any, num_steps: int) -> int:
    """``k``: the loop steps before the first stochastic one (all ``T`` when none is stochastic)."""
    stochastic = settings.stochastic_steps(num_steps)
    return min(stochastic) if stochastic else num_steps


def validate(p: Any, family: str, *, context_parallel: bool) -> None:
    """400 naming ``rollout_share_prefix`` when the request's rows would not be identical."""
    if not p.share_prefix:
        return
    field = "rollout_share_prefix"
    if family not in SUPPORTED_FAMILIES:
        raise RequestError(
            f"rollout_share_prefix is supported for {', '.join(SUPPORTED_FAMILIES)}, not {family}",
            field=field,
        )
    if not p.rollout:
        raise RequestError("rollout_share_prefix needs rollout=true", field=field)
    if p.initial_noise_seed is None or p.initial_noise_group_ids is not None or p.initial_noise is not None:
        raise RequestError(
            "rollout_share_prefix needs one x_T for the whole group: send initial_noise_seed "
            "(without initial_noise_group_ids or initial_noise)",
            field=field,
        )
    if p.feature_cache is not None:
        raise RequestError("rollout_share_prefix cannot be combined with feature_cache", field=field)
    if context_parallel:
        raise RequestError("rollout_share_prefix is not supported on a context_parallel engine", field=field)


@contextlib.contextmanager
def narrowed_prefix(
    modules: dict[str, torch.nn.Module], group: int, steps: int, loop_index: Callable[[], int]
) -> Iterator[None]:
    """While ``loop_index() < steps``, run each transformer call on one row per ``group`` rows.

    Attach *after* the call recorder (hooks run in registration order), so it records full batches.
    """
    if group < 2 or steps < 1:
        yield
        return
    with shared_rows(modules.values(), group, lambda: group if loop_index() < steps else 1):
        yield
