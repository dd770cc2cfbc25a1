"""Reading LoRA adapters: payload keys, configs, PEFT/diffusers folders and uploaded safetensors.

Design decisions:

- Payload keys are PEFT state-dict keys (``<layer>.lora_A.weight``, ``<layer>.lora_B.weight``), with
  an optional ``base_model.model.`` or ``"<module>."`` prefix and an optional adapter name before
  ``.weight`` (raw ``named_parameters`` keys). Anything else is reported, never skipped.
- Without a config the payload describes the adapter: exactly its layers (a full-match regex, so
  nothing else is wrapped), rank from ``lora_A``, alpha as given or equal to the rank (SGLang's
  rule); layers of another rank get ``rank_pattern``/``alpha_pattern`` entries.
- A config comes from the request, from ``adapter_config.json`` (PEFT folders), or from the
  safetensors header: ``peft_config`` (this server's upload convention, what the client sends) or
  diffusers' ``lora_adapter_metadata`` (keys prefixed ``"<module>."`` when a pipeline saved it).
  Unknown config keys are an error; provenance keys of ``LoraConfig.to_dict()`` are ignored.
- Nothing here touches a model: the manager reads off the worker thread, then applies on it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.server.weights.receive import Lease, parse_safetensors, unpooled
from diffusion_rollout.server.weights.updater import describe_names

_KEY = re.compile(r"^(?P<layer>.+?)\.(?P<kind>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight$")
_PREFIXES = ("base_model.model.",)
# LoraConfig.to_dict() keys that describe provenance, not the adapter.
_META_KEYS = {"peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping", "peft_version"}  # fmt: skip


def _lora_config_class():
    import peft

    return peft.LoraConfig


# ---------------------------------------------------------------------------- payload parsing
@dataclass
class LoraPayload:
    """LoRA tensors grouped by layer path: ``{layer: (lora_A, lora_B)}``."""

    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def layers(self) -> list[str]:
        return sorted(self.pairs)

    def ranks(self) -> dict[str, int]:
        return {layer: int(a.shape[0]) for layer, (a, _) in self.pairs.items()}


def parse_lora_tensors(named_tensors: Iterable[tuple[str, Any]], target: str) -> LoraPayload:
    """Group PEFT-style keys into complete A/B pairs; raise naming every malformed key."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    bad: list[str] = []
    twice: list[str] = []
    for key, tensor in named_tensors:
        if not isinstance(key, str) or not isinstance(tensor, torch.Tensor):
            bad.append(repr(key))
            continue
        name = key
        for prefix in (*_PREFIXES, target + "."):
            name = name.removeprefix(prefix)
        m = _KEY.match(name)
        if m is None:
            bad.append(key)
            continue
        kind = "A" if m["kind"] == "lora_A" else "B"
        slot = halves.setdefault(m["layer"], {})
        if kind in slot:
            twice.append(key)
        slot[kind] = tensor
    incomplete = sorted(layer for layer, slot in halves.items() if len(slot) != 2)
    problems = []
    if bad:
        problems.append(
            f"keys that are not '<layer>.lora_A|lora_B.weight' ({len(bad)}): {describe_names(bad)}"
        )
    if twice:
        problems.append(f"keys sent twice ({len(twice)}): {describe_names(twice)}")
    if incomplete:
        problems.append(f"layers missing lora_A or lora_B ({len(incomplete)}): {describe_names(incomplete)}")
    if problems:
        raise WeightUpdateError("LoRA payload rejected, nothing changed: " + "; ".join(problems))
    pairs = {layer: (slot["A"], slot["B"]) for layer, slot in halves.items()}
    if not pairs:
        raise WeightUpdateError(f"the LoRA payload for {target!r} holds no lora_A/lora_B tensors")
    return LoraPayload(pairs)


def lora_config_from_dict(cfg: Mapping[str, Any]) -> Any:
    """A ``LoraConfig`` from a dict (e.g. ``adapter_config.json``); unknown keys are an error."""
    LoraConfig = _lora_config_class()
    known = {f.name for f in dataclasses.fields(LoraConfig)}
    unknown = sorted(set(cfg) - known - _META_KEYS)
    if unknown:
        raise WeightUpdateError(f"unknown LoRA config keys: {', '.join(unknown)}", field="peft_config")
    kwargs = {k: v for k, v in cfg.items() if k in known and k not in _META_KEYS}
    if kwargs.get("peft_type") not in (None, "LORA"):
        raise WeightUpdateError(f"only LoRA adapters are supported, got {kwargs['peft_type']}")
    try:
        return LoraConfig(**kwargs)
    except Exception as exc:
        raise WeightUpdateError(f"invalid LoRA config: {exc}", field="peft_config") from exc


def inferred_lora_config(payload: LoraPayload, lora_alpha: float | None = None) -> Any:
    """The config that wraps exactly the payload's layers: rank from ``lora_A``, alpha or rank."""
    LoraConfig = _lora_config_class()
    ranks = payload.ranks()
    r = max(set(ranks.values()), key=lambda v: (list(ranks.values()).count(v), -v))
    alpha = float(lora_alpha) if lora_alpha is not None else None
    # Pattern keys match a layer path or a ".path" suffix; the full path names exactly one layer.
    rank_pattern = {re.escape(layer): v for layer, v in ranks.items() if v != r}
    alpha_pattern = {}
    if alpha is None:
        alpha_pattern = {re.escape(layer): v for layer, v in ranks.items() if v != r}
    regex = "^(" + "|".join(re.escape(layer) for layer in payload.layers) + ")$"
    return LoraConfig(
        r=r,
        lora_alpha=alpha if alpha is not None else r,
        target_modules=regex,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        lora_dropout=0.0,
    )


# ---------------------------------------------------------------------------- reading adapters
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"
DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"
UPLOAD_METADATA_KEY = "peft_config"


def _config_from_metadata(metadata: Mapping[str, str] | None, target: str) -> dict[str, Any] | None:
    """The LoRA config stored in a safetensors header, if any.

    ``peft_config`` (this server's upload convention) or diffusers' ``lora_adapter_metadata``; the
    latter's keys carry a ``"<module>."`` prefix when a whole pipeline's LoRA was saved.
    """
    if not metadata:
        return None
    raw = metadata.get(UPLOAD_METADATA_KEY) or metadata.get(DIFFUSERS_METADATA_KEY)
    if raw is None:
        return None
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise WeightUpdateError(f"the LoRA config in the safetensors metadata is not JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise WeightUpdateError("the LoRA config in the safetensors metadata is not an object")
    prefixed = {k[len(target) + 1 :]: v for k, v in cfg.items() if k.startswith(target + ".")}
    return prefixed or cfg


def read_lora_bytes(
    data: bytes | Lease, target: str
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any] | None]:
    """An uploaded safetensors body -> tensors and the config from its metadata (if any).

    ``data`` may be a receive buffer (``receive.py``): the tensors are then views into it.
    """
    lease = data if isinstance(data, Lease) else unpooled(data)
    tensors, metadata = parse_safetensors(lease)
    return list(tensors.items()), _config_from_metadata(metadata or None, target)


def read_lora_path(path: str, target: str) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any] | None]:
    """A PEFT folder, a diffusers LoRA folder or a ``.safetensors`` file -> tensors and config."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    p = Path(path)
    config = None
    if p.is_file():
        weights = p
    elif p.is_dir():
        if (p / PEFT_WEIGHTS).is_file():
            weights = p / PEFT_WEIGHTS
        elif (p / DIFFUSERS_WEIGHTS).is_file():
            weights = p / DIFFUSERS_WEIGHTS
        else:
            found = sorted(p.glob("*.safetensors"))
            if len(found) != 1:
                raise WeightUpdateError(
                    f"{path} holds {len(found)} .safetensors files; expected {PEFT_WEIGHTS}, "
                    f"{DIFFUSERS_WEIGHTS} or exactly one file",
                    field="path",
                )
            weights = found[0]
        if (p / PEFT_CONFIG).is_file():
            try:
                config = json.loads((p / PEFT_CONFIG).read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise WeightUpdateError(f"cannot read {p / PEFT_CONFIG}: {exc}", field="path") from exc
    else:
        raise WeightUpdateError(f"no LoRA file or folder at {path!r} on this server", field="path")
    try:
        tensors = load_file(str(weights))
        with safe_open(str(weights), framework="pt") as f:
            metadata = f.metadata()
    except (SafetensorError, OSError) as exc:
        raise WeightUpdateError(f"cannot read {weights}: {exc}", field="path") from exc
    if config is None:
        config = _config_from_metadata(metadata, target)
    return list(tensors.items()), config
