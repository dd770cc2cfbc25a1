"""Same-host full-weight (or LoRA-merge) pushes through SGLang's ``update_weights_from_tensor`` path.

Design decisions:

- **The project's one encoder.** :func:`build_update_weights_from_tensor_request` builds SGLang's
  body with ``diffusion_rollout.protocol.weight_transport.serialize_named_tensors``, the module the server's
  decoder shares, so the trainer and the server cannot disagree on the format. CUDA tensors travel
  as IPC handles, CPU tensors as shared-memory descriptors: the payload is only valid on the same
  host, and the caller keeps the tensors alive until the server has answered.
- **Cast once, verify after.** Tensors are cast on the trainer (``dtype="server"`` by default) and,
  for full weights, the server's per-tensor hashes are checked after the update.
- Only the blocking :class:`RolloutClient` is accepted: pushes happen between training steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from diffusion_rollout.client.results import UpdateResult
from diffusion_rollout.client.weights.tensors import (
    DTypeSpec,
    NamedTensors,
    _cast,
    _check_manifest,
    _named,
    resolve_dtype,
)
from diffusion_rollout.protocol.checksums import tensor_sha256

if TYPE_CHECKING:
    from diffusion_rollout.client.sync_client import RolloutClient

__all__ = ["build_update_weights_from_tensor_request", "push_weights_ipc"]


def _gpu_uuid(tensors: Iterable[torch.Tensor]) -> str | None:
    for t in tensors:
        if t.device.type == "cuda":
            return str(torch.cuda.get_device_properties(t.device).uuid)
    return None


def build_update_weights_from_tensor_request(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    target_module: str = "transformer",
    load_format: str | None = "flattened_bucket",
    weight_update_mode: str | None = None,
    lora_alpha: float | None = None,
    lora_rank: int | None = None,
    weight_version: str | int | None = None,
    flush_cache: bool = True,
) -> dict[str, Any]:
    """SGLang's ``/update_weights_from_tensor`` body for one server rank (weights.md).

    CUDA tensors travel as IPC handles, CPU tensors as shared-memory descriptors: the payload is
    only valid on the same host, and the tensors must stay alive until the server has answered.
    """
    from diffusion_rollout.protocol.weight_transport import serialize_named_tensors

    pairs = list(named_tensors)
    gpu = _gpu_uuid(t for _, t in pairs)
    body: dict[str, Any] = {
        "serialized_named_tensors": [serialize_named_tensors(pairs, load_format=load_format)],
        "load_format": load_format,
        "target_modules": [target_module],
        "weight_update_mode": weight_update_mode,
        "lora_alpha": lora_alpha,
        "lora_rank": lora_rank,
        "weight_version": weight_version,
        "payload_gpu_uuids": [gpu] if gpu else None,
        "flush_cache": flush_cache,
    }
    return {k: v for k, v in body.items() if v is not None}


def push_weights_ipc(
    client: RolloutClient,
    named_tensors: NamedTensors,
    *,
    target_module: str = "transformer",
    dtype: DTypeSpec = "server",
    load_format: str | None = "flattened_bucket",
    weight_update_mode: str | None = None,
    lora_alpha: float | None = None,
    lora_rank: int | None = None,
    weight_version: str | int | None = None,
    flush_cache: bool = True,
    verify: bool = True,
    server: int | None = None,
) -> UpdateResult:
    """Same-host push without copies through HTTP: SGLang's ``update_weights_from_tensor`` path.

    ``weight_update_mode="lora_merge"`` sends LoRA A/B pairs (SGLang's LoRA sync; the server loads
    them as adapter ``default`` and activates it). Verification (full weights only) checks the
    per-tensor hashes after the update.
    """
    cast_to = resolve_dtype(client, dtype, server=server or 0)
    pairs = [(n, _cast(n, t, cast_to).contiguous()) for n, t in _named(named_tensors)]
    body = build_update_weights_from_tensor_request(
        pairs,
        target_module=target_module,
        load_format=load_format,
        weight_update_mode=weight_update_mode,
        lora_alpha=lora_alpha,
        lora_rank=lora_rank,
        weight_version=weight_version,
        flush_cache=flush_cache,
    )
    result = client.update_weights_from_tensor(
        body["serialized_named_tensors"],
        load_format=body.get("load_format"),
        target_modules=body["target_modules"],
        weight_update_mode=body.get("weight_update_mode"),
        lora_alpha=body.get("lora_alpha"),
        lora_rank=body.get("lora_rank"),
        weight_version=body.get("weight_version"),
        payload_gpu_uuids=body.get("payload_gpu_uuids"),
        flush_cache=flush_cache,
        server=server,
    )
    del body  # the handles were consumed; ``pairs`` kept the tensors alive until here
    if verify and weight_update_mode is None:
        _check_manifest(client, target_module, {n: tensor_sha256(t) for n, t in pairs}, server)
    return result
