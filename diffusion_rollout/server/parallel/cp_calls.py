"""What rank 0 and the context-parallel followers share (``server/parallel/context_parallel.py``).

- **A call's structure without its tensors** (:func:`strip_tensors` / :func:`fill_tensors`): rank 0
  sends each transformer call's args and kwargs over a queue with every tensor replaced by a
  :class:`TensorSlot` (shape, dtype), and the tensors themselves over ``torch.distributed``
  broadcasts, in slot order.
- **The weight layout** (:func:`synced_tensors`): every parameter and buffer by name, through PEFT
  wrappers to the base weights, so both sides walk the same order; :func:`weights_digest` and
  :func:`output_checksum` are mirror mode's bit-for-bit checks.
- **The process group and the layout** (:func:`init_group`, :func:`enable_layout`), and the slots of
  a follower's shared stats array (:data:`FORWARDS` ...).
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from diffusion_rollout.protocol.checksums import base_named_buffers, base_named_parameters
from diffusion_rollout.server.parallel.cp_plans import enable_plan

# A follower's stats array (shared memory, read by rank 0's ``stats()``): one slot each.
FORWARDS, LAST_OUTPUT, SYNCS, RELEASED, DECODES, TILES = range(6)


@dataclass(frozen=True)
class TensorSlot:
    """Where a broadcast tensor goes back into a call's structure."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def strip_tensors(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: strip_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(strip_tensors(v, tensors) for v in obj)
    return obj


def fill_tensors(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, TensorSlot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: fill_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(fill_tensors(v, tensors) for v in obj)
    return obj


def slots(obj: Any) -> list[TensorSlot]:
    if isinstance(obj, TensorSlot):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return sorted((s for v in obj for s in slots(v)), key=lambda s: s.index)
    return []


def output_checksum(output: Any) -> float:
    """A float64 sum of a transformer output's first tensor: equal bits give equal sums."""
    tensor = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
    return float(tensor.detach().double().sum())


def module_entry(module: nn.Module) -> tuple[str, str, dict[str, Any]]:
    """What a follower needs to build ``module`` without its weights: class and config."""
    return type(module).__module__, type(module).__name__, dict(module.config)


def synced_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    # By name, so rank 0 and the followers walk the same order; buffers too (rotary tables). Through
    # PEFT wrappers to the base weights: a merged adapter lives there, a plain follower has no wrapper.
    named = [*base_named_parameters(module), *base_named_buffers(module)]
    return sorted(named, key=lambda item: item[0])


def weights_digest(modules: dict[str, nn.Module]) -> str:
    """SHA-256 over every synced tensor's bytes (mirror mode's weight check; reads them to the host)."""
    h = hashlib.sha256()
    for name in sorted(modules):
        for key, t in synced_tensors(modules[name]):
            h.update(f"{name}.{key}".encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def init_group(rank: int, world: int, port: int, cuda: bool, timeout_s: float) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def enable_layout(modules: dict[str, nn.Module], ring_degree: int, ulysses_degree: int) -> None:
    from diffusers import ContextParallelConfig

    for module in modules.values():
        # diffusers' mesh is (ring, ulysses): with both > 1, Ulysses groups of consecutive ranks, and
        # each ring joins the ranks of one Ulysses position. Its plan, or the server's (cp_plans).
        enable_plan(module, ContextParallelConfig(ring_degree=ring_degree, ulysses_degree=ulysses_degree))
