"""A response whose body is a list of buffers, sent one ASGI message each under one Content-Length.

The msgpack rollout answer arrives from :func:`diffusion_rollout.protocol.wire.encode_chunks` as packed
pieces and memoryviews of the result tensors' host memory. Joining them into one ``bytes`` would
copy the whole answer (tens of MB) into fresh memory first; here each buffer goes to the server as
it is. The pieces are already coalesced by the encoder; a buffer larger than :data:`SEND_CHUNK` goes out
as slices of that size. A ``Content-Length`` (not chunked transfer encoding) lets the client
allocate the whole body once before reading it.

Why slices: uvicorn's h11 protocol, the one a plain ``pip install`` runs, hands each
body message to ``h11.Connection.send``, which joins it into new ``bytes``: one copy of a tensor's
memory, made while holding the GIL. A video answer has pieces of tens of MB; each join held the GIL
for about 20 ms, beside the engine's worker thread that launches the next call's kernels. Measured
on the 2-core CPU VM, 150 MB sent through uvicorn h11 to a client in another process, 5 repeats each:
a busy thread in the server process was starved 235-280 ms in all (longest stall 19-21 ms) with
40 MB messages, 0-6 ms (longest 1-3 ms) with 1 MiB slices; and without that thread the whole
transfer took 620-720 ms against 460-520 ms (small copies stay in cache; large ones fault in fresh
pages). httptools writes memoryviews as they are and only makes a few more writes.

The response holds the buffers, and the memoryviews hold their tensors, so the memory stays alive
until the last write. uvicorn (h11 and httptools alike) writes a memoryview body as it does
``bytes``; the ASGI test transports accept it too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

SEND_CHUNK = 1 << 20  # bytes per body message at most (module doc: the GIL under h11)


def _slices(buffers: Sequence[bytes | memoryview], size: int) -> list[bytes | memoryview]:
    out: list[bytes | memoryview] = []
    for buffer in buffers:
        view = memoryview(buffer)
        if view.nbytes <= size:
            out.append(buffer)
            continue
        view = view.cast("B")
        out.extend(view[i : i + size] for i in range(0, len(view), size))
    return out


class BuffersResponse(Response):
    def __init__(
        self,
        buffers: Sequence[bytes | memoryview],
        length: int,
        media_type: str,
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.buffers = _slices(buffers, SEND_CHUNK)
        super().__init__(None, status_code, {**(headers or {}), "content-length": str(length)}, media_type)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = len(self.buffers) - 1
        for i, buffer in enumerate(self.buffers):
            await send({"type": "http.response.body", "body": buffer, "more_body": i < last})
        if last < 0:
            await send({"type": "http.response.body", "body": b""})
        if self.background is not None:
            await self.background()
