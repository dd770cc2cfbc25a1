"""Full-weight updates in two phases, by transaction id: every transport's prepare, then commit or
rollback. The single engine and each replica of a cluster go through the same steps.

1. :meth:`WeightTransactions.prepare`: the transport (``transports/``) receives and stages the
   tensors; they are then validated and cast against the live pipeline (``plan_update``, on the
   worker between batches). Nothing changes; a failure here is a refusal (400).
2. :meth:`~WeightTransactions.commit`: the copies run on the worker (a merged LoRA suspended, so
   the base weights are exact), the version becomes the given one (the trainer's, the cluster
   front's, or the next count); the previous values are kept. A copy that fails restores what it
   had copied and raises (500): the model is as before.
3. :meth:`~WeightTransactions.rollback` restores a committed update exactly (bytes and version), for
   a cluster whose other replica failed; :meth:`~WeightTransactions.finish` drops the kept values
   and gives the receive buffers back.

:meth:`~WeightTransactions.update` is the single engine's path: prepare, commit, finish, with the
validation and the copies in one worker job between batches.

Memory: the kept previous values are the backups ``apply_copies`` makes anyway; they live until
``finish`` (at once in one process, after the last replica's commit in a cluster).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_rollout.errors import WeightApplyError, WeightUpdateError
from diffusion_rollout.server.weights.transports.base import Staged, WeightTransport
from diffusion_rollout.server.weights.transports.disk import DiskTransport
from diffusion_rollout.server.weights.transports.distributed import DistributedTransport
from diffusion_rollout.server.weights.transports.ipc import TensorTransport
from diffusion_rollout.server.weights.transports.upload import UploadTransport
from diffusion_rollout.server.weights.updater import (
    UpdatePlan,
    apply_copies,
    get_module,
    plan_update,
    restore_copy,
)

logger = logging.getLogger(__name__)

#: Every full-weight transport, by the name a cluster front sends to its replicas.
TRANSPORTS: dict[str, WeightTransport] = {
    t.name: t for t in (DiskTransport(), UploadTransport(), TensorTransport(), DistributedTransport())
}


def transport_for(source: str) -> WeightTransport:
    transport = TRANSPORTS.get(source)
    if transport is None:
        raise WeightUpdateError(f"unknown update source {source!r}; one of {tuple(TRANSPORTS)}")
    return transport


@dataclass
class _Prepared:
    plan: UpdatePlan | None  # None: validated in the commit's worker job
    flush_cache: bool
    staged: Staged


@dataclass
class _Applied:
    plan: UpdatePlan
    backups: list[torch.Tensor]
    previous_version: Any
    seconds: float


class WeightTransactions:
    """Prepared and applied full-weight updates of one ``WeightManager``, by transaction id."""

    def __init__(self, manager) -> None:
        self.manager = manager
        self._prepared: dict[str, _Prepared] = {}
        self._applied: dict[str, _Applied] = {}
        self._finishing: dict[str, Callable[[], None] | None] = {}

    async def prepare(
        self,
        txn: str,
        source: str | WeightTransport,
        request: Mapping[str, Any],
        *,
        data: Any = None,
        flush_cache: bool = True,
        validate_now: bool = True,
    ) -> str:
        """Receive the update through ``source``, validate it and keep the plan; returns its summary.

        ``validate_now=False``: the validation against the live model runs in the commit's worker
        job instead (the single engine: one job between batches, so an update waits for at most
        one batch in flight); a cluster validates every replica before any commits."""
        transport = transport_for(source) if isinstance(source, str) else source
        staged = await transport.prepare(self.manager, request, data)
        try:
            self.manager.targets(list(staged.payload))
            plan = await self.manager._exclusive(lambda: self._plan(staged)) if validate_now else None
        except BaseException:
            if staged.on_finish is not None:
                staged.on_finish()
            raise
        self._prepared[txn] = _Prepared(plan, flush_cache, staged)
        return plan.summary() if plan is not None else "received"

    def _plan(self, staged: Staged) -> UpdatePlan:
        """On the worker: every staged tensor checked against the live model and cast; no change."""
        return plan_update(self.manager.engine.pipe, staged.payload, check_finite=not staged.finite_checked)

    def _merge_suspended(self, stack: contextlib.ExitStack, plan: UpdatePlan) -> None:
        pipe = self.manager.engine.pipe
        for name in plan.modules:
            stack.enter_context(self.manager.lora.merge_suspended(name, get_module(pipe, name)))

    async def commit(self, txn: str, weight_version: Any) -> Any:
        """Apply the prepared plan; the new version is ``weight_version`` (None: the next count)."""

        def run() -> Any:
            prepared = self._prepared.pop(txn, None)
            if prepared is None:
                raise WeightUpdateError(f"no prepared update {txn!r} on this replica")
            self._finishing[txn] = prepared.staged.on_finish
            t0 = time.perf_counter()
            if prepared.plan is None:
                prepared.plan = self._plan(prepared.staged)  # a refusal here has changed nothing
            previous = self.manager.engine.weight_version
            with contextlib.ExitStack() as stack:
                self._merge_suspended(stack, prepared.plan)
                backups = apply_copies(prepared.plan.copies, before_copy=self.manager.before_copy)
            version = self.manager._bump(weight_version, prepared.plan.modules, prepared.flush_cache)
            self.manager.remember_received(prepared.staged.received_sha256)
            seconds = time.perf_counter() - t0
            self._applied[txn] = _Applied(prepared.plan, backups, previous, seconds)
            logger.info(
                "weights updated to version %s: %s, %.1f MiB in %.3f s",
                version, prepared.plan.summary(), prepared.plan.num_bytes / 2**20, seconds,
            )  # fmt: skip
            return version

        return await self.manager._exclusive(run)

    async def rollback(self, txn: str) -> bool:
        """Undo an applied update (exact previous bytes and version); False if none was applied
        (a prepared one is dropped)."""

        def run() -> bool:
            prepared = self._prepared.pop(txn, None)
            if prepared is not None:
                self._finishing[txn] = prepared.staged.on_finish
            applied = self._applied.pop(txn, None)
            if applied is None:
                return False
            with contextlib.ExitStack() as stack, torch.no_grad():
                self._merge_suspended(stack, applied.plan)
                try:
                    for copy, saved in zip(applied.plan.copies, applied.backups, strict=True):
                        restore_copy(copy, saved)
                except Exception as exc:  # pragma: no cover - the device itself is failing
                    logger.critical("rollback of update %s failed; weights are inconsistent: %s", txn, exc)
                    raise WeightApplyError(
                        f"rollback failed on this replica: {exc}; reload the weights"
                    ) from exc
            self.manager.updates_applied -= 1
            self.manager.received.weights_changed()
            self.manager.engine.weight_version = applied.previous_version
            self.manager.engine.prompt_cache.clear()
            logger.warning("update %s rolled back to version %s", txn, applied.previous_version)
            return True

        return await self.manager._exclusive(run)

    def finish(self, txn: str) -> None:
        """Forget the transaction (its kept previous values are freed, its buffers given back)."""
        prepared = self._prepared.pop(txn, None)
        self._applied.pop(txn, None)
        on_finish = prepared.staged.on_finish if prepared is not None else self._finishing.pop(txn, None)
        self._finishing.pop(txn, None)
        # The plan's tensors may be views into receive buffers: they go first, so the pool takes
        # the buffers back.
        del prepared
        if on_finish is not None:
            on_finish()

    async def update(
        self,
        source: str | WeightTransport,
        request: Mapping[str, Any],
        *,
        data: Any = None,
        weight_version: Any = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """One engine's whole update: prepare, commit, finish; the success answer."""
        txn = uuid.uuid4().hex
        try:
            await self.prepare(txn, source, request, data=data, flush_cache=flush_cache, validate_now=False)
            extra = self._prepared[txn].staged.extra
            await self.commit(txn, weight_version)
            applied = self._applied[txn]
            summary, mib, seconds = applied.plan.summary(), applied.plan.num_bytes / 2**20, applied.seconds
            del applied  # its tensors may be views into receive buffers, given back by finish
        finally:
            self.finish(txn)
        return self.manager.result(f"updated {summary} ({mib:.1f} MiB in {seconds:.3f} s)", **extra)
