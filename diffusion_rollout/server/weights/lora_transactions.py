"""LoRA changes on one replica that can be undone, so a cluster applies them on all or on none.

A LoRA change validates before it changes anything, and replicas hold the same model, so a refusal
is the same on every replica. What a cluster must still survive is a change that fails on some
replicas after others applied it (a device fault, a replica that dies): those that applied it must
come back, or rollouts would see different adapters depending on the replica. Per transaction id:

1. :meth:`LoraTransactions.apply`: on the worker, the LoRA state the change can touch is captured
   (``server/weights/lora_snapshot.py``: the named adapter's tensors for a load or unload, only
   records and activation for a switch; no base weights), with the version; then the change runs
   exactly as in one process.
2. :meth:`~LoraTransactions.rollback` puts that state and the version back if another replica
   failed; :meth:`~LoraTransactions.finish` drops it once the front is done.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.server.weights.lora_snapshot import LoraSnapshot, capture, restore
from diffusion_rollout.server.weights.updater import get_module

logger = logging.getLogger(__name__)

# The LoRA-changing manager methods, and the adapters whose tensors each can change or remove
# (None: every adapter of the module). Switches change only records and activation.
TOUCHED: dict[str, Callable[[Mapping[str, Any]], list[str] | None]] = {
    "load_lora": lambda kw: [kw["name"]],
    "load_lora_tensors": lambda kw: [kw["name"]],
    "update_from_tensor": lambda kw: ["default"],  # lora_merge payloads load adapter "default"
    "unload_lora": lambda kw: None if kw.get("name") is None else [kw["name"]],
    "activate_lora": lambda kw: [],
    "set_lora_mode": lambda kw: [],
}


@dataclass
class _Saved:
    snapshots: dict[str, LoraSnapshot]
    weight_version: Any
    updates_applied: int


class LoraTransactions:
    """Undo records of the LoRA changes of one ``WeightManager``, by transaction id."""

    def __init__(self, manager) -> None:
        self.manager = manager
        self._saved: dict[str, _Saved] = {}

    def _targets(self, method: str, kwargs: Mapping[str, Any]) -> list[str]:
        if method == "update_from_tensor":
            return self.manager.targets(kwargs.get("target_modules"))
        return self.manager.targets([kwargs["target_module"]])

    async def apply(
        self, txn: str, method: str, kwargs: Mapping[str, Any], change: Callable[[], Awaitable[Any]]
    ) -> Any:
        """Capture what ``method`` can change, then run ``change()`` (the manager call)."""
        if method not in TOUCHED:
            raise WeightUpdateError(f"{method!r} is not a LoRA change")
        targets = self._targets(method, kwargs)
        touched = TOUCHED[method](kwargs)
        m = self.manager

        def take() -> _Saved:
            pipe = m.engine.pipe
            snapshots = {t: capture(m.lora, t, get_module(pipe, t), touched) for t in targets}
            return _Saved(snapshots, m.engine.weight_version, m.updates_applied)

        # Kept before the change runs: a change that fails half-way is put back as well.
        self._saved[txn] = await m._exclusive(take)
        return await change()

    async def rollback(self, txn: str) -> bool:
        """Put the captured LoRA state and version back; False if nothing was captured."""
        saved = self._saved.pop(txn, None)
        if saved is None:
            return False
        m = self.manager

        def run() -> None:
            pipe = m.engine.pipe
            for target, snapshot in saved.snapshots.items():
                restore(m.lora, target, get_module(pipe, target), snapshot)
            m.updates_applied = saved.updates_applied
            m.received.weights_changed()
            m.engine.weight_version = saved.weight_version
            m.engine.prompt_cache.clear()  # a text encoder's adapter may have changed and come back

        await m._exclusive(run)
        logger.warning("LoRA change %s rolled back to version %s", txn, saved.weight_version)
        return True

    def finish(self, txn: str) -> None:
        """Forget the transaction (its captured tensors are freed)."""
        self._saved.pop(txn, None)
