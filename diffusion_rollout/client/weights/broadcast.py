"""``WeightBroadcaster``: trainer rank 0 of an NCCL/gloo weight-update group joined by every server.

Design decisions:

- **Announcement and collective at once.** The servers' HTTP calls (join, announce, leave) block
  until the collective on this side has run too, so they go out on threads (one per server) while
  this thread joins the group, posts the broadcasts or destroys the group; the threads' answers are
  always collected, so no thread is left behind after a failure.
- **Plain torch.** Joining goes through ``diffusion_rollout.protocol.weight_transport.join_group``, the same
  code the server uses; ``backend="gloo"`` works on CPU tensors, ``"nccl"`` needs them on
  this rank's GPU. Tensors are cast on the trainer and broadcast in announcement order.
- **Verification.** After the broadcast the server's per-tensor hashes are checked, per target
  module (names routed by their ``"<module>."`` prefix when there are several).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from diffusion_rollout.client.results import UpdateResult
from diffusion_rollout.client.weights.tensors import NamedTensors, _cast, _check_manifest, _named
from diffusion_rollout.protocol.checksums import hash_pool, tensor_sha256

if TYPE_CHECKING:
    from diffusion_rollout.client.sync_client import RolloutClient

__all__ = ["WeightBroadcaster"]


class WeightBroadcaster:
    """Trainer rank 0 of a weight-update process group joined by every server of ``client``.

    ``init()`` makes server ``i`` join from rank ``1 + (ranks of the servers before it)``, where a
    server has ``weight_update_ranks`` ranks (``/server_info``; one per replica behind a cluster
    front, else 1), so every replica receives the one broadcast; ``broadcast()``
    announces the tensors to every server and broadcasts each one in order; ``destroy()`` leaves.
    ``backend="nccl"`` needs the tensors on this rank's GPU; ``"gloo"`` works on CPU tensors.
    Use as a context manager to destroy the group on exit.
    """

    def __init__(
        self,
        client: RolloutClient,
        *,
        master_address: str,
        master_port: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: float = 300.0,
        device: str | torch.device | None = None,
    ) -> None:
        self.client = client
        self.master_address = master_address
        self.master_port = int(master_port)
        self.group_name = group_name
        self.backend = backend
        self.timeout_s = timeout_s
        self.device = torch.device(device) if device is not None else None
        self.world_size = 1 + len(client.urls)  # until init() asks how many ranks each server has
        self.rank_offsets = [1 + i for i in range(len(client.urls))]
        self.group: Any = None

    def _layout(self) -> None:
        """Ranks per server from ``/server_info`` (``weight_update_ranks``: a cluster front joins
        with one rank per replica; a single server, or one that does not say, with one)."""
        ranks = [
            int(self.client.server_info(server=i).get("weight_update_ranks", 1))
            for i in range(len(self.client.urls))
        ]
        self.rank_offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        self.world_size = 1 + sum(ranks)

    def _on_servers(
        self, fn
    ) -> tuple[concurrent.futures.ThreadPoolExecutor, list[concurrent.futures.Future]]:
        pool = concurrent.futures.ThreadPoolExecutor(len(self.client.urls), thread_name_prefix="weight-group")
        return pool, [pool.submit(fn, index) for index in range(len(self.client.urls))]

    @staticmethod
    def _results(pool, futures) -> list[UpdateResult]:
        try:
            return [f.result() for f in futures]
        finally:
            pool.shutdown(wait=True)

    def init(self) -> WeightBroadcaster:
        from diffusion_rollout.protocol.weight_transport import join_group

        if self.group is not None:
            raise RuntimeError("the group is already initialised")
        self._layout()
        pool, futures = self._on_servers(
            lambda index: self.client.init_weights_update_group(
                master_address=self.master_address,
                master_port=self.master_port,
                rank_offset=self.rank_offsets[index],
                world_size=self.world_size,
                group_name=self.group_name,
                backend=self.backend,
                timeout_s=self.timeout_s,
                server=index,
            )
        )
        try:
            self.group = join_group(
                master_address=self.master_address,
                master_port=self.master_port,
                rank=0,
                world_size=self.world_size,
                group_name=self.group_name,
                backend=self.backend,
                timeout_s=self.timeout_s,
            )
        finally:
            # Collect the servers' answers whatever happened here, so no thread is left behind.
            self._results(pool, futures)
        return self

    def broadcast(
        self,
        named_tensors: NamedTensors,
        *,
        target_modules: list[str] | None = None,
        dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
        weight_version: str | int | None = None,
        flush_cache: bool = True,
        verify: bool = True,
        announce: Sequence[tuple[str, torch.dtype, Sequence[int]]] | None = None,
    ) -> UpdateResult:
        """Send tensors to every server (one ``dist.broadcast`` per tensor, in order) and apply them.

        ``announce`` -- ``(name, dtype, shape)`` of every tensor in order, the dtype being the one
        sent -- lets ``named_tensors`` be an iterator consumed one tensor at a time: each is made,
        cast, checked against its announcement, broadcast and hashed before the next is asked for.
        An FSDP trainer gathers its parameters this way without ever holding the whole model
        twice. Without it the tensors are all cast first and announced from what they are.
        """
        import torch.distributed as dist

        if self.group is None:
            raise RuntimeError("call init() first")

        def prepared(items):
            for name, tensor in items:
                t = _cast(name, tensor, dtype)
                yield name, (t if self.device is None else t.to(self.device)).contiguous()

        if announce is None:
            pairs = list(prepared(_named(named_tensors)))
            announce = [(n, t.dtype, tuple(t.shape)) for n, t in pairs]
            source = iter(pairs)
        else:
            announce = [(n, dt, tuple(int(x) for x in shape)) for n, dt, shape in announce]
            source = prepared(_named(named_tensors))
        if not announce:
            raise ValueError("nothing to broadcast")
        names = [n for n, _, _ in announce]
        pool, futures = self._on_servers(
            lambda index: self.client.update_weights_from_distributed(
                names=names,
                dtypes=[str(dt) for _, dt, _ in announce],
                shapes=[list(shape) for _, _, shape in announce],
                group_name=self.group_name,
                target_modules=target_modules,
                weight_version=weight_version,
                flush_cache=flush_cache,
                server=index,
            )
        )
        hashes: dict[str, concurrent.futures.Future] = {}
        try:
            sent = 0
            for (name, t), (want, want_dtype, want_shape) in zip(source, announce, strict=False):
                if name != want or t.dtype != want_dtype or tuple(t.shape) != want_shape:
                    raise ValueError(
                        f"tensor {sent} is {name} {t.dtype} {tuple(t.shape)}, announced as "
                        f"{want} {want_dtype} {want_shape}"
                    )
                dist.broadcast(t, src=0, group=self.group)
                if verify:  # hashed on the hash threads from a host copy: the GPU copy goes now
                    hashes[name] = hash_pool().submit(tensor_sha256, t.cpu())
                sent += 1
            if sent != len(announce):
                raise ValueError(f"{sent} tensors came for the {len(announce)} announced")
        finally:
            results = self._results(pool, futures)
        if verify:
            targets = target_modules or ["transformer"]
            for module in targets:
                prefix = module + "."
                own = {n: h.result() for n, h in hashes.items() if len(targets) == 1 or n.startswith(prefix)}
                if own:
                    _check_manifest(self.client, module, own, None)
        return UpdateResult.from_responses({u: r for res in results for u, r in res.responses.items()})

    def destroy(self) -> None:
        if self.group is None:
            return
        import torch.distributed as dist

        # Both sides at once: tearing down an NCCL communicator can wait for the peer ranks, so a
        # trainer that waited for the server's answer first would deadlock with it.
        pool, futures = self._on_servers(
            lambda index: self.client.destroy_weights_update_group(self.group_name, server=index)
        )
        try:
            dist.destroy_process_group(self.group)
        finally:
            self.group = None
            self._results(pool, futures)

    def __enter__(self) -> WeightBroadcaster:
        return self.init()

    def __exit__(self, *exc: object) -> None:
        self.destroy()
