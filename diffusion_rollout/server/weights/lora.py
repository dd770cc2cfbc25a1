"""Named LoRA adapters on pipeline modules, with PEFT: load, reload in place, activate, merge, unload.

Design decisions:

- Adapters are real PEFT LoRA layers injected with ``peft.inject_adapter_in_model`` (the function
  diffusers' ``add_adapter`` uses), so the ``dynamic`` forward *is* PEFT's forward: outputs are bit
  for bit those of a PEFT-wrapped model holding the same adapter. Several adapters live side by side
  (DiffusionNFT's ``default`` policy and its EMA ``old``); one, or none, is active per module.
- Payload keys are PEFT state-dict keys (``<layer>.lora_A.weight``, ``<layer>.lora_B.weight``), with
  an optional ``base_model.model.`` or ``"<module>."`` prefix and an optional adapter name before
  ``.weight`` (raw ``named_parameters`` keys). Without a config the adapter is described by the
  payload: the exact layers present (a full-match regex, so nothing else is wrapped), rank from
  ``lora_A``, alpha as given or equal to the rank (SGLang's rule). With a config, the layers it
  targets must be exactly the layers in the payload.
- Everything is validated before anything changes: every key parses, every layer exists, pairs
  are complete, shapes fit the base layer, values are finite. A payload that binds no layer is an
  error, never a silent no-op. A new adapter that fails after injection is removed again.
- Reloading an existing name with the same layout copies the tensors into the existing LoRA
  weights in place (no re-wrap, no new modules); a different layout (rank, layers, alpha) re-injects.
- ``merged`` mode folds the active adapter into the base weights (``W + delta`` in the parameter
  dtype unless a merge dtype is asked for) after keeping an exact copy of every touched base weight;
  unmerge, switching adapters, reloading and full weight updates restore the base from that copy,
  never by subtraction, so unmerge gives back the original checksum bit for bit. While merged, PEFT
  sees the layer as merged and runs the base layer only. DoRA and LoRA biases are not merged.
- Unloading the last adapter of a layer puts the original base layer object back in its parent, so
  module structure, parameter names and checksums return to exactly what they were.
- This class does no locking and no versioning: the manager calls it on the engine's worker thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from diffusion_rollout.checksums import weights_checksum
from diffusion_rollout.errors import NotFoundError, WeightApplyError, WeightUpdateError
from diffusion_rollout.server.weights.updater import PlannedCopy, apply_copies, describe_names

logger = logging.getLogger(__name__)

Mode = Literal["dynamic", "merged"]
MODES = ("dynamic", "merged")

_KEY = re.compile(r"^(?P<layer>.+?)\.(?P<kind>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight$")
_PREFIXES = ("base_model.model.",)
# LoraConfig.to_dict() keys that describe provenance, not the adapter.
_META_KEYS = {"peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping", "peft_version"}  # fmt: skip
_LAYOUT_FIELDS = ("r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora", "use_dora", "lora_bias", "fan_in_fan_out")  # fmt: skip


def _peft():
    import peft
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import check_target_module_exists

    return peft, LoraLayer, check_target_module_exists


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
    peft, _, _ = _peft()
    known = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    unknown = sorted(set(cfg) - known - _META_KEYS)
    if unknown:
        raise WeightUpdateError(f"unknown LoRA config keys: {', '.join(unknown)}", field="peft_config")
    kwargs = {k: v for k, v in cfg.items() if k in known and k not in _META_KEYS}
    if kwargs.get("peft_type") not in (None, "LORA"):
        raise WeightUpdateError(f"only LoRA adapters are supported, got {kwargs['peft_type']}")
    try:
        return peft.LoraConfig(**kwargs)
    except Exception as exc:
        raise WeightUpdateError(f"invalid LoRA config: {exc}", field="peft_config") from exc


def inferred_lora_config(payload: LoraPayload, lora_alpha: float | None = None) -> Any:
    """The config that wraps exactly the payload's layers: rank from ``lora_A``, alpha or rank."""
    peft, _, _ = _peft()
    ranks = payload.ranks()
    r = max(set(ranks.values()), key=lambda v: (list(ranks.values()).count(v), -v))
    alpha = float(lora_alpha) if lora_alpha is not None else None
    # Pattern keys match a layer path or a ".path" suffix; the full path names exactly one layer.
    rank_pattern = {re.escape(layer): v for layer, v in ranks.items() if v != r}
    alpha_pattern = {}
    if alpha is None:
        alpha_pattern = {re.escape(layer): v for layer, v in ranks.items() if v != r}
    regex = "^(" + "|".join(re.escape(layer) for layer in payload.layers) + ")$"
    return peft.LoraConfig(
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


def read_lora_bytes(data: bytes, target: str) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any] | None]:
    """An uploaded safetensors body -> tensors and the config from its metadata (if any)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if not data:
        raise WeightUpdateError("the request body is empty; send safetensors bytes")
    try:
        tensors = load(data)
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len])
    except (SafetensorError, ValueError, OSError) as exc:
        raise WeightUpdateError(
            f"the body ({len(data)} bytes) is not a valid safetensors file: {exc}"
        ) from exc
    return list(tensors.items()), _config_from_metadata(header.get("__metadata__"), target)


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


# ---------------------------------------------------------------------------- module structure
def tuner_layers(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(path, LoraLayer)`` for every PEFT LoRA layer in ``module``."""
    _, LoraLayer, _ = _peft()
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


def _base(layer: nn.Module) -> nn.Module:
    return layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer


def _expected_shapes(base: nn.Module, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
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


class LoraManager:
    """LoRA state of every pipeline module that has (had) adapters."""

    def __init__(self) -> None:
        self.targets: dict[str, TargetState] = {}

    def state(self, target: str) -> TargetState:
        return self.targets.setdefault(target, TargetState())

    def has_adapters(self, target: str) -> bool:
        return bool(self.targets.get(target) and self.targets[target].adapters)

    def kept_tensors(self) -> list[torch.Tensor]:
        """Exact base copies of merged layers (they move with the model on memory release)."""
        return [t for s in self.targets.values() for t in s.merged_copies.values()]

    # ------------------------------------------------------------------ load
    def load(
        self,
        target: str,
        module: nn.Module,
        name: str,
        payload: LoraPayload,
        *,
        config: Any | None = None,
        lora_alpha: float | None = None,
        source: str | None = None,
    ) -> tuple[AdapterRecord, bool]:
        """Load or reload adapter ``name``; returns the record and whether it was reloaded in place."""
        if not name or not isinstance(name, str):
            raise WeightUpdateError("an adapter needs a non-empty name", field="name")
        state = self.state(target)
        try:
            config = config if config is not None else inferred_lora_config(payload, lora_alpha)
            layers = self._validate(target, module, payload, config)
        except Exception:
            if not state.adapters:
                self.targets.pop(target, None)
            raise
        new_record = AdapterRecord(name, config, tuple(layers), source)
        old = state.adapters.get(name)
        in_place = old is not None and old.layout() == new_record.layout()
        # Only the merged adapter's own deltas, or a change of module structure, need the exact base.
        needs_base = not in_place or (state.merged and state.active == name)
        with self.merge_suspended(target, module) if needs_base else _nothing():
            if in_place:
                self._copy_into(module, name, payload)
                old.loads += 1
                old.source = source
                record = old
            else:
                if old is not None:
                    # Validated above, so injection failing now is unexpected; the old layout is gone then.
                    logger.info("adapter %r on %s changes layout; re-injecting it", name, target)
                    self._remove(module, state, name)
                    new_record.loads = old.loads + 1
                self._inject(target, module, name, payload, config, layers)
                record = new_record
                state.adapters[name] = record
                if old is not None and old.strength != 1.0:
                    self._set_strength(module, record, old.strength)
                self._apply_activation(module, state)
        return record, in_place

    def _validate(self, target: str, module: nn.Module, payload: LoraPayload, config: Any) -> list[str]:
        _, _, check_target = _peft()
        paths = canonical_module_paths(module)
        unknown = [layer for layer in payload.layers if layer not in paths]
        if len(unknown) == len(payload.layers):
            raise WeightUpdateError(
                f"the LoRA payload binds no layer of {target!r} ({len(unknown)} layers, e.g. "
                f"{describe_names(unknown, 3)}); check the key names and the target module",
                field="target_module",
            )
        problems = []
        if unknown:
            problems.append(f"layers not in {target} ({len(unknown)}): {describe_names(unknown)}")
        wrapped = sorted(p for p, sub in paths.items() if _is_wrappable(sub) and check_target(config, p))
        not_sent = sorted(set(wrapped) - set(payload.layers))
        not_targeted = sorted(set(payload.layers) - set(wrapped) - set(unknown))
        if not_sent:
            problems.append(
                f"layers the config targets but the payload lacks ({len(not_sent)}): {describe_names(not_sent)}"
            )
        if not_targeted:
            problems.append(
                f"layers in the payload the config does not target ({len(not_targeted)}): {describe_names(not_targeted)}"
            )
        shape_bad, value_bad = [], []
        for layer, (a, b) in payload.pairs.items():
            if layer in unknown:
                continue
            rank = int(a.shape[0]) if a.dim() >= 1 else -1
            expected = _expected_shapes(_base(paths[layer]), rank)
            ok = a.dim() >= 2 and b.dim() >= 2 and b.shape[1] == rank
            if expected is not None:
                ok = ok and tuple(a.shape) == expected[0] and tuple(b.shape) == expected[1]
            if not ok:
                shape_bad.append(f"{layer}: A {tuple(a.shape)}, B {tuple(b.shape)}")
            elif not (a.is_floating_point() and b.is_floating_point()) or not (
                bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())
            ):
                value_bad.append(layer)
        if shape_bad:
            problems.append(
                f"shapes that do not fit the layer ({len(shape_bad)}): {describe_names(shape_bad)}"
            )
        if value_bad:
            problems.append(
                f"non-float or non-finite tensors ({len(value_bad)}): {describe_names(value_bad)}"
            )
        if problems:
            raise WeightUpdateError("LoRA payload rejected, nothing changed: " + "; ".join(problems))
        return wrapped

    def _inject(self, target, module, name, payload, config, layers) -> None:
        peft, _, _ = _peft()
        was_training = module.training
        try:
            with warnings.catch_warnings():
                # PEFT warns when a module already carries a peft_config; several adapters is the point.
                warnings.simplefilter("ignore")
                peft.inject_adapter_in_model(config, module, adapter_name=name)
            got = sorted(p for p, layer in tuner_layers(module) if name in layer.lora_A)
            if got != sorted(layers):
                raise WeightUpdateError(
                    f"PEFT wrapped {len(got)} layers for adapter {name!r} but the payload has {len(layers)}"
                )
            for _, layer in tuner_layers(module):
                layer.train(was_training)
            self._copy_into(module, name, payload)
        except Exception:
            self._remove(module, self.state(target), name, forget=False)
            raise

    def _copy_into(self, module: nn.Module, name: str, payload: LoraPayload) -> None:
        copies = []
        shape_bad = []
        for layer_path, (a, b) in payload.pairs.items():
            layer = module.get_submodule(layer_path)
            for half, src in (("lora_A", a), ("lora_B", b)):
                dst = getattr(layer, half)[name].weight
                if tuple(dst.shape) != tuple(src.shape):
                    shape_bad.append(
                        f"{layer_path}.{half}: got {tuple(src.shape)}, expected {tuple(dst.shape)}"
                    )
                    continue
                copies.append(PlannedCopy("lora", f"{layer_path}.{half}", dst, src.detach().to(dst.dtype)))
        if shape_bad:
            raise WeightUpdateError(f"LoRA shapes do not match adapter {name!r}: {describe_names(shape_bad)}")
        apply_copies(copies)

    # ------------------------------------------------------------------ activation and modes
    def activate(
        self,
        target: str,
        module: nn.Module,
        name: str | None,
        *,
        mode: Mode | None = None,
        strength: float | None = None,
        merge_dtype: torch.dtype | None = None,
    ) -> None:
        state = self.state(target)
        if name is not None and name not in state.adapters:
            raise NotFoundError(
                f"no LoRA adapter {name!r} on {target}; loaded: {', '.join(state.adapters) or 'none'}"
            )
        if mode is not None and mode not in MODES:
            raise WeightUpdateError(f"mode must be one of {MODES}, got {mode!r}", field="mode")
        if strength is not None and not (math.isfinite(strength)):
            raise WeightUpdateError("strength must be finite", field="strength")
        new_mode = mode or state.mode
        if new_mode == "merged" and name is not None:
            self._check_mergeable(state.adapters[name])
        self._unmerge(module, state)
        state.active = name
        state.mode = new_mode
        if merge_dtype is not None:
            state.merge_dtype = merge_dtype
        if name is not None and strength is not None:
            self._set_strength(module, state.adapters[name], strength)
        self._apply_activation(module, state)
        self._merge(module, state)

    def set_mode(
        self, target: str, module: nn.Module, mode: Mode, merge_dtype: torch.dtype | None = None
    ) -> None:
        state = self.state(target)
        self.activate(target, module, state.active, mode=mode, merge_dtype=merge_dtype)

    def _check_mergeable(self, record: AdapterRecord) -> None:
        cfg = record.config
        if getattr(cfg, "use_dora", False) or getattr(cfg, "lora_bias", False):
            raise WeightUpdateError(
                f"adapter {record.name!r} uses DoRA or LoRA biases, which merged mode does not fold; use dynamic",
                field="mode",
            )

    def _set_strength(self, module: nn.Module, record: AdapterRecord, strength: float) -> None:
        if strength == record.strength:
            return
        for _, layer in tuner_layers(module):
            layer.set_scale(record.name, float(strength))
        record.strength = float(strength)

    def _apply_activation(self, module: nn.Module, state: TargetState) -> None:
        for _, layer in tuner_layers(module):
            if state.active is None:
                layer.enable_adapters(False)
            else:
                layer.enable_adapters(True)
                # A layer without the active adapter runs its base layer only (PEFT skips the name).
                layer.set_adapter(state.active, inference_mode=True)

    def _merge(self, module: nn.Module, state: TargetState) -> None:
        if state.mode != "merged" or state.active is None or state.merged:
            return
        name = state.active
        self._check_mergeable(state.adapters[name])
        layers = [(p, layer) for p, layer in tuner_layers(module) if name in layer.lora_A]
        copies: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            try:
                for path, layer in layers:
                    copies[path] = _base(layer).weight.detach().clone()
                for _, layer in layers:
                    weight = _base(layer).weight
                    dtype = state.merge_dtype or weight.dtype
                    delta = layer.get_delta_weight(name)
                    weight.data.copy_((weight.to(dtype) + delta.to(dtype)).to(weight.dtype))
                    layer.merged_adapters = [name]
            except Exception as exc:
                for path, layer in layers:
                    if path in copies:
                        _base(layer).weight.data.copy_(copies[path])
                    layer.merged_adapters = []
                raise WeightApplyError(
                    f"merging adapter {name!r} failed ({exc}); base weights restored"
                ) from exc
        state.merged_copies = copies

    def _unmerge(self, module: nn.Module, state: TargetState) -> None:
        if not state.merged:
            return
        with torch.no_grad():
            for path, saved in state.merged_copies.items():
                layer = module.get_submodule(path)
                _base(layer).weight.data.copy_(saved)
                layer.merged_adapters = []
        state.merged_copies = {}

    @contextmanager
    def merge_suspended(self, target: str, module: nn.Module):
        """Exact base weights inside (for full updates and reloads); re-merged afterwards."""
        state = self.targets.get(target)
        if state is None or not state.merged:
            yield
            return
        self._unmerge(module, state)
        try:
            yield
        finally:
            self._merge(module, state)

    # ------------------------------------------------------------------ unload
    def unload(self, target: str, module: nn.Module, name: str | None) -> list[str]:
        """Remove adapter ``name`` (None: all of them); returns the names removed."""
        state = self.state(target)
        names = list(state.adapters) if name is None else [name]
        missing = [n for n in names if n not in state.adapters]
        if missing:
            raise NotFoundError(
                f"no LoRA adapter {missing[0]!r} on {target}; loaded: {', '.join(state.adapters) or 'none'}"
            )
        self._unmerge(module, state)
        for n in names:
            self._remove(module, state, n)
        if state.active in names:
            state.active = None
        self._apply_activation(module, state)
        self._merge(module, state)
        if not state.adapters:
            self.targets.pop(target, None)
        return names

    def _remove(self, module: nn.Module, state: TargetState, name: str, *, forget: bool = True) -> None:
        for path, layer in list(tuner_layers(module)):
            if name in layer.lora_A:
                layer.delete_adapter(name)
            if not layer.lora_A:
                parent_path, _, child = path.rpartition(".")
                parent = module.get_submodule(parent_path) if parent_path else module
                setattr(parent, child, layer.get_base_layer())
        configs = getattr(module, "peft_config", None)
        if isinstance(configs, dict):
            configs.pop(name, None)
            if not configs:
                del module.peft_config
        if forget:
            state.adapters.pop(name, None)

    # ------------------------------------------------------------------ reports
    def adapter_tensors(self, module: nn.Module, name: str) -> list[tuple[str, torch.Tensor]]:
        """The adapter's tensors under PEFT state-dict names (``<layer>.lora_A.weight``)."""
        out = []
        for path, layer in tuner_layers(module):
            if name in layer.lora_A:
                out.append((f"{path}.lora_A.weight", layer.lora_A[name].weight))
                out.append((f"{path}.lora_B.weight", layer.lora_B[name].weight))
        return out

    def describe(self, modules: Mapping[str, nn.Module]) -> dict[str, Any]:
        out = {}
        for target, state in self.targets.items():
            module = modules.get(target)
            adapters = {}
            for name, rec in state.adapters.items():
                adapters[name] = {
                    "rank": rec.config.r,
                    "alpha": rec.config.lora_alpha,
                    "num_layers": len(rec.layers),
                    "strength": rec.strength,
                    "source": rec.source,
                    "loads": rec.loads,
                    "checksum": weights_checksum(self.adapter_tensors(module, name))
                    if module is not None
                    else None,
                }
            out[target] = {
                "active": state.active,
                "mode": state.mode,
                "merged": state.merged,
                "adapters": adapters,
            }
        return out


@contextmanager
def _nothing():
    yield


def _is_wrappable(module: nn.Module) -> bool:
    """Leaf layer types PEFT's LoRA can wrap (wrappers themselves count, by their base layer)."""
    base = _base(module)
    return (
        isinstance(base, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding))
        or type(base).__name__ == "Conv1D"
    )
