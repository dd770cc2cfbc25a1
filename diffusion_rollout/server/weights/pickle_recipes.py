"""The inert stand-ins and recipe builders of the restricted unpickler (``safe_pickle.py``).

Loading a payload resolves torch's rebuild functions to the builders here: each checks the types of
its arguments and returns a recipe (a plain record of sizes, strides, dtype and where the storage
lives) instead of a tensor. Classes become :class:`ClassToken`, which cannot be called, and
``DupFd`` becomes an :class:`FdTicket` that only holds an address. Nothing here opens a descriptor,
maps memory or touches a device; ``safe_pickle.materialize`` does that after every recipe of the
payload has been checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from diffusion_rollout.errors import WeightUpdateError

BUCKET_METADATA_CLASS = "FlattenedTensorMetadata"
SGLANG_CUDA_REBUILD = "_rebuild_cuda_tensor_modified"
MAX_NDIM = 16  # more dimensions than any weight has: a cheap bound on what a recipe may claim

_INT_DTYPES = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool}
_INT_DTYPES |= {d for d in (getattr(torch, n, None) for n in ("uint16", "uint32", "uint64")) if d is not None}


def allowed_dtype(dtype: object) -> bool:
    """Plain numeric dtypes only: floats (fp8 included), complex, integers, bool; no quantized types."""
    return isinstance(dtype, torch.dtype) and (
        dtype.is_floating_point or dtype.is_complex or dtype in _INT_DTYPES
    )


def refuse(message: str) -> WeightUpdateError:
    return WeightUpdateError(f"tensor payload refused: {message}")


# ---------------------------------------------------------------------------- inert stand-ins
@dataclass(frozen=True)
class ClassToken:
    """Stands for a tensor or storage class named by the pickle; not callable, so never built."""

    name: str


TENSOR = ClassToken("Tensor")
PARAMETER = ClassToken("Parameter")
UNTYPED_STORAGE = ClassToken("UntypedStorage")
TYPED_STORAGE = ClassToken("TypedStorage")


class FdTicket:
    """``multiprocessing.resource_sharer.DupFd`` as data: the sharer's address and key, nothing more.

    A real payload builds it with NEWOBJ (no arguments) and BUILD (state ``{"_id": (address, key)}``).
    Calling it with arguments (REDUCE) would, on the real class, duplicate a descriptor of this
    process: refused here.
    """

    __slots__ = ("address", "key")

    def __new__(cls, *args: Any) -> FdTicket:
        if args:
            raise refuse("DupFd may not be constructed with arguments")
        ticket = object.__new__(cls)
        ticket.address = None
        ticket.key = None
        return ticket

    def __init__(self, *args: Any) -> None:
        if args:
            raise refuse("DupFd may not be constructed with arguments")

    def __setstate__(self, state: Any) -> None:
        ident = state.get("_id") if isinstance(state, dict) and set(state) == {"_id"} else None
        if not (isinstance(ident, tuple) and len(ident) == 2):
            raise refuse("DupFd state must be {'_id': (address, key)}")
        address, key = ident
        if not isinstance(key, int) or isinstance(key, bool):
            raise refuse("DupFd key must be an integer")
        if not isinstance(address, str):
            # A tuple would be a TCP address: descriptors never travel over the network.
            raise refuse(f"DupFd address must be a local AF_UNIX path, got {type(address).__name__}")
        self.address, self.key = address, key


@dataclass(frozen=True, eq=False)
class FdStorage:
    ticket: FdTicket
    nbytes: int


@dataclass(frozen=True, eq=False)
class EmptyStorage:
    nbytes: int = 0


@dataclass(frozen=True, eq=False)
class InlineStorage:
    """Bytes carried inside the payload (``torch.save`` archives)."""

    data: bytes
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True, eq=False)
class TypedStorageRecipe:
    storage: FdStorage | EmptyStorage | InlineStorage
    dtype: torch.dtype


@dataclass(frozen=True, eq=False)
class TensorRecipe:
    """A CPU tensor: a view ``(offset, size, stride)`` in elements of ``dtype`` over ``storage``."""

    storage: FdStorage | EmptyStorage | InlineStorage
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class CudaTensorRecipe:
    """torch's ``rebuild_cuda_tensor`` arguments, checked; the device may be a GPU UUID (SGLang)."""

    args: tuple
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_nbytes: int


def as_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise refuse(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > MAX_NDIM:
        raise refuse(f"{what} must be a tuple of at most {MAX_NDIM} integers")
    return tuple(as_int(v, what) for v in value)


def _dtype(value: Any) -> torch.dtype:
    if not allowed_dtype(value):
        raise refuse(f"dtype {value!r} is not a plain numeric dtype")
    return value


def checked_view(size: Any, stride: Any, offset: Any) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    size, stride, offset = _ints(size, "size"), _ints(stride, "stride"), as_int(offset, "storage offset")
    if len(size) != len(stride):
        raise refuse(f"size {size} and stride {stride} differ in length")
    return size, stride, offset


# ---------------------------------------------------------------------------- recipe builders
def rebuild_storage_fd(cls: Any, df: Any, size: Any) -> FdStorage:
    if cls is not UNTYPED_STORAGE:
        raise refuse("rebuild_storage_fd must name torch.UntypedStorage")
    if not isinstance(df, FdTicket) or df.address is None:
        raise refuse("rebuild_storage_fd needs a DupFd descriptor holder")
    return FdStorage(df, as_int(size, "storage size"))


def rebuild_storage_empty(cls: Any) -> EmptyStorage:
    if cls is not UNTYPED_STORAGE:
        raise refuse("rebuild_storage_empty must name torch.UntypedStorage")
    return EmptyStorage()


def rebuild_typed_storage(storage: Any, dtype: Any) -> TypedStorageRecipe:
    if not isinstance(storage, (FdStorage, EmptyStorage)):
        raise refuse("rebuild_typed_storage needs a storage")
    return TypedStorageRecipe(storage, _dtype(dtype))


def rebuild_tensor_recipe(cls: Any, storage: Any, metadata: Any) -> TensorRecipe:
    if cls not in (TENSOR, PARAMETER):
        raise refuse("rebuild_tensor must name torch.Tensor or Parameter")
    if not isinstance(storage, TypedStorageRecipe):
        raise refuse("rebuild_tensor needs a typed storage")
    if not (isinstance(metadata, tuple) and len(metadata) == 4):
        raise refuse("rebuild_tensor metadata must be (offset, size, stride, requires_grad)")
    offset, size, stride, _requires_grad = metadata
    size, stride, offset = checked_view(size, stride, offset)
    return TensorRecipe(storage.storage, storage.dtype, offset, size, stride)


_CUDA_ARGS = 15  # torch's rebuild_cuda_tensor signature


def rebuild_cuda_tensor_recipe(*args: Any) -> CudaTensorRecipe:
    if len(args) != _CUDA_ARGS:
        raise refuse(f"rebuild_cuda_tensor takes {_CUDA_ARGS} arguments, got {len(args)}")
    (
        cls, size, stride, offset, storage_cls, dtype, device, handle, nbytes, storage_offset_bytes,
        _requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required,
    ) = args  # fmt: skip
    if cls not in (TENSOR, PARAMETER) or storage_cls not in (TYPED_STORAGE, UNTYPED_STORAGE):
        raise refuse("rebuild_cuda_tensor must name tensor and storage classes")
    if not (isinstance(device, str) or (isinstance(device, int) and not isinstance(device, bool))):
        raise refuse("rebuild_cuda_tensor device must be an index or a GPU UUID")
    # None is what torch sends for an empty storage (it then builds an empty one, nothing opened).
    for value, what in ((handle, "storage"), (ref_counter_handle, "ref-counter"), (event_handle, "event")):
        if not (value is None or isinstance(value, bytes)):
            raise refuse(f"rebuild_cuda_tensor {what} handle must be bytes")
    as_int(storage_offset_bytes, "storage offset bytes")
    as_int(ref_counter_offset, "ref-counter offset")
    if not isinstance(event_sync_required, bool):
        raise refuse("rebuild_cuda_tensor event_sync_required must be a bool")
    size, stride, offset = checked_view(size, stride, offset)
    real_storage_cls = torch.storage.TypedStorage if storage_cls is TYPED_STORAGE else torch.UntypedStorage
    real = (torch.Tensor, size, stride, offset, real_storage_cls, *args[5:])
    # Without a handle torch builds an empty storage whatever size is claimed: check against that.
    nbytes = 0 if handle is None else as_int(nbytes, "storage size")
    return CudaTensorRecipe(real, _dtype(dtype), offset, size, stride, nbytes)
