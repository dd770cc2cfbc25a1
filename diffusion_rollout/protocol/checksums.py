"""Weight checksums shared by the server and the trainer-side client (pure torch + hashlib).

Design decisions:

- ``algorithm="sglang"`` (the default) is SGLang's diffusion ``get_weights_checksum``: one SHA-256
  over the module's *parameters* (not buffers) sorted by name, feeding for each the UTF-8 name and
  then the raw bytes of the contiguous CPU tensor. Source (facts only, re-implemented here):
  ``sglang/multimodal_gen/runtime/loader/weight_utils.py::compute_weights_checksum`` (names sorted,
  ``name.encode()``, bytes of ``t.cpu().contiguous().reshape(-1).view(torch.uint8)``), called by
  ``gpu_worker_post_training_mixin.get_weights_checksum`` on the module's parameters; SGLang's
  disk-side twin filters buffers out ("keep only named_parameters() keys").
- ``algorithm="v2"`` also feeds ``str(dtype)`` and the shape, each string followed by a NUL byte,
  so two tensors with the same bytes but a different shape or dtype hash differently and a name
  cannot run into the next field.
- ``algorithm="state_dict"`` hashes as ``"sglang"`` does, over what ``module.state_dict()`` holds:
  the parameters *and the persistent buffers*, a tied tensor under every name it has. miles'
  optional sync check hashes a trainer module's ``state_dict()`` that way, so it needs this mode to
  compare with the server (``"sglang"`` would differ on every module with a persistent buffer).
- Bytes are read through a ``uint8`` view, never a float conversion: a bf16 weight hashes its own
  two bytes per element, so equal hashes mean bit-equal weights.
- The per-tensor hash (for ``/update_weights_from_tensor_checker``) is SGLang's
  ``compute_tensor_sha256``: ``str(dtype)``, ``repr(tuple(shape))``, then the bytes.
- PEFT-wrapped layers are seen through to their base layer (``x.base_layer.weight`` is named
  ``x.weight``; adapter tensors are left out), so a module's checksum is the checksum of its base
  weights whether or not LoRA adapters are attached, and unloading an adapter restores it exactly.
  Detection is structural (a child ``base_layer`` on a module that declares ``adapter_layer_names``),
  so this file does not import peft.
- A trainer computes the same numbers on its own tensors with :func:`trainer_weights_checksum`,
  which casts each tensor with ``tensor.to(dtype)`` first: the exact cast the server applies.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import torch
from torch import nn

Algorithm = Literal["sglang", "v2", "state_dict"]
ALGORITHMS: tuple[str, ...] = ("sglang", "v2", "state_dict")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of ``tensor`` (CPU, contiguous, row-major) without any dtype conversion."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def weights_checksum(
    named_tensors: Iterable[tuple[str, torch.Tensor]], algorithm: Algorithm = "sglang"
) -> str:
    """One SHA-256 over ``(name, tensor)`` pairs sorted by name (see the module docstring)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    hasher = hashlib.sha256()
    # "state_dict" differs from "sglang" in which tensors are fed (base_state_dict), not in how.
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        hasher.update(name.encode("utf-8"))
        if algorithm == "v2":
            hasher.update(b"\0")
            hasher.update(str(tensor.dtype).encode("utf-8"))
            hasher.update(b"\0")
            hasher.update(repr(tuple(tensor.shape)).encode("utf-8"))
            hasher.update(b"\0")
        hasher.update(tensor_bytes(tensor))
    return hasher.hexdigest()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of one tensor: ``str(dtype)``, ``repr(tuple(shape))``, then its bytes."""
    hasher = hashlib.sha256()
    hasher.update(str(tensor.dtype).encode("utf-8"))
    hasher.update(repr(tuple(tensor.shape)).encode("utf-8"))
    hasher.update(tensor_bytes(tensor))
    return hasher.hexdigest()


_HASH_POOL: ThreadPoolExecutor | None = None
_HASH_POOL_LOCK = threading.Lock()


def hash_pool() -> ThreadPoolExecutor:
    """The process's threads for per-tensor SHA-256: ``hashlib`` releases the GIL while it hashes a
    large buffer, so tensors hash on several cores at once."""
    global _HASH_POOL
    with _HASH_POOL_LOCK:
        if _HASH_POOL is None:
            workers = max(1, min(8, os.cpu_count() or 1))
            _HASH_POOL = ThreadPoolExecutor(workers, thread_name_prefix="tensor-sha256")
        return _HASH_POOL


def submit_tensors_sha256(tensors: Mapping[str, torch.Tensor]) -> dict[str, Future]:
    """Start ``tensor_sha256`` of every tensor on :func:`hash_pool`; ``{name: future}``. Never call
    it from a hash-pool thread (it would wait on itself)."""
    pool = hash_pool()
    return {name: pool.submit(tensor_sha256, t) for name, t in tensors.items()}


def tensors_sha256(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{name: tensor_sha256}``, hashed in parallel (:func:`hash_pool`)."""
    return {name: f.result() for name, f in submit_tensors_sha256(tensors).items()}


def named_tensors_sha256(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """``{name: tensor_sha256}``; a repeated name is an error (the manifest would be ambiguous)."""
    out: dict[str, str] = {}
    for name, tensor in named_tensors:
        if name in out:
            raise ValueError(f"duplicate tensor name {name!r}")
        out[name] = tensor_sha256(tensor)
    return out


# ---------------------------------------------------------------------------- module views
def _is_adapter_wrapper(module: nn.Module) -> bool:
    return isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(
        module, "adapter_layer_names"
    )


def _walk(module: nn.Module, prefix: str, kind: str, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    if _is_adapter_wrapper(module):
        # The wrapper's own tensors are adapter weights; its base layer keeps the wrapper's name.
        yield from _walk(module.base_layer, prefix, kind, seen)
        return
    own = module._parameters if kind == "parameters" else module._buffers
    for name, tensor in own.items():
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        yield prefix + name, tensor
    for child_name, child in module._modules.items():
        if child is not None:
            yield from _walk(child, f"{prefix}{child_name}.", kind, seen)


def base_named_parameters(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module.named_parameters()`` with PEFT wrappers seen through to their base layers."""
    return _walk(module, "", "parameters", set())


def base_named_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module.named_buffers()`` with PEFT wrappers seen through to their base layers."""
    return _walk(module, "", "buffers", set())


def base_state_dict(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """What ``module.state_dict()`` holds (parameters and persistent buffers, tied tensors under
    each name), with PEFT wrappers seen through to their base layers."""
    if _is_adapter_wrapper(module):
        yield from base_state_dict(module.base_layer, prefix)
        return
    for name, tensor in module._parameters.items():
        if tensor is not None:
            yield prefix + name, tensor
    for name, tensor in module._buffers.items():
        if tensor is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, tensor
    for child_name, child in module._modules.items():
        if child is not None:
            yield from base_state_dict(child, f"{prefix}{child_name}.")


def module_checksum(module: nn.Module, algorithm: Algorithm = "sglang") -> str:
    """The checksum of a module's (base) parameters, or of its state dict (``"state_dict"``)."""
    if algorithm == "state_dict":
        return weights_checksum(base_state_dict(module), algorithm)
    return weights_checksum(base_named_parameters(module), algorithm)


# ---------------------------------------------------------------------------- trainer side
def cast_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype | Mapping[str, torch.dtype],
    *,
    strip_prefix: str | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Trainer tensors as the server will hold them: ``tensor.to(dtype)`` (one dtype, or per name).

    ``strip_prefix`` removes a leading ``"<module>."`` the way the server does for names such as
    ``transformer.blocks.0...``.
    """
    for name, tensor in named_tensors:
        if strip_prefix and name.startswith(strip_prefix + "."):
            name = name[len(strip_prefix) + 1 :]
        target = dtype[name] if isinstance(dtype, Mapping) else dtype
        yield name, tensor.detach().to(target)


def trainer_weights_checksum(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype | Mapping[str, torch.dtype],
    *,
    algorithm: Algorithm = "sglang",
    strip_prefix: str | None = None,
) -> str:
    """The checksum the server reports after receiving these tensors (all of the module's parameters)."""
    return weights_checksum(cast_named_tensors(named_tensors, dtype, strip_prefix=strip_prefix), algorithm)


def trainer_named_tensors_sha256(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype | Mapping[str, torch.dtype],
    *,
    strip_prefix: str | None = None,
) -> dict[str, str]:
    """The manifest for ``/update_weights_from_tensor_checker``, computed after the server's cast."""
    return named_tensors_sha256(cast_named_tensors(named_tensors, dtype, strip_prefix=strip_prefix))
