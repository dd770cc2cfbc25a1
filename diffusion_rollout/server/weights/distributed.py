"""Weight broadcasts over ``torch.distributed`` (trainer rank 0 -> this server).

Protocol (field names of SGLang's LLM server and UniRL): ``/init_weights_update_group`` with
``{master_address, master_port, rank_offset, world_size, group_name, backend}`` joins a process
group as rank ``rank_offset`` (this server is one rank); ``/update_weights_from_distributed`` with
``{names, dtypes, shapes, group_name, target_modules}`` receives one broadcast from rank 0 per name,
in order, into fresh buffers; ``/destroy_weights_update_group`` leaves the group.

Design decisions:

- The group is built the way SGLang, verl, OpenRLHF and UniRL build theirs
  (``init_custom_process_group``, facts only): ``rendezvous("tcp://addr:port", rank, world_size)``
  for a TCP store (rank 0, the trainer, hosts it), a ``PrefixStore(group_name, store)``, then
  torch's ``_new_process_group_helper`` with ``group_name``. The store keys therefore match a trainer
  that uses that helper with the same ``group_name``, and the group is independent of any default
  process group (the server has none). :func:`join_group` is also what a trainer calls, with rank 0.
- NCCL on GPUs, gloo on CPUs (tests). Buffers are allocated on the engine device for NCCL and on the
  CPU for gloo.
- Receiving is blocking collective I/O, so it runs on its own thread, not on the engine's worker:
  rollouts keep running while the bytes arrive. Every announced tensor is received, even when the
  announcement is invalid for this model, so the trainer never hangs on a broadcast nobody posts;
  validation and the atomic copy happen afterwards (on the worker, between batches).
- Calls on one group are serialized by a per-group lock; collectives must be posted in order.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from diffusion_rollout.errors import NotFoundError, WeightUpdateError
from diffusion_rollout.protocol.weight_transport import join_group

logger = logging.getLogger(__name__)

BACKENDS = ("nccl", "gloo")


def parse_dtype(name: str) -> torch.dtype:
    candidate = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(candidate, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r}", field="dtypes")
    return candidate


@dataclass
class UpdateGroup:
    name: str
    group: object
    rank: int
    world_size: int
    backend: str
    master: str
    lock: threading.Lock = field(default_factory=threading.Lock)


class UpdateGroups:
    """The process groups this server has joined, by name."""

    def __init__(self) -> None:
        self._groups: dict[str, UpdateGroup] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        with self._lock:
            return list(self._groups)

    def get(self, name: str) -> UpdateGroup:
        with self._lock:
            group = self._groups.get(name)
        if group is None:
            raise NotFoundError(
                f"no weight update group {name!r}; joined groups: {', '.join(self.names()) or 'none'}"
            )
        return group

    def init(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> UpdateGroup:
        """Blocking: returns once every rank has joined (or raises after ``timeout_s``)."""
        if backend not in BACKENDS:
            raise WeightUpdateError(f"backend must be one of {BACKENDS}, got {backend!r}", field="backend")
        if backend == "nccl" and not torch.cuda.is_available():
            raise WeightUpdateError("backend 'nccl' needs a GPU; this server runs on the CPU (use 'gloo')")
        if not 0 < rank_offset < world_size:
            raise WeightUpdateError(
                f"rank_offset must be in 1..world_size-1 (rank 0 is the trainer), got {rank_offset} "
                f"with world_size {world_size}",
                field="rank_offset",
            )
        with self._lock:
            if group_name in self._groups:
                raise WeightUpdateError(
                    f"weight update group {group_name!r} already exists; destroy it first", field="group_name"
                )
        logger.info(
            "joining weight update group %r at %s:%d as rank %d of %d (%s)",
            group_name, master_address, master_port, rank_offset, world_size, backend,
        )  # fmt: skip
        try:
            pg = join_group(
                master_address=master_address,
                master_port=master_port,
                rank=rank_offset,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
                timeout_s=timeout_s,
            )
        except Exception as exc:
            raise WeightUpdateError(
                f"could not join group {group_name!r} at {master_address}:{master_port} as rank "
                f"{rank_offset} of {world_size}: {type(exc).__name__}: {exc}"
            ) from exc
        group = UpdateGroup(
            group_name, pg, rank_offset, world_size, backend, f"{master_address}:{master_port}"
        )
        with self._lock:
            self._groups[group_name] = group
        return group

    def receive(
        self,
        group_name: str,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        device: str,
    ) -> list[tuple[str, torch.Tensor]]:
        """Blocking: one broadcast from rank 0 per name, in order, into fresh buffers."""
        if not (len(names) == len(dtypes) == len(shapes)):
            raise WeightUpdateError(
                f"names, dtypes and shapes must have the same length, got {len(names)}, {len(dtypes)}, "
                f"{len(shapes)}",
                field="names",
            )
        group = self.get(group_name)
        parsed = [parse_dtype(d) for d in dtypes]
        target_device = device if group.backend == "nccl" else "cpu"
        out: list[tuple[str, torch.Tensor]] = []
        with group.lock:
            for name, dtype, shape in zip(names, parsed, shapes, strict=True):
                buf = torch.empty(tuple(int(s) for s in shape), dtype=dtype, device=target_device)
                dist.broadcast(buf, src=0, group=group.group)
                out.append((name, buf))
            if target_device.startswith("cuda"):
                torch.cuda.synchronize(target_device)
        return out

    def destroy(self, group_name: str) -> None:
        group = self.get(group_name)
        with group.lock:
            dist.destroy_process_group(group.group)
        with self._lock:
            self._groups.pop(group_name, None)
        logger.info("left weight update group %r", group_name)

    def destroy_all(self) -> None:
        for name in self.names():
            try:
                self.destroy(name)
            except Exception:  # shutting down: leave what cannot be torn down
                logger.exception("could not destroy weight update group %r", name)
