"""``WeightManager``: every weight, LoRA, memory and pause operation of one engine, in one object.

Design decisions:

- **Split by responsibility, one object.** The state and plumbing live in ``manager_core``
  (versioning, exclusive execution on the engine's worker, target validation, the full-weight
  transactions of ``transports/``), full-weight entry points and checks in ``full_ops``, upload
  staging in ``upload_ops``, adapters in ``lora_ops``; :class:`WeightManager` combines them and adds
  only what belongs to none: SGLang's ``update_weights_from_tensor`` (one payload format that
  carries either full weights or LoRA pairs, so it dispatches between the IPC transport and an
  adapter load) and releasing memory and pausing generation.
- The engine knows nothing of weights management: the manager is attached to an engine lazily by
  :func:`get_weight_manager` (a weak map, so the engine needs no attribute for it).
- Generation is paused while the user asked for it or while memory is released; admin jobs still
  run while paused, so ``pause_generation`` returns once the batch in flight has finished.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.server.weights import ipc
from diffusion_rollout.server.weights.full_ops import FullWeightOps
from diffusion_rollout.server.weights.lora_ops import LoraOps
from diffusion_rollout.server.weights.manager_core import Version
from diffusion_rollout.server.weights.safe_pickle import FdPolicy
from diffusion_rollout.server.weights.upload_ops import UploadOps


class WeightManager(FullWeightOps, UploadOps, LoraOps):
    """The engine's weight manager; see the module docstrings of ``full_ops``, ``upload_ops`` and
    ``lora_ops``."""

    # ------------------------------------------------------------------ SGLang tensor payloads
    _decoder: ipc.PayloadDecoder | None = None

    def _payload_decoder(self) -> ipc.PayloadDecoder:
        if self._decoder is None:
            cfg = self.engine.config
            policy = FdPolicy(allow_cpu_ipc=cfg.allow_cpu_ipc, timeout_s=cfg.ipc_timeout_s)
            self._decoder = ipc.PayloadDecoder(policy)
        return self._decoder

    async def update_from_tensor(
        self,
        serialized_named_tensors: Sequence[str | bytes],
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
        request = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "target_modules": targets,
            "payload_gpu_uuids": payload_gpu_uuids,
        }
        if weight_update_mode is None:
            return await self.transactions.update(
                "tensor", request, weight_version=weight_version, flush_cache=flush_cache
            )
        payload = await self.tensor_payload(**request)
        if weight_update_mode != "lora_merge":
            raise WeightUpdateError(
                f"unknown weight_update_mode {weight_update_mode!r}; use null or 'lora_merge'",
                field="weight_update_mode",
            )
        if len(targets) != 1:
            raise WeightUpdateError(
                "lora_merge updates one target module per request", field="target_modules"
            )
        [target] = targets
        return await self._load_lora_merge(
            target,
            payload[target],
            lora_alpha=lora_alpha,
            lora_rank=lora_rank,
            weight_version=weight_version,
        )

    async def tensor_payload(
        self,
        serialized_named_tensors: Sequence[str | bytes],
        *,
        load_format: str | None = None,
        target_modules: Sequence[str] | None = None,
        payload_gpu_uuids: Sequence[str] | None = None,
    ) -> dict[str, list[tuple[str, Any]]]:
        """Decode this server's entry into ``{module: [(name, tensor)]}``; nothing is applied."""
        targets = self.targets(target_modules)
        entry = ipc.select_entry(serialized_named_tensors, payload_gpu_uuids, self.engine.device)
        local = ipc.own_gpu_index(payload_gpu_uuids, self.engine.device)
        decoded = await self._payload_decoder().decode(entry, cuda_device=local)
        return ipc.module_payloads(decoded, load_format, targets)

    # ------------------------------------------------------------------ memory and pause
    def _sync_pause(self) -> None:
        if self.user_paused or self.memory.released:
            self.engine.worker.pause()
        else:
            self.engine.worker.resume()

    async def release_memory(self) -> dict[str, Any]:
        def run() -> str:
            if self.memory.released:
                return "memory already released"
            self.engine.invalidate_captures()  # graphs hold device memory and the old weights' addresses
            moved = self.memory.release(self.modules().values(), self.lora.kept_tensors())
            followers = getattr(self.engine, "context_parallel", None)
            if followers is not None:
                followers.release_memory(True)
            self.engine.prompt_cache.clear()
            self.engine.status = "released"
            self._sync_pause()
            if moved == 0:
                return "released (CPU server: no device memory to free)"
            return f"released {moved / 2**20:.1f} MiB to pinned CPU memory"

        return self.result(await self._exclusive(run))

    async def resume_memory(self) -> dict[str, Any]:
        def run() -> str:
            if not self.memory.released:
                return "memory already resident"
            moved = self.memory.resume(self.modules().values(), self.lora.kept_tensors(), self.engine.device)
            followers = getattr(self.engine, "context_parallel", None)
            if followers is not None:
                followers.release_memory(False)
            self.engine.status = "ready"
            self._sync_pause()
            return f"resumed {moved / 2**20:.1f} MiB to {self.engine.device}"

        return self.result(await self._exclusive(run))

    async def pause_generation(self) -> dict[str, Any]:
        self.user_paused = True
        self._sync_pause()
        # Admin jobs still run while paused: this one returns once the batch in flight has finished.
        await self._exclusive(lambda: None)
        return self.result("generation paused; queued requests wait")

    async def continue_generation(self) -> dict[str, Any]:
        self.user_paused = False
        self._sync_pause()
        if self.memory.released:
            return self.result("generation continues after /resume_memory_occupation (memory is released)")
        return self.result("generation continues")


_MANAGERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MANAGERS_LOCK = threading.Lock()


def get_weight_manager(engine) -> WeightManager:
    """The engine's manager, created on first use."""
    with _MANAGERS_LOCK:
        manager = _MANAGERS.get(engine)
        if manager is None:
            manager = WeightManager(engine)
            _MANAGERS[engine] = manager
        return manager
