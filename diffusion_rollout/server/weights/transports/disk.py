"""The disk transport: ``update_weights_from_disk`` reads ``<model_path>/<module>/*.safetensors``.

Design decisions:

- All files of every target are read before anything is applied, off the worker (a thread), so
  rollouts keep running meanwhile and an unreadable file leaves every module as it was.
- ``model_path`` may be a Hugging Face repo id, resolved as SGLang resolves it (the local cache).
- No ``target_modules`` (or ``["all"]``) means every module of the pipeline, as SGLang reads it.
- File names of transformers models are mapped to the names the model has in memory with the
  model's own renaming rules (:func:`checkpoint_names_to_module`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.server.weights.transports.base import Payload, Staged, WeightTransport

logger = logging.getLogger(__name__)


def _local_model_dir(model_path: str) -> Path:
    """A folder as given, else a Hugging Face repo id resolved as SGLang's ``maybe_download_model``
    resolves it (the local cache; a download unless ``HF_HUB_OFFLINE`` is set, which ``serve`` sets
    by default). SGLang's refit test sends the served model's repo id to reset the weights."""
    root = Path(model_path)
    if root.is_dir():
        return root
    if not root.is_absolute() and model_path.count("/") == 1 and not model_path.startswith("."):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model_path))
        except Exception as exc:  # not a repo id, not cached offline, no network: the folder error below
            logger.info("model_path %r is neither a folder nor a resolvable repo id: %s", model_path, exc)
    raise WeightUpdateError(f"model_path {model_path!r} is not a folder on this server", field="model_path")


def checkpoint_names_to_module(
    module: Any, pairs: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """A transformers model's file names as its parameters are named in memory.

    transformers renames some checkpoints' keys when it loads them (Qwen-Image's Qwen2.5-VL text
    encoder is saved as ``model.layers...`` and lives as ``model.language_model.layers...``); a
    folder written by ``save_pretrained`` keeps the file names. The model's own renaming rules are
    applied to each name the module does not have; a name that needs a tensor conversion (merged or
    split tensors) is left as it is, so the update is rejected naming it."""
    if module is None or not hasattr(module, "base_model_prefix"):
        return pairs
    try:
        from transformers import WeightConverter
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import rename_source_key
    except ImportError:
        return pairs
    state = module.state_dict()
    if all(name in state for name, _ in pairs):
        return pairs
    try:
        rules = get_model_conversion_mapping(module)
    except Exception:  # a model without rules
        return pairs
    renamings = [r for r in rules if not isinstance(r, WeightConverter)]
    converters = [r for r in rules if isinstance(r, WeightConverter)]
    out = []
    for name, tensor in pairs:
        if name not in state:
            renamed, conversion = rename_source_key(
                name, renamings, converters, module.base_model_prefix, state
            )
            if conversion is None and renamed in state:
                name = renamed
        out.append((name, tensor))
    return out


def read_disk_update(model_path: str, targets: Sequence[str]) -> Payload:
    """``<model_path>/<module>/*.safetensors`` for every target (diffusers layout), all or nothing."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = _local_model_dir(model_path)
    files = {m: sorted((root / m).glob("*.safetensors")) for m in targets}
    missing = [m for m, found in files.items() if not found]
    if missing:
        raise WeightUpdateError(
            f"no <module>/*.safetensors under {model_path} for {', '.join(missing)}; nothing was applied",
            field="model_path",
        )
    out: Payload = {}
    for module, paths in files.items():
        pairs: list[tuple[str, torch.Tensor]] = []
        for path in paths:
            try:
                pairs.extend(load_file(str(path)).items())
            except (SafetensorError, OSError) as exc:
                # SGLang's wording for a module whose load failed (its clients match it); here the
                # files are all read before any is applied, so every module keeps its weights.
                raise WeightUpdateError(
                    f"Failed to update module '{module}': cannot read {path}: {exc}; rolled back: "
                    "every module keeps its previous weights",
                    field="model_path",
                ) from exc
        out[module] = pairs
    return out


class DiskTransport(WeightTransport):
    """``{model_path, target_modules?}``: safetensors files on a filesystem this server sees."""

    name = "disk"

    async def prepare(self, manager: Any, request: Mapping[str, Any], data: Any = None) -> Staged:
        target_modules = request.get("target_modules")
        if target_modules is None or list(target_modules) == ["all"]:
            target_modules = manager.module_names()
        targets = manager.targets(target_modules)
        payload = await asyncio.to_thread(read_disk_update, request["model_path"], targets)
        modules = manager.modules()
        return Staged({m: checkpoint_names_to_module(modules.get(m), pairs) for m, pairs in payload.items()})
