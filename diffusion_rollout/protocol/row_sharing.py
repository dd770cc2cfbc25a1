"""Identical rows computed once: the transformer call narrowed to one row per block, shared by the
server (shared prefixes, branching trees) and the client's replay of a tree.

Within one pipeline call, rows that hold the same latent with the same conditioning at the same
timestep need one transformer evaluation. A forward pre-hook keeps the first row of each block of
``block`` consecutive rows in every chunk of ``group`` rows (the pipeline stacks guidance branches
as chunks: ``[uncond; cond]``), and a forward hook repeats the output back to the full batch. The
model arithmetic is that of a call at the narrowed batch, which is why a trainer replaying such a
step narrows the same way (``client/training.py``): the same rows, the same batch, the same bits.

Branching trees (``rollout_branch``): the outputs of a tree are its leaves, in order; leaf ``r``'s
child index at branch point ``i`` is digit ``i`` of ``r`` in the mixed radix of the factors (the
first branch most significant). Rows entering loop step ``s`` are identical in blocks of
``G / prod(factors of the branch points before s)`` (:func:`branch_block`).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["branch_block", "branch_path", "shared_rows"]


def branch_block(group: int, branch: Sequence[Sequence[int]], step: int) -> int:
    """Rows per identical block entering loop ``step`` of a tree of ``group`` leaves."""
    before = math.prod(int(f) for s, f in branch if int(s) < step)
    return group // before


def branch_path(row: int, branch: Sequence[Sequence[int]]) -> list[int]:
    """Leaf ``row``'s child index at each branch point (mixed radix, the first branch first)."""
    factors = [int(f) for _, f in branch]
    path, rest = [], math.prod(factors)
    for f in factors:
        rest //= f
        path.append((row // rest) % f)
    return path


def _take(value: Any, rows: torch.Tensor, batch: int) -> Any:
    """``value`` narrowed to ``rows`` when it is per-row (batch on dimension 0), else as is."""
    if isinstance(value, torch.Tensor):
        if value.ndim > 0 and value.shape[0] == batch:
            return value.index_select(0, rows.to(value.device))
        return value
    if isinstance(value, (list, tuple)) and len(value) == batch:
        return type(value)(value[i] for i in rows.tolist())
    return value


def _repeat(output: Any, expand: torch.Tensor) -> Any:
    """The model output of the narrowed rows repeated back to the full batch."""
    if isinstance(output, torch.Tensor):
        return output.index_select(0, expand.to(output.device))
    if isinstance(output, tuple):
        return (_repeat(output[0], expand), *output[1:])
    if hasattr(output, "sample"):  # diffusers' Transformer2DModelOutput
        output.sample = _repeat(output.sample, expand)
        return output
    raise TypeError(f"row sharing: unexpected transformer output {type(output).__name__}")


@contextlib.contextmanager
def shared_rows(
    modules: Iterable[torch.nn.Module], group: int, block: Callable[[], int], *, this_thread: bool = True
) -> Iterator[None]:
    """While ``block() > 1``, each call of ``modules`` runs on one row per ``block()`` rows of each
    ``group``-row chunk. ``this_thread``: only calls from the thread that entered (pipeline lanes
    share modules). Attach *after* a call recorder, so it records full batches."""
    owner = threading.get_ident()
    pending: list[torch.Tensor] = []  # the expansion of the call in flight (pre-hook -> hook)

    def mine() -> bool:
        return not this_thread or threading.get_ident() == owner

    def pre_hook(module, args, kwargs):
        b = block()
        if not mine() or b < 2:
            return None
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        batch = hidden.shape[0]
        if batch % group or group % b:
            raise RuntimeError(f"row sharing: a batch of {batch} rows in groups of {group}, blocks of {b}")
        units = batch // b  # kept rows: the first of every block, chunk after chunk
        rows = torch.arange(units) * b
        pending.append(torch.arange(units).repeat_interleave(b))
        return (
            tuple(_take(a, rows, batch) for a in args),
            {name: _take(v, rows, batch) for name, v in kwargs.items()},
        )

    def hook(module, args, kwargs, output):
        if not mine() or not pending:
            return None
        return _repeat(output, pending.pop())

    handles = []
    try:
        for m in modules:
            handles.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(m.register_forward_hook(hook, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()
