"""msgpack request bodies for ``POST /rollout/generate``.

A trainer on another host sends input images and precomputed conditioning (``prompt_embeds``...)
inline; in JSON they travel as base64 (a third larger), in a msgpack body as raw bytes. This pure
ASGI middleware reads a body sent with ``Content-Type: application/msgpack``, decodes it and hands
the route the equivalent JSON body: loose bytes as base64 text, which ``image_data`` accepts, and
each tensor envelope decoded into a tensor right away (one copy of its bytes, never base64) and
replaced by a reference to it (``protocol/request_tensors.py``). The route's typed model then
validates both forms by the same rules (unknown fields, ranges, 422s). It sits inside the key gate
and the body limits, so a refused or oversized body is never decoded. A body that is not msgpack,
or not a map, or holds a malformed tensor envelope (named by its path), is a 400.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import msgpack

from diffusion_rollout.entrypoints.http_errors import error_body
from diffusion_rollout.protocol import wire
from diffusion_rollout.protocol.request_tensors import holding

MSGPACK_PATHS = frozenset({"/rollout/generate"})


def _content_type(scope) -> str:
    for key, value in scope.get("headers") or ():
        if key == b"content-type":
            return value.decode("latin-1").split(";", 1)[0].strip().lower()
    return ""


def _json_ready(obj: Any, tensors: list, path: str = "body") -> Any:
    """``obj`` as JSON values; tensor envelopes are decoded into ``tensors`` and referenced."""
    if isinstance(obj, (bytes, bytearray)):
        return base64.b64encode(bytes(obj)).decode("ascii")
    if isinstance(obj, dict):
        if obj.get(wire.TENSOR_KEY) is True:
            try:
                tensors.append(wire.envelope_to_tensor(obj))
            except wire.WireFormatError as exc:
                raise ValueError(f"{path}: {exc}") from None
            return {wire.TENSOR_KEY: True, "ref": len(tensors) - 1}
        return {k: _json_ready(v, tensors, f"{path}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_ready(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]
    return obj


class MsgpackBodyMiddleware:
    def __init__(self, app, paths: frozenset[str] = MSGPACK_PATHS) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in self.paths
            or _content_type(scope) not in ("application/msgpack", "application/x-msgpack")
        ):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        tensors: list = []
        try:
            decoded = msgpack.unpackb(b"".join(chunks), raw=False)
            chunks.clear()
            if not isinstance(decoded, dict):
                raise ValueError(f"the body is a msgpack {type(decoded).__name__}, not a map")
            data = json.dumps(_json_ready(decoded, tensors)).encode()
        except Exception as exc:  # any malformed body (msgpack raises several types) is the client's
            await _answer_400(send, f"body: not a valid msgpack map ({type(exc).__name__}: {exc})"[:500])
            return
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-type", b"content-length")]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        delivered = False

        async def replay_receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()  # after the body: only the disconnect the route watches for

        with holding(tensors):
            await self.app({**scope, "headers": headers}, replay_receive, send)


async def _answer_400(send, message: str) -> None:
    body = json.dumps(error_body(message, "invalid_request", 400)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})
