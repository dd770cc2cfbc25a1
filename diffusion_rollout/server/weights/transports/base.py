"""The transport interface: how one kind of full-weight update reaches the staging step.

Design decisions:

- **A transport only receives.** :meth:`WeightTransport.prepare` turns one update request (and
  the bytes that came with it, if any) into :class:`Staged` named tensors, routed to pipeline
  modules. It may read files, parse bodies, decode IPC handles or wait for a broadcast; it never
  changes the model, so it can fail freely.
- **Commit and rollback are shared.** Every transport ends in the same ``{module: [(name,
  tensor)]}``, so validating against the live model, the in-place copies, the version bump and the
  exact undo are one implementation for all of them (``transactions.WeightTransactions``).
- **The manager is passed in.** A transport holds no state of its own: what it needs (the staging
  area of uploads, update groups, the IPC decoder) lives on the engine's ``WeightManager``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

Payload = dict[str, list[tuple[str, torch.Tensor]]]


@dataclass
class Staged:
    """What a transport received: tensors by module, not applied yet."""

    payload: Payload
    # Every tensor was already cast and checked finite on arrival (staged upload parts).
    finite_checked: bool = False
    # Runs once the update is over, whatever the outcome (gives receive buffers back).
    on_finish: Callable[[], None] | None = None
    # {module: {name: sha256}} of the received bytes, kept for the tensor checker.
    received_sha256: Mapping[str, Mapping[str, str]] | None = None
    # Fields the transport adds to the success answer (an upload's ``upload_id``).
    extra: dict[str, Any] = field(default_factory=dict)


class WeightTransport(ABC):
    """One way full weights arrive (disk, HTTP body or upload port, CUDA IPC, NCCL broadcast)."""

    #: The name the cluster sends to its replicas (``prepare(txn, source, ...)``).
    name: ClassVar[str]

    @abstractmethod
    async def prepare(self, manager: Any, request: Mapping[str, Any], data: Any = None) -> Staged:
        """Receive and verify one update; nothing of the model changes.

        ``request``: the transport's own keyword arguments (already parsed by the HTTP layer);
        ``data``: bytes that travelled beside them (an upload's body), or None."""
