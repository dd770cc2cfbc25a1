"""Named tensors, dtype casts and the per-tensor hash check shared by every trainer-side push path.

Design decisions:

- **Cast once, on the trainer.** Tensors are cast to the dtype the server holds (``dtype="server"``
  asks ``/model_info`` once) with ``tensor.to(dtype)``, the very cast the server would apply. That
  halves the bytes of a float32 master pushed to a bf16 server, and the hashes computed on the
  trainer are then hashes of exactly what the server stores. Models that keep some parameters in
  float32 (diffusers' ``_keep_in_fp32_modules``, e.g. Wan) take a ``{name: dtype}`` mapping.
- **One notion of "named tensors".** A state dict, an iterator of ``(name, tensor)`` (e.g.
  FSDP-gathered shards, consumed lazily) or a module; a module is seen through PEFT wrappers to its
  base weights, so a full push never carries adapters.
- **Verification with the server's checker.** :func:`_check_manifest` sends per-tensor SHA-256
  (``checksums.tensor_sha256``) to ``/update_weights_from_tensor_checker`` on every target server
  and turns a refusal into :class:`ChecksumMismatchError` naming the server.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from diffusion_rollout.client.exceptions import ChecksumMismatchError, ServerWeightUpdateError
from diffusion_rollout.protocol.checksums import base_named_parameters

if TYPE_CHECKING:
    from diffusion_rollout.client.sync_client import RolloutClient

__all__ = ["DTypeSpec", "NamedTensors", "resolve_dtype"]

DTypeSpec = torch.dtype | Mapping[str, torch.dtype] | Literal["server"] | None
NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | nn.Module


def _parse_dtype(name: str) -> torch.dtype:
    candidate = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(candidate, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return candidate


def resolve_dtype(
    client: RolloutClient, dtype: DTypeSpec, *, server: int = 0
) -> torch.dtype | Mapping | None:
    """``"server"`` -> the server's model dtype (``/model_info``); anything else as given."""
    if isinstance(dtype, str):
        if dtype != "server":
            return _parse_dtype(dtype)
        return _parse_dtype(client.model_info(server=server)["dtype"])
    return dtype


def _named(tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tensors, nn.Module):
        # PEFT wrappers seen through to the base weights: a full push never carries adapters.
        return base_named_parameters(tensors)
    if isinstance(tensors, Mapping):
        return iter(tensors.items())
    return iter(tensors)


def _cast(name: str, tensor: torch.Tensor, dtype: torch.dtype | Mapping | None) -> torch.Tensor:
    t = tensor.detach()
    target = dtype.get(name, t.dtype) if isinstance(dtype, Mapping) else dtype or t.dtype
    return t.to(target)


def _check_manifest(
    client: RolloutClient, target_module: str, manifest: Mapping[str, str], server: int | None
) -> None:
    for index in range(len(client.urls)) if server is None else [server]:
        try:
            client.check_weights(target_module, manifest, server=index)
        except ServerWeightUpdateError as exc:
            raise ChecksumMismatchError(
                f"{client.urls[index]}: {target_module} does not hold the pushed tensors: {exc.message}"
            ) from exc
