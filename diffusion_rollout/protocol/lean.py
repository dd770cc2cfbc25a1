"""The lean response form: conditioning shared by several outputs of a request travels once.

The outputs of one request usually share one prompt, so their ``denoising_env`` (prompt embeddings
for both CFG branches: megabytes per output) is the same bits for every output. In the lean form
(request field ``lean_response: true``) the first output carries it and every later output whose
env is identical carries ``{"__same_as__": j}``, the index of that earlier output in the response
list. Field names are unchanged; only a client that asked for the lean form ever sees a reference.

- The server decides sharing by **bitwise equality** of the host copies (:func:`share_equal`), never
  by assumption, so a reference always stands for exactly the bits it replaces; the lean encoder
  (:func:`to_lean`) then only looks at object identity.
- The client (:func:`from_lean`) gives every output its own dict structure again (per-output views
  sharing the same tensors), so replay sees exactly what the per-output form would have delivered.
- **A tree's shared trajectory entries** (``rollout_branch``): a leaf's trajectory entry that is
  bit-identical to an earlier leaf's (the latents of their common ancestors) travels once. The leaf
  carries only its own entries in ``latents`` and ``latents_from``: per kept entry, ``-1`` (its own,
  next in ``latents``) or the index of the output whose entry it is. Only entries the tree's shape
  says are shared are compared, and only bit-equal ones are referenced.
"""

from __future__ import annotations

from typing import Any

import torch

REF_KEY = "__same_as__"
LEAN_FIELDS = ("denoising_env",)

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Compare bit patterns, not values: -0.0 == 0.0 and NaN != NaN would both mislead.
    if t.is_floating_point():
        return t.contiguous().view(_INT_OF_SIZE[t.element_size()])
    if t.is_complex():
        return t.contiguous().view(torch.uint8)
    return t


def same_tree(a: Any, b: Any) -> bool:
    """Whether two nested structures are identical, tensors compared bit for bit."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def share_equal(values: list[Any]) -> list[Any]:
    """``values`` with every entry bit-identical to an earlier one replaced by that earlier object."""
    kept: list[Any] = []
    out = []
    for v in values:
        match = next((k for k in kept if same_tree(k, v)), None) if v is not None else None
        if match is None:
            if v is not None:
                kept.append(v)
            out.append(v)
        else:
            out.append(match)
    return out


FROM_KEY = "latents_from"


def _tree_trajectories(outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``outputs`` with each tree leaf's trajectory entries shared with an earlier leaf referenced."""
    from diffusion_rollout.protocol.row_sharing import branch_block

    group = len(outputs)
    out = list(outputs)
    for i, d in enumerate(outputs):
        traj, branch = d.get("dit_trajectory"), d.get("rollout_branch")
        if not traj or not branch or not isinstance(traj.get("latents"), torch.Tensor):
            continue
        latents, steps = traj["latents"], list(traj["latent_step_indices"])
        sources: list[int] = []
        for k, step in enumerate(steps):
            first = (i // branch_block(group, branch, step)) * branch_block(group, branch, step)
            src = outputs[first].get("dit_trajectory") if first < i else None
            same = (
                src is not None
                and list(src["latent_step_indices"]) == steps
                and same_tree(src["latents"][k], latents[k])
            )
            sources.append(first if same else -1)
        if all(s == -1 for s in sources):
            continue
        own = [k for k, s in enumerate(sources) if s == -1]
        lean_traj = dict(traj)
        lean_traj["latents"] = latents[own] if own else latents[:0]
        lean_traj[FROM_KEY] = sources
        out[i] = {**d, "dit_trajectory": lean_traj}
    return out


def _tree_latents(resolved: list[dict[str, Any]], i: int, traj: dict[str, Any]) -> dict[str, Any]:
    sources, own = traj[FROM_KEY], iter(traj["latents"])
    rows = []
    for k, src in enumerate(sources):
        if src == -1:
            rows.append(next(own))
            continue
        if not isinstance(src, int) or not 0 <= src < i:
            raise ValueError(f"output {i}: trajectory entry {k} refers to output {src!r}")
        rows.append(resolved[src]["dit_trajectory"]["latents"][k])
    full = {k: v for k, v in traj.items() if k != FROM_KEY}
    full["latents"] = torch.stack(rows)
    return full


def to_lean(outputs: list[dict[str, Any]], fields: tuple[str, ...] = LEAN_FIELDS) -> list[dict[str, Any]]:
    """The lean form of one response: a field value that *is* an earlier output's becomes a reference
    (and a tree's shared trajectory entries travel once)."""
    if any(isinstance(d, dict) and d.get("rollout_branch") for d in outputs):
        outputs = _tree_trajectories(outputs)
    lean = []
    for i, d in enumerate(outputs):
        d = dict(d)
        for name in fields:
            value = d.get(name)
            if value is None:
                continue
            for j in range(i):
                if outputs[j].get(name) is value:
                    d[name] = {REF_KEY: j}
                    break
        lean.append(d)
    return lean


def _fresh_structure(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _fresh_structure(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fresh_structure(v) for v in obj]
    return obj  # tensors and scalars are shared, not copied


def is_ref(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and REF_KEY in value


def from_lean(outputs: list[dict[str, Any]], fields: tuple[str, ...] = LEAN_FIELDS) -> list[dict[str, Any]]:
    """Per-output form of a decoded response (references resolved; harmless on the plain form)."""
    resolved: list[dict[str, Any]] = []
    for i, d in enumerate(outputs):
        if not isinstance(d, dict):
            resolved.append(d)
            continue
        d = dict(d)
        for name in fields:
            value = d.get(name)
            if is_ref(value):
                j = value[REF_KEY]
                if not isinstance(j, int) or not 0 <= j < i or resolved[j].get(name) is None:
                    raise ValueError(f"output {i}: {name} refers to output {j!r}, which does not carry it")
                d[name] = _fresh_structure(resolved[j][name])
        traj = d.get("dit_trajectory")
        if isinstance(traj, dict) and FROM_KEY in traj:
            d["dit_trajectory"] = _tree_latents(resolved, i, traj)
        resolved.append(d)
    return resolved
