"""Keeping the server on the trainer's current weights before a rollout (``ServedPipeline``).

Design decisions:

- **A LoRA is compared by checksum every time.** When the trainer's module carries a PEFT adapter,
  its checksum (the tensors cast to the server's dtype, as ``push_lora`` sends them) is compared
  with the one ``GET /lora`` reports for the server's adapter of that name; a different checksum,
  a missing adapter or another active adapter means a push (``push_lora``, activated, verified).
  An adapter is small, so hashing it per rollout costs little, and a restarted server or another
  writer is noticed.
- **Full weights are compared once, then followed by version counters.** Hashing a 2.5B-parameter
  transformer per rollout would cost seconds, so the first sync compares checksums
  (``verify_weights_checksum``) and later ones compare the parameters' in-place version counters
  (``Tensor._version``, which every optimizer step bumps): changed counters mean a push
  (``push_weights``, verified). A write that bypasses autograd's counters (``param.data = ...``)
  is not seen; call :meth:`WeightFollower.sync` with ``force=True`` after one.
- With a LoRA the base weights are taken as the server's (frozen, as flow_grpo trains them).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from diffusion_rollout.client.exceptions import ChecksumMismatchError
from diffusion_rollout.client.weights.lora import lora_checksum, push_lora
from diffusion_rollout.client.weights.tensors import resolve_dtype
from diffusion_rollout.client.weights.upload import push_weights, verify_weights_checksum
from diffusion_rollout.protocol.checksums import base_named_parameters

if TYPE_CHECKING:
    from diffusion_rollout.client.sync_client import RolloutClient

__all__ = ["WeightFollower"]

logger = logging.getLogger(__name__)


def _adapter_name(module: nn.Module) -> str | None:
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        return None
    active = getattr(module, "active_adapter", None)
    if callable(active):  # diffusers' PeftAdapterMixin: a method; PEFT's models: a property
        active = None
    if isinstance(active, str) and active in configs:
        return active
    return "default" if "default" in configs else next(iter(configs))


class WeightFollower:
    """Pushes ``module`` (the trainer's ``target_module``) to the server when the server's copy differs."""

    def __init__(
        self, client: RolloutClient, module: nn.Module, *, target_module: str = "transformer"
    ) -> None:
        self.client = client
        self.module = module
        self.target_module = target_module
        self.pushes = 0
        self._dtype: torch.dtype | None = None
        self._versions: tuple[int, ...] | None = None

    def _server_dtype(self) -> torch.dtype:
        if self._dtype is None:
            self._dtype = resolve_dtype(self.client, "server")  # type: ignore[assignment]
        return self._dtype  # type: ignore[return-value]

    def sync(self, *, force: bool = False) -> bool:
        """Make the server hold the trainer's weights; True when something was pushed."""
        name = _adapter_name(self.module)
        pushed = self._sync_lora(name, force) if name is not None else self._sync_full(force)
        self.pushes += pushed
        return pushed

    def _sync_lora(self, name: str, force: bool) -> bool:
        local = lora_checksum(self.module, dtype=self._server_dtype(), adapter_name=name)
        listing = self.client.lora_list().get("modules", {}).get(self.target_module, {})
        remote = listing.get("adapters", {}).get(name, {}).get("checksum")
        if not force and remote == local and listing.get("active") == name:
            return False
        logger.info("pushing the trainer's LoRA %r (checksum %s, server's %s)", name, local[:12], remote)
        push_lora(self.client, self.module, name=name, target_module=self.target_module, activate=True)
        return True

    def _sync_full(self, force: bool) -> bool:
        versions = tuple(p._version for _, p in base_named_parameters(self.module))
        if not force and versions == self._versions:
            return False
        if not force and self._versions is None:
            try:
                verify_weights_checksum(self.client, self.module, target_module=self.target_module)
                self._versions = versions
                return False
            except ChecksumMismatchError:
                pass
        logger.info("pushing the trainer's %s weights", self.target_module)
        push_weights(self.client, self.module, target_module=self.target_module)
        self._versions = versions
        return True
