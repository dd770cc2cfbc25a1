"""Bringing a restarted replica back to the cluster's weights, copied from a serving peer.

A replica that Ray restarts comes back with the model as loaded from disk. The front keeps no copy
of every update (an IPC handle or a broadcast cannot be replayed, and a second copy of the weights
would cost the front a GPU's worth of memory), but every serving replica holds exactly the current
weights (updates are all or nothing, checksums agree), so the new replica copies them from one:

- :func:`export_state` (on the peer's worker, between batches): the *base* tensors of the modules
  that full updates have touched since start (seen through a merged LoRA, i.e. exact), every LoRA
  adapter (config, tensors, strength), which one is active and the mode, the version and the
  update count. Tensors go to the CPU and travel through Ray's object store.
- :func:`import_state` (on the new replica's worker): copies the base tensors in place (validated
  like any update), loads the adapters, activates as the peer had, sets the version.

Nothing here imports Ray.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from diffusion_rollout.server.weights.lora_io import parse_lora_tensors
from diffusion_rollout.server.weights.updater import apply_copies, get_module, live_tensors, plan_update


def export_state(manager, modules: Iterable[str]) -> dict[str, Any]:
    """Worker side, on a serving replica: what a restarted replica needs to match it exactly."""
    pipe = manager.engine.pipe
    base: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name in modules:
        module = get_module(pipe, name)
        with manager.lora.merge_suspended(name, module):
            base[name] = [(n, t.detach().to("cpu", copy=True)) for n, t in live_tensors(module).items()]
    lora: dict[str, Any] = {}
    for target, state in manager.lora.targets.items():
        module = get_module(pipe, target)
        lora[target] = {
            "active": state.active,
            "mode": state.mode,
            "merge_dtype": state.merge_dtype,
            "adapters": [
                {
                    "name": name,
                    "config": record.config,
                    "source": record.source,
                    "strength": record.strength,
                    "tensors": [
                        (n, t.detach().to("cpu", copy=True))
                        for n, t in manager.lora.adapter_tensors(module, name)
                    ],
                }
                for name, record in state.adapters.items()
            ],
        }
    return {
        "weight_version": manager.engine.weight_version,
        "updates_applied": manager.updates_applied,
        "modules": base,
        "lora": lora,
    }


def import_state(manager, state: dict[str, Any]) -> Any:
    """Worker side, on the restarted replica: take the peer's weights, adapters and version."""
    engine = manager.engine
    pipe = engine.pipe
    if state["modules"]:
        plan = plan_update(pipe, state["modules"], check_finite=False)
        with contextlib.ExitStack() as stack:
            for name in plan.modules:
                stack.enter_context(manager.lora.merge_suspended(name, get_module(pipe, name)))
            apply_copies(plan.copies)
    for target, lora in state["lora"].items():
        module = get_module(pipe, target)
        for adapter in lora["adapters"]:
            payload = parse_lora_tensors(adapter["tensors"], target)
            manager.lora.load(
                target, module, adapter["name"], payload, config=adapter["config"], source=adapter["source"]
            )
            if adapter["strength"] != 1.0:
                # Strength is set through activation; the final activation below restores the active one.
                manager.lora.activate(target, module, adapter["name"], strength=adapter["strength"])
        manager.lora.activate(
            target, module, lora["active"], mode=lora["mode"], merge_dtype=lora["merge_dtype"]
        )
    manager.updates_applied = state["updates_applied"]
    engine.weight_version = state["weight_version"]
    engine.prompt_cache.clear()
    return engine.weight_version
