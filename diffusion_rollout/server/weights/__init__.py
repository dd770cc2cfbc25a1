"""Hot weight and LoRA updates (weights.md), one subsystem. This package's own names are its public
facade: the cluster and the HTTP layer import from here and from ``transports`` only.

- ``transports``: the interface every full-weight update goes through. A transport (disk, upload
  body or port, CUDA IPC, NCCL broadcast) only receives and stages tensors (``prepare``);
  ``WeightTransactions`` validates them, then commits them all at once or rolls back.
- ``updater``: validate-all-then-apply in-place copies with rollback (the core of every commit).
- ``staging``, ``receive``, ``upload_ops``: multi-part uploads staged in pooled buffers until the
  final part.
- ``ipc``: SGLang ``update_weights_from_tensor`` payloads, decoded on a pool of their own.
- ``safe_pickle``: the restricted two-phase unpickler for pickled tensors from the network (IPC
  payloads, ``decode_torch_save`` for ``torch.save`` bytes): recipes, checks, then tensors.
- ``distributed``: NCCL/gloo update groups and broadcasts from the trainer.
- ``lora``: named PEFT adapters, dynamic and merged modes; ``lora_io`` reads adapters and configs.
- ``lora_snapshot``, ``lora_transactions``: LoRA changes that a cluster replica can undo.
- ``replica_state``: a restarted replica copies a serving peer's weights, adapters and version.
- ``memory``: releasing and resuming device memory.
- ``manager``: ``WeightManager`` and ``get_weight_manager(engine)``; combines ``manager_core``
  (state, versioning, every mutation through ``engine.run_exclusive`` so updates land between
  generation batches), ``full_ops`` (full-weight entry points and checks), ``upload_ops`` (upload
  parts) and ``lora_ops`` (adapter operations), and adds SGLang tensor payloads, memory release and
  pause.
"""

from diffusion_rollout.server.weights.lora_transactions import LoraTransactions
from diffusion_rollout.server.weights.manager import WeightManager, get_weight_manager
from diffusion_rollout.server.weights.manager_core import DEFAULT_TARGETS, Version, validate_targets
from diffusion_rollout.server.weights.receive import BufferPool, Lease, unpooled
from diffusion_rollout.server.weights.replica_state import export_state, import_state
from diffusion_rollout.server.weights.torch_blob import decode_named_tensors
from diffusion_rollout.server.weights.transports import TRANSPORTS, WeightTransactions, WeightTransport

__all__ = [
    "DEFAULT_TARGETS",
    "TRANSPORTS",
    "BufferPool",
    "Lease",
    "LoraTransactions",
    "Version",
    "WeightManager",
    "WeightTransactions",
    "WeightTransport",
    "decode_named_tensors",
    "export_state",
    "get_weight_manager",
    "import_state",
    "unpooled",
    "validate_targets",
]
