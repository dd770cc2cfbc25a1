"""The wire codec shared by the server and the client.

A tensor travels as ``{"__tensor__": true, "data": <safetensors bytes of one tensor named "t">,
"shape": [...], "dtype": "torch.float32"}``. In msgpack bodies ``data`` is raw bytes; in JSON bodies
it is base64 of the same bytes, so both forms decode to identical tensors. safetensors (not pickle)
carries the bytes so a client never unpickles anything the server sent.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import msgpack
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

MSGPACK = "application/msgpack"
JSON = "application/json"
TENSOR_KEY = "__tensor__"


def tensor_to_envelope(t: torch.Tensor) -> dict[str, Any]:
    """A CPU copy of ``t`` as the tensor envelope with raw safetensors bytes."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return {
        TENSOR_KEY: True,
        "data": st_save({"t": t.contiguous()}),
        "shape": list(t.shape),
        "dtype": str(t.dtype),
    }


def envelope_to_tensor(env: dict[str, Any]) -> torch.Tensor:
    """Inverse of :func:`tensor_to_envelope`; ``data`` may be bytes or base64 text."""
    data = env["data"]
    if isinstance(data, str):
        data = base64.b64decode(data)
    t = st_load(bytes(data))["t"]
    if list(t.shape) != list(env.get("shape", t.shape)) or str(t.dtype) != env.get("dtype", str(t.dtype)):
        raise ValueError(f"tensor envelope disagrees with its data: {env.get('shape')} {env.get('dtype')}")
    return t


def to_wire(obj: Any) -> Any:
    """Replace every tensor in a nested structure by its envelope (raw bytes)."""
    if isinstance(obj, torch.Tensor):
        return tensor_to_envelope(obj)
    if isinstance(obj, dict):
        return {k: to_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_wire(v) for v in obj]
    return obj


def from_wire(obj: Any) -> Any:
    """Replace every tensor envelope in a decoded body by a torch tensor."""
    if isinstance(obj, dict):
        if obj.get(TENSOR_KEY) is True:
            return envelope_to_tensor(obj)
        return {k: from_wire(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_wire(v) for v in obj]
    return obj


def _json_default(o: Any) -> Any:
    if isinstance(o, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(o)).decode("ascii")
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def encode(obj: Any, media_type: str = MSGPACK) -> bytes:
    """Serialize a nested structure (tensors allowed) as msgpack or JSON bytes."""
    wired = to_wire(obj)
    if media_type == JSON:
        return json.dumps(wired, default=_json_default, separators=(",", ":")).encode()
    return msgpack.packb(wired, use_bin_type=True)


def decode(body: bytes, media_type: str = MSGPACK) -> Any:
    """Parse msgpack or JSON bytes and turn tensor envelopes back into tensors."""
    if media_type.startswith(JSON):
        return from_wire(json.loads(body))
    return from_wire(msgpack.unpackb(body, raw=False))


def choose_media_type(accept: str | None) -> str:
    """msgpack unless the client asks for JSON (and does not also accept msgpack)."""
    if not accept:
        return MSGPACK
    accept = accept.lower()
    if MSGPACK in accept or "application/x-msgpack" in accept:
        return MSGPACK
    if JSON in accept:
        return JSON
    return MSGPACK
