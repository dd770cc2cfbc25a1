"""Reading a rollout answer's body into one buffer allocated to its Content-Length.

``httpx`` gathers a body as a list of 64 KB reads and joins them: the whole answer is copied once
more into fresh memory after it has arrived (a Flow-GRPO answer is tens of MB, and on a loaded host
fresh pages are slow). Here the buffer is allocated once from the ``Content-Length`` and each read
is copied straight into it; :func:`diffusion_rollout.protocol.wire.decode` takes that buffer as it is. Used
by both clients and by the benchmarks' trainer process, so the three cannot drift apart.

- A new buffer comes from ``numpy.empty``, not ``bytearray(n)``, which zero-fills: the memory is only
  touched as data arrives, so a server announcing a huge length and sending little costs nothing.
- **Recycled buffers**. Fresh memory is slow to fill the first time: every 4 KiB page
  faults in, zeroed by the kernel. On the H200 host a video answer's last bytes arrived about 2 ms
  per MB after the GPU had finished, against stock's nothing, while the GPU work was the same; on the
  2-core CPU VM filling fresh memory took 0.8 ms per MB against 0.1 for memory already touched. So
  a buffer of at least :data:`POOL_MIN_BYTES` is handed out through :class:`ReceivePool`: when the
  last array made from it is gone (the trainer dropped the iteration's results), its memory goes
  back to the pool, and the next answer of the same length is read into it, already faulted in.
  A buffer is never reused while anything made from it is alive. The pool keeps at most
  ``DIFFUSION_ROLLOUT_RECEIVE_POOL_MB`` (default 2048) of idle buffers, oldest dropped first; 0
  turns it off. The default holds an iteration of about 1 GB of answers: each answer's body
  buffer and its tensors' memory, for instance four answers of two 1280x704x33 videos each.
- A body longer or shorter than announced is a :class:`RolloutConnectionError` here, even if the
  HTTP layer let it through.
- Without a ``Content-Length``, with a ``Content-Encoding`` (the raw reads would then be
  compressed), or when the transport already holds the body in memory, it is read the ordinary way.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any

import httpx
import numpy as np
import torch

from diffusion_rollout.client.exceptions import RolloutConnectionError
from diffusion_rollout.protocol import wire

__all__ = ["POOL_MIN_BYTES", "ReceivePool", "aread_body", "decode_answer", "host_bytes", "read_body"]

POOL_MIN_BYTES = 1 << 20  # smaller answers come from the allocator's own warm memory


class _Owner:
    """Holds one pooled buffer for the arrays made from it (their ``base``, through
    ``__array_interface__``); once the last of them is gone, gives the buffer back to its pool."""

    def __init__(self, array: np.ndarray, pool: ReceivePool) -> None:
        self._array = array
        self._pool = pool
        self.__array_interface__ = {
            "shape": array.shape,
            "typestr": "|u1",
            "data": (array.ctypes.data, False),
            "version": 3,
        }

    def __del__(self) -> None:
        self._pool.give_back(self._array)


class ReceivePool:
    """Receive buffers already faulted in, reused for answers of the same length (module doc).

    A buffer comes back from ``_Owner.__del__``, which runs in whatever thread drops the last array,
    possibly while that same thread is inside :meth:`take` (a garbage collection started by an
    allocation there). So :meth:`give_back` never waits for the lock: when it cannot take it at
    once, it leaves the buffer on a queue that the next holder of the lock files.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._idle: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._idle_bytes = 0
        self._returned: collections.deque[np.ndarray] = collections.deque()
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again (tests, diagnostics)

    @classmethod
    def from_env(cls) -> ReceivePool:
        raw = os.environ.get("DIFFUSION_ROLLOUT_RECEIVE_POOL_MB", "2048").strip()
        try:
            mb = float(raw)
        except ValueError:
            raise ValueError(
                f"DIFFUSION_ROLLOUT_RECEIVE_POOL_MB must be a number of MB, got {raw!r}"
            ) from None
        return cls(max(0, int(mb * 2**20)))

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            self._file_returned()
            return self._idle_bytes

    def pools(self, length: int) -> bool:
        """Whether a buffer of ``length`` bytes goes through the pool."""
        return POOL_MIN_BYTES <= length <= self.capacity_bytes

    def take(self, length: int) -> np.ndarray:
        """A writable uint8 array of ``length`` bytes: a recycled one when the pool holds one."""
        if not self.pools(length):
            return np.empty(length, dtype=np.uint8)
        array = None
        with self._lock:
            self._file_returned()
            key = next((k for k, idle in self._idle.items() if idle.nbytes == length), None)
            if key is not None:
                array = self._idle.pop(key)
                self._idle_bytes -= length
                self.reused += 1
        if array is None:
            array = np.empty(length, dtype=np.uint8)
        return np.asarray(_Owner(array, self))

    def give_back(self, array: np.ndarray) -> None:
        """Take ``array`` back (any thread; never blocks)."""
        self._returned.append(array)
        if self._lock.acquire(blocking=False):
            try:
                self._file_returned()
            finally:
                self._lock.release()

    def _file_returned(self) -> None:
        """Move the returned buffers into the idle ones, the longest idle dropped past the cap (lock held)."""
        while self._returned:
            array = self._returned.popleft()
            if array.nbytes > self.capacity_bytes:
                continue
            while self._idle and self._idle_bytes + array.nbytes > self.capacity_bytes:
                _, old = self._idle.popitem(last=False)
                self._idle_bytes -= old.nbytes
            self._idle[id(array)] = array
            self._idle_bytes += array.nbytes

    def clear(self) -> None:
        with self._lock:
            self._returned.clear()
            self._idle.clear()
            self._idle_bytes = 0


POOL = ReceivePool.from_env()
# A lock another thread held at a fork stays held in the child: give the child a fresh one.
os.register_at_fork(after_in_child=lambda: setattr(POOL, "_lock", threading.Lock()))


def host_bytes(length: int) -> torch.Tensor:
    """``length`` uint8 bytes for a decoded tensor: from the pool (so a tensor the trainer has dropped
    lends its memory, already faulted in, to the next answer's tensor of the same size). A tensor
    too small or too large for the pool gets ordinary ``torch.empty`` memory."""
    if not POOL.pools(length):
        return torch.empty(length, dtype=torch.uint8)
    return torch.from_numpy(POOL.take(length))


def decode_answer(body: bytes | memoryview, media_type: str) -> Any:
    """A rollout answer's body decoded as both clients and the benchmarks' trainer decode it: tensor
    data read in place from ``body`` and copied once, into :func:`host_bytes` (``wire.decode``)."""
    return wire.decode(body, media_type, alloc=host_bytes)


def _announced_length(resp: httpx.Response) -> int | None:
    if resp.is_stream_consumed:  # a transport that answered with a body already in memory
        return None
    if resp.headers.get("content-encoding", "identity").lower() not in ("", "identity"):
        return None
    raw = resp.headers.get("content-length", "").strip()
    if not (raw.isascii() and raw.isdigit()):  # absent, repeated ("1, 2"), or not a plain number
        return None
    return int(raw)


class _Filler:
    """The buffer being filled, and where the next read goes."""

    def __init__(self, resp: httpx.Response, length: int) -> None:
        self.url = str(resp.request.url)
        try:
            self.view = memoryview(POOL.take(length))
        except (MemoryError, ValueError, OverflowError):  # more than this host could ever hold
            raise self._error(f"an answer of {length} bytes does not fit in memory") from None
        self.filled = 0

    def _error(self, message: str) -> RolloutConnectionError:
        return RolloutConnectionError(f"{self.url}: {message}", url=self.url)

    def add(self, chunk: bytes) -> None:
        end = self.filled + len(chunk)
        if end > len(self.view):
            raise self._error(f"the answer is longer than its Content-Length of {len(self.view)} bytes")
        self.view[self.filled : end] = chunk
        self.filled = end

    def body(self) -> memoryview:
        if self.filled != len(self.view):
            raise self._error(f"the answer ended after {self.filled} of its {len(self.view)} announced bytes")
        return self.view


def read_body(resp: httpx.Response) -> bytes | memoryview:
    """The whole body of a response opened with ``stream=True`` (the caller closes it)."""
    length = _announced_length(resp)
    if length is None:
        return resp.read()
    filler = _Filler(resp, length)
    for chunk in resp.iter_raw():
        filler.add(chunk)
    return filler.body()


async def aread_body(resp: httpx.Response) -> bytes | memoryview:
    """:func:`read_body` for an ``httpx.AsyncClient`` response."""
    length = _announced_length(resp)
    if length is None:
        return await resp.aread()
    filler = _Filler(resp, length)
    async for chunk in resp.aiter_raw():
        filler.add(chunk)
    return filler.body()
