"""Per-tensor SHA-256 of uploaded weights, taken while the upload arrives, for the tensor checker.

``push_weights(verify=True)`` asks ``/update_weights_from_tensor_checker`` for every tensor it sent.
Hashing the live weights means reading them back from the GPU, one tensor after another, on the
worker, after the transfer: it cost more than the transfer itself. The hashes of the bytes an upload
delivered are taken instead when each part arrives (``checksums.tensors_sha256``, on several cores,
while the next part is on the wire) and the checker compares against those.

Design decisions:

- **Only while nothing else changed the weights.** The hashes of an applied upload are kept per
  module with a token; every later change of the weights (any update, LoRA operation or rollback:
  ``ManagerCore._bump`` and the rollbacks call :meth:`ReceivedDigests.weights_changed`) makes a new
  token, and the checker then hashes the live weights as before.
- **Not under a merged LoRA.** A module with a merged adapter holds base weights plus the adapter,
  which are not the bytes received: nothing is recorded for it, so the checker reads the live
  weights and answers exactly as it would without this record.
- **What a match proves.** The bytes hashed are the ones then copied into the parameters (already
  cast to the parameter dtype): a match says the update delivered, in full and unaltered, what the
  trainer sent, and was applied. The copy itself (``Tensor.copy_``) is not read back; a
  whole-module ``/get_weights_checksum`` (``verify_weights_checksum``) still reads the live weights.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping


class ReceivedDigests:
    """``{module: {name: sha256}}`` of the last applied upload, valid until the weights change."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._token = object()
        self._by_module: dict[str, tuple[object, dict[str, str]]] = {}

    def weights_changed(self) -> None:
        with self._lock:
            self._token = object()

    def remember(self, digests: Mapping[str, Mapping[str, str]]) -> None:
        """After an upload's apply (and its version bump): its per-tensor hashes, per module."""
        with self._lock:
            for module, named in digests.items():
                self._by_module[module] = (self._token, dict(named))

    def lookup(self, module: str) -> Mapping[str, str]:
        """The hashes still valid for ``module`` (empty when the weights changed since)."""
        with self._lock:
            token, named = self._by_module.get(module, (None, {}))
            return named if token is self._token else {}
