"""``ClusterWeights``: the weight-manager facade of a cluster; every operation reaches every replica.

Design decisions:

- **One at a time.** Operations are serialized by the front's admin lock (the single engine
  serializes them on its worker), so a two-phase update never interleaves with another change.
- **Versions chosen by the front.** Every changing operation carries an explicit
  ``weight_version`` to the replicas: the trainer's, else the front's count of updates + 1. All
  replicas therefore report the same version, which becomes the front's after the update.
- **Full weights: all or nothing.** Disk, HTTP upload (final part), IPC tensors and broadcasts run
  in two phases (the transports' prepare / commit / rollback, ``server/weights/transports``): every replica reads and validates (rollouts keep
  running); if any refuses, none applies and the first refusal is the answer (400). Then, with the
  dispatch gate closed, every replica applies; if one fails, the replicas that applied roll back
  to the exact previous bytes and version, and the failure is the answer.
- **Serving replicas.** Operations reach the replicas that serve; one that is restarting copies
  the result from a serving peer before it serves again (``server/weights/replica_state.py``), so it never
  misses an update. Forming an update group needs every replica (a collective needs every rank).
- **HTTP bodies once.** Upload and LoRA bodies are ``ray.put`` once; each replica reads the object.
  A part whose body the front did not receive whole reaches no replica; ``refuse_part`` tells every
  serving replica to drop its upload, as the single manager does (400, nothing applied anywhere).
- **LoRA changes: all or nothing** (``cluster/lora_fanout.py``). Loads (path, upload, tensors, ``lora_merge``), activation, mode
  switches and unloads run on every replica at once with the dispatch gate closed, each replica
  first keeping what the change can touch (``server/weights/lora_transactions.py``). They validate before
  changing anything and replicas hold the same model, so a refusal is the same everywhere and is
  the answer (400). If the change fails on only some replicas (a device fault), every replica puts
  back its adapters, their tensors, activation, mode (merged base weights included) and version,
  and the answer is 500 naming the failure; rollouts never see the replicas apart.
- **Other operations** (pause, memory, groups, checks) fan out at once and change no weights.
- **Checksums** are read from every replica; if they differ the answer is 500 naming the replicas
  and modules that disagree with replica 0.
- **Update groups.** Replica ``i`` joins as ``rank_offset + i`` (``routing.replica_ranks``), all at
  once since joining is collective; a broadcast is received by all replicas concurrently (prepare),
  then applied in the commit phase. The front remembers each group's members (replica and
  process); a broadcast into a group that lost one (restarting, or restarted: a new process never
  joined) is refused at once with 503 instead of waiting for it until the group's timeout, and
  destroying the group asks only the members that are still in it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from diffusion_rollout.cluster.fanout import Version, first_error
from diffusion_rollout.cluster.lora_fanout import ClusterLoraOps
from diffusion_rollout.cluster.routing import ipc_entry_for, replica_ranks
from diffusion_rollout.errors import (
    DiffusionRolloutError,
    ReplicasDivergedError,
    ServiceUnavailableError,
    WeightApplyError,
    WeightUpdateError,
)
from diffusion_rollout.server.weights import BufferPool, Lease

logger = logging.getLogger(__name__)


class ClusterWeights(ClusterLoraOps):
    """Fan-out of every ``WeightOps`` call to the replicas of a ``ClusterEngine``."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        # Upload bodies are received here once (unpinned: the front holds no model), then put in
        # the object store for the replicas and given back.
        self.receive_buffers = BufferPool(pin=False, keep_bytes=cluster.config.upload_buffer_keep_bytes)
        # Update groups formed through this front: group name -> {replica id: pid at joining}. A
        # replica restarted since (a new process) is no member, and a collective without it would wait
        # for it until the group's timeout: such a broadcast is refused before any replica is asked.
        self._groups: dict[str, dict[int, Any]] = {}

    async def _full(
        self,
        source: str,
        per_replica: Sequence[dict[str, Any]],
        *,
        modules: Sequence[str],
        weight_version: Version,
        flush_cache: bool,
        data: bytes | Lease | None = None,
    ) -> dict[str, Any]:
        """Two-phase full-weight update on every serving replica (see the module docstring)."""
        async with self.cluster.admin_lock:
            replicas = self._replicas()
            ref = self._put(data)
            txn = uuid.uuid4().hex
            try:
                prepared = await self._gather(
                    replicas,
                    lambda r: r.actor.prepare.remote(
                        txn, source, {**per_replica[r.replica_id], "flush_cache": flush_cache}, ref
                    ),
                )
                refused = first_error(prepared)
                if refused is not None:
                    raise refused
                version = self._next_version(weight_version)
                async with self.cluster.gate.closed():
                    committed = await self._gather(replicas, lambda r: r.actor.commit.remote(txn, version))
                    failed = [
                        (r.replica_id, c)
                        for r, c in zip(replicas, committed, strict=True)
                        if isinstance(c, BaseException)
                    ]
                    if failed:
                        await self._gather(replicas, lambda r: r.actor.rollback.remote(txn))
                        rid, exc = failed[0]
                        msg = getattr(exc, "message", str(exc))
                        raise WeightApplyError(
                            f"replica {rid} failed to apply the update ({msg}); every replica was rolled "
                            f"back to version {self.weight_version}"
                        ) from exc
                    self.cluster.set_weight_version(version)
                    self.cluster.touched_modules.update(modules)
            finally:
                await self._gather(replicas, lambda r: r.actor.finish.remote(txn))
        return self.result(f"{prepared[0]} on {len(replicas)} replicas")

    # ------------------------------------------------------------------ full weights
    async def update_from_disk(
        self,
        model_path: str,
        target_modules: Sequence[str] | None,
        *,
        flush_cache: bool = True,
        weight_version: Version = None,
    ) -> dict[str, Any]:
        targets = self.targets(target_modules)
        kwargs = {"model_path": model_path, "target_modules": targets}
        return await self._full(
            "disk",
            [kwargs] * len(self.cluster.replicas),
            modules=targets,
            weight_version=weight_version,
            flush_cache=flush_cache,
        )

    async def upload_part(
        self,
        body: bytes | Lease,
        *,
        target_module: str,
        weight_version: Version = None,
        final: bool = True,
        upload_id: str | None = None,
        part: int | None = None,
        flush_cache: bool = True,
        partial: bool = False,
    ) -> dict[str, Any]:
        [target] = self.targets([target_module])
        kwargs = {
            "target_module": target,
            "weight_version": weight_version,
            "upload_id": upload_id,
            "part": part,
            "partial": partial,
        }
        if not final:
            results = await self._fanout("upload_part", {**kwargs, "final": False}, data=body)
            return results[0]
        out = await self._full(
            "upload",
            [kwargs] * len(self.cluster.replicas),
            modules=[target],
            weight_version=weight_version,
            flush_cache=flush_cache,
            data=body,
        )
        out["upload_id"] = upload_id or (str(weight_version) if weight_version is not None else "default")
        return out

    async def refuse_part(
        self,
        exc: WeightUpdateError,
        *,
        upload_id: str | None,
        weight_version: Version,
        part: int | None,
        final: bool,
    ) -> NoReturn:
        """A part whose body did not arrive whole at the front (so no replica saw it): every serving
        replica drops its upload as the single manager does (later parts refused, nothing applied).
        Raises the refusal, which says whether the upload was dropped."""
        kwargs = {"exc": exc, "upload_id": upload_id, "weight_version": weight_version, "part": part}
        replicas = self.cluster.serving()  # none serving: none holds the upload, the refusal stands
        results = await self._gather(
            replicas, lambda r: r.actor.manager_call.remote("refuse_part", {**kwargs, "final": final})
        )
        refusals = []
        for r, res in zip(replicas, results, strict=True):
            if isinstance(res, WeightUpdateError):
                refusals.append(res)
            else:  # e.g. a replica died: it restarts with nothing staged; the part is refused anyway
                logger.warning("replica %d could not drop the refused part's upload: %s", r.replica_id, res)
        # Serving replicas staged the same parts and word the refusal alike; one restarted since the
        # upload began holds none of it and gives the plain refusal: one that dropped it speaks.
        raise next((e for e in refusals if e.message != exc.message), exc)

    async def update_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        target_modules: Sequence[str] | None = None,
        weight_update_mode: str | None = None,
        lora_alpha: float | None = None,
        lora_rank: int | None = None,
        weight_version: Version = None,
        payload_gpu_uuids: Sequence[str] | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        targets = self.targets(target_modules)
        per_replica = []
        for r in self.cluster.replicas:
            entries, uuids = ipc_entry_for(
                serialized_named_tensors, payload_gpu_uuids, r.info.get("gpu_uuids", [])
            )
            per_replica.append(
                {
                    "serialized_named_tensors": entries,
                    "payload_gpu_uuids": uuids,
                    "load_format": load_format,
                    "target_modules": targets,
                }
            )
        if weight_update_mode is None:
            return await self._full(
                "tensor", per_replica, modules=targets, weight_version=weight_version, flush_cache=flush_cache
            )
        async with self.cluster.admin_lock:
            version = self._next_version(weight_version)
            extra = {
                "weight_update_mode": weight_update_mode,
                "lora_alpha": lora_alpha,
                "lora_rank": lora_rank,
                "weight_version": version,
                "flush_cache": flush_cache,
            }
            result = await self._lora_change(
                "update_from_tensor",
                {r.replica_id: {**per_replica[r.replica_id], **extra} for r in self.cluster.replicas},
            )
            self.cluster.set_weight_version(version)
        return {**result, "weight_version": self.weight_version}

    # ------------------------------------------------------------------ update groups
    async def init_group(self, **kwargs: Any) -> dict[str, Any]:
        down = [r.replica_id for r in self.cluster.replicas if r.state != "serving"]
        if down:
            # A collective needs every rank: a group formed without them would hang the trainer.
            raise ServiceUnavailableError(f"replica(s) {down} are not serving; an update group needs all")
        ranks = replica_ranks(kwargs["rank_offset"], kwargs["world_size"], len(self.cluster.replicas))
        per_replica = [{**kwargs, "rank_offset": rank} for rank in ranks]
        async with self.cluster.admin_lock:
            await self._fanout("init_group", per_replica=per_replica)
            self._groups[kwargs["group_name"]] = {
                r.replica_id: r.info.get("pid") for r in self.cluster.replicas
            }
        return self.result(
            f"replicas joined weight update group {kwargs['group_name']!r} as ranks {ranks[0]}..{ranks[-1]} "
            f"of {kwargs['world_size']} ({kwargs['backend']})",
            ranks=ranks,
        )

    async def update_from_distributed(
        self,
        *,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        target_modules: Sequence[str] | None = None,
        weight_version: Version = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        self._check_members(group_name)
        kwargs = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "target_modules": target_modules,
        }
        return await self._full(
            "distributed",
            [kwargs] * len(self.cluster.replicas),
            modules=self.targets(target_modules),
            weight_version=weight_version,
            flush_cache=flush_cache,
        )

    def _lost_members(self, group_name: str) -> list[str]:
        """Why members of ``group_name`` cannot take part any more (empty: all can)."""
        joined = self._groups.get(group_name)
        if joined is None:
            return []  # not formed through this front: the replicas answer for themselves
        lost = []
        for r in self.cluster.replicas:
            if r.replica_id not in joined:
                continue
            if r.state != "serving":
                lost.append(f"replica {r.replica_id} is {r.state}")
            elif r.info.get("pid") != joined[r.replica_id]:
                lost.append(f"replica {r.replica_id} restarted since the group was formed")
        return lost

    def _check_members(self, group_name: str) -> None:
        lost = self._lost_members(group_name)
        if lost:
            raise ServiceUnavailableError(
                f"weight update group {group_name!r} lost members ({'; '.join(lost)}): a broadcast would "
                "wait for them until the group's timeout. Nothing was applied: destroy the group and "
                "init it again once every replica serves"
            )

    async def destroy_group(self, group_name: str) -> dict[str, Any]:
        async with self.cluster.admin_lock:
            joined = self._groups.pop(group_name, None)
            members = [
                r
                for r in self._replicas()
                if joined is None or (r.replica_id in joined and r.info.get("pid") == joined[r.replica_id])
            ]
            # A replica restarted since the group was formed never joined it: nothing to leave there.
            if members:
                await self._fanout("destroy_group", {"group_name": group_name}, replicas=members)
        return self.result(f"replicas left weight update group {group_name!r}")

    # ------------------------------------------------------------------ checks
    async def checksums(
        self, module_names: Sequence[str] | None, algorithm: str = "sglang"
    ) -> dict[str, str]:
        async with self.cluster.admin_lock:
            replicas = self._replicas()
            sums = await self._fanout(
                "checksums", {"module_names": module_names, "algorithm": algorithm}, replicas=replicas
            )
        reference = sums[0]
        differ = {
            r.replica_id: sorted(m for m in reference if s.get(m) != reference[m])
            for r, s in zip(replicas, sums, strict=True)
            if s != reference
        }
        if differ:
            detail = "; ".join(f"replica {rid}: {', '.join(mods)}" for rid, mods in differ.items())
            raise ReplicasDivergedError(
                f"replicas hold different weights than replica {replicas[0].replica_id}: {detail}"
            )
        return reference

    async def check_tensors(self, target_module: str, expected: Mapping[str, str]) -> dict[str, Any]:
        replicas = self._replicas()
        results = await self._gather(
            replicas,
            lambda r: r.actor.manager_call.remote(
                "check_tensors", {"target_module": target_module, "expected": dict(expected)}
            ),
        )
        for r, res in zip(replicas, results, strict=True):
            if isinstance(res, DiffusionRolloutError):
                raise type(res)(f"replica {r.replica_id}: {res.message}", field=res.field)
            if isinstance(res, BaseException):
                raise res
        return self.result(f"{results[0]['message']} on {len(replicas)} replicas")

    # ------------------------------------------------------------------ pause and memory
    async def pause_generation(self) -> dict[str, Any]:
        self.cluster.user_paused = True
        await self._fanout("pause_generation")
        return self.result("generation paused on every replica; queued requests wait")

    async def continue_generation(self) -> dict[str, Any]:
        self.cluster.user_paused = False
        await self._fanout("continue_generation")
        return self.result("generation continues on every replica")

    async def release_memory(self) -> dict[str, Any]:
        async with self.cluster.admin_lock:
            results = await self._fanout("release_memory")
            self.cluster.status = "released"
        return self.result(f"replica 0: {results[0]['message']} (every replica released)")

    async def resume_memory(self) -> dict[str, Any]:
        async with self.cluster.admin_lock:
            results = await self._fanout("resume_memory")
            self.cluster.status = "ready"
        return self.result(f"replica 0: {results[0]['message']} (every replica resumed)")
