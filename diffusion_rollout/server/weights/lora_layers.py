"""The PEFT layer structure LoRA adapters live in, and the records ``LoraManager`` keeps of them.

- :func:`tuner_layers` and :func:`canonical_module_paths` read a module's structure through PEFT's
  wrappers (a wrapped layer keeps the path the unwrapped model gives it).
- :class:`AdapterRecord` is one named adapter (config, layers, strength); its ``layout`` decides
  whether a reload can copy in place or must re-inject. :class:`TargetState` is a module's adapters,
  which one is active, the mode, and the exact base copies kept while merged.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

Mode = Literal["dynamic", "merged"]
MODES = ("dynamic", "merged")

_TARGETING_FIELDS = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")
_LAYOUT_FIELDS = ("r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora", "use_dora", "lora_bias", "fan_in_fan_out")  # fmt: skip


def peft_classes():
    import peft
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import check_target_module_exists

    return peft, LoraLayer, check_target_module_exists


# ---------------------------------------------------------------------------- module structure
def tuner_layers(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(path, LoraLayer)`` for every PEFT LoRA layer in ``module``."""
    _, LoraLayer, _ = peft_classes()
    for path, sub in module.named_modules():
        if isinstance(sub, LoraLayer):
            yield path, sub


def canonical_module_paths(module: nn.Module) -> dict[str, nn.Module]:
    """Paths of ``module``'s submodules as an unwrapped model names them (wrappers at their path)."""
    out: dict[str, nn.Module] = {}

    def walk(mod: nn.Module, prefix: str) -> None:
        for name, child in mod._modules.items():
            if child is None:
                continue
            path = prefix + name
            out[path] = child
            base = getattr(child, "base_layer", None)
            if isinstance(base, nn.Module) and hasattr(child, "adapter_layer_names"):
                walk(base, path + ".")
            else:
                walk(child, path + ".")

    walk(module, "")
    return out


def base_layer_of(layer: nn.Module) -> nn.Module:
    return layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer


def expected_lora_shapes(base: nn.Module, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(lora_A, lora_B)`` weight shapes PEFT creates for a plain Linear; None for other layers."""
    if isinstance(base, nn.Linear):
        return (rank, base.in_features), (base.out_features, rank)
    return None


# ---------------------------------------------------------------------------- state
@dataclass
class AdapterRecord:
    name: str
    config: Any
    layers: tuple[str, ...]
    source: str | None
    strength: float = 1.0
    loads: int = 1

    def layout(self) -> tuple:
        return (self.layers, *(_freeze(getattr(self.config, f)) for f in _LAYOUT_FIELDS))


def config_key(config: Any) -> tuple:
    """What decides which layers a config wraps and how: equal keys wrap the same way."""
    return tuple(_freeze(getattr(config, f, None)) for f in (*_LAYOUT_FIELDS, *_TARGETING_FIELDS))


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, set, tuple)):
        return tuple(sorted(map(str, value)))
    return value


@dataclass
class TargetState:
    adapters: dict[str, AdapterRecord] = field(default_factory=dict)
    active: str | None = None
    mode: Mode = "dynamic"
    merge_dtype: torch.dtype | None = None
    merged_copies: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def merged(self) -> bool:
        return bool(self.merged_copies)
