"""``ReplicaFanout``: how a cluster front calls one weight operation on every serving replica.

The plumbing ``ClusterWeights`` and its LoRA operations share: the serving replicas, gathering
their answers (a lost replica is reported to the cluster, Ray's wrapping taken off the errors),
bytes put in the object store once for all of them, and the plain fan-out of operations that
change no weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from diffusion_rollout.cluster.ray_support import import_ray, replica_lost, unwrap
from diffusion_rollout.errors import DiffusionRolloutError, ServiceUnavailableError
from diffusion_rollout.server.weights import Lease, validate_targets

Version = str | int | None


def first_error(results: Sequence[Any]) -> BaseException | None:
    return next((r for r in results if isinstance(r, BaseException)), None)


def is_refusal(exc: BaseException) -> bool:
    """A 4xx: the request was refused by validation, before the replica changed anything. Any other
    failure (device fault, 5xx, a dead actor) may have left a change half-applied."""
    return isinstance(exc, DiffusionRolloutError) and exc.status_code < 500


class ReplicaFanout:
    """The fan-out plumbing of a cluster's weight operations (``self.cluster``: the ``ClusterEngine``)."""

    cluster: Any

    # ------------------------------------------------------------------ plumbing
    @property
    def weight_version(self) -> Any:
        return self.cluster.weight_version

    def module_names(self) -> list[str]:
        return list(self.cluster.module_names)

    def targets(self, target_modules: Sequence[str] | None) -> list[str]:
        return validate_targets(target_modules, self.cluster.module_names)

    def result(self, message: str, **extra: Any) -> dict[str, Any]:
        return {"success": True, "message": message, "weight_version": self.weight_version, **extra}

    def _next_version(self, weight_version: Version) -> Any:
        return weight_version if weight_version is not None else self.cluster.updates_applied + 1

    def _replicas(self):
        """The serving replicas: a restarting one copies the result from a peer when it is back."""
        replicas = self.cluster.serving()
        if not replicas:
            raise ServiceUnavailableError("no replica is serving; weight operations need at least one")
        return replicas

    async def _gather(self, replicas, call) -> list[Any]:
        results = await asyncio.gather(*(call(r) for r in replicas), return_exceptions=True)
        out = []
        for r, res in zip(replicas, results, strict=True):
            if isinstance(res, BaseException) and replica_lost(res):
                self.cluster.replica_died(r, res)
            out.append(unwrap(res) if isinstance(res, BaseException) else res)
        return out

    @staticmethod
    def _put(data: bytes | Lease | None):
        """Bytes (or a receive buffer, given back here) into the object store once, for every replica."""
        if data is None:
            return None
        if isinstance(data, Lease):
            try:
                return import_ray().put(data.data.numpy())
            finally:
                data.release()
        return import_ray().put(data)

    async def _fanout(
        self,
        method: str,
        kwargs: Mapping[str, Any] | None = None,
        *,
        per_replica: Sequence[Mapping[str, Any]] | None = None,
        data: bytes | Lease | None = None,
        replicas: Sequence[Any] | None = None,
    ) -> list[Any]:
        """``method(**kwargs)`` on every serving replica's manager (``per_replica``: arguments by
        replica id); raises unless every one succeeded. For operations that change no weights or
        adapters (LoRA changes go through :meth:`_lora_change`)."""
        replicas = list(replicas) if replicas is not None else self._replicas()
        ref = self._put(data)
        args = per_replica or {r.replica_id: kwargs or {} for r in replicas}
        results = await self._gather(
            replicas, lambda r: r.actor.manager_call.remote(method, dict(args[r.replica_id]), ref)
        )
        refused = first_error(results)
        if refused is not None:
            raise refused
        return results
