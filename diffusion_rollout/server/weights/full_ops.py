"""Full-weight operations of ``WeightManager``: every transport of new base weights, and their checks.

Design decisions:

- **Read, then apply.** Each transport has a reader that only gathers and routes the tensors
  (``disk_payload``, ``stage_upload_part``, ``receive_distributed``; ``WeightManager
  .tensor_payload``), so a cluster can validate on every replica before any applies.
- **One core, four transports.** Disk (``update_weights_from_disk``), multi-part HTTP uploads,
  SGLang tensor payloads (dispatched by ``WeightManager.update_from_tensor``) and torch.distributed
  broadcasts all end in :meth:`FullWeightOps.apply_named_tensors`: validate every tensor, then copy
  them all in place on the worker (base weights exact under a merged LoRA), then bump the version.
  A failure anywhere leaves the old weights.
- **Slow I/O off the worker.** Reading files, parsing safetensors bodies and receiving broadcasts
  happen before, in threads, so rollouts keep running meanwhile; only the copies run exclusively.
- **A full upload is full.** The final part of an HTTP upload applies only if the upload names
  every parameter of each module it targets (buffers optional), unless it says ``partial=true``.
  SGLang's transports (tensor payloads, broadcasts, disk) stay per-call subsets, as SGLang trainers
  stream them bucket by bucket; each call is atomic by itself.
- **Uploads all or nothing.** A failing part (numbering included) drops its whole upload from the
  staging area; nothing of it is applied. Tensor specs of a module are read once and cached.
- **Uploads without copies.** A part arrives in a pooled receive buffer (``receive.py``); its
  tensors are views into it, checked (finiteness after the cast) when the part arrives, while the
  next part is being received, and staged as views. The final part applies the staged tensors
  without checking finiteness again; its buffers go back to the pool afterwards.
- **Broadcasts are received first**, whatever the announcement says: a trainer blocked in a
  broadcast nobody posts would hang; validation follows once every byte is here.
- **Checks see updates.** Whole-module checksums and the per-tensor checker run on the worker, so a
  checksum asked after an update sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from diffusion_rollout.checksums import (
    ALGORITHMS,
    base_named_parameters,
    module_checksum,
    tensors_sha256,
)
from diffusion_rollout.errors import NotFoundError, WeightUpdateError
from diffusion_rollout.server.weights.manager_core import ManagerCore, Version
from diffusion_rollout.server.weights.receive import Lease, unpooled
from diffusion_rollout.server.weights.receive import parse_safetensors as parse_received
from diffusion_rollout.server.weights.staging import Upload
from diffusion_rollout.server.weights.updater import (
    Problems,
    TensorSpec,
    apply_copies,
    canonical_name,
    check_and_convert,
    describe_names,
    get_module,
    live_tensors,
    module_spec,
    plan_update,
)

logger = logging.getLogger(__name__)


def _local_model_dir(model_path: str) -> Path:
    """A folder as given, else a Hugging Face repo id resolved as SGLang's ``maybe_download_model``
    resolves it (the local cache; a download unless ``HF_HUB_OFFLINE`` is set, which ``serve`` sets
    by default). SGLang's refit test sends the served model's repo id to reset the weights."""
    root = Path(model_path)
    if root.is_dir():
        return root
    if not root.is_absolute() and model_path.count("/") == 1 and not model_path.startswith("."):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model_path))
        except Exception as exc:  # not a repo id, not cached offline, no network: the folder error below
            logger.info("model_path %r is neither a folder nor a resolvable repo id: %s", model_path, exc)
    raise WeightUpdateError(f"model_path {model_path!r} is not a folder on this server", field="model_path")


def checkpoint_names_to_module(
    module: Any, pairs: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """A transformers model's file names as its parameters are named in memory.

    transformers renames some checkpoints' keys when it loads them (Qwen-Image's Qwen2.5-VL text
    encoder is saved as ``model.layers...`` and lives as ``model.language_model.layers...``); a
    folder written by ``save_pretrained`` keeps the file names. The model's own renaming rules are
    applied to each name the module does not have; a name that needs a tensor conversion (merged or
    split tensors) is left as it is, so the update is rejected naming it."""
    if module is None or not hasattr(module, "base_model_prefix"):
        return pairs
    try:
        from transformers import WeightConverter
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import rename_source_key
    except ImportError:
        return pairs
    state = module.state_dict()
    if all(name in state for name, _ in pairs):
        return pairs
    try:
        rules = get_model_conversion_mapping(module)
    except Exception:  # a model without rules
        return pairs
    renamings = [r for r in rules if not isinstance(r, WeightConverter)]
    converters = [r for r in rules if isinstance(r, WeightConverter)]
    out = []
    for name, tensor in pairs:
        if name not in state:
            renamed, conversion = rename_source_key(
                name, renamings, converters, module.base_model_prefix, state
            )
            if conversion is None and renamed in state:
                name = renamed
        out.append((name, tensor))
    return out


def read_disk_update(model_path: str, targets: Sequence[str]) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """``<model_path>/<module>/*.safetensors`` for every target (diffusers layout), all or nothing."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = _local_model_dir(model_path)
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
                # SGLang's wording for a module whose load failed (its clients match it); here the
                # files are all read before any is applied, so every module keeps its weights.
                raise WeightUpdateError(
                    f"Failed to update module '{module}': cannot read {path}: {exc}; rolled back: "
                    "every module keeps its previous weights",
                    field="model_path",
                ) from exc
        out[module] = pairs
    return out


def missing_parameters(pipe, staged: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[list[str], int]]:
    """``{module: (parameter names not in staged[module], number of parameters)}`` where any are missing.

    Parameters only: buffers may be sent but a trainer's state dict of parameters is a full update.
    """
    gaps = {}
    for module, tensors in staged.items():
        names = [n for n, _ in base_named_parameters(get_module(pipe, module))]
        lacking = [n for n in names if n not in tensors]
        if lacking:
            gaps[module] = (lacking, len(names))
    return gaps


def parse_safetensors(body: bytes) -> dict[str, torch.Tensor]:
    """A safetensors file in memory -> CPU tensors; a truncated or garbled body is a 400."""
    tensors, _ = parse_received(unpooled(body))
    return tensors


Payload = dict[str, list[tuple[str, torch.Tensor]]]


@dataclass
class StagedPart:
    """One upload part staged: ``payload`` is the whole upload after its final part, else None and
    ``result`` is the answer for the staged part."""

    upload_id: str
    payload: Payload | None
    result: dict[str, Any] | None
    _release: Callable[[], None] | None = None
    # {module: {name: sha256}} of the received bytes (``received_digests.py``)
    digests: dict[str, dict[str, str]] | None = None

    def release(self) -> None:
        """Give the receive buffers back once the payload is applied (or dropped)."""
        # The views into the buffers go first, so the pool can take them back. Emptied, not just
        # dropped: the worker's finished job may still hold this dict for a while.
        if self.payload is not None:
            self.payload.clear()
        self.payload = None
        if self._release is not None:
            self._release()
            self._release = None


def _upload_id(upload_id: str | None, weight_version: Version) -> str:
    return upload_id or (str(weight_version) if weight_version is not None else "default")


class FullWeightOps(ManagerCore):
    """Apply, upload, receive and verify full weights (mixed into ``WeightManager``)."""

    # ------------------------------------------------------------------ full updates
    def _apply_full(
        self,
        payload: Mapping[str, Sequence[tuple[str, Any]]],
        weight_version: Version,
        flush_cache: bool,
        finite_checked: bool = False,
        received_sha256: Mapping[str, Mapping[str, str]] | None = None,
    ) -> str:
        """Worker side: validate all, copy all (base weights exact under merged LoRA), bump."""
        t0 = time.perf_counter()
        pipe = self.engine.pipe
        plan = plan_update(pipe, payload, check_finite=not finite_checked)
        with contextlib.ExitStack() as stack:
            for name in plan.modules:
                stack.enter_context(self.lora.merge_suspended(name, get_module(pipe, name)))
            apply_copies(plan.copies, before_copy=self.before_copy)
        version = self._bump(weight_version, plan.modules, flush_cache)
        self.remember_received(received_sha256)
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
        finite_checked: bool = False,
        received_sha256: Mapping[str, Mapping[str, str]] | None = None,
    ) -> dict[str, Any]:
        """Apply ``{module: [(name, tensor)]}`` atomically (the core every transport ends in).

        ``finite_checked``: every tensor was already checked finite in its target dtype (staged parts);
        ``received_sha256``: their hashes taken on arrival, kept for the tensor checker.
        """
        self.targets(list(payload))
        message = await self._exclusive(
            lambda: self._apply_full(payload, weight_version, flush_cache, finite_checked, received_sha256)
        )
        return self.result(message)

    def remember_received(self, received_sha256: Mapping[str, Mapping[str, str]] | None) -> None:
        """After an upload's apply and bump: keep its hashes, except for a module under a merged
        LoRA (its live weights are not the bytes received)."""
        if not received_sha256:
            return
        self.received.remember(
            {
                module: named
                for module, named in received_sha256.items()
                if not getattr(self.lora.targets.get(module), "merged", False)
            }
        )

    async def update_from_disk(
        self,
        model_path: str,
        target_modules: Sequence[str] | None,
        *,
        flush_cache: bool = True,
        weight_version: Version = None,
    ) -> dict[str, Any]:
        payload = await self.disk_payload(model_path, target_modules)
        return await self.apply_named_tensors(payload, weight_version=weight_version, flush_cache=flush_cache)

    async def disk_payload(self, model_path: str, target_modules: Sequence[str] | None) -> Payload:
        """Read ``<model_path>/<module>/*.safetensors`` (off the worker); nothing is applied.

        No ``target_modules`` (or ``["all"]``) means every module of the pipeline, as SGLang's
        ``WeightsUpdater._collect_modules`` reads it; the other weight routes keep ``transformer``."""
        if target_modules is None or list(target_modules) == ["all"]:
            target_modules = self.module_names()
        targets = self.targets(target_modules)
        payload = await asyncio.to_thread(read_disk_update, model_path, targets)
        modules = self.modules()
        return {m: checkpoint_names_to_module(modules.get(m), pairs) for m, pairs in payload.items()}

    # ------------------------------------------------------------------ multi-part HTTP upload
    async def _spec(self, module: str) -> dict[str, TensorSpec]:
        spec = self._specs.get(module)
        if spec is None:
            spec = await self._exclusive(lambda: module_spec(get_module(self.engine.pipe, module)))
            self._specs[module] = spec
        return spec

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
        """Stage one safetensors part (``body``: bytes, or a receive buffer this call then owns)."""
        staged = await self.stage_upload_part(
            body, target_module=target_module, weight_version=weight_version, final=final,
            upload_id=upload_id, part=part, partial=partial,
        )  # fmt: skip
        if staged.payload is None:
            return staged.result
        try:
            # Every staged tensor was checked finite after its cast when its part arrived.
            out = await self.apply_named_tensors(
                staged.payload, weight_version=weight_version, flush_cache=flush_cache, finite_checked=True,
                received_sha256=staged.digests,
            )  # fmt: skip
        finally:
            staged.release()
        out["upload_id"] = staged.upload_id
        return out

    async def stage_upload_part(
        self,
        body: bytes | Lease,
        *,
        target_module: str,
        weight_version: Version = None,
        final: bool = True,
        upload_id: str | None = None,
        part: int | None = None,
        partial: bool = False,
    ) -> StagedPart:
        """Validate and stage one part; after the final part the whole upload comes back, not applied
        (its tensors already cast and checked finite; call ``release()`` once they are applied)."""
        lease = body if isinstance(body, Lease) else unpooled(body)
        kept = False
        try:
            [module] = self.targets([target_module])
            uid = _upload_id(upload_id, weight_version)
            spec = await self._spec(module)
            began = None
            try:
                # Any failing part (numbering included) fails its whole upload: nothing of it is applied.
                # Part 0 opens the upload: a retry under the same id starts it afresh (staging.py),
                # unless it would commit a fraction of a model by itself (final and partial).
                opens = part == 0 and not (final and partial)
                upload = began = self.staging.begin_part(uid, part, opens=opens)

                def parse() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
                    problems = Problems()
                    parsed, _ = parse_received(lease)
                    tensors = check_and_convert(
                        module, parsed.items(), spec, problems, seen=upload.seen_names(module)
                    )
                    problems.raise_if_any()
                    # Hashed here, while the next part is received: the tensor checker then needs
                    # no read-back of the applied weights (received_digests.py).
                    return tensors, tensors_sha256(tensors) if tensors else {}

                tensors, digests = await asyncio.to_thread(parse)
                # Same-dtype tensors stay views into the receive buffer, which the upload then keeps.
                keep = any(lease.shares_storage(t) for t in tensors.values())
                upload = self.staging.add_part(
                    uid, part, module, tensors, lease if keep else None, digests=digests, began=began
                )
                kept = keep
            except Exception as exc:
                self._drop_failed(uid, part, final, exc, began=began)
                raise
        finally:
            if not kept:
                lease.release()
        if not final:
            return StagedPart(
                uid,
                None,
                self.result(
                    f"staged part {part if part is not None else upload.num_parts - 1} of upload {uid!r} "
                    f"({len(tensors)} tensors; {upload.num_tensors} staged, {upload.num_bytes / 2**20:.1f} MiB)",
                    upload_id=uid,
                    staged_tensors=upload.num_tensors,
                ),
            )
        del tensors
        complete = self.staging.take_complete(uid, part)
        if not partial:
            gaps = await self._exclusive(lambda: missing_parameters(self.engine.pipe, complete.tensors))
            if gaps:
                complete.release()
                raise WeightUpdateError(
                    f"upload {uid!r} is not a full update: "
                    + "; ".join(
                        f"{m} has {total} parameters, {len(lacking)} not sent ({describe_names(lacking)})"
                        for m, (lacking, total) in gaps.items()
                    )
                    + ". Nothing was applied: send every parameter, or add partial=true to apply only "
                    "the tensors sent",
                    field="partial",
                )
        return StagedPart(
            uid,
            {m: list(t.items()) for m, t in complete.tensors.items()},
            None,
            complete.release,
            digests=complete.digests,
        )

    async def refuse_part(
        self,
        exc: WeightUpdateError,
        *,
        upload_id: str | None,
        weight_version: Version,
        part: int | None,
        final: bool,
    ) -> NoReturn:
        """A part refused before it could be parsed (its body did not arrive whole): its upload is
        dropped like that of any failing part; raises the error saying so. A coroutine although
        nothing here waits: it is part of the routers' weight interface, where a cluster must reach
        its replicas."""
        self._drop_failed(_upload_id(upload_id, weight_version), part, final, exc)
        raise exc

    def _drop_failed(
        self, uid: str, part: int | None, final: bool, exc: Exception, *, began: Upload | None = None
    ) -> None:
        """Drop upload ``uid`` after one of its parts failed; a 400 then says so (raised from ``exc``).
        ``began``: the attempt the part belonged to (a restarted upload's new attempt is kept)."""
        # A refused part of a multi-part upload aborts it: its later parts are refused too.
        dropped = self.staging.discard(
            uid,
            f"part {part if part is not None else '?'} failed: {exc}",
            abort=not final or bool(part),
            began=began,
        )
        if dropped and isinstance(exc, WeightUpdateError):
            raise WeightUpdateError(
                f"{exc.message}; upload {uid!r} was dropped, none of its parts will be applied",
                field=exc.field,
            ) from exc

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
        payload = await self.receive_distributed(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, target_modules=target_modules
        )
        return await self.apply_named_tensors(payload, weight_version=weight_version, flush_cache=flush_cache)

    async def receive_distributed(
        self,
        *,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        target_modules: Sequence[str] | None = None,
    ) -> Payload:
        """Receive one announced broadcast and route its names to modules; nothing is applied."""
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
        return payload

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
            received = self.received.lookup(target_module)
            missing, mismatched, to_hash = [], [], {}
            for raw, digest in expected.items():
                name = canonical_name(raw, target_module, live)
                if name not in live:
                    missing.append(raw)
                elif name in received:
                    if received[name] != digest:
                        mismatched.append(raw)
                else:
                    to_hash[raw] = live[name]
            # Whatever no applied upload vouches for is read back and hashed, on several cores.
            live_digests = tensors_sha256(to_hash)
            mismatched += [raw for raw, got in live_digests.items() if got != expected[raw]]
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
