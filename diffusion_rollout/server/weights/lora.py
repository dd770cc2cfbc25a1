"""Named LoRA adapters on pipeline modules, with PEFT: load, reload in place, activate, merge, unload.

Design decisions:

- Adapters are real PEFT LoRA layers injected with ``peft.inject_adapter_in_model`` (the function
  diffusers' ``add_adapter`` uses), so the ``dynamic`` forward *is* PEFT's forward: outputs are bit
  for bit those of a PEFT-wrapped model holding the same adapter. Several adapters live side by side
  (DiffusionNFT's ``default`` policy and its EMA ``old``); one, or none, is active per module.
- Payloads arrive parsed by ``lora_io`` (A/B pairs per layer, and a config or none). Without a
  config the payload describes the adapter; with one, the layers it targets must be exactly the
  layers in the payload.
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
- The active adapter's weights require grad, like the trainer's: ``torch.matmul`` picks its kernel
  path by that flag (``_apply_activation`` says why), so the served forward is the trainer's to the bit.
- The PEFT layer structure and the adapter records are in ``lora_layers.py``.
- This class does no locking and no versioning: the manager calls it on the engine's worker thread.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from diffusion_rollout.errors import NotFoundError, WeightApplyError, WeightUpdateError
from diffusion_rollout.protocol.checksums import weights_checksum
from diffusion_rollout.server.weights.lora_io import LoraPayload, inferred_lora_config
from diffusion_rollout.server.weights.lora_layers import (
    MODES,
    AdapterRecord,
    Mode,
    TargetState,
    base_layer_of,
    canonical_module_paths,
    config_key,
    expected_lora_shapes,
    peft_classes,
    tuner_layers,
)
from diffusion_rollout.server.weights.updater import PlannedCopy, apply_copies, describe_names, finite_flags

logger = logging.getLogger(__name__)


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
        old = state.adapters.get(name)
        try:
            config = config if config is not None else inferred_lora_config(payload, lora_alpha)
            # A reload with the same layers and config wraps the same layers: skip matching the config
            # against every module path (the slow part of validation on a large model).
            same = (
                old is not None
                and tuple(payload.layers) == old.layers
                and config_key(config) == config_key(old.config)
            )
            layers = self._validate(
                target, module, payload, config, wrapped=list(old.layers) if same else None
            )
        except Exception:
            if not state.adapters:
                self.targets.pop(target, None)
            raise
        new_record = AdapterRecord(name, config, tuple(layers), source)
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

    def _validate(
        self,
        target: str,
        module: nn.Module,
        payload: LoraPayload,
        config: Any,
        wrapped: list[str] | None = None,
    ) -> list[str]:
        _, _, check_target = peft_classes()
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
        if wrapped is None:
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
        shape_bad, value_bad, to_check = [], [], []
        for layer, (a, b) in payload.pairs.items():
            if layer in unknown:
                continue
            rank = int(a.shape[0]) if a.dim() >= 1 else -1
            expected = expected_lora_shapes(base_layer_of(paths[layer]), rank)
            ok = a.dim() >= 2 and b.dim() >= 2 and b.shape[1] == rank
            if expected is not None:
                ok = ok and tuple(a.shape) == expected[0] and tuple(b.shape) == expected[1]
            if not ok:
                shape_bad.append(f"{layer}: A {tuple(a.shape)}, B {tuple(b.shape)}")
            elif not (a.is_floating_point() and b.is_floating_point()):
                value_bad.append(layer)
            else:
                to_check.append(layer)
        flags = finite_flags([t for layer in to_check for t in payload.pairs[layer]])
        value_bad += [layer for k, layer in enumerate(to_check) if not (flags[2 * k] and flags[2 * k + 1])]
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
        peft, _, _ = peft_classes()
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
        state = self.targets.get(target)
        if state is None:
            if name is None:
                return  # no adapters on this module: it already runs its base weights
            state = TargetState()
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
        state = self.targets.get(target)
        if state is None:
            raise NotFoundError(f"no LoRA adapters on {target}")
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
                # inference_mode=False: the active adapter's weights keep requires_grad=True, as a
                # trainer's adapter does. Never used for autograd here (the worker runs under
                # inference_mode), but torch.matmul reads the flag: a weight that requires grad
                # folds a >2-D input into one mm, one that does not runs a non-contiguous input
                # (SD3's attention output projections) as a bmm, whose last bits differ on a GPU;
                # measured exactly that split at rank 4 (benchmarks/investigations/lora_bits_served.py).
                layer.set_adapter(state.active, inference_mode=False)

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
                    copies[path] = base_layer_of(layer).weight.detach().clone()
                for _, layer in layers:
                    weight = base_layer_of(layer).weight
                    dtype = state.merge_dtype or weight.dtype
                    delta = layer.get_delta_weight(name)
                    weight.data.copy_((weight.to(dtype) + delta.to(dtype)).to(weight.dtype))
                    layer.merged_adapters = [name]
            except Exception as exc:
                for path, layer in layers:
                    if path in copies:
                        base_layer_of(layer).weight.data.copy_(copies[path])
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
                base_layer_of(layer).weight.data.copy_(saved)
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
                with warnings.catch_warnings():
                    # PEFT warns when the active adapter goes; activation is reapplied by the caller.
                    warnings.simplefilter("ignore")
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
    base = base_layer_of(module)
    return (
        isinstance(base, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding))
        or type(base).__name__ == "Conv1D"
    )
