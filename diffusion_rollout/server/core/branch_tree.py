"""Branching trees (BranchGRPO's rollout; ``rollout_branch``): one request, a tree of rollouts.

``rollout_branch: [{"step": s1, "factor": f1}, {"step": s2, "factor": f2}, ...]`` asks for
``G = f1 * f2 * ...`` leaves (``num_outputs_per_prompt``) grown from one x_T: all rows are one node
until step ``s1``, where each node splits into ``f1`` children, and so on. The branch steps are
stochastic steps; a child is a child because its noise at the branch step is its own.

How:

- **Noise per node.** Row ``r``'s noise at loop step ``s`` comes from a CPU generator keyed by the
  tree's first seed (``seed``; a list prompt's group its own), ``s`` and the node ``r`` belongs to after ``s`` (its path through the branch
  points up to ``s``), so the rows of one node draw the same noise and stay identical, and the
  children of a node draw their own at the branch step.
- **Each node's steps once.** The pipeline runs its loop at batch ``G`` as always; the transformer
  calls of step ``s`` are narrowed to one row per node (``row_sharing.shared_rows``, with blocks of
  ``row_sharing.branch_block``) and their outputs repeated, as for shared prefixes. So the leaves
  cost ``sum over steps of (nodes at that step)`` transformer rows, not ``T * G``.
- **Replay.** The answer names each leaf's ``branch_path`` and the request's ``rollout_branch``; the
  client's ``ReplayBatch`` narrows a tree's steps the same way, so the trainer's model outputs are
  the server's bit for bit and the PPO ratio is exactly 1 (tests/server/core/test_branch_tree.py). A tree
  replays as one batch, all its leaves in order.
- **What is exact, and what not.** Every node's computation is that of a call at the narrowed batch
  (its node count); a leaf is therefore not the last bits of the same path sampled alone at batch 1
  (a transformer's last bits depend on its batch, as documented for shared prefixes). Trajectories
  are per leaf; in the lean form a shared node's entries travel once (``lean.py``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from diffusion_rollout.errors import RequestError
from diffusion_rollout.protocol import noise_recipes
from diffusion_rollout.protocol.row_sharing import branch_path
from diffusion_rollout.server.core.shared_prefix import SUPPORTED_FAMILIES

FIELD = "rollout_branch"


def validate(p: Any, family: str, num_steps: int, *, context_parallel: bool) -> None:
    """400 naming ``rollout_branch`` (or the field in the way) when the tree cannot run as asked."""
    branch = p.branch
    if not branch:
        return
    why = (
        f"the {family} family (supported: {', '.join(SUPPORTED_FAMILIES)})" if family not in SUPPORTED_FAMILIES
        else "rollout=false" if not p.rollout
        else "rollout_share_prefix (a tree shares its prefix already)" if p.share_prefix
        else "denoise_seeds (a tree keys its step noise by node)" if p.denoise_seeds
        else "feature_cache" if p.feature_cache is not None
        else "rollout_outside_window_stride" if p.outside_window_stride != 1
        else "a context-parallel server" if context_parallel
        else None
    )  # fmt: skip
    if why is not None:
        raise RequestError(f"rollout_branch does not go with {why}", field=FIELD)
    if p.initial_noise_seed is None or p.initial_noise_group_ids is not None or p.initial_noise is not None:
        raise RequestError(
            "rollout_branch grows the tree from one x_T: send initial_noise_seed (without "
            "initial_noise_group_ids or initial_noise)",
            field=FIELD,
        )
    if p.seed is None and not p.seeds:
        raise RequestError("rollout_branch derives every node's noise from seed: send seed", field=FIELD)
    steps = [s for s, _ in branch]
    if steps != sorted(set(steps)):
        raise RequestError(f"rollout_branch steps must increase strictly, got {steps}", field=FIELD)
    stochastic = set(p.settings.stochastic_steps(num_steps))
    off = [s for s in steps if s not in stochastic]
    if off:
        raise RequestError(
            f"rollout_branch steps {off} are not stochastic steps (rollout_sde_step_indices: "
            f"{sorted(stochastic)}); a tree branches where its children draw their own noise",
            field=FIELD,
        )
    leaves = math.prod(f for _, f in branch)
    if p.num_outputs_per_prompt != leaves:
        raise RequestError(
            f"rollout_branch makes {leaves} leaves; send num_outputs_per_prompt={leaves}", field=FIELD
        )


def _node_generator(seed: int, branch: tuple[tuple[int, int], ...], row: int, step: int) -> torch.Generator:
    depth = sum(1 for s, _ in branch if s <= step)
    node = ".".join(str(c) for c in branch_path(row, branch)[:depth]) or "root"
    return noise_recipes.step_generator(seed, step, f"branch:{node}")


def step_generators(p: Any, n: int) -> list:
    """Per row, the function of the loop step its noise comes from (keyed by node)."""
    # The tree's base: its first output's seed (seed, or a list prompt's per-group seeds[0]).
    base = int(p.seeds[0]) if p.seeds else int(p.seed)
    return [functools.partial(_node_generator, base, tuple(p.branch), row) for row in range(n)]
