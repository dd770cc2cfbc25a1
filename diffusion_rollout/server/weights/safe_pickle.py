"""Restricted, two-phase unpickling of tensor payloads that come from the network.

Used by ``update_weights_from_tensor`` (``ipc.py``) and importable by any route that decodes
pickled tensors (``decode_torch_save`` for ``torch.save`` bytes).

Design decisions:

- **Recipes first, tensors after.** The unpickler resolves the few globals a payload may name to
  *inert stand-ins*: torch's rebuild functions return recipe objects, tensor and storage classes
  become tokens that cannot be called, ``multiprocessing.resource_sharer.DupFd`` becomes an
  :class:`FdTicket` that only holds an address. Loading the pickle therefore touches no file
  descriptor, socket, device or allocator whatever the bytes say. Only :func:`materialize` builds
  tensors, and it first checks *every* recipe of the payload: dtype (plain numeric types only),
  device (CPU shared memory or CUDA IPC; never ``meta``), non-negative sizes and strides, and the
  tensor's extent (offset + reach of its strides) inside its storage. So a hostile payload is a 400
  before any connection is made, any storage is mapped, or any weight is copied.
- **What a real payload contains** (``ForkingPickler`` with torch's reductions, as SGLang's
  ``MultiprocessingSerializer`` makes it): ``torch.multiprocessing.reductions.rebuild_tensor`` /
  ``rebuild_typed_storage`` / ``rebuild_storage_fd`` / ``rebuild_storage_empty`` on a CPU,
  ``rebuild_cuda_tensor`` (or SGLang's UUID-aware ``_rebuild_cuda_tensor_modified``) on a GPU, the
  classes ``torch.Tensor``, ``torch.nn.parameter.Parameter``, ``torch.storage.UntypedStorage`` /
  ``TypedStorage`` (as arguments only), ``torch.Size``, ``torch.device``, dtypes,
  ``collections.OrderedDict``, ``DupFd`` (built by NEWOBJ + BUILD with state ``{"_id": (address,
  key)}``: never by calling it) and the bucket metadata class. Nothing else resolves; every other
  rebuild function (meta tensors, the ``file_system`` strategy's shared-memory manager, events,
  sparse and nested tensors) is refused by name.
- The stand-ins and the recipe builders are in ``pickle_recipes.py``; this module resolves globals
  to them, checks the recipes and builds the tensors.
- **CPU descriptors are off unless enabled** (:class:`FdPolicy`, ``allow_cpu_ipc`` in the config).
  Descriptors can only travel between processes that share the multiprocessing authkey (a parent
  and the child it spawned, or one process), so a real trainer on a GPU host uses CUDA IPC and the
  option exists for same-process tools and tests. When enabled, the descriptor is fetched (``shared_fd.py``) the way
  ``multiprocessing.resource_sharer`` hands it out, but only from an ``AF_UNIX`` path (local by
  construction; a TCP address is refused without a connection), authenticated with this process's
  authkey, with every socket operation bounded by ``timeout_s``. Every descriptor received is closed
  whatever happens (one is mapped, then closed), and it must be a regular file at least as large as
  the storage it claims to back (a shorter one would fault on access).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import pickle
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.protocol.weight_transport import FlattenedTensorMetadata
from diffusion_rollout.server.weights.pickle_recipes import (
    BUCKET_METADATA_CLASS,
    PARAMETER,
    SGLANG_CUDA_REBUILD,
    TENSOR,
    TYPED_STORAGE,
    UNTYPED_STORAGE,
    ClassToken,
    CudaTensorRecipe,
    EmptyStorage,
    FdStorage,
    FdTicket,
    InlineStorage,
    TensorRecipe,
    TypedStorageRecipe,
    allowed_dtype,
    as_int,
    checked_view,
    rebuild_cuda_tensor_recipe,
    rebuild_storage_empty,
    rebuild_storage_fd,
    rebuild_tensor_recipe,
    rebuild_typed_storage,
    refuse,
)
from diffusion_rollout.server.weights.shared_fd import map_shared_storage


# ---------------------------------------------------------------------------- the unpickler
class RefusedGlobal(pickle.UnpicklingError):
    def __init__(self, module: str, name: str, reason: str = "") -> None:
        super().__init__(f"{module}.{name}")
        self.module, self.name, self.reason = module, name, reason


_REDUCTIONS = "torch.multiprocessing.reductions"
_GLOBALS: dict[tuple[str, str], Any] = {
    (_REDUCTIONS, "rebuild_tensor"): rebuild_tensor_recipe,
    (_REDUCTIONS, "rebuild_typed_storage"): rebuild_typed_storage,
    (_REDUCTIONS, "rebuild_storage_fd"): rebuild_storage_fd,
    (_REDUCTIONS, "rebuild_storage_empty"): rebuild_storage_empty,
    (_REDUCTIONS, "rebuild_cuda_tensor"): rebuild_cuda_tensor_recipe,
    ("torch", "Tensor"): TENSOR,
    ("torch._tensor", "Tensor"): TENSOR,
    ("torch.nn.parameter", "Parameter"): PARAMETER,
    ("torch", "UntypedStorage"): UNTYPED_STORAGE,
    ("torch.storage", "UntypedStorage"): UNTYPED_STORAGE,
    ("torch", "TypedStorage"): TYPED_STORAGE,
    ("torch.storage", "TypedStorage"): TYPED_STORAGE,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("collections", "OrderedDict"): OrderedDict,
    ("multiprocessing.resource_sharer", "DupFd"): FdTicket,
}
# Named so the refusal says why, not just "refused".
_REFUSED_REASONS = {
    "rebuild_meta_tensor": "meta tensors carry no data",
    "rebuild_storage_filename": "the file_system sharing strategy connects to a shared-memory manager",
    "rebuild_event": "CUDA events are not weights",
}


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals of a real tensor payload, each to an inert stand-in."""

    def find_class(self, module: str, name: str) -> Any:
        if name == BUCKET_METADATA_CLASS:
            return FlattenedTensorMetadata  # SGLang's dataclass, wherever the sender defined it
        if name == SGLANG_CUDA_REBUILD:
            return rebuild_cuda_tensor_recipe  # the device is a UUID, resolved when materialized
        obj = _GLOBALS.get((module, name))
        if obj is not None:
            return obj
        if module == "torch":
            dtype = getattr(torch, name, None)
            if allowed_dtype(dtype):
                return dtype
        raise RefusedGlobal(module, name, _REFUSED_REASONS.get(name, ""))

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in this payload")


def loads_recipes(data: bytes, unpickler: type[pickle.Unpickler] = RestrictedUnpickler) -> Any:
    """Phase one: the payload's structure with recipes in place of tensors. Touches nothing."""
    try:
        return unpickler(io.BytesIO(data)).load()
    except RefusedGlobal as exc:
        why = f" ({exc.reason})" if exc.reason else ""
        raise WeightUpdateError(
            f"refused pickle global {exc.module}.{exc.name}{why}: a tensor payload may reference only "
            "torch's tensor rebuild functions, tensor/storage types, dtypes and the bucket metadata"
        ) from exc
    except WeightUpdateError:
        raise
    except Exception as exc:
        raise WeightUpdateError(f"could not decode the tensor payload ({type(exc).__name__}: {exc})") from exc


def decode_base64(entry: Any, field: str) -> bytes:
    if isinstance(entry, (bytes, bytearray)):
        return bytes(entry)
    if not isinstance(entry, str):
        raise WeightUpdateError(f"{field} entries must be strings, got {type(entry).__name__}", field=field)
    try:
        return base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WeightUpdateError(f"{field} entry is not base64: {exc}", field=field) from exc


# ---------------------------------------------------------------------------- checks
def iter_recipes(obj: Any, depth: int = 0) -> Iterator[Any]:
    """Every recipe inside a decoded structure (lists, tuples, dicts, bucket metadata)."""
    if depth > 32:
        raise refuse("payload nests deeper than 32 levels")
    if isinstance(obj, (TensorRecipe, CudaTensorRecipe)):
        yield obj
    elif isinstance(obj, (FdStorage, EmptyStorage, TypedStorageRecipe, FdTicket, ClassToken)):
        raise refuse(f"a bare {type(obj).__name__} is not a tensor")
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_recipes(item, depth + 1)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from iter_recipes(key, depth + 1)
            yield from iter_recipes(value, depth + 1)


def check_extent(
    size: tuple[int, ...], stride: tuple[int, ...], offset: int, itemsize: int, nbytes: int
) -> None:
    """The view's last element lies inside the storage (so no storage is grown or read past its end)."""
    if math.prod(size) == 0:
        end = offset
    else:
        end = offset + 1 + sum((s - 1) * st for s, st in zip(size, stride, strict=True))
    if end * itemsize > nbytes:
        raise refuse(
            f"tensor of size {list(size)}, stride {list(stride)} at offset {offset} reaches byte "
            f"{end * itemsize} of a storage of {nbytes} bytes"
        )


@dataclass(frozen=True)
class FdPolicy:
    """Whether (and how long) CPU tensors may be fetched by descriptor; see the module docstring."""

    allow_cpu_ipc: bool = False
    timeout_s: float = 10.0
    # Set when the entry was chosen by this server's own GPU UUID: the sender numbers devices under
    # its own CUDA_VISIBLE_DEVICES (a colocated trainer sees every GPU, a replica only its own), so
    # the integer index in its handles means "the GPU with that UUID", which is this local index.
    cuda_device: int | None = None


def check_recipes(obj: Any, policy: FdPolicy) -> list[Any]:
    """Phase two, first half: every recipe checked before anything is connected, mapped or copied."""
    recipes = list(iter_recipes(obj))
    for r in recipes:
        if isinstance(r, CudaTensorRecipe):
            check_extent(r.size, r.stride, r.offset, r.dtype.itemsize, r.storage_nbytes)
            if not torch.cuda.is_available():
                raise refuse("the payload holds CUDA IPC handles but this server has no GPU")
            continue
        if isinstance(r.storage, FdStorage) and not policy.allow_cpu_ipc:
            raise refuse(
                "CPU tensors shared by file descriptor are disabled on this server (allow_cpu_ipc=false); "
                "send CUDA tensors from a trainer on this GPU host, or use POST /update_weights"
            )
        check_extent(r.size, r.stride, r.offset, r.dtype.itemsize, r.storage.nbytes)
    return recipes


# ---------------------------------------------------------------------------- materialize
def _cuda_device_index(device: int | str) -> int:
    if isinstance(device, str):
        for index in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(index).uuid) == device:
                return index
        raise refuse(f"payload tensor lives on GPU {device}, which this server cannot see")
    if not 0 <= device < torch.cuda.device_count():
        raise refuse(f"payload tensor lives on cuda:{device}, which this server cannot see")
    return device


def _build(recipe: Any, storages: dict[int, torch.UntypedStorage], policy: FdPolicy) -> torch.Tensor:
    if isinstance(recipe, CudaTensorRecipe):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = list(recipe.args)
        if policy.cuda_device is not None and isinstance(args[6], int):
            args[6] = policy.cuda_device
        else:
            args[6] = _cuda_device_index(args[6])
        return rebuild_cuda_tensor(*args).detach()
    source = recipe.storage
    storage = storages.get(id(source))
    if storage is None:
        if isinstance(source, FdStorage):
            storage = map_shared_storage(source, policy.timeout_s)
        elif isinstance(source, InlineStorage) and source.data:
            storage = torch.UntypedStorage.from_buffer(source.data, dtype=torch.uint8)
        else:
            storage = torch.UntypedStorage(0)
        storages[id(source)] = storage
    t = torch.empty(0, dtype=recipe.dtype)
    return t.set_(storage, recipe.offset, recipe.size, recipe.stride)


def materialize(obj: Any, policy: FdPolicy) -> Any:
    """Phase two: check every recipe, then return ``obj`` with tensors in place of recipes."""
    check_recipes(obj, policy)
    storages: dict[int, torch.UntypedStorage] = {}
    built: dict[int, torch.Tensor] = {}

    def walk(node: Any) -> Any:
        if isinstance(node, (TensorRecipe, CudaTensorRecipe)):
            if id(node) not in built:
                built[id(node)] = _build(node, storages, policy)
            return built[id(node)]
        if isinstance(node, list):
            return [walk(x) for x in node]
        if isinstance(node, tuple):
            return tuple(walk(x) for x in node)
        if isinstance(node, dict):
            return type(node)((k, walk(v)) for k, v in node.items())
        return node

    return walk(obj)


def decode_tensor_pickle(data: bytes, policy: FdPolicy) -> Any:
    """A ``ForkingPickler`` tensor payload -> the object with checked tensors (both phases)."""
    return materialize(loads_recipes(data), policy)


# ---------------------------------------------------------------------------- torch.save archives
def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> TensorRecipe:
    if not isinstance(storage, InlineStorage):
        raise refuse("_rebuild_tensor_v2 needs a storage of the archive")
    size, stride, offset = checked_view(size, stride, offset)
    return TensorRecipe(storage, storage.dtype, offset, size, stride)


@dataclass(frozen=True)
class _LegacyStorage:
    dtype: torch.dtype


# torch.save names a storage by its legacy typed class (torch.FloatStorage, ...): name -> dtype.
_LEGACY_STORAGES = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


def decode_torch_save(data: bytes, *, max_tensors: int = 100_000) -> Any:
    """``torch.save`` bytes (zip format) -> the saved object with checked CPU tensors.

    Same rules as the IPC decoder: only tensor rebuilds, dtypes, ``OrderedDict`` and storage data
    from the archive itself resolve; every view is checked inside its storage before it is built.
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        names = archive.namelist()
    except (zipfile.BadZipFile, ValueError) as exc:
        raise WeightUpdateError(f"not a torch.save archive (zip): {exc}") from exc
    pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
    if len(pkl) != 1:
        raise WeightUpdateError("a torch.save archive holds exactly one data.pkl")
    prefix = pkl[0][: -len("data.pkl")]
    storages: dict[str, InlineStorage] = {}

    class ArchiveUnpickler(RestrictedUnpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                return _rebuild_tensor_v2
            if module == "torch" and allowed_dtype(_LEGACY_STORAGES.get(name)):
                return _LegacyStorage(_LEGACY_STORAGES[name])
            return super().find_class(module, name)

        def persistent_load(self, pid: Any) -> Any:
            if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
                raise refuse("unknown persistent id in the archive")
            _, cls, key, _location, numel = pid
            if not isinstance(key, str) or (key not in storages and len(storages) >= max_tensors):
                raise refuse("too many storages in the archive")
            if key not in storages:
                if not isinstance(cls, _LegacyStorage):
                    raise refuse("unknown storage class in the archive")
                dtype = cls.dtype
                try:
                    raw = archive.read(f"{prefix}data/{key}")
                except KeyError as exc:
                    raise refuse(f"storage {key!r} missing from the archive") from exc
                if len(raw) != as_int(numel, "storage numel") * dtype.itemsize:
                    raise refuse(f"storage {key!r} holds {len(raw)} bytes, not {numel} x {dtype}")
                storages[key] = InlineStorage(raw, dtype)
            return storages[key]

    try:
        structure = loads_recipes(archive.read(pkl[0]), ArchiveUnpickler)
    finally:
        archive.close()
    return materialize(structure, FdPolicy())
