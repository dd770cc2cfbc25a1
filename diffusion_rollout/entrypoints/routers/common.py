"""Helpers shared by the routers: engine access and wire-format responses."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from pathlib import PurePath
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from diffusion_rollout.entrypoints.buffers_response import BuffersResponse
from diffusion_rollout.errors import AuthenticationError, DiffusionRolloutError, PermissionDeniedError
from diffusion_rollout.protocol import answer_segments, wire
from diffusion_rollout.server.core.engine_api import RolloutEngine, WeightOps


def get_engine(request: Request) -> RolloutEngine:
    return request.app.state.engine


def get_weights(request: Request) -> WeightOps:
    """The engine's weight-manager facade (a cluster's fans out to every replica)."""
    return get_engine(request).weights()


async def wire_response(request: Request, payload: Any, *, segments: bool = False) -> Response:
    """msgpack (default) or JSON per the Accept header, encoded off the event loop.

    msgpack goes out as the encoder's buffers (views of the payload's host tensors, which the
    response keeps alive and which nothing changes once a result is made: result_copy.py) under a
    Content-Length, without joining them into one copy of the body. With ``segments`` (rollout
    answers) a caller on this host may have it written into its shared-memory file instead
    (``answer_segments``).
    """
    media = wire.choose_media_type(request.headers.get("accept"))
    if media == wire.MSGPACK:
        buffers, length = await asyncio.to_thread(wire.encode_chunks, payload)
        name = request.headers.get(answer_segments.HEADER) if segments else None
        if name is None:
            return BuffersResponse(buffers, length, media_type=media)
        declined = await _into_segment(request, name, buffers, length)
        if declined is None:
            written = {
                answer_segments.HEADER: answer_segments.WRITTEN,
                answer_segments.LENGTH_HEADER: str(length),
            }
            return Response(b"", media_type=media, headers=written)
        headers = {answer_segments.HEADER: answer_segments.DECLINED + declined}
        return BuffersResponse(buffers, length, media_type=media, headers=headers)
    body = await asyncio.to_thread(wire.encode, payload, media)
    return Response(content=body, media_type=media)


async def _into_segment(request: Request, name: str, buffers, length: int) -> str | None:
    writer = getattr(request.app.state, "segment_writer", None)
    if writer is None:
        return "same-host answers are off on this server"
    if not _loopback_peer(request):
        return "not a loopback peer"
    token = request.headers.get(answer_segments.TOKEN_HEADER)
    return await asyncio.to_thread(writer.write, name, buffers, length, token)


def _loopback_peer(request: Request) -> bool:
    """A caller on this host's loopback: the only kind that can share a file with the server."""
    host = request.client.host if request.client is not None else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer_token(authorization: str | None) -> str | None:
    """The token of ``Authorization: Bearer <token>``, or None (no header, another scheme, empty)."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _matches(token: str | None, key: str | None) -> bool:
    # Constant-time comparison so the key cannot be guessed byte by byte from response timing.
    return key is not None and token is not None and hmac.compare_digest(token.encode(), key.encode())


def key_error(authorization: str | None, config, level: str) -> DiffusionRolloutError | None:
    """Why a caller with this ``Authorization`` header may not use a ``level`` route, or None.

    ``level`` is ``"api"`` (generation: the API key or the admin key) or ``"admin"``. Messages
    never echo the token or the key: error bodies and log lines may be shared.
    """
    expected, what = (config.admin_key, "admin") if level == "admin" else (config.api_key, "API")
    if expected is None:
        return None
    token = bearer_token(authorization)
    if level == "api" and _matches(token, config.admin_key):
        return None
    if token is None:
        return AuthenticationError(f"missing {what} key: send 'Authorization: Bearer <key>'")
    if not _matches(token, expected):
        return PermissionDeniedError(f"wrong {what} key")
    return None


def is_admin(request: Request) -> bool:
    """Whether the caller may see what only admins see (everyone, when no admin key is set)."""
    return key_error(request.headers.get("authorization"), request.app.state.config, "admin") is None


def require_api_key(request: Request) -> None:
    """Dependency for generation endpoints (the admin key is accepted too)."""
    error = key_error(request.headers.get("authorization"), request.app.state.config, "api")
    if error is not None:
        raise error


def require_admin_key(request: Request) -> None:
    """Dependency for weight, LoRA, memory and pause endpoints."""
    error = key_error(request.headers.get("authorization"), request.app.state.config, "admin")
    if error is not None:
        raise error


def public_path(path: str | None) -> str | None:
    """The model folder's name without where it lives (callers without the admin key)."""
    return None if path is None else (PurePath(path).name or path)


def upload_port(request: Request) -> int | None:
    """The port of the direct weight-upload listener (``--upload-port``), or None when it is off.

    Shown to every caller, like the main port it sits beside: the same admin key guards both.
    """
    listener = getattr(request.app.state, "upload_listener", None)
    return listener.port if listener is not None and listener.running else None


def model_info_for(request: Request) -> dict[str, Any]:
    """The engine's model info (its path reduced to the folder's name for non-admin callers) and
    ``weight_upload_port``, where the client sends full-weight parts when it is set."""
    info = get_engine(request).model_info()
    if not is_admin(request):
        info["model_path"] = public_path(info.get("model_path"))
    info["weight_upload_port"] = upload_port(request)
    return info


def refuse_unknown_fields(request: Request, body: Any) -> None:
    """Under ``serve --strict-fields``, a generation body with keys this server does not know is a
    422 naming them, in FastAPI's validation shape (by default they are accepted and reported)."""
    unknown = getattr(body, "unknown_fields", ())
    if unknown and request.app.state.config.strict_fields:
        raise RequestValidationError(
            [
                {
                    "type": "extra_forbidden",
                    "loc": ("body", *name.split(".")),
                    "msg": "Extra inputs are not permitted",
                }
                for name in unknown
            ]
        )
