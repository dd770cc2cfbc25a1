"""Trainer-side weight and LoRA pushes (weights.md), each verified with the shared checksum code.

Design decisions:

- **Cast once, on the trainer.** Tensors are cast to the dtype the server holds (``dtype="server"``
  asks ``/model_info`` once) with ``tensor.to(dtype)``, the very cast the server would apply. That
  halves the bytes of a float32 master pushed to a bf16 server, and the hashes computed on the
  trainer are then hashes of exactly what the server stores. Models that keep some parameters in
  float32 (diffusers' ``_keep_in_fp32_modules``, e.g. Wan) take a ``{name: dtype}`` mapping.
- **Bounded parts, one commit.** :func:`push_weights` packs named tensors into safetensors parts of
  at most ``max_part_bytes`` (a larger single tensor travels alone), sends them with
  ``final=false`` and numbered ``part``, and commits with the last part (``final=true``): the server
  stages the parts and applies all or nothing. The iterator is consumed lazily with one part of
  look-ahead, so an FSDP trainer can feed gathered shards without holding the whole model twice.
  Each push gets its own ``upload_id`` so stale parts of an earlier failed push never mix in.
- **Verification with the same code.** Per-tensor SHA-256 (``checksums.tensor_sha256``) is computed
  on every cast tensor as it is packed, and checked with ``/update_weights_from_tensor_checker``
  after the commit; whole-module checksums use ``checksums.trainer_weights_checksum``; adapter
  checksums use ``checksums.weights_checksum`` over the PEFT state-dict names that ``GET /lora``
  reports. A mismatch raises :class:`ChecksumMismatchError`.
- **LoRA payloads are self-describing.** :func:`push_lora` sends one safetensors body whose header
  metadata carries the adapter's ``LoraConfig`` (``peft_config``), so the server wraps exactly the
  layers the trainer wrapped, with the same rank, alpha and scaling: its dynamic-mode forward is then
  the trainer's PEFT forward, bit for bit.
- **Same-host and NCCL paths.** :func:`push_weights_ipc` builds SGLang's
  ``update_weights_from_tensor`` body with the project's one encoder
  (``server.weights.ipc.serialize_named_tensors``, imported lazily: it needs no GPU and no server
  state). :class:`WeightBroadcaster` is trainer rank 0 of a process group with every server: the
  HTTP announcement and the collective must run at the same time, so the announcements go out on
  threads while this thread posts the broadcasts. Both are plain torch and run on CPU (gloo) too.
- Only the blocking :class:`RolloutClient` is accepted: pushes happen between training steps.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from safetensors.torch import save as st_save
from torch import nn

from diffusion_rollout.checksums import (
    base_named_parameters,
    tensor_sha256,
    trainer_weights_checksum,
    weights_checksum,
)
from diffusion_rollout.client.exceptions import ChecksumMismatchError, ServerWeightUpdateError
from diffusion_rollout.client.results import UpdateResult

if TYPE_CHECKING:
    from diffusion_rollout.client.http import RolloutClient

__all__ = [
    "DEFAULT_MAX_PART_BYTES",
    "WeightBroadcaster",
    "WeightPart",
    "build_update_weights_from_tensor_request",
    "lora_checksum",
    "lora_config_dict",
    "lora_state_dict",
    "push_lora",
    "push_weights",
    "push_weights_ipc",
    "resolve_dtype",
    "safetensors_parts",
    "verify_lora",
    "verify_weights_checksum",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_PART_BYTES = 512 * 2**20
DTypeSpec = torch.dtype | Mapping[str, torch.dtype] | Literal["server"] | None
NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | nn.Module

# LoraConfig fields that decide which layers are wrapped and how the adapter computes.
_LORA_LAYOUT_KEYS = (
    "r", "lora_alpha", "target_modules", "exclude_modules", "lora_dropout", "fan_in_fan_out", "bias",
    "use_rslora", "use_dora", "lora_bias", "rank_pattern", "alpha_pattern", "layers_to_transform",
    "layers_pattern",
)  # fmt: skip
_PEFT_PREFIX = "base_model.model."


# ---------------------------------------------------------------------------- dtypes and tensors
def _parse_dtype(name: str) -> torch.dtype:
    candidate = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(candidate, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return candidate


def resolve_dtype(
    client: RolloutClient, dtype: DTypeSpec, *, server: int = 0
) -> torch.dtype | Mapping | None:
    """``"server"`` -> the server's model dtype (``/model_info``); anything else as given."""
    if isinstance(dtype, str):
        if dtype != "server":
            return _parse_dtype(dtype)
        return _parse_dtype(client.model_info(server=server)["dtype"])
    return dtype


def _named(tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tensors, nn.Module):
        # PEFT wrappers seen through to the base weights: a full push never carries adapters.
        return base_named_parameters(tensors)
    if isinstance(tensors, Mapping):
        return iter(tensors.items())
    return iter(tensors)


def _cast(name: str, tensor: torch.Tensor, dtype: torch.dtype | Mapping | None) -> torch.Tensor:
    t = tensor.detach()
    target = dtype.get(name, t.dtype) if isinstance(dtype, Mapping) else dtype or t.dtype
    return t.to(target)


# ---------------------------------------------------------------------------- HTTP upload
@dataclass
class WeightPart:
    """One safetensors body of a multi-part upload and the per-tensor hashes of what it holds."""

    data: bytes
    names: list[str]
    sha256: dict[str, str] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return len(self.data)


def safetensors_parts(
    named_tensors: NamedTensors,
    *,
    max_part_bytes: int = DEFAULT_MAX_PART_BYTES,
    dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
) -> Iterator[WeightPart]:
    """Cast and pack named tensors into safetensors bodies of at most ``max_part_bytes`` of tensor data.

    A single tensor larger than the bound travels alone. Repeated names are an error.
    """
    if max_part_bytes < 1:
        raise ValueError("max_part_bytes must be positive")
    seen: set[str] = set()
    batch: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> WeightPart:
        part = WeightPart(st_save(batch), list(batch), {n: tensor_sha256(t) for n, t in batch.items()})
        return part

    for name, tensor in _named(named_tensors):
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        t = _cast(name, tensor, dtype).cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        if batch and size + nbytes > max_part_bytes:
            yield flush()
            batch, size = {}, 0
        batch[name] = t
        size += nbytes
    if batch:
        yield flush()


def _lookahead(parts: Iterator[WeightPart]) -> Iterator[tuple[WeightPart, bool]]:
    prev = next(parts, None)
    if prev is None:
        raise ValueError("nothing to push: no named tensors")
    for part in parts:
        yield prev, False
        prev = part
    yield prev, True


def _check_manifest(
    client: RolloutClient, target_module: str, manifest: Mapping[str, str], server: int | None
) -> None:
    for index in range(len(client.urls)) if server is None else [server]:
        try:
            client.check_weights(target_module, manifest, server=index)
        except ServerWeightUpdateError as exc:
            raise ChecksumMismatchError(
                f"{client.urls[index]}: {target_module} does not hold the pushed tensors: {exc.message}"
            ) from exc


def push_weights(
    client: RolloutClient,
    named_tensors: NamedTensors,
    *,
    target_module: str = "transformer",
    dtype: DTypeSpec = "server",
    max_part_bytes: int = DEFAULT_MAX_PART_BYTES,
    weight_version: str | int | None = None,
    upload_id: str | None = None,
    flush_cache: bool = True,
    verify: bool = True,
    server: int | None = None,
    timeout: float | None = None,
) -> UpdateResult:
    """Upload full weights over HTTP in bounded parts and apply them atomically with the last one.

    ``named_tensors`` is a state dict, an iterator of ``(name, tensor)`` (e.g. FSDP-gathered) or a
    module (its base parameters). Names may carry the ``"<target_module>."`` prefix. With ``verify``
    the server checks every tensor's SHA-256 afterwards (raises :class:`ChecksumMismatchError`).
    """
    cast_to = resolve_dtype(client, dtype, server=server or 0)
    upload_id = upload_id or uuid.uuid4().hex
    manifest: dict[str, str] = {}
    result: UpdateResult | None = None
    parts = safetensors_parts(named_tensors, max_part_bytes=max_part_bytes, dtype=cast_to)
    total = 0
    for index, (part, last) in enumerate(_lookahead(parts)):
        result = client.update_weights(
            part.data,
            target_module=target_module,
            weight_version=weight_version,
            final=last,
            upload_id=upload_id,
            part=index,
            flush_cache=flush_cache,
            server=server,
            timeout=timeout,
        )
        manifest.update(part.sha256)
        total += part.num_bytes
        logger.info(
            "pushed part %d (%d tensors, %.1f MiB)%s", index, len(part.names), part.num_bytes / 2**20,
            " and committed" if last else "",
        )  # fmt: skip
    assert result is not None  # _lookahead raised on an empty iterator
    if verify:
        _check_manifest(client, target_module, manifest, server)
    return result


def verify_weights_checksum(
    client: RolloutClient,
    named_tensors: NamedTensors,
    *,
    target_module: str = "transformer",
    dtype: DTypeSpec = "server",
    algorithm: str = "sglang",
    server: int | None = None,
) -> str:
    """Compare the server's ``/get_weights_checksum`` of a whole module with the trainer's tensors.

    ``named_tensors`` must be *all* of the module's parameters (e.g. the trainer's module). Returns
    the checksum; raises :class:`ChecksumMismatchError` naming the server that differs.
    """
    cast_to = resolve_dtype(client, dtype, server=server or 0)
    pairs = [(n.removeprefix(target_module + "."), t) for n, t in _named(named_tensors)]
    if cast_to is None:
        local = weights_checksum(pairs, algorithm)  # type: ignore[arg-type]
    else:
        local = trainer_weights_checksum(pairs, cast_to, algorithm=algorithm)  # type: ignore[arg-type]
    for index in range(len(client.urls)) if server is None else [server]:
        remote = client.get_weights_checksum([target_module], algorithm=algorithm, server=index)[
            target_module
        ]
        if remote != local:
            raise ChecksumMismatchError(
                f"{client.urls[index]}: {target_module} checksum {remote} != trainer's {local}",
                expected=local,
                actual=remote,
            )
    return local


# ---------------------------------------------------------------------------- LoRA
def _normalize_lora_key(key: str, adapter_name: str | None, target_module: str | None) -> str:
    key = key.removeprefix(_PEFT_PREFIX)
    if target_module:
        key = key.removeprefix(target_module + ".")
    if adapter_name:
        # Raw named_parameters keys carry the adapter name: "<layer>.lora_A.<adapter>.weight".
        for half in ("lora_A", "lora_B"):
            key = key.replace(f".{half}.{adapter_name}.weight", f".{half}.weight")
    return key


def lora_state_dict(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    *,
    adapter_name: str = "default",
    target_module: str | None = None,
) -> dict[str, torch.Tensor]:
    """An adapter's tensors under PEFT state-dict names (``<layer>.lora_A.weight``), detached.

    From a PEFT-wrapped module (``add_adapter``/``inject_adapter_in_model`` or a ``PeftModel``) via
    ``peft.get_peft_model_state_dict``, or from a state dict (prefixes and adapter names stripped).
    """
    if isinstance(model_or_state_dict, nn.Module):
        from peft import get_peft_model_state_dict

        raw = get_peft_model_state_dict(model_or_state_dict, adapter_name=adapter_name)
    else:
        raw = dict(model_or_state_dict)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in raw.items():
        name = _normalize_lora_key(key, adapter_name, target_module)
        if name in out:
            raise ValueError(f"two tensors map to the adapter key {name!r}")
        out[name] = tensor.detach()
    if not out:
        raise ValueError(f"no tensors for adapter {adapter_name!r}")
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return getattr(value, "value", value)  # enums


def lora_config_dict(config_or_model: Any, *, adapter_name: str = "default") -> dict[str, Any]:
    """The layout fields of a ``LoraConfig`` (or of a PEFT-wrapped model's adapter) as JSON values."""
    config = config_or_model
    if isinstance(config_or_model, nn.Module):
        configs = getattr(config_or_model, "peft_config", None)
        if not isinstance(configs, Mapping) or adapter_name not in configs:
            raise ValueError(f"the model has no PEFT adapter {adapter_name!r}")
        config = configs[adapter_name]
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return {k: _jsonable(raw[k]) for k in _LORA_LAYOUT_KEYS if raw.get(k) is not None}


def lora_checksum(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    adapter_name: str = "default",
    target_module: str | None = None,
) -> str:
    """The adapter checksum ``GET /lora`` reports, computed on the trainer's tensors cast to ``dtype``."""
    sd = lora_state_dict(model_or_state_dict, adapter_name=adapter_name, target_module=target_module)
    return weights_checksum((n, t.to(dtype) if dtype is not None else t) for n, t in sd.items())


def verify_lora(
    client: RolloutClient,
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    *,
    name: str = "default",
    adapter_name: str | None = None,
    target_module: str = "transformer",
    dtype: DTypeSpec = "server",
    server: int | None = None,
) -> str:
    """Check that every server holds adapter ``name`` with exactly the trainer's tensors."""
    cast_to = resolve_dtype(client, dtype, server=server or 0)
    if isinstance(cast_to, Mapping):
        raise ValueError("LoRA verification takes one dtype (the adapter's)")
    local = lora_checksum(
        model_or_state_dict, dtype=cast_to, adapter_name=adapter_name or name, target_module=target_module
    )
    for index in range(len(client.urls)) if server is None else [server]:
        listing = client.lora_list(server=index)
        adapters = listing.get("modules", {}).get(target_module, {}).get("adapters", {})
        if name not in adapters:
            raise ChecksumMismatchError(
                f"{client.urls[index]}: no adapter {name!r} on {target_module}", expected=local
            )
        remote = adapters[name].get("checksum")
        if remote != local:
            raise ChecksumMismatchError(
                f"{client.urls[index]}: adapter {name!r} checksum {remote} != trainer's {local}",
                expected=local,
                actual=remote,
            )
    return local


def push_lora(
    client: RolloutClient,
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    *,
    name: str = "default",
    adapter_name: str | None = None,
    peft_config: Any = None,
    target_module: str = "transformer",
    activate: bool = True,
    mode: str | None = None,
    strength: float | None = None,
    lora_alpha: float | None = None,
    weight_version: str | int | None = None,
    dtype: DTypeSpec = "server",
    verify: bool = True,
    server: int | None = None,
    timeout: float | None = None,
) -> UpdateResult:
    """Push a PEFT adapter as server adapter ``name`` (in place when it exists), optionally activate it.

    ``model_or_state_dict`` is the trainer's PEFT-wrapped module (its adapter ``adapter_name``,
    default ``name``) or an adapter state dict. The config comes from the model unless
    ``peft_config`` (a ``LoraConfig`` or dict) is given; without either the server infers it from
    the tensors (rank from ``lora_A``, alpha = ``lora_alpha`` or the rank). With ``verify`` the
    server's adapter checksum is compared with the trainer's.
    """
    adapter_name = adapter_name or name
    cast_to = resolve_dtype(client, dtype, server=server or 0)
    if isinstance(cast_to, Mapping):
        raise ValueError("a LoRA push takes one dtype (the adapter's)")
    sd = lora_state_dict(model_or_state_dict, adapter_name=adapter_name, target_module=target_module)
    tensors = {n: (t.to(cast_to) if cast_to is not None else t).cpu().contiguous() for n, t in sd.items()}
    config = None
    if peft_config is not None:
        config = lora_config_dict(peft_config)
    elif isinstance(model_or_state_dict, nn.Module):
        config = lora_config_dict(model_or_state_dict, adapter_name=adapter_name)
    metadata = {"peft_config": json.dumps(config)} if config is not None else None
    result = client.lora_load(
        name,
        data=st_save(tensors, metadata=metadata),
        target_module=target_module,
        lora_alpha=lora_alpha,
        activate=activate,
        mode=mode,
        strength=strength,
        weight_version=weight_version,
        server=server,
        timeout=timeout,
    )
    if verify:
        verify_lora(
            client, tensors, name=name, adapter_name=adapter_name, target_module=target_module, dtype=None,
            server=server,
        )  # fmt: skip
    return result


# ---------------------------------------------------------------------------- same-host CUDA IPC
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
    from diffusion_rollout.server.weights.ipc import serialize_named_tensors

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


# ---------------------------------------------------------------------------- NCCL / gloo broadcast
class WeightBroadcaster:
    """Trainer rank 0 of a weight-update process group joined by every server of ``client``.

    ``init()`` makes server ``i`` join as rank ``1 + i`` of ``1 + len(client.urls)``; ``broadcast()``
    announces the tensors to every server and broadcasts each one in order; ``destroy()`` leaves.
    ``backend="nccl"`` needs the tensors on this rank's GPU; ``"gloo"`` works on CPU tensors.
    Use as a context manager to destroy the group on exit.
    """

    def __init__(
        self,
        client: RolloutClient,
        *,
        master_address: str,
        master_port: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: float = 300.0,
        device: str | torch.device | None = None,
    ) -> None:
        self.client = client
        self.master_address = master_address
        self.master_port = int(master_port)
        self.group_name = group_name
        self.backend = backend
        self.timeout_s = timeout_s
        self.device = torch.device(device) if device is not None else None
        self.world_size = 1 + len(client.urls)
        self.group: Any = None

    def _on_servers(
        self, fn
    ) -> tuple[concurrent.futures.ThreadPoolExecutor, list[concurrent.futures.Future]]:
        pool = concurrent.futures.ThreadPoolExecutor(len(self.client.urls), thread_name_prefix="weight-group")
        return pool, [pool.submit(fn, index) for index in range(len(self.client.urls))]

    @staticmethod
    def _results(pool, futures) -> list[UpdateResult]:
        try:
            return [f.result() for f in futures]
        finally:
            pool.shutdown(wait=True)

    def init(self) -> WeightBroadcaster:
        from diffusion_rollout.server.weights.distributed import join_group

        if self.group is not None:
            raise RuntimeError("the group is already initialised")
        pool, futures = self._on_servers(
            lambda index: self.client.init_weights_update_group(
                master_address=self.master_address,
                master_port=self.master_port,
                rank_offset=1 + index,
                world_size=self.world_size,
                group_name=self.group_name,
                backend=self.backend,
                timeout_s=self.timeout_s,
                server=index,
            )
        )
        try:
            self.group = join_group(
                master_address=self.master_address,
                master_port=self.master_port,
                rank=0,
                world_size=self.world_size,
                group_name=self.group_name,
                backend=self.backend,
                timeout_s=self.timeout_s,
            )
        finally:
            # Collect the servers' answers whatever happened here, so no thread is left behind.
            self._results(pool, futures)
        return self

    def broadcast(
        self,
        named_tensors: NamedTensors,
        *,
        target_modules: list[str] | None = None,
        dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
        weight_version: str | int | None = None,
        flush_cache: bool = True,
        verify: bool = True,
    ) -> UpdateResult:
        """Send tensors to every server (one ``dist.broadcast`` per tensor, in order) and apply them."""
        import torch.distributed as dist

        if self.group is None:
            raise RuntimeError("call init() first")
        pairs = []
        for name, tensor in _named(named_tensors):
            t = _cast(name, tensor, dtype)
            if self.device is not None:
                t = t.to(self.device)
            pairs.append((name, t.contiguous()))
        if not pairs:
            raise ValueError("nothing to broadcast")
        names = [n for n, _ in pairs]
        pool, futures = self._on_servers(
            lambda index: self.client.update_weights_from_distributed(
                names=names,
                dtypes=[str(t.dtype) for _, t in pairs],
                shapes=[list(t.shape) for _, t in pairs],
                group_name=self.group_name,
                target_modules=target_modules,
                weight_version=weight_version,
                flush_cache=flush_cache,
                server=index,
            )
        )
        try:
            for _, t in pairs:
                dist.broadcast(t, src=0, group=self.group)
        finally:
            results = self._results(pool, futures)
        if verify:
            targets = target_modules or ["transformer"]
            for module in targets:
                prefix = module + "."
                own = {n: tensor_sha256(t) for n, t in pairs if len(targets) == 1 or n.startswith(prefix)}
                if own:
                    _check_manifest(self.client, module, own, None)
        return UpdateResult.from_responses({u: r for res in results for u, r in res.responses.items()})

    def destroy(self) -> None:
        if self.group is None:
            return
        import torch.distributed as dist

        # Both sides at once: tearing down an NCCL communicator can wait for the peer ranks, so a
        # trainer that waited for the server's answer first would deadlock with it.
        pool, futures = self._on_servers(
            lambda index: self.client.destroy_weights_update_group(self.group_name, server=index)
        )
        try:
            dist.destroy_process_group(self.group)
        finally:
            self.group = None
            self._results(pool, futures)

    def __enter__(self) -> WeightBroadcaster:
        return self.init()

    def __exit__(self, *exc: object) -> None:
        self.destroy()
