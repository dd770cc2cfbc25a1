"""A module's LoRA state captured and put back exactly: adapters, their tensors, activation, mode.

Two users need the same thing: a cluster undoes a LoRA change on the replicas that applied it when
another replica failed (``lora_transactions.py``), and a restarted replica takes a serving
peer's adapters (``replica_state.py``).

Design decisions:

- **Only what can change.** :func:`capture` copies the tensors of the adapters named in
  ``touched`` (all of them when None); every adapter's record (config, strength, source, load
  count) and the module's active adapter, mode and merge dtype are kept always (a few scalars).
  Adapters the change cannot touch keep their tensors where they are.
- **No base weights.** Merged mode keeps an exact copy of every base weight it folds into
  (``LoraManager._merge``), so :func:`restore` unmerges (the exact base comes back), puts the
  adapters back and merges again from that base: the same bytes as before the change.
- **Through the loader.** Adapters come back through ``LoraManager.load`` (in place when the layout
  still matches, re-injected otherwise), so a restored adapter is validated and wrapped like any
  other; adapters the change added are removed as an unload would.
- Like ``LoraManager``, no locking and no versioning: callers run these on the engine's worker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from diffusion_rollout.errors import WeightApplyError
from diffusion_rollout.server.weights.lora import LoraManager
from diffusion_rollout.server.weights.lora_io import parse_lora_tensors
from diffusion_rollout.server.weights.lora_layers import AdapterRecord, Mode


@dataclass
class LoraSnapshot:
    """One module's LoRA state at capture time."""

    records: dict[str, AdapterRecord]
    tensors: dict[str, list[tuple[str, torch.Tensor]]]  # of the touched adapters only
    active: str | None = None
    mode: Mode = "dynamic"
    merge_dtype: torch.dtype | None = None


def capture(
    lora: LoraManager,
    target: str,
    module: nn.Module,
    touched: Iterable[str] | None = None,
    *,
    device: str | torch.device | None = None,
) -> LoraSnapshot:
    """``target``'s LoRA state; tensors of the adapters in ``touched`` (None: all) are copied
    (to ``device``, default where they are)."""
    state = lora.targets.get(target)
    if state is None:
        return LoraSnapshot({}, {})
    names = list(state.adapters) if touched is None else [n for n in touched if n in state.adapters]
    tensors = {
        name: [
            (k, t.detach().to(device or t.device, copy=True)) for k, t in lora.adapter_tensors(module, name)
        ]
        for name in names
    }
    records = {name: dataclasses.replace(record) for name, record in state.adapters.items()}
    return LoraSnapshot(records, tensors, state.active, state.mode, state.merge_dtype)


def restore(lora: LoraManager, target: str, module: nn.Module, snapshot: LoraSnapshot) -> None:
    """Put ``target``'s LoRA state back to ``snapshot`` exactly (base weights included)."""
    state = lora.state(target)
    lora._unmerge(module, state)  # the exact base: merged mode kept a copy of every weight it changed
    for name in [n for n in state.adapters if n not in snapshot.records]:
        lora._remove(module, state, name)
    for name, pairs in snapshot.tensors.items():
        record = snapshot.records[name]
        payload = parse_lora_tensors(pairs, target)
        lora.load(target, module, name, payload, config=record.config, source=record.source)
    missing = [n for n in snapshot.records if n not in state.adapters]
    if missing:
        # A change that removes an adapter must list it as touched; without its tensors it is lost.
        raise WeightApplyError(
            f"cannot restore LoRA adapter(s) {missing} on {target}: their tensors were not kept"
        )
    for name, saved in snapshot.records.items():
        record = state.adapters[name]
        lora._set_strength(module, record, saved.strength)
        record.loads, record.source = saved.loads, saved.source
    state.active, state.mode, state.merge_dtype = snapshot.active, snapshot.mode, snapshot.merge_dtype
    lora._apply_activation(module, state)
    lora._merge(module, state)
    if not state.adapters:
        lora.targets.pop(target, None)
