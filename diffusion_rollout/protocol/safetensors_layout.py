"""The safetensors byte layout, written by the client and read by the server without copying tensors.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``) and the
tensor bytes. ``safetensors.torch.save`` builds the whole file as one ``bytes`` (every tensor
copied, twice for a multi-GB push), and ``load`` copies every tensor out again. Here:

- :class:`SafetensorsBody` (trainer side) is the header plus memoryviews of the tensors' own
  memory, sent in slices: nothing is copied before the socket. Tensors are laid out largest element
  first, then by name (as ``safetensors`` does), so every entry is aligned to its element size and
  the receiver can view it in place. ``bytes(body)`` is a file ``safetensors.torch.load`` reads.
- :func:`parse_header` (server side) checks a header completely before anything is viewed.

Shared by the client and the server (the client imports nothing from ``server``) so the two sides
cannot drift.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from collections.abc import Iterator, Mapping

import torch

# safetensors dtype names <-> torch dtypes (those torch has).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
SAFETENSORS_DTYPE = {v: k for k, v in DTYPES.items()}

# A header larger than this is not a weight file (safetensors' own reader caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000

Entry = tuple[torch.dtype, list[int], int, int]  # dtype, shape, begin, end (in the data section)


class HeaderError(ValueError):
    """A malformed safetensors header (the caller turns it into its own error)."""


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


# ---------------------------------------------------------------------------- writing
class SafetensorsBody:
    """A safetensors file made of a header and views of the tensors' memory (no copy until sent).

    ``head`` is the length prefix and the padded JSON header (bytes); ``views`` the tensors' bytes in
    file order, one flat uint8 memoryview per non-empty tensor. For one tensor without metadata the
    file is byte for byte what ``safetensors.torch.save`` writes (the wire codec relies on it).
    """

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
    ) -> None:
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        self.views: list[memoryview] = []
        offset = 0
        ordered = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
        for name, tensor in ordered:
            if tensor.dtype not in SAFETENSORS_DTYPE:
                raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot hold")
            t = tensor.detach().cpu().contiguous()
            size = t.numel() * t.element_size()
            header[name] = {
                "dtype": SAFETENSORS_DTYPE[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + size],
            }
            if size:
                # The numpy array keeps ``t`` alive for as long as the view exists.
                self.views.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % 8)  # tensor data starts 8-byte aligned
        self.head = struct.pack("<Q", len(raw)) + raw
        self.names = [name for name, _ in ordered]
        self.nbytes = len(self.head) + offset

    def __len__(self) -> int:
        return self.nbytes

    def slices(self, size: int) -> Iterator[memoryview | bytes]:
        """The body in pieces of at most ``size`` bytes (views, not copies)."""
        yield self.head
        for view in self.views:
            for start in range(0, len(view), size):
                yield view[start : start + size]

    def __bytes__(self) -> bytes:
        return b"".join(itertools.chain([self.head], self.views))


# ---------------------------------------------------------------------------- reading
def parse_header(head: bytes, total: int) -> tuple[dict[str, Entry], dict[str, str], int]:
    """Check a header; ``({name: (dtype, shape, begin, end)}, metadata, data start)``.

    ``head`` holds at least the first ``8 + header length`` bytes of a body of ``total`` bytes
    (a :class:`HeaderError` says what is wrong otherwise).
    """
    if total < 8 or len(head) < 8:
        raise HeaderError("shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", head[:8])
    if header_len > MAX_HEADER_BYTES or 8 + header_len > total or 8 + header_len > len(head):
        raise HeaderError(f"header length {header_len} does not fit")
    try:
        header = json.loads(head[8 : 8 + header_len])
    except (UnicodeDecodeError, ValueError) as exc:
        raise HeaderError(f"header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise HeaderError("header is not a JSON object")
    start = 8 + header_len
    data_len = total - start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise HeaderError("__metadata__ must map names to strings")
    entries: dict[str, Entry] = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            raise HeaderError(f"entry {name!r} is not an object")
        dtype = DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
        shape = info.get("shape")
        offsets = info.get("data_offsets")
        if dtype is None:
            raise HeaderError(f"entry {name!r} has an unknown dtype {info.get('dtype')!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise HeaderError(f"entry {name!r} has an invalid shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_len
        ):
            raise HeaderError(f"entry {name!r} has offsets {offsets!r} outside the {data_len} data bytes")
        size = math.prod(shape) * itemsize(dtype)
        if offsets[1] - offsets[0] != size:
            raise HeaderError(f"entry {name!r} spans {offsets[1] - offsets[0]} bytes, its shape needs {size}")
        entries[name] = (dtype, shape, offsets[0], offsets[1])
    spans = sorted((b, e, n) for n, (_, _, b, e) in entries.items() if e > b)
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise HeaderError(f"entries {first!r} and {second!r} overlap")
    return entries, metadata, start
