"""``ManagerCore``: the state and plumbing that every group of ``WeightManager`` operations shares.

Design decisions:

- The engine knows nothing of weights management: the manager keeps its own state here (LoRA
  adapters, staged uploads, update groups, released memory, the pause flag, cached tensor specs,
  the full-weight transactions)
  and reaches the engine only through ``engine.pipe``, ``engine.run_exclusive``,
  ``engine.weight_version``, ``engine.prompt_cache``, ``engine.worker``, ``engine.device``,
  ``engine.status`` and ``engine.config`` (for the upload buffers' bound).
- Every mutation of the pipeline runs through :meth:`ManagerCore._exclusive` (``engine.run_exclusive``,
  i.e. on the engine's worker thread between generation batches): no output ever mixes two weight
  versions, and an update sent while a rollout runs lands after it.
- ``weight_version`` changes with every successful change of what the model computes
  (:meth:`ManagerCore._bump`, called on the worker): it becomes the string (or integer) the trainer
  sent, else the count of updates applied so far (a number that never repeats). Reads and failed
  updates leave it alone. The prompt cache is cleared whenever a module that can change prompt
  encodings changes (and on ``flush_cache``).
- Target modules are validated up front (:meth:`ManagerCore.targets`) with a message naming what the
  pipeline has, before any payload is read.
- ``before_copy`` is a fault-injection hook (called before each in-place copy) for tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from torch import nn

from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.server.weights.distributed import UpdateGroups
from diffusion_rollout.server.weights.lora import LoraManager
from diffusion_rollout.server.weights.memory import MemoryOccupation
from diffusion_rollout.server.weights.receive import BufferPool
from diffusion_rollout.server.weights.received_digests import ReceivedDigests
from diffusion_rollout.server.weights.staging import StagingArea
from diffusion_rollout.server.weights.transports import WeightTransactions
from diffusion_rollout.server.weights.updater import (
    BeforeCopy,
    TensorSpec,
    encoder_modules_touched,
    pipeline_modules,
)

T = TypeVar("T")

DEFAULT_TARGETS = ("transformer",)
Version = str | int | None


def validate_targets(target_modules: Sequence[str] | None, available: Iterable[str]) -> list[str]:
    """``target_modules`` (default ``transformer``) checked against the pipeline's module names."""
    if target_modules is not None and not target_modules:
        raise WeightUpdateError(
            "target_modules is empty; leave it out for the default", field="target_modules"
        )
    names = list(dict.fromkeys(target_modules or DEFAULT_TARGETS))
    modules = set(available)
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise WeightUpdateError(
            # "not found in pipeline": SGLang's wording, which its clients' tests match.
            f"module(s) {', '.join(repr(n) for n in unknown)} not found in pipeline; this pipeline has: "
            f"{', '.join(sorted(modules))}",
            field="target_modules",
        )
    return names


class ManagerCore:
    """One engine's weight-management state and the helpers every operation uses."""

    def __init__(self, engine, *, staging_ttl_s: float = 600.0, max_staged_uploads: int = 2) -> None:
        self.engine = engine
        self.lora = LoraManager()
        self.staging = StagingArea(ttl_s=staging_ttl_s, max_uploads=max_staged_uploads)
        self.groups = UpdateGroups()
        self.memory = MemoryOccupation()
        self.updates_applied = 0
        self.received = ReceivedDigests()  # per-tensor hashes of the last applied upload
        self.user_paused = False
        self.before_copy: BeforeCopy | None = None
        self._specs: dict[str, dict[str, TensorSpec]] = {}
        # Upload bodies are received into these (pinned when the model is on a GPU: see receive.py).
        self.receive_buffers = BufferPool(
            pin=str(engine.device).startswith("cuda"), keep_bytes=engine.config.upload_buffer_keep_bytes
        )
        # Every full-weight update: a transport's prepare, then commit or rollback (transports/).
        self.transactions = WeightTransactions(self)

    # ------------------------------------------------------------------ plumbing
    async def _exclusive(self, fn: Callable[[], T]) -> T:
        return await self.engine.run_exclusive(fn)

    def modules(self) -> dict[str, nn.Module]:
        return pipeline_modules(self.engine.pipe)

    def module_names(self) -> list[str]:
        """What ``target_modules`` can name (the routers' view; they never touch the modules)."""
        return list(self.modules())

    @property
    def weight_version(self) -> Any:
        return self.engine.weight_version

    def targets(self, target_modules: Sequence[str] | None) -> list[str]:
        return validate_targets(target_modules, self.modules())

    def _bump(self, weight_version: Version, modules: Sequence[str], flush_cache: bool = False) -> Any:
        """On the worker, after a successful change: new version, prompt cache cleared if needed."""
        self.updates_applied += 1
        self.received.weights_changed()
        self.engine.weight_version = weight_version if weight_version is not None else self.updates_applied
        if flush_cache or encoder_modules_touched(modules):
            self.engine.prompt_cache.clear()
        return self.engine.weight_version

    def result(self, message: str, **extra: Any) -> dict[str, Any]:
        return {"success": True, "message": message, "weight_version": self.engine.weight_version, **extra}
