"""A response whose body is a list of buffers, sent one ASGI message each under one Content-Length.

The msgpack rollout answer arrives from :func:`diffusion_rollout.wire.encode_chunks` as packed
pieces and memoryviews of the result tensors' host memory. Joining them into one ``bytes`` would
copy the whole answer (tens of MB) into fresh memory first; here each buffer goes to the server as
it is. The pieces are already coalesced by the encoder, so an answer is a few dozen writes, not
thousands. A ``Content-Length`` (not chunked transfer encoding) lets the client allocate the whole
body once before reading it.

The response holds the buffers, and the memoryviews hold their tensors, so the memory stays alive
until the last write. uvicorn (h11 and httptools alike) writes a memoryview body as it does
``bytes``; the ASGI test transports accept it too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class BuffersResponse(Response):
    def __init__(
        self,
        buffers: Sequence[bytes | memoryview],
        length: int,
        media_type: str,
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.buffers = list(buffers)
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
