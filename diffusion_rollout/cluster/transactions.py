"""Full-weight updates in two phases on one replica, so a cluster applies them on all or on none.

The single engine validates and applies in one exclusive step (``FullWeightOps._apply_full``). A
cluster must validate on every replica before any applies, and undo the replicas that applied when
another fails. This module splits the step, per transaction id:

1. :meth:`FullUpdateTransactions.prepare`: the payload (already read by the transport's reader:
   disk, upload, IPC entry, broadcast) is validated and cast against the live pipeline
   (``plan_update``, on the worker between batches); nothing changes.
2. :meth:`~FullUpdateTransactions.commit`: the copies run on the worker (merged LoRA suspended, as
   in the single engine), the version becomes the one the front chose; the previous values are
   kept.
3. :meth:`~FullUpdateTransactions.rollback` restores them exactly (and the previous version) if
   another replica failed; :meth:`~FullUpdateTransactions.finish` drops them once every replica has
   applied.

Memory: the kept previous values are the backups ``apply_copies`` makes anyway; they live until the
front's ``finish`` (milliseconds after the last commit) instead of until the end of the copy.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_rollout.errors import WeightApplyError, WeightUpdateError
from diffusion_rollout.server.weights.updater import (
    UpdatePlan,
    apply_copies,
    get_module,
    plan_update,
    restore_copy,
)

logger = logging.getLogger(__name__)


@dataclass
class _Prepared:
    plan: UpdatePlan
    flush_cache: bool
    on_finish: Callable[[], None] | None = None
    received_sha256: Mapping[str, Mapping[str, str]] | None = None  # an upload's hashes on arrival


@dataclass
class _Applied:
    plan: UpdatePlan
    backups: list[torch.Tensor]
    previous_version: Any


class FullUpdateTransactions:
    """Prepared and applied full-weight updates of one ``WeightManager``, by transaction id."""

    def __init__(self, manager) -> None:
        self.manager = manager
        self._prepared: dict[str, _Prepared] = {}
        self._applied: dict[str, _Applied] = {}
        self._finishing: dict[str, Callable[[], None] | None] = {}

    async def prepare(
        self,
        txn: str,
        payload: dict[str, list],
        *,
        flush_cache: bool,
        finite_checked: bool = False,
        on_finish: Callable[[], None] | None = None,
        received_sha256: Mapping[str, Mapping[str, str]] | None = None,
    ) -> str:
        """Validate ``{module: [(name, tensor)]}`` and keep the plan; returns its summary.

        ``finite_checked``: the tensors were checked finite already (staged upload parts);
        ``on_finish`` runs when the transaction ends, whatever the outcome (gives buffers back)."""
        try:
            self.manager.targets(list(payload))
            plan = await self.manager._exclusive(
                lambda: plan_update(self.manager.engine.pipe, payload, check_finite=not finite_checked)
            )
        except BaseException:
            if on_finish is not None:
                on_finish()
            raise
        self._prepared[txn] = _Prepared(plan, flush_cache, on_finish, received_sha256)
        return plan.summary()

    def _merge_suspended(self, stack: contextlib.ExitStack, plan: UpdatePlan) -> None:
        pipe = self.manager.engine.pipe
        for name in plan.modules:
            stack.enter_context(self.manager.lora.merge_suspended(name, get_module(pipe, name)))

    async def commit(self, txn: str, weight_version: Any) -> Any:
        """Apply the prepared plan; the new version is ``weight_version`` (the front's choice)."""

        def run() -> Any:
            prepared = self._prepared.pop(txn, None)
            if prepared is None:
                raise WeightUpdateError(f"no prepared update {txn!r} on this replica")
            self._finishing[txn] = prepared.on_finish
            t0 = time.perf_counter()
            previous = self.manager.engine.weight_version
            with contextlib.ExitStack() as stack:
                self._merge_suspended(stack, prepared.plan)
                backups = apply_copies(prepared.plan.copies, before_copy=self.manager.before_copy)
            version = self.manager._bump(weight_version, prepared.plan.modules, prepared.flush_cache)
            self.manager.remember_received(prepared.received_sha256)
            self._applied[txn] = _Applied(prepared.plan, backups, previous)
            logger.info(
                "weights updated to version %s: %s, %.1f MiB in %.3f s",
                version, prepared.plan.summary(), prepared.plan.num_bytes / 2**20, time.perf_counter() - t0,
            )  # fmt: skip
            return version

        return await self.manager._exclusive(run)

    async def rollback(self, txn: str) -> bool:
        """Undo an applied update (exact previous bytes and version); False if none was applied."""

        def run() -> bool:
            prepared = self._prepared.pop(txn, None)
            if prepared is not None:
                self._finishing[txn] = prepared.on_finish
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
        on_finish = prepared.on_finish if prepared is not None else self._finishing.pop(txn, None)
        self._finishing.pop(txn, None)
        if on_finish is not None:
            on_finish()
