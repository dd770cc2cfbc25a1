"""LoRA changes of a cluster front: every serving replica at once, all or nothing.

Loads (path, upload, tensors, ``lora_merge``), activation, mode switches and unloads run on every
replica with the dispatch gate closed, each replica first keeping what the change can touch
(``server.weights.LoraTransactions``). They validate before changing anything and replicas hold the
same model, so a refusal is the same everywhere and is the answer (400). If the change fails on
only some replicas (a device fault), every replica puts back its adapters, their tensors,
activation, mode (merged base weights included) and version, and the answer is 500 naming the
failure; rollouts never see the replicas apart.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from diffusion_rollout.cluster.fanout import ReplicaFanout, first_error, is_refusal
from diffusion_rollout.errors import ReplicasDivergedError, WeightApplyError
from diffusion_rollout.server.weights import Lease


class ClusterLoraOps(ReplicaFanout):
    """The LoRA operations of ``ClusterWeights``."""

    async def _lora_change(
        self,
        method: str,
        per_replica: Sequence[Mapping[str, Any]] | Mapping[int, Mapping[str, Any]],
        *,
        data: bytes | Lease | None = None,
    ) -> dict[str, Any]:
        """A LoRA change on every serving replica, all or nothing (see the module docstring);
        ``per_replica``: arguments by replica id, each with the version the front chose."""
        replicas = self._replicas()
        ref = self._put(data)
        txn = uuid.uuid4().hex
        try:
            async with self.cluster.gate.closed():
                results = await self._gather(
                    replicas,
                    lambda r: r.actor.lora_change.remote(txn, method, dict(per_replica[r.replica_id]), ref),
                )
                failed = [
                    (r.replica_id, res)
                    for r, res in zip(replicas, results, strict=True)
                    if isinstance(res, BaseException)
                ]
                if len(failed) == len(replicas) and all(is_refusal(e) for _, e in failed):
                    # Refused everywhere alike (validation runs before any change): nothing changed.
                    raise failed[0][1]
                if failed:
                    # Every replica, the failed ones too: a change that failed half-way comes back as well.
                    undone = await self._gather(replicas, lambda r: r.actor.lora_rollback.remote(txn))
                    rid, exc = failed[0]
                    msg = getattr(exc, "message", str(exc))
                    stuck = [
                        r.replica_id
                        for r, u in zip(replicas, undone, strict=True)
                        if isinstance(u, BaseException)
                    ]
                    if stuck:
                        raise ReplicasDivergedError(
                            f"{method} failed on replica {rid} ({msg}) and rolling back failed on replica(s) "
                            f"{stuck} ({first_error(undone)}); the replicas may differ: reload the adapters"
                        ) from exc
                    raise WeightApplyError(
                        f"{method} failed on replica {rid} ({msg}); every replica was rolled back to "
                        f"version {self.weight_version}"
                    ) from exc
        finally:
            await self._gather(replicas, lambda r: r.actor.lora_finish.remote(txn))
        return results[0]

    async def _changing(
        self, method: str, kwargs: dict[str, Any], *, data: bytes | Lease | None = None
    ) -> dict:
        """A version-bumping LoRA change: explicit version, front version set after."""
        async with self.cluster.admin_lock:
            version = self._next_version(kwargs.get("weight_version"))
            args = {**kwargs, "weight_version": version}
            result = await self._lora_change(
                method, {r.replica_id: args for r in self.cluster.replicas}, data=data
            )
            self.cluster.set_weight_version(version)
        return {**result, "weight_version": self.weight_version}

    # ------------------------------------------------------------------ LoRA
    async def load_lora(self, *, data: bytes | Lease | None = None, **kwargs: Any) -> dict[str, Any]:
        return await self._changing("load_lora", kwargs, data=data)

    async def load_lora_tensors(self, **kwargs: Any) -> dict[str, Any]:
        return await self._changing("load_lora_tensors", kwargs)

    async def activate_lora(self, **kwargs: Any) -> dict[str, Any]:
        return await self._changing("activate_lora", kwargs)

    async def set_lora_mode(self, **kwargs: Any) -> dict[str, Any]:
        return await self._changing("set_lora_mode", kwargs)

    async def unload_lora(self, **kwargs: Any) -> dict[str, Any]:
        return await self._changing("unload_lora", kwargs)

    async def describe_lora(self) -> dict[str, Any]:
        # Replicas apply the same changes in the same order; replica 0 speaks for all.
        replica = self._replicas()[0]
        [described] = await self._gather(
            [replica], lambda r: r.actor.manager_call.remote("describe_lora", {})
        )
        if isinstance(described, BaseException):
            raise described
        return described
