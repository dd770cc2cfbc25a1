"""SGLang ``update_weights_from_tensor`` payloads: decoding (server) and encoding (trainer side).

Payload layout, as SGLang builds it (facts from ``sglang/srt/utils/common.py``
``MultiprocessingSerializer``, ``sglang/srt/weight_sync/tensor_bucket.py`` ``FlattenedTensorBucket``
and ``sglang/multimodal_gen/runtime/post_training/weights_updater.py``; re-implemented here):

- ``serialized_named_tensors`` is a list with one entry per TP rank, each the base64 text of a
  ``multiprocessing.reduction.ForkingPickler`` pickle. torch's multiprocessing reductions turn every
  tensor into a rebuild recipe: a CUDA IPC handle on GPUs, a shared-memory file descriptor (passed
  through ``multiprocessing.resource_sharer``) on CPUs, so no weight bytes travel in the body. This
  server is one rank: it uses the entry whose ``payload_gpu_uuids`` item is its own GPU, else entry 0.
- An entry decodes to ``[(name, tensor), ...]`` (``load_format`` null or ``"direct"``), or with
  ``load_format="flattened_bucket"`` to ``{"flattened_tensor": 1-D tensor, "metadata": [...]}``
  whose items carry ``name, shape, dtype, start_idx, end_idx, numel``; in current SGLang the flat
  tensor is ``uint8`` and the indices are byte offsets (older versions flattened one dtype and
  indexed elements; both decode here by slicing the flat tensor and viewing it as the item dtype).
- Several target modules: the entry is a dict ``{module_name: module_payload}``.
- SGLang trainers patch torch's reductions so a CUDA tensor names its device by UUID; the rebuild
  function is then pickled as ``sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified``. That
  name resolves to this module's own UUID-aware rebuild, never to the sender's code.

Security: the pickle comes from the network. It is decoded by ``safe_pickle`` in two phases:
the restricted unpickler builds inert recipes (no descriptor, socket or allocation is touched),
every recipe is checked (dtype, device, extent inside its storage), and only then are tensors
built. CPU tensors (shared by file descriptor) are refused unless the server runs with
``allow_cpu_ipc``; see ``safe_pickle`` for why and how. Decoding runs on a small pool of its own
(:class:`PayloadDecoder`), bounded by ``ipc_timeout_s``, so a slow or stalled payload never holds
a thread that rollouts need.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.protocol.weight_transport import (  # noqa: F401  (re-exported: the trainer side)
    FlattenedTensorMetadata,
    flatten_bucket,
    serialize,
    serialize_named_tensors,
)
from diffusion_rollout.server.weights.safe_pickle import FdPolicy, decode_base64, decode_tensor_pickle

logger = logging.getLogger(__name__)

LOAD_FORMATS = (None, "direct", "flattened_bucket")


class PayloadDecoder:
    """Decodes entries on its own small thread pool, each bounded in time (see the module docstring)."""

    def __init__(self, policy: FdPolicy, workers: int = 2) -> None:
        self.policy = policy
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ipc-decode")

    async def decode(self, entry: str | bytes, cuda_device: int | None = None) -> Any:
        """``cuda_device``: the local index the entry's CUDA handles map to (see ``own_gpu_index``)."""
        data = decode_base64(entry, "serialized_named_tensors")
        loop = asyncio.get_running_loop()
        policy = (
            self.policy if cuda_device is None else dataclasses.replace(self.policy, cuda_device=cuda_device)
        )
        job = loop.run_in_executor(self._pool, decode_tensor_pickle, data, policy)
        try:
            # The socket operations inside are bounded too; this bounds the queue wait and the sum.
            return await asyncio.wait_for(job, timeout=self.policy.timeout_s * 3)
        except TimeoutError as exc:
            raise WeightUpdateError(
                f"the tensor payload was not decoded within {self.policy.timeout_s * 3:g} s "
                "(3 x ipc_timeout_s); nothing was applied"
            ) from exc

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def decode_entry(entry: str | bytes, policy: FdPolicy | None = None) -> Any:
    """Base64 (or raw bytes) of a ForkingPickler pickle -> the object, checked (synchronous form)."""
    return decode_tensor_pickle(decode_base64(entry, "serialized_named_tensors"), policy or FdPolicy())


def own_gpu_index(gpu_uuids: Sequence[str] | None, device: str) -> int | None:
    """This server's local CUDA index when ``payload_gpu_uuids`` names its GPU, else None."""
    if gpu_uuids is None or not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    index = torch.device(device).index or 0
    return index if str(torch.cuda.get_device_properties(index).uuid) in gpu_uuids else None


def select_entry(entries: Sequence[Any], gpu_uuids: Sequence[str] | None, device: str) -> Any:
    """The entry meant for this server: the one on its GPU when UUIDs are given, else entry 0."""
    if not entries:
        raise WeightUpdateError("serialized_named_tensors is empty", field="serialized_named_tensors")
    if gpu_uuids is not None:
        if len(gpu_uuids) != len(entries):
            raise WeightUpdateError(
                f"payload_gpu_uuids has {len(gpu_uuids)} items but serialized_named_tensors has {len(entries)}",
                field="payload_gpu_uuids",
            )
        if device.startswith("cuda") and torch.cuda.is_available():
            index = torch.device(device).index or 0
            mine = str(torch.cuda.get_device_properties(index).uuid)
            if mine in gpu_uuids:
                return entries[list(gpu_uuids).index(mine)]
            logger.info("no payload on this GPU (%s); using entry 0", mine)
    return entries[0]


# ---------------------------------------------------------------------------- payload structure
def _as_named_list(payload: Any, where: str) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(payload, (list, tuple)):
        raise WeightUpdateError(
            f"{where}: expected a list of (name, tensor) pairs, got {type(payload).__name__}"
        )
    out = []
    for i, item in enumerate(payload):
        if (
            not isinstance(item, (list, tuple))
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], torch.Tensor)
        ):
            raise WeightUpdateError(f"{where}: item {i} is not a (name, tensor) pair")
        out.append((item[0], item[1]))
    return out


def _normalize_dtype(dtype: Any, where: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        candidate = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(candidate, torch.dtype):
            return candidate
    raise WeightUpdateError(f"{where}: unsupported dtype {dtype!r}")


def unflatten_bucket(payload: Any, where: str = "flattened_bucket") -> list[tuple[str, torch.Tensor]]:
    """``{"flattened_tensor", "metadata"}`` -> ``[(name, tensor view)]``, every range checked."""
    if not isinstance(payload, dict) or "flattened_tensor" not in payload or "metadata" not in payload:
        raise WeightUpdateError(f"{where}: expected a dict with 'flattened_tensor' and 'metadata'")
    flat, metadata = payload["flattened_tensor"], payload["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise WeightUpdateError(f"{where}: 'flattened_tensor' must be a 1-D tensor")
    if not isinstance(metadata, (list, tuple)):
        raise WeightUpdateError(f"{where}: 'metadata' must be a list")
    out = []
    for i, meta in enumerate(metadata):
        if not isinstance(meta, FlattenedTensorMetadata):
            raise WeightUpdateError(f"{where}: metadata item {i} is not FlattenedTensorMetadata")
        name = meta.name
        if not isinstance(name, str):
            raise WeightUpdateError(f"{where}: metadata item {i} has no string name")
        dtype = _normalize_dtype(meta.dtype, f"{where}.{name}")
        try:
            shape = torch.Size([int(s) for s in meta.shape])
            start, end = int(meta.start_idx), int(meta.end_idx)
        except (TypeError, ValueError) as exc:
            raise WeightUpdateError(f"{where}.{name}: malformed shape or range ({exc})") from exc
        if not (0 <= start <= end <= flat.numel()):
            raise WeightUpdateError(
                f"{where}.{name}: range [{start}, {end}) outside the flat tensor of {flat.numel()} elements"
            )
        need = math.prod(shape) * dtype.itemsize
        have = (end - start) * flat.element_size()
        if need != have:
            raise WeightUpdateError(
                f"{where}.{name}: range holds {have} bytes but {tuple(shape)} {dtype} needs {need}"
            )
        piece = flat[start:end]
        try:
            tensor = piece.view(dtype).reshape(shape)
        except RuntimeError:
            # A slice whose byte offset is not a multiple of the item size cannot be viewed in place.
            tensor = piece.clone().view(dtype).reshape(shape)
        out.append((name, tensor))
    return out


def named_tensors_of(payload: Any, load_format: str | None, where: str) -> list[tuple[str, torch.Tensor]]:
    if load_format == "flattened_bucket":
        return unflatten_bucket(payload, where)
    return _as_named_list(payload, where)


def module_payloads(
    decoded: Any, load_format: str | None, target_modules: Sequence[str]
) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Split a decoded entry into ``{module: [(name, tensor)]}`` following SGLang's rules."""
    if load_format not in LOAD_FORMATS:
        raise WeightUpdateError(f"unknown load_format {load_format!r}; use null or 'flattened_bucket'")
    is_bucket = isinstance(decoded, dict) and "flattened_tensor" in decoded
    if isinstance(decoded, dict) and not is_bucket:
        missing = [m for m in target_modules if m not in decoded]
        extra = sorted(set(decoded) - set(target_modules))
        if missing or extra:
            raise WeightUpdateError(
                f"per-module payload does not match target_modules {list(target_modules)}: "
                f"missing {missing}, unexpected {extra}",
                field="target_modules",
            )
        return {m: named_tensors_of(decoded[m], load_format, m) for m in target_modules}
    if len(target_modules) != 1:
        raise WeightUpdateError(
            f"a payload for several target modules {list(target_modules)} must be a dict "
            "{module_name: payload}",
            field="target_modules",
        )
    return {target_modules[0]: named_tensors_of(decoded, load_format, target_modules[0])}
