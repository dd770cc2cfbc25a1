"""msgpack decoding that leaves ``bin`` payloads in the body: they come back as memoryviews of it.

Why not ``msgpack.unpackb``: it copies every ``bin`` into a new ``bytes``. A video
answer's tensors are hundreds of MB of ``bin``; each copy lands in fresh memory, which the kernel
faults in page by page. On the 2-core CPU VM decoding a 120 MB answer took 108-520 ms, most of it
those page faults, against about 10 ms for one copy into memory already touched. The client reads
an answer into one buffer (``client/receive.py``); with this reader each tensor is copied once,
from that buffer into its own memory (``wire.envelope_to_tensor``).

It reads what ``msgpack.unpackb(body, raw=False)`` reads, with the same results except that a
``bin`` is a memoryview: nil, booleans, integers, floats, UTF-8 strings, bin, arrays and maps whose
keys are strings or bytes (``strict_map_key``). Ext types, bytes after the object, truncated input
and nesting deeper than :data:`MAX_DEPTH` are ``ValueError``. The server, which decodes small
requests, keeps ``msgpack.unpackb``; this is the client's path for the large answers.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

MAX_DEPTH = 200  # answers nest a few levels; deep input must not exhaust the interpreter stack

_FIXED = {  # type byte -> (struct format, size) of a scalar
    0xCA: (">f", 4),
    0xCB: (">d", 8),
    0xCC: (">B", 1),
    0xCD: (">H", 2),
    0xCE: (">I", 4),
    0xCF: (">Q", 8),
    0xD0: (">b", 1),
    0xD1: (">h", 2),
    0xD2: (">i", 4),
    0xD3: (">q", 8),
}
_LENGTH = {  # type byte -> (kind, struct format of its length, size of the length)
    0xC4: ("bin", ">B", 1),
    0xC5: ("bin", ">H", 2),
    0xC6: ("bin", ">I", 4),
    0xD9: ("str", ">B", 1),
    0xDA: ("str", ">H", 2),
    0xDB: ("str", ">I", 4),
    0xDC: ("array", ">H", 2),
    0xDD: ("array", ">I", 4),
    0xDE: ("map", ">H", 2),
    0xDF: ("map", ">I", 4),
}


class _Reader:
    def __init__(self, body: memoryview, object_hook: Callable[[dict], Any] | None) -> None:
        self.body = body
        self.pos = 0
        self.hook = object_hook

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.body):
            raise ValueError(f"truncated msgpack: {n} bytes wanted at offset {self.pos} of {len(self.body)}")
        view = self.body[self.pos : end]
        self.pos = end
        return view

    def read(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"msgpack nested deeper than {MAX_DEPTH}")
        b = self.take(1)[0]
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0x80 <= b <= 0x8F:
            return self.map(b & 0x0F, depth)
        if 0x90 <= b <= 0x9F:
            return self.array(b & 0x0F, depth)
        if 0xA0 <= b <= 0xBF:
            return self.text(b & 0x1F)
        if b == 0xC0:
            return None
        if b in (0xC2, 0xC3):
            return b == 0xC3
        if b in _FIXED:
            fmt, size = _FIXED[b]
            return struct.unpack(fmt, self.take(size))[0]
        if b in _LENGTH:
            kind, fmt, size = _LENGTH[b]
            (n,) = struct.unpack(fmt, self.take(size))
            if kind == "bin":
                return self.take(n)
            if kind == "str":
                return self.text(n)
            return self.array(n, depth) if kind == "array" else self.map(n, depth)
        raise ValueError(f"unsupported msgpack type byte 0x{b:02x} at offset {self.pos - 1}")

    def text(self, n: int) -> str:
        return str(self.take(n), "utf-8")

    def array(self, n: int, depth: int) -> list[Any]:
        return [self.read(depth + 1) for _ in range(n)]

    def map(self, n: int, depth: int) -> Any:
        out: dict[Any, Any] = {}
        for _ in range(n):
            key = self.read(depth + 1)
            if isinstance(key, memoryview):
                key = key.tobytes()
            elif not isinstance(key, str):
                raise ValueError(f"msgpack map key of type {type(key).__name__} (strings or bytes only)")
            out[key] = self.read(depth + 1)
        return self.hook(out) if self.hook is not None else out


def unpack(body: bytes | bytearray | memoryview, object_hook: Callable[[dict], Any] | None = None) -> Any:
    """The one object in ``body``; each ``bin`` a memoryview of ``body`` (which must outlive them)."""
    reader = _Reader(memoryview(body).cast("B"), object_hook)
    obj = reader.read(0)
    if reader.pos != len(reader.body):
        raise ValueError(f"{len(reader.body) - reader.pos} bytes after the msgpack object")
    return obj
