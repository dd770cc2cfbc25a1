"""Receive buffers for uploaded weights, and safetensors parsed in place (no copy of the tensor bytes).

Design decisions:

- **Bodies land in reused buffers.** A multi-GB upload used to be joined into one ``bytes`` by
  ``request.body()`` and copied again into fresh tensors by ``safetensors.load`` before it was
  staged. Fresh host memory is slow to touch the first time (on a VM a
  page fault costs microseconds: 1 GiB of new memory took 1.9 s to fill here, 0.08 s once
  touched), and pinned memory is slow to allocate, so parts are received straight into buffers of a
  :class:`BufferPool` that are kept between uploads (a trainer pushes every step). On CUDA the
  buffers are pinned, so the final host-to-device copy runs at DMA speed.
- **Parsing is views.** :func:`parse_safetensors` reads the header and returns tensors that are
  views into the buffer; an entry whose offset is not aligned to its element size (no writer we
  know makes one) is the only copy.
- **A buffer goes back to the pool only when nothing else holds it.** Staged tensors, and anything
  a loader keeps from them, are views sharing the buffer's storage. :meth:`Lease.release` returns
  the buffer only when the storage's use count is back to the pool's own references. A buffer still
  viewed is *deferred*: it is looked at again at every later lease and release and joins the free
  list once its last view is gone. That matters because a view can outlive the lease by
  microseconds: a worker thread that ran the parse still holds its finished job (and so the
  result) until its loop drops it, which races the event loop's ``release()``. Deferred buffers
  count against ``keep_bytes`` and are dropped first when over it (``abandoned``), so a view that
  lives on for good costs memory only until the bound, and never corrupts weights.
- The header is checked completely (``safetensors_layout.parse_header``: known dtypes, offsets
  inside the body, sizes equal to shape x element size, no overlaps) before any view is made; a
  malformed body is a :class:`WeightUpdateError` (400) naming the problem.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.protocol.safetensors_layout import (
    MAX_HEADER_BYTES,
    HeaderError,
    itemsize,
    parse_header,
)

logger = logging.getLogger(__name__)

# Buffers are allocated in whole MiB so a slightly larger part reuses a buffer of the same class.
_GRAIN = 1 << 20

# How many tensors and storage objects share a storage (torch's own count, private; without it a
# buffer is never reused, which is slower but still correct).
_STORAGE_USE_COUNT: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _use_count(storage: torch.UntypedStorage) -> int | None:
    return None if _STORAGE_USE_COUNT is None else int(_STORAGE_USE_COUNT(storage._cdata))


# ---------------------------------------------------------------------------- buffer pool
class Lease:
    """``nbytes`` of a pooled buffer, held by one upload part until :meth:`release`."""

    def __init__(self, pool: BufferPool | None, buffer: torch.Tensor, nbytes: int) -> None:
        self._pool = pool
        self._buffer = buffer
        self.nbytes = nbytes
        self._baseline = _use_count(buffer.untyped_storage())

    @property
    def data(self) -> torch.Tensor:
        """The received bytes: a ``uint8`` view of ``nbytes`` elements."""
        if self._buffer is None:
            raise RuntimeError("this receive buffer was released")
        return self._buffer[: self.nbytes]

    def writable(self) -> memoryview:
        """A writable memoryview of ``nbytes`` (what the receiver copies socket chunks into)."""
        return memoryview(self.data.numpy()).cast("B")

    def shares_storage(self, t: torch.Tensor) -> bool:
        return self._buffer is not None and t.untyped_storage().data_ptr() == self._buffer.data_ptr()

    def release(self) -> None:
        """Give the buffer back (to the pool if nothing else still holds a view of it). Idempotent."""
        buffer, self._buffer = self._buffer, None
        if buffer is None or self._pool is None:
            return
        self._pool._give_back(buffer, self._baseline)


@dataclass
class PoolStats:
    allocated: int = 0  # buffers created
    reused: int = 0  # leases served from kept buffers
    kept_bytes: int = 0  # bytes of free buffers held now
    deferred: int = 0  # releases that found a view still alive (the buffer is looked at again later)
    deferred_bytes: int = 0  # bytes of deferred buffers held now
    abandoned: int = 0  # deferred buffers let go while still viewed (over keep_bytes)


@dataclass
class BufferPool:
    """Host buffers for upload bodies, kept between uploads up to ``keep_bytes`` (pinned on CUDA)."""

    pin: bool = False
    keep_bytes: int = 64 * 2**30
    _free: list[torch.Tensor] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    stats: PoolStats = field(default_factory=PoolStats)

    _held: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # deferred (buffer, baseline)

    def lease(self, nbytes: int) -> Lease:
        """A buffer of at least ``nbytes``: the smallest kept one that fits, else a new one."""
        with self._lock:
            self._reclaim()
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                buffer = min(fits, key=lambda b: b.numel())
                self._free = [b for b in self._free if b is not buffer]
                self.stats.kept_bytes -= buffer.numel()
                self.stats.reused += 1
                return Lease(self, buffer, nbytes)
        size = max(_GRAIN, -(-nbytes // _GRAIN) * _GRAIN)
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        with self._lock:
            self.stats.allocated += 1
        return Lease(self, buffer, nbytes)

    def _give_back(self, buffer: torch.Tensor, baseline: int | None) -> None:
        if baseline is None or _use_count(buffer.untyped_storage()) is None:
            return  # no use count in this torch: never reuse (slower, still correct)
        with self._lock:
            self._held.append((buffer, baseline))
            self.stats.deferred_bytes += buffer.numel()
            if not self._reclaim(buffer):
                self.stats.deferred += 1
            self._bound()

    def _reclaim(self, just: torch.Tensor | None = None) -> bool:
        """Move every deferred buffer with no view left to the free list (under the lock); whether
        ``just`` was among them."""
        moved = False
        still: list[tuple[torch.Tensor, int]] = []
        for buffer, baseline in self._held:
            if (_use_count(buffer.untyped_storage()) or 0) > baseline:
                still.append((buffer, baseline))
                continue
            self._free.append(buffer)
            self.stats.deferred_bytes -= buffer.numel()
            self.stats.kept_bytes += buffer.numel()
            moved = moved or buffer is just
        self._held = still
        return moved

    def _bound(self) -> None:
        """Over ``keep_bytes``: let go of deferred buffers first (they may be viewed for good), then
        the smallest free ones (the large ones are the expensive ones to redo)."""
        while self.stats.kept_bytes + self.stats.deferred_bytes > self.keep_bytes and self._held:
            buffer, _ = self._held.pop(0)
            self.stats.deferred_bytes -= buffer.numel()
            self.stats.abandoned += 1
        while self.stats.kept_bytes > self.keep_bytes and self._free:
            smallest = min(self._free, key=lambda b: b.numel())
            self._free = [b for b in self._free if b is not smallest]
            self.stats.kept_bytes -= smallest.numel()

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._held.clear()
            self.stats.kept_bytes = self.stats.deferred_bytes = 0


def unpooled(data: bytes | bytearray | memoryview) -> Lease:
    """A lease over bytes already in memory (tests, callers that hold a ``bytes`` body)."""
    buffer = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if len(data)
        else torch.empty(0, dtype=torch.uint8)
    )
    return Lease(None, buffer, len(data))


# ---------------------------------------------------------------------------- parsing
def parse_safetensors(lease: Lease) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a received safetensors body as views into its buffer, and its metadata."""
    data = lease.data
    nbytes = data.numel()
    if nbytes == 0:
        raise WeightUpdateError("the request body is empty; send safetensors bytes")
    head = data[:8].numpy().tobytes()
    if len(head) == 8:  # the header itself (bounded: parse_header refuses a longer one)
        header_len = min(int.from_bytes(head, "little"), MAX_HEADER_BYTES)
        head = data[: 8 + header_len].numpy().tobytes()
    try:
        entries, metadata, start = parse_header(head, nbytes)
    except HeaderError as exc:
        raise WeightUpdateError(
            f"the body ({nbytes} bytes) is not a valid safetensors file (truncated?): {exc}"
        ) from exc
    out: dict[str, torch.Tensor] = {}
    for name, (dtype, shape, begin, end) in entries.items():
        raw = data[start + begin : start + end]
        if (data.data_ptr() + start + begin) % itemsize(dtype):
            raw = raw.clone()  # misaligned for its dtype: the one copy a view cannot avoid
        out[name] = raw.view(dtype).reshape(shape)
    return out, metadata
