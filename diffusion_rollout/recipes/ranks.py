"""Data parallel for the recipes: N trainer ranks under ``torchrun``, one rank being today's run.

    torchrun --standalone --nproc-per-node 2 examples/flow_grpo.py --server-gpus 0,1 --trainer-gpus 2,3

Design decisions:

- **One code path.** :class:`Ranks` is built from torchrun's environment (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``); without it there is one rank and every collective below is a no-op, so the
  single-process recipe is the N = 1 case of the same code, not a copy of it.
- **Each rank owns a contiguous block of the iteration's groups** (:meth:`Ranks.share`): rank r of N
  takes groups ``[r * P / N, (r + 1) * P / N)`` of the P prompts. The seeds are those of the group's
  index in the whole iteration, so the union of the ranks' groups is the 1-rank run's batch, group
  for group; advantages are per group, so no rank needs another's rewards to train.
- **Gradients are summed, not averaged.** Each rank scales its loss terms by the number of terms in
  the *whole* iteration (:meth:`Ranks.sum`) and the LoRA gradients are all-reduced with ``SUM`` in
  float32 (:meth:`Ranks.all_reduce_grads`): the update is the 1-rank update up to the order of the
  float additions. One flat buffer, one collective per optimizer step (DDP's bucketing for a few
  MB of adapter would buy nothing), and the same gradients on every rank keep the adapters equal.
- **Rank 0 speaks for the run**: it starts the server (others receive its URL and key over the
  process group, never on a command line), pushes weights and writes the JSON; the others wait at
  a barrier for the push before their next on-policy batch.
- The backend is NCCL on CUDA and gloo on the CPU (the suite's two-rank tests).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device | None = None  # the collectives' device (NCCL: this rank's GPU)
    grouped: bool = False  # a process group was joined (and is destroyed by close())

    @classmethod
    def from_env(cls, *, always_group: bool = False, timeout_s: float = 1800.0) -> Ranks:
        """torchrun's ranks (the process group joined here), or the single rank of a plain run.

        ``always_group``: a plain run gets a process group of one too (FSDP2 needs one).
        """
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1 and not always_group:
            return cls()
        import torch.distributed as dist

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if not dist.is_initialized():
            # Objects travel over gloo, tensors on CUDA over NCCL, whose communicator binds the GPU
            # current at its first collective: trainer_device sets it before any.
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            timeout = datetime.timedelta(seconds=timeout_s)
            if "MASTER_ADDR" in os.environ:
                dist.init_process_group(backend, timeout=timeout)
            else:  # a plain run's group of one
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                dist.init_process_group(
                    backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timeout
                )
        return cls(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local_rank, grouped=True)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def use_device(self, device: torch.device) -> None:
        """Run the tensor collectives on ``device`` (this rank's GPU under NCCL, else the CPU)."""
        self.device = device

    # ---------------------------------------------------------------------------------- work split
    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous block of ``items`` (their count must divide by the ranks)."""
        if len(items) % self.world:
            raise SystemExit(
                f"{len(items)} groups per iteration do not divide over {self.world} trainer ranks: "
                "make --prompts a multiple of the number of ranks"
            )
        k = len(items) // self.world
        return list(items[self.rank * k : (self.rank + 1) * k])

    # ---------------------------------------------------------------------------------- collectives
    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order, on every rank (pickled: small objects only)."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def sum(self, value: float) -> float:
        return float(sum(self.gather(value))) if self.active else value

    def all_reduce_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum the gradients of ``params`` over the ranks, in float32, in one collective.

        A parameter no rank's loss reached (Qwen-Image's last block feeds only its image stream
        onwards, so that block's text-stream LoRA never gets a gradient) keeps no gradient, as in a
        1-rank run; one that some ranks reached and others did not counts as zero on the others."""
        if not self.active:
            return
        import torch.distributed as dist

        reached = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=self.device)
        dist.all_reduce(reached, op=dist.ReduceOp.SUM)
        live = [p for p, n in zip(params, reached.tolist(), strict=True) if n > 0]
        for p in live:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in live]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        if self.device is not None:
            flat = flat.to(self.device)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g).to(g.device, g.dtype))
            offset += n

    def broadcast_params(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Rank 0's values of ``params`` on every rank (the same start whatever each rank drew)."""
        if not self.active:
            return
        import torch.distributed as dist

        with torch.no_grad():
            for p in params:
                t = p.data if self.device is None else p.data.to(self.device)
                dist.broadcast(t, src=0)
                if t is not p.data:
                    p.data.copy_(t)

    def close(self, *, finished: bool = True) -> None:
        """Leave the process group. ``finished`` (the run ended normally): every rank first meets
        the others, so none tears its group down while another still runs its last steps (rank 0
        stops the rollout server after the others are done with it). A rank that failed leaves at
        once: waiting for peers that may never come would only hide its error."""
        if self.grouped:
            import torch.distributed as dist

            if dist.is_initialized():
                if finished:
                    self.barrier()
                dist.destroy_process_group()
