"""The weight-sync interface: transports receive, transactions commit or roll back.

A full-weight update is one request to one transport, then two phases:

- ``prepare``: the transport (:class:`WeightTransport`) receives, verifies and stages the tensors
  (:class:`Staged`); the transaction validates them against the live model. The model does not
  change, so this step can fail freely.
- ``commit``: every staged tensor is copied in place at once between generation batches and the
  version moves on; or ``rollback``: the staged state is dropped, and a committed one is restored to
  the exact previous bytes and version.

The transports, by the name the cluster sends (:data:`TRANSPORTS`): ``disk`` (a folder of
safetensors), ``upload`` (safetensors bytes from an HTTP body or the upload port), ``tensor``
(CUDA IPC handles, SGLang's ``update_weights_from_tensor``) and ``distributed`` (an NCCL or gloo
broadcast into an update group). :class:`WeightTransactions` runs the phases for one engine; the
single engine's routes call :meth:`WeightTransactions.update` (prepare, commit, finish), a cluster
replica exposes the phases one by one so its front can commit on every replica or on none.
"""

from diffusion_rollout.server.weights.transports.base import Payload, Staged, WeightTransport
from diffusion_rollout.server.weights.transports.disk import DiskTransport
from diffusion_rollout.server.weights.transports.distributed import DistributedTransport
from diffusion_rollout.server.weights.transports.ipc import TensorTransport
from diffusion_rollout.server.weights.transports.transactions import (
    TRANSPORTS,
    WeightTransactions,
    transport_for,
)
from diffusion_rollout.server.weights.transports.upload import UploadTransport

__all__ = [
    "TRANSPORTS",
    "DiskTransport",
    "DistributedTransport",
    "Payload",
    "Staged",
    "TensorTransport",
    "UploadTransport",
    "WeightTransactions",
    "WeightTransport",
    "transport_for",
]
