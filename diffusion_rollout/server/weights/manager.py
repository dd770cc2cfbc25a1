"""``WeightManager``: every weight, LoRA, memory and pause operation of one engine, in one place.

Design decisions:

- The engine knows nothing of weights management: the manager keeps its own state (LoRA adapters,
  staged uploads, update groups, released memory) and is attached to an engine lazily by
  :func:`get_weight_manager` (a weak map, so the engine needs no attribute for it).
- Every mutation of the pipeline runs through ``engine.run_exclusive``, i.e. on the engine's worker
  thread between generation batches: no output ever mixes two weight versions, and an update sent
  while a rollout runs lands after it. Slow I/O that does not touch the model (reading files,
  parsing bodies, unpickling, receiving broadcasts) happens before, off the worker, so rollouts keep
  running meanwhile.
- Reads that must be consistent with updates (checksums, the tensor checker, the LoRA listing) run
  on the worker too, so a checksum asked after an update sees it.
- ``weight_version`` changes with every successful change of what the model computes: it becomes
  the string (or integer) the trainer sent, else the count of updates applied so far (a number that
  never repeats). Reads and failed updates leave it alone. The prompt cache is cleared whenever a
  module that can change prompt encodings changes (and on ``flush_cache``).
- ``before_copy`` is a fault-injection hook (called before each in-place copy) for tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from diffusion_rollout.checksums import ALGORITHMS, module_checksum, tensor_sha256
from diffusion_rollout.errors import NotFoundError, WeightUpdateError
from diffusion_rollout.server.weights import ipc
from diffusion_rollout.server.weights.distributed import UpdateGroups
from diffusion_rollout.server.weights.lora import LoraManager
from diffusion_rollout.server.weights.lora_io import (
    lora_config_from_dict,
    parse_lora_tensors,
    read_lora_bytes,
    read_lora_path,
)
from diffusion_rollout.server.weights.memory import MemoryOccupation
from diffusion_rollout.server.weights.staging import StagingArea
from diffusion_rollout.server.weights.updater import (
    BeforeCopy,
    Problems,
    TensorSpec,
    apply_copies,
    canonical_name,
    check_and_convert,
    describe_names,
    encoder_modules_touched,
    get_module,
    live_tensors,
    module_spec,
    pipeline_modules,
    plan_update,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_TARGETS = ("transformer",)
Version = str | int | None


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    candidate = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(candidate, torch.dtype) or not candidate.is_floating_point:
        raise WeightUpdateError(f"unknown floating dtype {name!r}", field="merge_dtype")
    return candidate


def read_disk_update(model_path: str, targets: Sequence[str]) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """``<model_path>/<module>/*.safetensors`` for every target (diffusers layout), all or nothing."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(model_path)
    if not root.is_dir():
        raise WeightUpdateError(
            f"model_path {model_path!r} is not a folder on this server", field="model_path"
        )
    files = {m: sorted((root / m).glob("*.safetensors")) for m in targets}
    missing = [m for m, found in files.items() if not found]
    if missing:
        raise WeightUpdateError(
            f"no <module>/*.safetensors under {model_path} for {', '.join(missing)}; nothing was applied",
            field="model_path",
        )
    out: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for module, paths in files.items():
        pairs: list[tuple[str, torch.Tensor]] = []
        for path in paths:
            try:
                pairs.extend(load_file(str(path)).items())
            except (SafetensorError, OSError) as exc:
                raise WeightUpdateError(f"cannot read {path}: {exc}", field="model_path") from exc
        out[module] = pairs
    return out


def parse_safetensors(body: bytes) -> dict[str, torch.Tensor]:
    """A safetensors file in memory -> CPU tensors; a truncated or garbled body is a 400."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if not body:
        raise WeightUpdateError("the request body is empty; send safetensors bytes")
    try:
        return load(body)
    except (SafetensorError, ValueError, OSError) as exc:
        raise WeightUpdateError(
            f"the body ({len(body)} bytes) is not a valid safetensors file (truncated?): {exc}"
        ) from exc


class WeightManager:
    def __init__(self, engine, *, staging_ttl_s: float = 600.0, max_staged_uploads: int = 2) -> None:
        self.engine = engine
        self.lora = LoraManager()
        self.staging = StagingArea(ttl_s=staging_ttl_s, max_uploads=max_staged_uploads)
        self.groups = UpdateGroups()
        self.memory = MemoryOccupation()
        self.updates_applied = 0
        self.user_paused = False
        self.before_copy: BeforeCopy | None = None
        self._specs: dict[str, dict[str, TensorSpec]] = {}

    # ------------------------------------------------------------------ plumbing
    async def _exclusive(self, fn: Callable[[], T]) -> T:
        return await self.engine.run_exclusive(fn)

    def modules(self) -> dict[str, nn.Module]:
        return pipeline_modules(self.engine.pipe)

    def targets(self, target_modules: Sequence[str] | None) -> list[str]:
        if target_modules is not None and not target_modules:
            raise WeightUpdateError(
                "target_modules is empty; leave it out for the default", field="target_modules"
            )
        names = list(dict.fromkeys(target_modules or DEFAULT_TARGETS))
        modules = self.modules()
        unknown = [n for n in names if n not in modules]
        if unknown:
            raise WeightUpdateError(
                f"unknown target module(s) {', '.join(unknown)}; this pipeline has: {', '.join(sorted(modules))}",
                field="target_modules",
            )
        return names

    def _bump(self, weight_version: Version, modules: Sequence[str], flush_cache: bool = False) -> Any:
        """On the worker, after a successful change: new version, prompt cache cleared if needed."""
        self.updates_applied += 1
        self.engine.weight_version = weight_version if weight_version is not None else self.updates_applied
        if flush_cache or encoder_modules_touched(modules):
            self.engine.prompt_cache.clear()
        return self.engine.weight_version

    def result(self, message: str, **extra: Any) -> dict[str, Any]:
        return {"success": True, "message": message, "weight_version": self.engine.weight_version, **extra}

    # ------------------------------------------------------------------ full updates
    def _apply_full(
        self, payload: Mapping[str, Sequence[tuple[str, Any]]], weight_version: Version, flush_cache: bool
    ) -> str:
        """Worker side: validate all, copy all (base weights exact under merged LoRA), bump."""
        t0 = time.perf_counter()
        pipe = self.engine.pipe
        plan = plan_update(pipe, payload)
        with contextlib.ExitStack() as stack:
            for name in plan.modules:
                stack.enter_context(self.lora.merge_suspended(name, get_module(pipe, name)))
            apply_copies(plan.copies, before_copy=self.before_copy)
        version = self._bump(weight_version, plan.modules, flush_cache)
        dt = time.perf_counter() - t0
        mib = plan.num_bytes / 2**20
        logger.info("weights updated to version %s: %s, %.1f MiB in %.3f s", version, plan.summary(), mib, dt)
        return f"updated {plan.summary()} ({mib:.1f} MiB in {dt:.3f} s)"

    async def apply_named_tensors(
        self,
        payload: Mapping[str, Sequence[tuple[str, Any]]],
        *,
        weight_version: Version = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Apply ``{module: [(name, tensor)]}`` atomically (the core every transport ends in)."""
        self.targets(list(payload))
        message = await self._exclusive(lambda: self._apply_full(payload, weight_version, flush_cache))
        return self.result(message)

    async def update_from_disk(
        self,
        model_path: str,
        target_modules: Sequence[str] | None,
        *,
        flush_cache: bool = True,
        weight_version: Version = None,
    ) -> dict[str, Any]:
        targets = self.targets(target_modules)
        payload = await asyncio.to_thread(read_disk_update, model_path, targets)
        return await self.apply_named_tensors(payload, weight_version=weight_version, flush_cache=flush_cache)

    # ------------------------------------------------------------------ multi-part HTTP upload
    async def _spec(self, module: str) -> dict[str, TensorSpec]:
        spec = self._specs.get(module)
        if spec is None:
            spec = await self._exclusive(lambda: module_spec(get_module(self.engine.pipe, module)))
            self._specs[module] = spec
        return spec

    async def upload_part(
        self,
        body: bytes,
        *,
        target_module: str,
        weight_version: Version = None,
        final: bool = True,
        upload_id: str | None = None,
        part: int | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        [module] = self.targets([target_module])
        uid = upload_id or (str(weight_version) if weight_version is not None else "default")
        spec = await self._spec(module)
        try:
            # Any failing part (numbering included) fails its whole upload: nothing of it is applied.
            upload = self.staging.begin_part(uid, part)

            def parse() -> dict[str, torch.Tensor]:
                problems = Problems()
                tensors = check_and_convert(
                    module, parse_safetensors(body).items(), spec, problems, seen=upload.seen_names(module)
                )
                problems.raise_if_any()
                return tensors

            tensors = await asyncio.to_thread(parse)
            upload = self.staging.add_part(uid, part, module, tensors)
        except Exception as exc:
            dropped = self.staging.discard(uid, f"part {part if part is not None else '?'} failed: {exc}")
            if dropped and isinstance(exc, WeightUpdateError):
                raise WeightUpdateError(
                    f"{exc.message}; upload {uid!r} was dropped, none of its parts will be applied",
                    field=exc.field,
                ) from exc
            raise
        if not final:
            return self.result(
                f"staged part {part if part is not None else upload.num_parts - 1} of upload {uid!r} "
                f"({len(tensors)} tensors; {upload.num_tensors} staged, {upload.num_bytes / 2**20:.1f} MiB)",
                upload_id=uid,
                staged_tensors=upload.num_tensors,
            )
        complete = self.staging.take_complete(uid, part)
        payload = {m: list(t.items()) for m, t in complete.tensors.items()}
        out = await self.apply_named_tensors(payload, weight_version=weight_version, flush_cache=flush_cache)
        out["upload_id"] = uid
        return out

    # ------------------------------------------------------------------ SGLang tensor payloads
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
        entry = ipc.select_entry(serialized_named_tensors, payload_gpu_uuids, self.engine.device)
        decoded = await asyncio.to_thread(ipc.decode_entry, entry)
        payload = ipc.module_payloads(decoded, load_format, targets)
        if weight_update_mode is None:
            return await self.apply_named_tensors(
                payload, weight_version=weight_version, flush_cache=flush_cache
            )
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
        lora = parse_lora_tensors(payload[target], target)
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
            lora_alpha=lora_alpha,
            source="update_weights_from_tensor",
            weight_version=weight_version,
            activate=True,
        )

    # ------------------------------------------------------------------ torch.distributed
    async def init_group(self, **kwargs: Any) -> dict[str, Any]:
        group = await asyncio.to_thread(lambda: self.groups.init(**kwargs))
        return self.result(
            f"joined weight update group {group.name!r} as rank {group.rank} of {group.world_size} "
            f"({group.backend}, {group.master})"
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
        # Receive first, whatever the announcement says: a trainer blocked in a broadcast nobody
        # posts would hang; validation follows once every byte is here.
        received = await asyncio.to_thread(
            self.groups.receive, group_name, names, dtypes, shapes, self.engine.device
        )
        targets = self.targets(target_modules)
        if len(targets) == 1:
            payload = {targets[0]: received}
        else:
            payload = {t: [] for t in targets}
            unrouted = []
            for name, tensor in received:
                owner = next((t for t in targets if name.startswith(t + ".")), None)
                if owner is None:
                    unrouted.append(name)
                else:
                    payload[owner].append((name, tensor))
            if unrouted:
                raise WeightUpdateError(
                    f"with several target_modules every name needs a '<module>.' prefix; "
                    f"{len(unrouted)} do not: {describe_names(unrouted)}",
                    field="names",
                )
            payload = {t: pairs for t, pairs in payload.items() if pairs}
        return await self.apply_named_tensors(payload, weight_version=weight_version, flush_cache=flush_cache)

    async def destroy_group(self, group_name: str) -> dict[str, Any]:
        await asyncio.to_thread(self.groups.destroy, group_name)
        return self.result(f"left weight update group {group_name!r}")

    # ------------------------------------------------------------------ checksums
    async def checksums(
        self, module_names: Sequence[str] | None, algorithm: str = "sglang"
    ) -> dict[str, str]:
        if algorithm not in ALGORITHMS:
            raise WeightUpdateError(f"algorithm must be one of {ALGORITHMS}", field="algorithm")

        def run() -> dict[str, str]:
            modules = self.modules()
            names = list(module_names) if module_names is not None else list(modules)
            unknown = [n for n in names if n not in modules]
            if unknown:
                raise NotFoundError(
                    f"unknown module(s) {', '.join(unknown)}; this pipeline has: {', '.join(sorted(modules))}"
                )
            return {n: module_checksum(modules[n], algorithm) for n in names}

        return await self._exclusive(run)

    async def check_tensors(self, target_module: str, expected: Mapping[str, str]) -> dict[str, Any]:
        if not expected:
            raise WeightUpdateError(
                "expected_named_tensors_sha256 is empty", field="expected_named_tensors_sha256"
            )

        def run() -> str:
            module = get_module(self.engine.pipe, target_module)
            live = live_tensors(module)
            missing, mismatched = [], []
            for raw, digest in expected.items():
                name = canonical_name(raw, target_module, live)
                if name not in live:
                    missing.append(raw)
                elif tensor_sha256(live[name]) != digest:
                    mismatched.append(raw)
            if missing or mismatched:
                parts = []
                if missing:
                    parts.append(f"missing {len(missing)} tensor(s): {describe_names(sorted(missing))}")
                if mismatched:
                    parts.append(
                        f"checksum mismatch for {len(mismatched)} tensor(s): {describe_names(sorted(mismatched))}"
                    )
                raise WeightUpdateError(f"module {target_module!r} check failed: " + "; ".join(parts))
            return f"verified {len(expected)} tensor(s) of {target_module!r}"

        return self.result(await self._exclusive(run))

    # ------------------------------------------------------------------ LoRA
    async def _load_lora(
        self,
        target: str,
        name: str,
        payload,
        *,
        config: Any,
        lora_alpha: float | None,
        source: str | None,
        weight_version: Version,
        activate: bool = False,
        mode: str | None = None,
        strength: float | None = None,
    ) -> dict[str, Any]:
        def run() -> str:
            t0 = time.perf_counter()
            module = get_module(self.engine.pipe, target)
            record, in_place = self.lora.load(
                target, module, name, payload, config=config, lora_alpha=lora_alpha, source=source
            )
            if activate or mode is not None or strength is not None:
                state = self.lora.state(target)
                self.lora.activate(
                    target, module, name if activate else state.active, mode=mode, strength=strength
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

    async def load_lora(
        self,
        *,
        target_module: str,
        name: str,
        path: str | None = None,
        data: bytes | None = None,
        peft_config: Mapping[str, Any] | None = None,
        lora_alpha: float | None = None,
        weight_version: Version = None,
        activate: bool = False,
        mode: str | None = None,
        strength: float | None = None,
    ) -> dict[str, Any]:
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
            lora_alpha=lora_alpha,
            source=source,
            weight_version=weight_version,
            activate=activate,
            mode=mode,
            strength=strength,
        )

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
            module = get_module(self.engine.pipe, target)
            self.lora.activate(target, module, name, mode=mode, strength=strength, merge_dtype=dtype)
            self._bump(weight_version, [target])
            state = self.lora.state(target)
            return f"{target}: active adapter {state.active!r} ({state.mode}{', merged' if state.merged else ''})"

        return self.result(await self._exclusive(run))

    async def set_lora_mode(
        self, *, target_module: str, mode: str, merge_dtype: str | None = None
    ) -> dict[str, Any]:
        [target] = self.targets([target_module])
        dtype = _dtype(merge_dtype)

        def run() -> str:
            module = get_module(self.engine.pipe, target)
            self.lora.set_mode(target, module, mode, merge_dtype=dtype)
            self._bump(None, [target])
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
            moved = self.memory.release(self.modules().values(), self.lora.kept_tensors())
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
