"""Decoding a ``torch.save`` blob of named tensors from the network, without arbitrary pickle.

Relax's ``POST /set_lora_from_tensor`` sends ``base64(torch.save(dict[str, Tensor]))``. A torch.save
file is a zip whose ``data.pkl`` is a pickle, and unpickling runs whatever callables the pickle
names, so the blob is checked before torch ever reads it:

1. **Sizes**: the base64 text, the decoded bytes and the sum of the zip's uncompressed entries are
   bounded by ``max_bytes`` (a zip bomb stops here), the pickle by ``MAX_PICKLE_BYTES``, the number
   of entries and tensors by ``max_tensors``.
2. **Opcodes**: the pickle's opcodes are scanned (``pickletools.genops``, which executes nothing).
   Only the globals a state dict of plain tensors needs are allowed: ``collections.OrderedDict``,
   ``torch._utils._rebuild_tensor_v2`` / ``_rebuild_parameter`` and the floating-point storage
   types. Opcodes that build arbitrary objects (``INST``, ``OBJ``, ``NEWOBJ*``, ``BUILD``, the
   extension registry) are refused outright; ``STACK_GLOBAL`` is accepted only when its module and
   name are the two strings pushed just before it, as picklers write them.
3. **torch's own restricted loader**: ``torch.load(weights_only=True)`` then reads it (its unpickler
   has its own allowlist), onto the CPU.
4. **Result**: a non-empty mapping of ``str`` to floating-point tensors, nothing nested.

Every refusal is a ``WeightUpdateError`` (400) that says what was refused; nothing was loaded.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickletools
import zipfile
from collections.abc import Mapping

import torch

from diffusion_rollout.errors import WeightUpdateError

MAX_PICKLE_BYTES = 64 * 2**20
_FLOAT_STORAGES = {"FloatStorage", "DoubleStorage", "HalfStorage", "BFloat16Storage"}
_ALLOWED_GLOBALS = {
    ("collections", "OrderedDict"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
} | {("torch", name) for name in _FLOAT_STORAGES}
_REFUSED_OPCODES = {"INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "BUILD", "EXT1", "EXT2", "EXT4"}
_STRING_OPCODES = {"UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "STRING", "BINSTRING", "SHORT_BINSTRING"}  # fmt: skip
_MEMO_OPCODES = {"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"}


def _refuse(message: str) -> WeightUpdateError:
    return WeightUpdateError(
        f"serialized_tensors refused, nothing changed: {message}", field="serialized_tensors"
    )


def _check_pickle(data: bytes) -> None:
    recent: list[tuple[str, object]] = []  # meaningful opcodes, memo writes skipped
    try:
        for op, arg, _pos in pickletools.genops(data):
            name = op.name
            if name in _REFUSED_OPCODES:
                raise _refuse(f"pickle opcode {name} is not allowed in a tensor payload")
            if name == "GLOBAL":
                module, _, attr = str(arg).partition(" ")
                if (module, attr) not in _ALLOWED_GLOBALS:
                    raise _refuse(f"pickle global {module}.{attr} is not allowed")
            elif name == "STACK_GLOBAL":
                if len(recent) < 2 or any(kind not in _STRING_OPCODES for kind, _ in recent[-2:]):
                    raise _refuse("pickle STACK_GLOBAL whose name was not pushed just before it")
                (_, module), (_, attr) = recent[-2:]
                if (module, attr) not in _ALLOWED_GLOBALS:
                    raise _refuse(f"pickle global {module}.{attr} is not allowed")
            if name not in _MEMO_OPCODES:
                recent = [*recent[-1:], (name, arg)]
    except WeightUpdateError:
        raise
    except Exception as exc:  # pickletools raises ValueError on malformed streams
        raise _refuse(f"malformed pickle ({exc})") from None


def decode_named_tensors(text: str, *, max_bytes: int, max_tensors: int = 100_000) -> dict[str, torch.Tensor]:
    """``base64(torch.save(dict[str, Tensor]))`` -> the dict, on the CPU (see the module docstring)."""
    if len(text) > max_bytes * 4 // 3 + 4:
        raise _refuse(
            f"{len(text)} base64 characters exceed the limit of {max_bytes} bytes (limit max_upload_bytes)"
        )
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _refuse(f"not base64 ({exc})") from None
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise _refuse("not a torch.save file (torch.save writes a zip archive)")
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        infos = archive.infolist()
        if len(infos) > 2 * max_tensors + 16:
            raise _refuse(f"the archive has {len(infos)} entries")
        total = sum(info.file_size for info in infos)
        if total > max_bytes:
            raise _refuse(
                f"the archive unpacks to {total} bytes, over the limit of {max_bytes} (max_upload_bytes)"
            )
        pickles = [
            info for info in infos if info.filename.endswith("/data.pkl") or info.filename == "data.pkl"
        ]
        if len(pickles) != 1:
            raise _refuse("the archive has no single data.pkl")
        if pickles[0].file_size > MAX_PICKLE_BYTES:
            raise _refuse(f"data.pkl is {pickles[0].file_size} bytes (limit {MAX_PICKLE_BYTES})")
        _check_pickle(archive.read(pickles[0]))
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise _refuse(f"torch.load(weights_only=True) failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, Mapping) or not obj:
        raise _refuse(f"expected a non-empty dict of tensors, got {type(obj).__name__}")
    if len(obj) > max_tensors:
        raise _refuse(f"{len(obj)} tensors (limit {max_tensors})")
    out: dict[str, torch.Tensor] = {}
    bad = []
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor) or not value.is_floating_point():
            bad.append(repr(key))
            continue
        out[key] = value.detach()
    if bad:
        raise _refuse(f"entries that are not str -> floating-point tensor: {', '.join(bad[:5])}")
    return out
