"""Reading a rollout answer's body into one buffer allocated to its Content-Length.

``httpx`` gathers a body as a list of 64 KB reads and joins them: the whole answer is copied once
more into fresh memory after it has arrived (a Flow-GRPO answer is tens of MB, and on a loaded host
fresh pages are slow). Here the buffer is allocated once from the ``Content-Length`` and each read
is copied straight into it; :func:`diffusion_rollout.wire.decode` takes that buffer as it is. Used
by both clients and by the benchmarks' trainer process, so the three cannot drift apart.

- The buffer comes from ``numpy.empty``, not ``bytearray(n)``, which zero-fills: the memory is only
  touched as data arrives, so a server announcing a huge length and sending little costs nothing.
- A body longer or shorter than announced is a :class:`RolloutConnectionError` here, even if the
  HTTP layer let it through.
- Without a ``Content-Length``, with a ``Content-Encoding`` (the raw reads would then be
  compressed), or when the transport already holds the body in memory, it is read the ordinary way.
"""

from __future__ import annotations

import httpx
import numpy as np

from diffusion_rollout.client.exceptions import RolloutConnectionError

__all__ = ["aread_body", "read_body"]


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
            self.view = memoryview(np.empty(length, dtype=np.uint8))
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
