"""Helpers shared by the routers: engine access and wire-format responses."""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from diffusion_rollout import wire
from diffusion_rollout.errors import AuthenticationError, PermissionDeniedError
from diffusion_rollout.server.engine import Engine


def get_engine(request: Request) -> Engine:
    return request.app.state.engine


async def wire_response(request: Request, payload: Any) -> Response:
    """msgpack (default) or JSON per the Accept header, encoded off the event loop."""
    media = wire.choose_media_type(request.headers.get("accept"))
    body = await asyncio.to_thread(wire.encode, payload, media)
    return Response(content=body, media_type=media)


def _bearer_token(request: Request) -> str | None:
    """The token of ``Authorization: Bearer <token>``, or None (no header, another scheme, empty)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _check_key(request: Request, expected: str | None, what: str) -> None:
    # Messages never echo the token or the key: error bodies and log lines may be shared.
    if expected is None:
        return
    token = _bearer_token(request)
    if token is None:
        raise AuthenticationError(f"missing {what} key: send 'Authorization: Bearer <key>'")
    # Constant-time comparison so the key cannot be guessed byte by byte from response timing.
    if not hmac.compare_digest(token.encode(), expected.encode()):
        raise PermissionDeniedError(f"wrong {what} key")


def require_api_key(request: Request) -> None:
    """Dependency for generation endpoints (the admin key is accepted too)."""
    cfg = request.app.state.config
    if cfg.api_key is None:
        return
    token = _bearer_token(request)
    if cfg.admin_key is not None and token and hmac.compare_digest(token.encode(), cfg.admin_key.encode()):
        return
    _check_key(request, cfg.api_key, "API")


def require_admin_key(request: Request) -> None:
    """Dependency for weight, LoRA, memory and pause endpoints."""
    _check_key(request, request.app.state.config.admin_key, "admin")
