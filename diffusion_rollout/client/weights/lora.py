"""Trainer-side LoRA: PEFT adapter state dicts and configs, the adapter push, and its verification.

Design decisions:

- **LoRA payloads are self-describing.** :func:`push_lora` sends one safetensors body whose header
  metadata carries the adapter's ``LoraConfig`` (``peft_config``), so the server wraps exactly the
  layers the trainer wrapped, with the same rank, alpha and scaling: its dynamic-mode forward is then
  the trainer's PEFT forward, bit for bit. Only the layout fields of the config travel.
- **PEFT state-dict names.** Tensors travel as ``<layer>.lora_A.weight`` / ``lora_B.weight``:
  ``base_model.model.``, the target module's prefix and the adapter name in raw
  ``named_parameters`` keys are stripped, so a ``PeftModel``, an injected module and a plain state
  dict all give the same keys.
- **Verification with the same code.** Adapter checksums use ``checksums.weights_checksum`` over
  the PEFT state-dict names that ``GET /lora`` reports, on the tensors cast to the adapter's dtype.
  A mismatch (or a missing adapter) raises :class:`ChecksumMismatchError` naming the server.
- Only the blocking :class:`RolloutClient` is accepted: pushes happen between training steps.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from diffusion_rollout.client.exceptions import ChecksumMismatchError
from diffusion_rollout.client.results import UpdateResult
from diffusion_rollout.client.weights.tensors import DTypeSpec, resolve_dtype
from diffusion_rollout.protocol.checksums import weights_checksum
from diffusion_rollout.protocol.safetensors_layout import SafetensorsBody

if TYPE_CHECKING:
    from diffusion_rollout.client.sync_client import RolloutClient

__all__ = ["lora_checksum", "lora_config_dict", "lora_state_dict", "push_lora", "verify_lora"]

# LoraConfig fields that decide which layers are wrapped and how the adapter computes.
_LORA_LAYOUT_KEYS = (
    "r", "lora_alpha", "target_modules", "exclude_modules", "lora_dropout", "fan_in_fan_out", "bias",
    "use_rslora", "use_dora", "lora_bias", "rank_pattern", "alpha_pattern", "layers_to_transform",
    "layers_pattern",
)  # fmt: skip
_PEFT_PREFIX = "base_model.model."


def _normalize_lora_key(key: str, adapter_name: str | None, target_module: str | None) -> str:
    key = key.removeprefix(_PEFT_PREFIX)
    if target_module:
        key = key.removeprefix(target_module + ".")
    if adapter_name:
        # Raw named_parameters keys carry the adapter name: "<layer>.lora_A.<adapter>.weight".
        for half in ("lora_A", "lora_B"):
            key = key.replace(f".{half}.{adapter_name}.weight", f".{half}.weight")
    return key


def lora_state_dict(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    *,
    adapter_name: str = "default",
    target_module: str | None = None,
) -> dict[str, torch.Tensor]:
    """An adapter's tensors under PEFT state-dict names (``<layer>.lora_A.weight``), detached.

    From a PEFT-wrapped module (``add_adapter``/``inject_adapter_in_model`` or a ``PeftModel``) via
    ``peft.get_peft_model_state_dict``, or from a state dict (prefixes and adapter names stripped).
    """
    if isinstance(model_or_state_dict, nn.Module):
        from peft import get_peft_model_state_dict

        raw = get_peft_model_state_dict(model_or_state_dict, adapter_name=adapter_name)
    else:
        raw = dict(model_or_state_dict)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in raw.items():
        name = _normalize_lora_key(key, adapter_name, target_module)
        if name in out:
            raise ValueError(f"two tensors map to the adapter key {name!r}")
        out[name] = tensor.detach()
    if not out:
        raise ValueError(f"no tensors for adapter {adapter_name!r}")
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return getattr(value, "value", value)  # enums


def lora_config_dict(config_or_model: Any, *, adapter_name: str = "default") -> dict[str, Any]:
    """The layout fields of a ``LoraConfig`` (or of a PEFT-wrapped model's adapter) as JSON values."""
    config = config_or_model
    if isinstance(config_or_model, nn.Module):
        configs = getattr(config_or_model, "peft_config", None)
        if not isinstance(configs, Mapping) or adapter_name not in configs:
            raise ValueError(f"the model has no PEFT adapter {adapter_name!r}")
        config = configs[adapter_name]
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return {k: _jsonable(raw[k]) for k in _LORA_LAYOUT_KEYS if raw.get(k) is not None}


def lora_checksum(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    adapter_name: str = "default",
    target_module: str | None = None,
) -> str:
    """The adapter checksum ``GET /lora`` reports, computed on the trainer's tensors cast to ``dtype``."""
    sd = lora_state_dict(model_or_state_dict, adapter_name=adapter_name, target_module=target_module)
    return weights_checksum((n, t.to(dtype) if dtype is not None else t) for n, t in sd.items())


def verify_lora(
    client: RolloutClient,
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    *,
    name: str = "default",
    adapter_name: str | None = None,
    target_module: str = "transformer",
    dtype: DTypeSpec = "server",
    server: int | None = None,
) -> str:
    """Check that every server holds adapter ``name`` with exactly the trainer's tensors."""
    cast_to = resolve_dtype(client, dtype, server=server or 0)
    if isinstance(cast_to, Mapping):
        raise ValueError("LoRA verification takes one dtype (the adapter's)")
    local = lora_checksum(
        model_or_state_dict, dtype=cast_to, adapter_name=adapter_name or name, target_module=target_module
    )
    for index in range(len(client.urls)) if server is None else [server]:
        listing = client.lora_list(server=index)
        adapters = listing.get("modules", {}).get(target_module, {}).get("adapters", {})
        if name not in adapters:
            raise ChecksumMismatchError(
                f"{client.urls[index]}: no adapter {name!r} on {target_module}", expected=local
            )
        remote = adapters[name].get("checksum")
        if remote != local:
            raise ChecksumMismatchError(
                f"{client.urls[index]}: adapter {name!r} checksum {remote} != trainer's {local}",
                expected=local,
                actual=remote,
            )
    return local


def push_lora(
    client: RolloutClient,
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    *,
    name: str = "default",
    adapter_name: str | None = None,
    peft_config: Any = None,
    target_module: str = "transformer",
    activate: bool = True,
    mode: str | None = None,
    strength: float | None = None,
    lora_alpha: float | None = None,
    weight_version: str | int | None = None,
    dtype: DTypeSpec = "server",
    verify: bool = True,
    server: int | None = None,
    timeout: float | None = None,
) -> UpdateResult:
    """Push a PEFT adapter as server adapter ``name`` (in place when it exists), optionally activate it.

    ``model_or_state_dict`` is the trainer's PEFT-wrapped module (its adapter ``adapter_name``,
    default ``name``) or an adapter state dict. The config comes from the model unless
    ``peft_config`` (a ``LoraConfig`` or dict) is given; without either the server infers it from
    the tensors (rank from ``lora_A``, alpha = ``lora_alpha`` or the rank). With ``verify`` the
    server's adapter checksum is compared with the trainer's.
    """
    adapter_name = adapter_name or name
    cast_to = resolve_dtype(client, dtype, server=server or 0)
    if isinstance(cast_to, Mapping):
        raise ValueError("a LoRA push takes one dtype (the adapter's)")
    sd = lora_state_dict(model_or_state_dict, adapter_name=adapter_name, target_module=target_module)
    tensors = {n: (t.to(cast_to) if cast_to is not None else t).cpu().contiguous() for n, t in sd.items()}
    config = None
    if peft_config is not None:
        config = lora_config_dict(peft_config)
    elif isinstance(model_or_state_dict, nn.Module):
        config = lora_config_dict(model_or_state_dict, adapter_name=adapter_name)
    metadata = {"peft_config": json.dumps(config)} if config is not None else None
    result = client.lora_load(
        name,
        data=SafetensorsBody(tensors, metadata),
        target_module=target_module,
        lora_alpha=lora_alpha,
        activate=activate,
        mode=mode,
        strength=strength,
        weight_version=weight_version,
        server=server,
        timeout=timeout,
    )
    if verify:
        verify_lora(
            client, tensors, name=name, adapter_name=adapter_name, target_module=target_module, dtype=None,
            server=server,
        )  # fmt: skip
    return result
