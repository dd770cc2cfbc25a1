"""Request-body limit for bodies without a ``Content-Length`` (chunked uploads).

The request middleware of ``app.py`` answers 413 from the ``Content-Length`` header before anything is
read. A chunked body has no such header, so this pure ASGI middleware counts the bytes as the app
receives them: past the limit it stops the read (the app's ``receive`` raises) and answers 413 in
place of whatever the app would have answered (FastAPI turns a failed body read into a 400, which
would hide the reason). Pure ASGI rather than ``BaseHTTPMiddleware`` because it must see ``receive``.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from diffusion_rollout.entrypoints.http_errors import error_body
from diffusion_rollout.errors import PayloadTooLargeError


class BodyLimitMiddleware:
    def __init__(self, app, limit_for: Callable[[str], tuple[int, str]]) -> None:
        """``limit_for(path) -> (bytes, name of the config field)``."""
        self.app = app
        self.limit_for = limit_for

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, name = self.limit_for(scope["path"])
        seen = 0
        exceeded = False
        answered = False

        async def limited_receive():
            nonlocal seen, exceeded
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    exceeded = True
                    raise PayloadTooLargeError(f"request body exceeds {name}={limit} bytes (limit {name})")
            return message

        async def answer_413() -> None:
            nonlocal answered
            answered = True
            message = f"request body of more than {limit} bytes exceeds {name}={limit} (limit {name})"
            body = json.dumps(error_body(message, "payload_too_large", 413, scope["path"])).encode()
            rid = dict(scope.get("headers") or []).get(b"x-request-id")
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            if rid:
                headers.append((b"x-request-id", rid))
            await send({"type": "http.response.start", "status": 413, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        async def guarded_send(message) -> None:
            if not exceeded:
                await send(message)
            elif not answered and message["type"] == "http.response.start":
                await answer_413()  # the app's own answer to the failed read is dropped

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            # The read error may come back as is, or wrapped (an ExceptionGroup from the task group
            # of a BaseHTTPMiddleware): the flag, not the exception type, says it was ours.
            if not exceeded:
                raise
            if not answered:
                await answer_413()
