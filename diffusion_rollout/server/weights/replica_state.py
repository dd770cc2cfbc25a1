"""Bringing a restarted replica back to the cluster's weights, copied from a serving peer.

A replica that Ray restarts comes back with the model as loaded from disk. The front keeps no copy
of every update (an IPC handle or a broadcast cannot be replayed, and a second copy of the weights
would cost the front a GPU's worth of memory), but every serving replica holds exactly the current
weights (updates are all or nothing, checksums agree), so the new replica copies them from one:

- :func:`export_state` (on the peer's worker, between batches): the *base* tensors of the modules
  that full updates have touched since start (seen through a merged LoRA, i.e. exact), every LoRA
  adapter (config, tensors, strength), which one is active and the mode, the version and the
  update count. Tensors go to the CPU and travel through Ray's object store. The adapters are a
  ``lora_snapshot`` capture, the same one a cluster's LoRA rollback uses.
- :func:`import_state` (on the new replica's worker): copies the base tensors in place (validated
  like any update), restores the adapters and their activation as the peer had, sets the version.

Nothing here imports Ray.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from diffusion_rollout.server.weights.lora_snapshot import capture, restore
from diffusion_rollout.server.weights.updater import apply_copies, get_module, live_tensors, plan_update


def export_state(manager, modules: Iterable[str]) -> dict[str, Any]:
    """Worker side, on a serving replica: what a restarted replica needs to match it exactly."""
    pipe = manager.engine.pipe
    base: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name in modules:
        module = get_module(pipe, name)
        with manager.lora.merge_suspended(name, module):
            base[name] = [(n, t.detach().to("cpu", copy=True)) for n, t in live_tensors(module).items()]
    lora = {
        target: capture(manager.lora, target, get_module(pipe, target), device="cpu")
        for target in manager.lora.targets
    }
    return {
        "weight_version": manager.engine.weight_version,
        "weight_versions": manager.engine.versions.as_list(),
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
    for target, snapshot in state["lora"].items():
        restore(manager.lora, target, get_module(pipe, target), snapshot)
    manager.updates_applied = state["updates_applied"]
    engine.weight_version = state["weight_version"]
    # The peer's whole sequence: min_weight_version of an earlier version is satisfied here too.
    engine.versions.replace(state.get("weight_versions") or [state["weight_version"]])
    engine.prompt_cache.clear()
    return engine.weight_version
