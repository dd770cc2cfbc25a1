"""The wire codec shared by the server and the client.

A tensor travels as ``{"__tensor__": true, "data": <safetensors bytes of one tensor named "t">,
"shape": [...], "dtype": "torch.float32"}``. In msgpack bodies ``data`` is raw bytes; in JSON bodies
it is base64 of the same bytes, so both forms decode to identical tensors. safetensors (not pickle)
carries the bytes so a client never unpickles anything the server sent.

Design decisions (a Flow-GRPO answer is tens of MB; every copy of it costs the trainer's wait):

- **msgpack bodies are written as a list of buffers** (:func:`encode_chunks`), not one ``bytes``:
  the structure, the envelope keys and headers and small tensors are packed into one piece per
  run, and every larger tensor's bytes follow as a memoryview of the tensor's own host memory.
  Nothing copies tensor data before the socket, and the bytes are exactly those of
  ``msgpack.packb(to_wire(obj))`` (the tests hold both side by side). Each envelope's file is
  :class:`~diffusion_rollout.protocol.safetensors_layout.SafetensorsBody` (header plus a view), because
  ``safetensors.torch.save`` has no way to serialize without copying the data; for one tensor its
  header is byte for byte safetensors' own.
- **Decoding makes each tensor with one copy** of its bytes. Envelopes become tensors while the
  body is unpacked (``object_hook``), so each envelope's bytes are released before the next one's
  are read and the allocator hands the same memory back, instead of the whole body existing twice.
  A decoded tensor owns fresh writable memory (never a view of the body).
- **A malformed body is a** :class:`WireFormatError` naming what is wrong, never a crash or a read
  past a buffer (a client must survive a broken or hostile server): the safetensors header is
  checked completely and must describe exactly one tensor ``"t"`` that fills the file and agrees
  with the envelope's shape and dtype.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import torch

from diffusion_rollout.protocol import msgpack_views
from diffusion_rollout.protocol.safetensors_layout import (
    MAX_HEADER_BYTES,
    HeaderError,
    SafetensorsBody,
    parse_header,
)

MSGPACK = "application/msgpack"
JSON = "application/json"
TENSOR_KEY = "__tensor__"
# A tensor smaller than this is copied into the packed piece around it: a separate buffer (and a
# separate socket write) per log-prob vector would cost more than the copy saves.
COALESCE_BYTES = 64 << 10

Buffer = bytes | memoryview
PARALLEL_COPY_BYTES = 4 << 20  # copies at least this large run on torch's threads (copy_into)


class WireFormatError(ValueError):
    """A body that is not a valid wire encoding (the client turns it into its own error)."""


# ---------------------------------------------------------------------------- encoding
def tensor_to_envelope(t: torch.Tensor) -> dict[str, Any]:
    """A CPU copy of ``t`` as the tensor envelope with raw safetensors bytes."""
    t = t.detach()
    return {
        TENSOR_KEY: True,
        "data": bytes(SafetensorsBody({"t": t})),
        "shape": list(t.shape),
        "dtype": str(t.dtype),
    }


def to_wire(obj: Any) -> Any:
    """Replace every tensor in a nested structure by its envelope (raw bytes)."""
    if isinstance(obj, torch.Tensor):
        return tensor_to_envelope(obj)
    if isinstance(obj, dict):
        return {k: to_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_wire(v) for v in obj]
    return obj


def _bin_header(n: int) -> bytes:
    """msgpack's header of a ``bin`` of ``n`` bytes (``Packer`` has no method for it), the smallest
    form as ``Packer.pack`` writes it."""
    if n < 1 << 8:
        return struct.pack(">BB", 0xC4, n)
    if n < 1 << 16:
        return struct.pack(">BH", 0xC5, n)
    if n < 1 << 32:
        return struct.pack(">BI", 0xC6, n)
    raise ValueError(f"a tensor file of {n} bytes is over msgpack's 4 GiB limit for one bin")


class _ChunkWriter:
    """msgpack of a nested structure as packed pieces and views of tensor memory.

    Walks the structure as ``to_wire`` then ``msgpack.packb`` would (same type tests, same order) and
    packs everything but large tensor bytes with msgpack's own ``Packer``, so the bytes agree.
    """

    def __init__(self) -> None:
        self._packer = msgpack.Packer(use_bin_type=True)
        self._pending = bytearray()
        self.chunks: list[Buffer] = []
        self.nbytes = 0
        # The envelope's first three fields are the same for every tensor.
        pack = self._packer.pack
        self._envelope_start = self._packer.pack_map_header(4) + pack(TENSOR_KEY) + pack(True) + pack("data")

    def write(self, obj: Any) -> None:
        pending = self._pending
        if isinstance(obj, torch.Tensor):
            self._tensor(obj)
        elif isinstance(obj, dict):
            pending += self._packer.pack_map_header(len(obj))
            for key, value in obj.items():
                pending += self._packer.pack(key)  # keys are never converted (as in ``to_wire``)
                self.write(value)
        elif isinstance(obj, (list, tuple)):
            pending += self._packer.pack_array_header(len(obj))
            for value in obj:
                self.write(value)
        else:
            pending += self._packer.pack(obj)

    def _tensor(self, t: torch.Tensor) -> None:
        t = t.detach()
        body = SafetensorsBody({"t": t})  # a view of ``t``'s memory; a copy only if not contiguous
        pending = self._pending
        pending += self._envelope_start
        pending += _bin_header(len(body))
        pending += body.head
        for view in body.views:
            if len(view) < COALESCE_BYTES:
                pending += view
            else:
                self._flush()
                self._add(view)
        pending += self._packer.pack("shape")
        pending += self._packer.pack(list(t.shape))
        pending += self._packer.pack("dtype")
        pending += self._packer.pack(str(t.dtype))

    def _add(self, chunk: Buffer) -> None:
        self.chunks.append(chunk)
        self.nbytes += len(chunk)

    def _flush(self) -> None:
        if self._pending:
            self._add(bytes(self._pending))
            self._pending.clear()

    def finish(self) -> tuple[list[Buffer], int]:
        self._flush()
        return self.chunks, self.nbytes


def encode_chunks(obj: Any) -> tuple[list[Buffer], int]:
    """The msgpack body of ``obj`` as ``(buffers, total length)``: ``b"".join(buffers)`` is
    ``encode(obj)``. Large tensors appear as memoryviews of their host memory (a CUDA tensor is
    copied to the host first), so the tensors must not change until the buffers are sent."""
    writer = _ChunkWriter()
    writer.write(obj)
    return writer.finish()


def _json_default(o: Any) -> Any:
    if isinstance(o, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(o)).decode("ascii")
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def encode(obj: Any, media_type: str = MSGPACK) -> bytes:
    """Serialize a nested structure (tensors allowed) as msgpack or JSON bytes."""
    if media_type == JSON:
        return json.dumps(to_wire(obj), default=_json_default, separators=(",", ":")).encode()
    return b"".join(encode_chunks(obj)[0])


# ---------------------------------------------------------------------------- decoding
def _file_bytes(env: dict[str, Any]) -> bytes | bytearray:
    data = env.get("data")
    if isinstance(data, str):
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise WireFormatError(f"tensor envelope data is not base64 ({exc})") from None
    if isinstance(data, memoryview):  # msgpack_views: a view of the answer body, not copied here
        return data.cast("B")
    if not isinstance(data, (bytes, bytearray)):
        raise WireFormatError(f"tensor envelope data is {type(data).__name__}, not bytes")
    return data


def envelope_to_tensor(
    env: dict[str, Any], alloc: Callable[[int], torch.Tensor] | None = None
) -> torch.Tensor:
    """Inverse of :func:`tensor_to_envelope`; ``data`` may be bytes, a memoryview or base64 text.

    The tensor owns new memory holding one copy of the file's data (``alloc(n)``'s n uint8 bytes when
    given, else ``torch.empty``); a file that is not exactly one well-formed tensor agreeing with the
    envelope is a :class:`WireFormatError`.
    """
    data = _file_bytes(env)
    # json reads the header from bytes; a view's header is copied alone (its tensor data is not).
    head = data if not isinstance(data, memoryview) else data[: 8 + _header_length(data)].tobytes()
    try:
        entries, _, start = parse_header(head, len(data))
    except HeaderError as exc:
        raise WireFormatError(f"tensor envelope data is not a safetensors file: {exc}") from None
    if list(entries) != ["t"]:
        raise WireFormatError(
            f"tensor envelope data must hold one tensor named 't', not {sorted(entries)[:4]}"
        )
    dtype, shape, begin, end = entries["t"]
    if begin != 0 or end != len(data) - start:
        raise WireFormatError(
            f"tensor data_offsets [{begin}, {end}] do not span the {len(data) - start} data bytes"
        )
    if env.get("shape", shape) != shape or env.get("dtype", str(dtype)) != str(dtype):
        raise WireFormatError(
            f"tensor envelope says {env.get('shape')} {env.get('dtype')}, its data holds {shape} {dtype}"
        )
    flat = alloc(end) if alloc is not None else torch.empty(end, dtype=torch.uint8)
    if end:
        copy_into(flat.numpy(), np.frombuffer(data, dtype=np.uint8, count=end, offset=start))
    if dtype is torch.bool and end and int(flat.max()) > 1:
        raise WireFormatError("a bool tensor holds bytes other than 0 and 1")
    try:
        return flat.view(dtype).reshape(shape)
    except (RuntimeError, TypeError, OverflowError):  # a zero-sized shape beyond int64 strides
        raise WireFormatError(f"tensor shape {shape[:8]} is not a valid torch shape") from None


def copy_into(dest: np.ndarray, src: np.ndarray) -> None:
    """``dest[:] = src`` for uint8 arrays of one size. A large writable source is copied by torch on
    its intra-op threads (several memory channels at once: 122 MB took 7 ms against numpy's 10 on
    the 2-core CPU VM); an immutable one (``bytes``) by numpy, which reads it without the warning
    torch gives for read-only memory."""
    if dest.nbytes >= PARALLEL_COPY_BYTES and src.flags.writeable:
        torch.from_numpy(dest).copy_(torch.from_numpy(src))
    else:
        dest[:] = src


def _header_length(data: memoryview) -> int:
    """The safetensors header length a view announces (0 when too short; ``parse_header`` says why),
    capped at what the view holds and one past the largest header allowed (so a hostile length
    copies no more than that before ``parse_header`` refuses it)."""
    if len(data) < 8:
        return 0
    return min(struct.unpack_from("<Q", data)[0], len(data) - 8, MAX_HEADER_BYTES + 1)


def _own_bins(obj: Any) -> Any:
    """Any ``bin`` left outside a tensor envelope as ``bytes`` (as ``msgpack.unpackb`` gives it), so
    nothing decoded keeps a view of the body."""
    if isinstance(obj, memoryview):
        return obj.tobytes()
    if isinstance(obj, dict):
        return {k: _own_bins(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_own_bins(v) for v in obj]
    return obj


def _from_envelope(obj: dict[str, Any]) -> Any:
    return envelope_to_tensor(obj) if obj.get(TENSOR_KEY) is True else obj


def from_wire(obj: Any) -> Any:
    """Replace every tensor envelope in an already decoded body by a torch tensor."""
    if isinstance(obj, dict):
        return _from_envelope({k: from_wire(v) for k, v in obj.items()})
    if isinstance(obj, list):
        return [from_wire(v) for v in obj]
    return obj


def decode(
    body: bytes | bytearray | memoryview,
    media_type: str = MSGPACK,
    *,
    alloc: Callable[[int], torch.Tensor] | None = None,
) -> Any:
    """Parse msgpack or JSON bytes (any buffer) and turn tensor envelopes into tensors.

    With ``alloc`` (the client's answers: ``client/receive.py``) msgpack is read by
    ``msgpack_views``, which leaves tensor data in ``body``, and each tensor is copied once, into
    ``alloc(n)``; without it, ``msgpack.unpackb`` copies each into a ``bytes`` first.
    """
    is_json = media_type.startswith(JSON)
    try:
        if is_json:
            text = body if isinstance(body, (bytes, bytearray)) else bytes(body)
            return json.loads(text, object_hook=_from_envelope)
        if alloc is not None:
            return _own_bins(
                msgpack_views.unpack(
                    body,
                    object_hook=lambda o: envelope_to_tensor(o, alloc) if o.get(TENSOR_KEY) is True else o,
                )
            )
        return msgpack.unpackb(body, raw=False, object_hook=_from_envelope)
    except WireFormatError:
        raise
    except (ValueError, msgpack.UnpackException, RecursionError) as exc:
        raise WireFormatError(f"body is not valid {'JSON' if is_json else 'msgpack'}: {exc}") from None


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
