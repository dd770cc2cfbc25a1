"""Upload bodies read from the ASGI stream straight into a pooled receive buffer.

Design decisions:

- **One copy on the server's side of the socket.** ``request.body()`` keeps every chunk the server
  hands over and joins them into one ``bytes``, then the parser copies again into tensors. Here the
  body is read chunk by chunk (``request.stream()``) into a buffer of the weight manager's pool
  (``server/weights/receive.py``) sized by ``Content-Length``; the tensors are then views into it.
- **Read inside the route**, so FastAPI's dependencies (the admin key) are checked before the first
  body byte is read, and the size limit middleware still counts every chunk.
- **Exact length.** A body longer than its ``Content-Length`` or one that ends early (a client
  that stopped sending) is a 400 that stages nothing; a client that disconnects mid-body is the
  same cut (nobody reads the answer): its part is refused and its upload dropped, as on the upload
  port, so a broken connection leaves nothing staged behind it. A chunked body (no ``Content-Length``) is collected, then copied
  once into a pooled buffer; the body-limit middleware bounds it.
- The buffer is the caller's from the moment this returns; on any failure here it goes back.
"""

from __future__ import annotations

from fastapi import Request
from starlette.requests import ClientDisconnect

from diffusion_rollout.entrypoints.upload_part import truncated_body_error
from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.server.weights import BufferPool, Lease, unpooled


async def receive_body(request: Request, pool: BufferPool) -> Lease:
    """The request body in a buffer leased from ``pool``."""
    length = request.headers.get("content-length")
    if length is None or not length.strip().isdigit():
        return await _receive_unsized(request, pool)
    expected = int(length)
    if expected == 0:
        async for _ in request.stream():
            pass
        return unpooled(b"")
    lease = pool.lease(expected)
    try:
        view = lease.writable()
        pos = 0
        try:
            async for chunk in request.stream():
                end = pos + len(chunk)
                if end > expected:
                    raise WeightUpdateError(
                        f"the body is longer than its Content-Length of {expected} bytes; nothing was staged",
                        field="body",
                    )
                view[pos:end] = chunk
                pos = end
        except ClientDisconnect:
            raise truncated_body_error(pos, expected) from None
        if pos != expected:
            raise truncated_body_error(pos, expected)
    except BaseException:
        view = None  # a live view of the buffer would keep it out of the pool
        lease.release()
        raise
    return lease


async def _receive_unsized(request: Request, pool: BufferPool) -> Lease:
    chunks = []
    total = 0
    async for chunk in request.stream():
        chunks.append(chunk)
        total += len(chunk)
    if total == 0:
        return unpooled(b"")
    lease = pool.lease(total)
    view = lease.writable()
    pos = 0
    for chunk in chunks:
        view[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    return lease
