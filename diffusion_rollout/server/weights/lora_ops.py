"""LoRA operations of ``WeightManager``: load, activate, switch mode, unload and describe adapters.

Design decisions:

- The adapters themselves live in :class:`~diffusion_rollout.server.weights.lora.LoraManager`
  (PEFT layers, merged and dynamic modes); this layer adds what the engine needs around it: files
  and bodies are read and parsed in threads (``lora_io``) before the change, the change runs on the
  engine's worker between batches, and every successful change bumps ``weight_version``.
- One path loads every adapter: a path on the server, an uploaded safetensors body and SGLang's
  ``lora_merge`` tensor payload (:meth:`LoraOps._load_lora_merge`, loaded as adapter ``default`` and
  activated) all end in :meth:`LoraOps._load_lora`, which may also activate the adapter or change
  the mode in the same exclusive step.
- ``merge_dtype`` is parsed before the worker is involved, so a bad name is a 400 that changes
  nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.protocol.lora_options import LoraLoadOptions
from diffusion_rollout.server.weights.lora_io import (
    lora_config_from_dict,
    parse_lora_tensors,
    read_lora_bytes,
    read_lora_path,
)
from diffusion_rollout.server.weights.manager_core import ManagerCore, Version
from diffusion_rollout.server.weights.receive import Lease
from diffusion_rollout.server.weights.updater import describe_names, get_module

DEFAULT_OPTIONS = LoraLoadOptions()  # load, change nothing about the active adapter

logger = logging.getLogger(__name__)


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    candidate = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(candidate, torch.dtype) or not candidate.is_floating_point:
        raise WeightUpdateError(f"unknown floating dtype {name!r}", field="merge_dtype")
    return candidate


class LoraOps(ManagerCore):
    """Named PEFT adapters on pipeline modules (mixed into ``WeightManager``)."""

    def _on_cp(self) -> bool:
        return getattr(self.engine, "context_parallel", None) is not None

    def _refuse_dynamic_on_cp(self, target: str, active: str | None, mode: str | None) -> None:
        """Before a change: a context-parallel engine cannot run an adapter in dynamic mode.

        Its followers mirror rank 0's parameters (server/parallel/context_parallel.py); a dynamic adapter runs
        in forward, outside them, so the ranks would compute different models. Merged mode is fine.
        """
        if getattr(self.engine, "context_parallel", None) is None or active is None:
            return
        if (mode or self.lora.state(target).mode) == "dynamic":
            raise WeightUpdateError(
                f"context_parallel={self.engine.config.context_parallel}: LoRA adapters run in merged mode "
                "only (its follower ranks copy the base weights); send mode='merged'",
                field="mode",
            )

    async def _load_lora(
        self,
        target: str,
        name: str,
        payload,
        *,
        config: Any,
        options: LoraLoadOptions,
        source: str | None,
        weight_version: Version,
    ) -> dict[str, Any]:
        def run() -> str:
            active = name if options.activate else None
            if self._on_cp() and options.changes_active():
                self._refuse_dynamic_on_cp(target, active or self.lora.state(target).active, options.mode)
            t0 = time.perf_counter()
            module = get_module(self.engine.pipe, target)
            record, in_place = self.lora.load(
                target, module, name, payload, config=config, lora_alpha=options.lora_alpha, source=source
            )
            if options.changes_active():
                state = self.lora.state(target)
                self.lora.activate(
                    target, module, active or state.active, mode=options.mode, strength=options.strength
                )
            self._bump(weight_version, [target])
            how = "reloaded in place" if in_place else "loaded"
            dt = time.perf_counter() - t0
            logger.info("LoRA %r on %s %s (%d layers, %.3f s)", name, target, how, len(record.layers), dt)
            return (
                f"adapter {name!r} {how} on {target} ({len(record.layers)} layers, rank {record.config.r}, "
                f"alpha {record.config.lora_alpha}, {dt:.3f} s)"
            )

        return self.result(await self._exclusive(run))

    async def _load_lora_merge(
        self,
        target: str,
        pairs: Sequence[tuple[str, Any]],
        *,
        lora_alpha: float | None,
        lora_rank: int | None,
        weight_version: Version,
    ) -> dict[str, Any]:
        """SGLang's ``lora_merge`` payload: A/B pairs loaded as adapter ``default`` and activated."""
        lora = parse_lora_tensors(pairs, target)
        if lora_rank is not None:
            wrong = sorted(layer for layer, r in lora.ranks().items() if r != lora_rank)
            if wrong:
                raise WeightUpdateError(
                    f"lora_rank={lora_rank} but lora_A has another rank for {len(wrong)} layers: "
                    f"{describe_names(wrong)}",
                    field="lora_rank",
                )
        return await self._load_lora(
            target,
            "default",
            lora,
            config=None,
            options=LoraLoadOptions(lora_alpha=lora_alpha, activate=True),
            source="update_weights_from_tensor",
            weight_version=weight_version,
        )

    async def load_lora(
        self,
        *,
        target_module: str,
        name: str,
        path: str | None = None,
        data: bytes | Lease | None = None,
        peft_config: Mapping[str, Any] | None = None,
        options: LoraLoadOptions = DEFAULT_OPTIONS,
        weight_version: Version = None,
    ) -> dict[str, Any]:
        """Load an adapter from ``path`` or ``data`` (bytes, or a receive buffer this call then owns)."""
        payload = tensors = None
        try:
            [target] = self.targets([target_module])
            if (path is None) == (data is None):
                raise WeightUpdateError("send either a path or safetensors bytes", field="path")
            if path is not None:
                tensors, file_config = await asyncio.to_thread(read_lora_path, path, target)
                source = path
            else:
                tensors, file_config = await asyncio.to_thread(read_lora_bytes, data, target)
                source = "upload"
            cfg = peft_config if peft_config is not None else file_config
            config = lora_config_from_dict(cfg) if cfg is not None else None
            payload = parse_lora_tensors(tensors, target)
            return await self._load_lora(
                target,
                name,
                payload,
                config=config,
                options=options,
                source=source,
                weight_version=weight_version,
            )
        finally:
            if payload is not None:
                # Emptied, not just dropped: the worker's job may still hold the payload for a while.
                payload.pairs.clear()
            payload = tensors = None
            if isinstance(data, Lease):
                # Back to the pool unless the adapter kept views of it (then it is simply not reused).
                data.release()

    async def load_lora_tensors(
        self,
        *,
        target_module: str,
        name: str,
        named_tensors: Mapping[str, torch.Tensor],
        options: LoraLoadOptions = DEFAULT_OPTIONS,
        weight_version: Version = None,
        source: str = "tensors",
    ) -> dict[str, Any]:
        """An adapter given as in-memory tensors (Relax's ``set_lora_from_tensor``); the payload
        describes the adapter (no config). The answer adds ``adapted_layers`` (SGLang's field)."""
        [target] = self.targets([target_module])
        payload = parse_lora_tensors(named_tensors.items(), target)
        out = await self._load_lora(
            target,
            name,
            payload,
            config=None,
            options=options,
            source=source,
            weight_version=weight_version,
        )
        return {**out, "adapted_layers": len(payload.pairs)}

    async def activate_lora(
        self,
        *,
        target_module: str,
        name: str | None,
        mode: str | None = None,
        strength: float | None = None,
        merge_dtype: str | None = None,
        weight_version: Version = None,
    ) -> dict[str, Any]:
        [target] = self.targets([target_module])
        dtype = _dtype(merge_dtype)

        def run() -> str:
            self._refuse_dynamic_on_cp(target, name, mode)
            module = get_module(self.engine.pipe, target)
            self.lora.activate(target, module, name, mode=mode, strength=strength, merge_dtype=dtype)
            self._bump(weight_version, [target])
            state = self.lora.state(target)
            return f"{target}: active adapter {state.active!r} ({state.mode}{', merged' if state.merged else ''})"

        return self.result(await self._exclusive(run))

    async def set_lora_mode(
        self, *, target_module: str, mode: str, merge_dtype: str | None = None, weight_version: Version = None
    ) -> dict[str, Any]:
        [target] = self.targets([target_module])
        dtype = _dtype(merge_dtype)

        def run() -> str:
            if self._on_cp():
                self._refuse_dynamic_on_cp(target, self.lora.state(target).active, mode)
            module = get_module(self.engine.pipe, target)
            self.lora.set_mode(target, module, mode, merge_dtype=dtype)
            self._bump(weight_version, [target])
            state = self.lora.state(target)
            return f"{target}: {state.mode} (active {state.active!r}{', merged' if state.merged else ''})"

        return self.result(await self._exclusive(run))

    async def unload_lora(
        self, *, target_module: str, name: str | None, weight_version: Version = None
    ) -> dict[str, Any]:
        [target] = self.targets([target_module])

        def run() -> str:
            module = get_module(self.engine.pipe, target)
            removed = self.lora.unload(target, module, name)
            self._bump(weight_version, [target])
            return f"unloaded {', '.join(repr(n) for n in removed)} from {target}"

        return self.result(await self._exclusive(run))

    async def describe_lora(self) -> dict[str, Any]:
        return await self._exclusive(lambda: self.lora.describe(self.modules()))
