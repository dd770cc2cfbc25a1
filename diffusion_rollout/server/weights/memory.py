"""Releasing the GPU to the trainer and taking it back (``/release_memory_occupation``, ``/resume...``).

Design decisions:

- Release moves every parameter and buffer of every pipeline module (and any extra tensors the
  LoRA manager keeps, such as exact base copies of merged layers) into pinned CPU memory by
  reassigning ``tensor.data``: parameter objects keep their identity, so PEFT wrappers, backups and
  anything else holding a reference stay valid. Each tensor remembers its device; resume moves it
  back there. The bytes are copied, never converted, so resume restores exactly what was released.
- The prompt cache holds encodings on the device; it is cleared on release (recomputed later).
- On a CPU-only server there is no device memory to free: release and resume are bookkeeping only
  (status and pause), and round-trip trivially.
- The engine's status becomes ``"released"`` (generation answers 503) and the worker is paused, so
  requests queued before the release wait instead of running on CPU weights; resume undoes both.
- The manager runs both on the engine's worker thread, between batches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)


def _module_tensors(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for module in modules:
        for tensor in list(module.parameters()) + list(module.buffers()):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                out.append(tensor)
    return out


class MemoryOccupation:
    """Which tensors were moved off the device, and where each goes back."""

    def __init__(self) -> None:
        self._moved: list[tuple[torch.Tensor, torch.device]] = []
        self.released = False
        self.released_bytes = 0

    def release(self, modules: Iterable[nn.Module], extra: Iterable[torch.Tensor] = ()) -> int:
        """Move device tensors to pinned CPU memory; returns the bytes moved (0 on a CPU server)."""
        if self.released:
            return 0
        t0 = time.perf_counter()
        staged: list[tuple[torch.Tensor, torch.device, torch.Tensor]] = []
        total = 0
        with torch.no_grad():
            for tensor in _module_tensors(modules) + list(extra):
                if tensor.device.type == "cpu":
                    continue
                host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
                host.copy_(tensor.data, non_blocking=True)
                staged.append((tensor, tensor.device, host))
                total += tensor.numel() * tensor.element_size()
            if staged:
                torch.cuda.synchronize()
            # Swap only after every copy landed, so a failure above leaves the model untouched.
            for tensor, _, host in staged:
                tensor.data = host
        moved = [(tensor, device) for tensor, device, _ in staged]
        self._moved = moved
        self.released = True
        self.released_bytes = total
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        logger.info("released %.1f MiB of device memory in %.2f s", total / 2**20, time.perf_counter() - t0)
        return total

    def resume(
        self, modules: Iterable[nn.Module] = (), extra: Iterable[torch.Tensor] = (), device: str = "cpu"
    ) -> int:
        """Move every released tensor back to its device; returns the bytes moved.

        Tensors created while released (a LoRA adapter loaded in the meantime) live on the CPU; on
        a GPU server they follow the model to ``device``.
        """
        if not self.released:
            return 0
        t0 = time.perf_counter()
        total = 0
        with torch.no_grad():
            back = list(self._moved)
            if self._moved and not device.startswith("cpu"):
                moved_ids = {id(t) for t, _ in back}
                back += [
                    (t, torch.device(device))
                    for t in _module_tensors(modules) + list(extra)
                    if id(t) not in moved_ids and t.device.type == "cpu"
                ]
            for tensor, target in back:
                tensor.data = tensor.data.to(target, non_blocking=True)
                total += tensor.numel() * tensor.element_size()
            if back:
                torch.cuda.synchronize()
        self._moved = []
        self.released = False
        self.released_bytes = 0
        logger.info("resumed %.1f MiB to the device in %.2f s", total / 2**20, time.perf_counter() - t0)
        return total
