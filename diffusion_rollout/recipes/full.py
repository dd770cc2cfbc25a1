"""Full-parameter training (``flow_grpo.py --full-finetune``): the denoiser sharded with FSDP2 over
the trainer ranks, and its full weights on every rollout replica after each optimizer step.

Design decisions:

- **float32 master, served-dtype compute.** The sharded parameters are float32 (Adam's small steps
  would vanish in bf16 weights); ``MixedPrecisionPolicy(param_dtype=<served dtype>)`` all-gathers
  them cast to the dtype the server holds, so the replayed forward uses exactly the values pushed
  to the server and the on-policy ratio stays exactly 1. Inputs are not cast
  (``cast_forward_inputs=False``): the timestep and conditioning keep the dtypes the server used.
  Gradients are reduced in float32; FSDP2 averages them over the ranks, so the recipe scales its
  loss terms by the number of ranks to make that a sum, as in the LoRA path.
- **Sharding units**: every block of the denoiser's block lists (``nn.ModuleList`` children:
  ``transformer_blocks``, ``single_transformer_blocks``, ``blocks``), then the root.
- **One parameter at a time to the servers.** Every rank all-gathers parameter k
  (``DTensor.full_tensor()``), rank 0 casts it to its served dtype and sends it, and parameter k + 1
  is gathered only after that: besides its shards a rank holds one full parameter (and, over HTTP,
  one part of look-ahead), never the whole model twice. Two transports, both verified tensor by
  tensor with SHA-256 by the server:
  - ``broadcast``: :class:`~diffusion_rollout.client.WeightBroadcaster`, trainer rank 0 and every
    replica in one NCCL group (gloo on a CPU), joined once; the tensors are announced from the
    parameters' global shapes before the first is gathered;
  - ``http``: :func:`~diffusion_rollout.client.push_weights`, bounded parts and one atomic commit,
    for servers on another host (``--url``).
- Every rank takes part in every gather, so a rank that is not 0 runs the same loop and drops what
  it gathered.
- **A send that fails mid-push still finishes the gathers.** When rank 0's send fails (the server
  killed mid-part, a lost connection), the other ranks are still inside the gather loop, waiting for
  the next parameter's all-gather: rank 0 takes part in the gathers left (dropping them) before it
  raises, so every rank leaves the push together and hears of the failure from rank 0
  (``recovery.on_main``), then waits and re-pushes as one (``Recovery``) or stops with its error
  within ``--recover-timeout``, instead of hanging in a collective that rank 0 left.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from diffusion_rollout.client import RolloutClient, WeightBroadcaster, push_weights
from diffusion_rollout.recipes.ranks import Ranks
from diffusion_rollout.recipes.trainer import load_trainer_transformer
from diffusion_rollout.testing import free_port

logger = logging.getLogger(__name__)


def _block_lists(module: torch.nn.Module) -> list[torch.nn.ModuleList]:
    return [child for child in module.children() if isinstance(child, torch.nn.ModuleList)]


class FullFinetune:
    """The sharded trainable denoiser (``transformer``, ``params``) and its sync (:meth:`push`).

    ``sync``: ``"broadcast"`` (the NCCL/gloo weight-update group; servers on this host) or
    ``"http"``. ``sync_seconds`` keeps each push's duration, ``sync_bytes`` the bytes it sent.
    """

    def __init__(
        self,
        model_path: Path,
        device: torch.device,
        dtype: torch.dtype,
        ranks: Ranks,
        gradient_checkpointing: bool = False,
        sync: str = "broadcast",
    ) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if sync not in ("broadcast", "http"):
            raise ValueError(f"sync must be 'broadcast' or 'http', not {sync!r}")
        transformer = load_trainer_transformer(
            model_path, device=device, dtype=dtype, gradient_checkpointing=gradient_checkpointing
        )
        # What the server holds, per parameter (a model may keep some in float32).
        self.served = {n: p.dtype for n, p in transformer.named_parameters()}
        transformer.float().requires_grad_(True)
        policy = MixedPrecisionPolicy(
            param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
        for blocks in _block_lists(transformer):
            for block in blocks:
                fully_shard(block, mp_policy=policy)
        fully_shard(transformer, mp_policy=policy)
        self.transformer = transformer
        self.params = [p for p in transformer.parameters() if p.requires_grad]
        self.ranks, self.device, self.sync = ranks, device, sync
        self.broadcaster: WeightBroadcaster | None = None
        self.sync_seconds: list[float] = []
        self.sync_bytes = sum(p.numel() * self.served[n].itemsize for n, p in transformer.named_parameters())
        self.parameters = sum(p.numel() for p in self.params)

    def _gathered(self):
        """``(name, full tensor in its served dtype)``, one parameter at a time (a collective: every
        rank must consume it to the end)."""
        from torch.distributed.tensor import DTensor

        self._gathers_done = 0
        with torch.no_grad():
            for name, p in self.transformer.named_parameters():
                full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
                self._gathers_done += 1
                yield name, full.to(self.served[name])

    def _finish_gathers(self) -> None:
        """Rank 0, after its send failed: the gathers the other ranks still wait in, to the end."""
        from torch.distributed.tensor import DTensor

        left = list(self.transformer.named_parameters())[self._gathers_done :]
        logger.warning(
            "full-weight push failed after %d of %d parameters were gathered; finishing the %d gathers "
            "the other ranks are in, so that every rank hears of it",
            self._gathers_done, self._gathers_done + len(left), len(left),
        )  # fmt: skip
        with torch.no_grad():
            for _, p in left:
                if isinstance(p, DTensor):
                    p.full_tensor()
        self._gathers_done += len(left)

    def _send(self, client: RolloutClient, version: str):
        """Rank 0's gather-and-send (see the module docstring's transports)."""
        if self.sync == "broadcast":
            if self.broadcaster is None:
                backend = "nccl" if self.device.type == "cuda" else "gloo"
                self.broadcaster = WeightBroadcaster(
                    client, master_address="127.0.0.1", master_port=free_port(), backend=backend,
                    device=self.device if self.device.type == "cuda" else None,
                ).init()  # fmt: skip
            announce = [(n, self.served[n], tuple(p.shape)) for n, p in self.transformer.named_parameters()]
            return self.broadcaster.broadcast(self._gathered(), announce=announce, weight_version=version)
        return push_weights(client, self._gathered(), dtype=None, weight_version=version)

    def push(self, client: RolloutClient | None, version: str) -> bool | None:
        """Every rank gathers; rank 0 (``client`` given) sends. True when the servers verified every
        tensor and hold ``version``; None on the other ranks."""
        t0 = time.perf_counter()
        if client is None:
            for _ in self._gathered():
                pass
            return None
        self._gathers_done = 0
        try:
            result = self._send(client, version)
        except Exception:
            if self.ranks.active:
                self._finish_gathers()
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.sync_seconds.append(time.perf_counter() - t0)
        return result.weight_version == version

    def record(self) -> dict[str, Any]:
        """The sync's figures for the run record."""
        secs = self.sync_seconds[1:] or self.sync_seconds  # the first push also joins the group
        mean = sum(secs) / len(secs) if secs else None
        return {
            "sync": self.sync,
            "parameters": self.parameters,
            "sync_bytes": self.sync_bytes,
            "sync_seconds": [round(s, 4) for s in self.sync_seconds],
            "sync_mean_s": None if mean is None else round(mean, 4),
            "sync_gb_per_s": None if not mean else round(self.sync_bytes / mean / 1e9, 3),
        }

    def close(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.destroy()
            self.broadcaster = None
