"""Tensor transport payloads built the same way by trainers and decoded by the server.

The trainer side of two weight paths of weights.md, shared by the client and the server so the
formats cannot drift (and so the client needs nothing from ``server``):

- SGLang's ``update_weights_from_tensor`` entries: a ``ForkingPickler`` pickle (base64) of
  ``[(name, tensor), ...]`` or of a flattened bucket (one uint8 tensor plus
  ``FlattenedTensorMetadata`` byte ranges); torch's multiprocessing reductions turn each tensor into
  a CUDA IPC handle (GPU) or a shared-memory file descriptor (CPU), so no weight bytes travel in
  the body. The server's restricted decoder lives in ``server/weights/ipc.py``.
- ``join_group``: a process group for NCCL/gloo weight broadcasts that is independent of any
  default group, joined the same way by the trainer (rank 0) and the server (``rank_offset``).
"""

from __future__ import annotations

import base64
import datetime
import io
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing.reductions


@dataclass
class FlattenedTensorMetadata:
    """One tensor's slice of a flattened bucket (field names as SGLang pickles them)."""

    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


def flatten_bucket(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """SGLang's multi-dtype bucket: one uint8 tensor and byte ranges per named tensor."""
    pieces, metadata, offset = [], [], 0
    for name, tensor in named_tensors:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        metadata.append(
            FlattenedTensorMetadata(
                name=name,
                shape=tensor.shape,
                dtype=tensor.dtype,
                start_idx=offset,
                end_idx=offset + flat.numel(),
                numel=flat.numel(),
            )
        )
        pieces.append(flat)
        offset += flat.numel()
    if not pieces:
        raise ValueError("cannot build an empty bucket")
    return {"flattened_tensor": torch.cat(pieces), "metadata": metadata}


def serialize(obj: Any) -> str:
    """What SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` produces."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, load_format: str | None = None
) -> str:
    """One ``serialized_named_tensors`` entry. The tensors must stay alive until the server answers."""
    pairs = [(n, t) for n, t in named_tensors]
    return serialize(flatten_bucket(pairs) if load_format == "flattened_bucket" else pairs)


def join_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = 300.0,
):
    """Create (and join) a process group independent of the default group; returns the group."""
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    timeout = datetime.timedelta(seconds=timeout_s)
    # The store directly, not through ``rendezvous("tcp://...")``: under torchrun that reuses the
    # launcher's agent store (TORCHELASTIC_USE_AGENT_STORE) instead of hosting this group's own on
    # rank 0, and a trainer rank launched by torchrun would then wait for a store nobody serves.
    store = TCPStore(master_address, int(master_port), world_size, rank == 0, timeout=timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    # What init_process_group records for a default group; collectives map group ranks through it.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
