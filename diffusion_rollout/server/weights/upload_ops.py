"""Multi-part HTTP uploads of full weights (mixed into ``WeightManager``): staging each part.

Design decisions:

- **A full upload is full.** The final part of an HTTP upload applies only if the upload names
  every parameter of each module it targets (buffers optional), unless it says ``partial=true``.
  SGLang's transports (tensor payloads, broadcasts, disk) stay per-call subsets, as SGLang trainers
  stream them bucket by bucket; each call is atomic by itself.
- **Uploads all or nothing.** A failing part (numbering included) drops its whole upload from the
  staging area; nothing of it is applied. Tensor specs of a module are read once and cached.
- **Uploads without copies.** A part arrives in a pooled receive buffer (``receive.py``); its
  tensors are views into it, checked (finiteness after the cast) and hashed when the part arrives,
  while the next part is being received, and staged as views. The final part hands the staged
  tensors to the upload transport (``transports/upload.py``), which the transaction applies without
  checking finiteness again; its buffers go back to the pool afterwards.
- The same staging serves HTTP bodies and the upload port (``entrypoints/upload_listener.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.protocol.checksums import base_named_parameters, tensors_sha256
from diffusion_rollout.server.weights.manager_core import ManagerCore, Version
from diffusion_rollout.server.weights.receive import Lease, unpooled
from diffusion_rollout.server.weights.receive import parse_safetensors as parse_received
from diffusion_rollout.server.weights.staging import Upload
from diffusion_rollout.server.weights.updater import (
    Problems,
    TensorSpec,
    check_and_convert,
    describe_names,
    get_module,
    module_spec,
)


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


class UploadOps(ManagerCore):
    """Stage, complete and refuse upload parts (mixed into ``WeightManager``)."""

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
        """Stage one safetensors part (``body``: bytes, or a receive buffer this call then owns); the
        final part applies the whole upload through the upload transport."""
        request = {
            "target_module": target_module, "weight_version": weight_version, "upload_id": upload_id,
            "part": part, "partial": partial,
        }  # fmt: skip
        if not final:
            staged = await self.stage_upload_part(body, final=False, **request)
            return staged.result
        return await self.transactions.update(
            "upload", request, data=body, weight_version=weight_version, flush_cache=flush_cache
        )

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
