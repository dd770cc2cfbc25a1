"""Request ids, the ``Content-Length`` limit and per-route response metrics, as a pure ASGI middleware.

Pure ASGI rather than ``@app.middleware("http")`` (Starlette's ``BaseHTTPMiddleware``) because the
latter wraps every ``receive`` of the body in a new task group and task: a multi-GB weight upload
arrives in hundreds of thousands of chunks, and that wrapping was a measurable share of the
server's CPU per upload. Here the body messages pass through untouched; only the response start
is looked at (to add ``X-Request-Id`` and count the status by route template).

- The request id is the client's ``X-Request-Id`` or a new one; it is put in the logging context
  and in ``request.state.request_id`` for the routers.
- A declared ``Content-Length`` over the route's limit is a 413 before anything is read (chunked
  bodies are counted by ``BodyLimitMiddleware`` as they arrive).
- Metrics label responses with the route template (bounded label values), ``unmatched`` otherwise.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from starlette.datastructures import Headers, MutableHeaders

from diffusion_rollout.entrypoints.http_errors import error_response
from diffusion_rollout.errors import PayloadTooLargeError
from diffusion_rollout.logging_utils import request_id_var


def declared_length_error(length: int, limit: int, limit_name: str) -> PayloadTooLargeError | None:
    """The 413 for a declared ``Content-Length`` over ``limit`` (``limit_name``: its config field)."""
    if length <= limit:
        return None
    return PayloadTooLargeError(
        f"request body of {length} bytes exceeds the limit of {limit} bytes (limit {limit_name})"
    )


class RequestContextMiddleware:
    def __init__(self, app, *, engine, limit_for: Callable[[str], tuple[int, str]]) -> None:
        """``limit_for(path) -> (bytes, name of the config field)``; ``engine.metrics`` counts answers."""
        self.app = app
        self.engine = engine
        self.limit_for = limit_for

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        rid = headers.get("x-request-id") or uuid.uuid4().hex
        token = request_id_var.set(rid)
        scope.setdefault("state", {})["request_id"] = rid
        metrics = self.engine.metrics
        try:
            limit, limit_name = self.limit_for(scope["path"])
            length = headers.get("content-length")
            too_large = (
                declared_length_error(int(length), limit, limit_name)
                if length is not None and length.isdigit()
                else None
            )
            if too_large is not None:
                metrics.http_response(scope["method"], "unmatched", 413)
                response = error_response(too_large, scope["path"])
                response.headers["X-Request-Id"] = rid
                await response(scope, receive, send)
                return

            async def send_with_context(message) -> None:
                if message["type"] == "http.response.start":
                    MutableHeaders(scope=message)["X-Request-Id"] = rid
                    # The route template, not the path: bounded label values for /metrics.
                    route = getattr(scope.get("route"), "path", None) or "unmatched"
                    metrics.http_response(scope["method"], route, message["status"])
                await send(message)

            await self.app(scope, receive, send_with_context)
        finally:
            request_id_var.reset(token)
