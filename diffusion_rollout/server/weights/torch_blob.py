"""Decoding a ``torch.save`` blob of named tensors from the network, without arbitrary pickle.

Relax's ``POST /set_lora_from_tensor`` sends ``base64(torch.save(dict[str, Tensor]))``. A torch.save
file is a zip whose ``data.pkl`` is a pickle, and unpickling runs whatever callables the pickle
names, so the blob goes through two layers:

1. **Sizes first** (here): the base64 text, the decoded bytes and the sum of the zip's uncompressed
   entries are bounded by ``max_bytes`` (``max_upload_bytes``), so a zip bomb is refused before
   anything is inflated; the number of entries is bounded by ``max_tensors``.
2. **The project's restricted unpickler** (``safe_pickle.decode_torch_save``, shared with the IPC
   decoder): only tensor rebuilds, dtypes, ``OrderedDict`` and storages from the archive itself
   resolve, every view is checked inside its storage, nothing else is ever called. This is
   ``torch.load(weights_only=True)``'s promise with a stricter allowlist of our own.

The result must be a non-empty mapping of ``str`` to floating-point tensors (an adapter's state
dict). Every refusal is a ``WeightUpdateError`` (400) naming ``serialized_tensors``; nothing was
loaded.
"""

from __future__ import annotations

import base64
import binascii
import io
import zipfile
from collections.abc import Mapping

import torch

from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.server.weights.safe_pickle import decode_torch_save


def _refuse(message: str) -> WeightUpdateError:
    return WeightUpdateError(
        f"serialized_tensors refused, nothing changed: {message}", field="serialized_tensors"
    )


def decode_named_tensors(text: str, *, max_bytes: int, max_tensors: int = 100_000) -> dict[str, torch.Tensor]:
    """``base64(torch.save(dict[str, Tensor]))`` -> the dict, on the CPU (see the module docstring)."""
    if len(text) > max_bytes * 4 // 3 + 4:
        raise _refuse(
            f"{len(text)} base64 characters exceed the limit of {max_bytes} bytes (max_upload_bytes)"
        )
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _refuse(f"not base64 ({exc})") from None
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, ValueError):
        raise _refuse("not a torch.save file (torch.save writes a zip archive)") from None
    if len(infos) > 2 * max_tensors + 16:
        raise _refuse(f"the archive has {len(infos)} entries")
    total = sum(info.file_size for info in infos)
    if total > max_bytes:
        raise _refuse(
            f"the archive unpacks to {total} bytes, over the limit of {max_bytes} (max_upload_bytes)"
        )
    try:
        obj = decode_torch_save(data, max_tensors=max_tensors)
    except WeightUpdateError as exc:
        raise _refuse(exc.message) from None
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
