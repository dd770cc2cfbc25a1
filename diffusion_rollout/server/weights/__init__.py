"""Hot weight and LoRA updates (weights.md): one module per job, tied together by ``WeightManager``.

- ``updater``: validate-all-then-apply in-place copies with rollback (the core every transport uses).
- ``staging``: multi-part HTTP uploads staged until the final part.
- ``ipc``: SGLang ``update_weights_from_tensor`` payloads, decoded on a pool of their own.
- ``safe_pickle``: the restricted two-phase unpickler for pickled tensors from the network (IPC
  payloads, ``decode_torch_save`` for ``torch.save`` bytes): recipes, checks, then tensors.
- ``distributed``: NCCL/gloo update groups and broadcasts from the trainer.
- ``lora``: named PEFT adapters, dynamic and merged modes; ``lora_io`` reads adapters and configs.
- ``memory``: releasing and resuming device memory.
- ``manager``: ``WeightManager`` and ``get_weight_manager(engine)``; combines ``manager_core``
  (state, versioning, every mutation through ``engine.run_exclusive`` so updates land between
  generation batches), ``full_ops`` (full-weight transports and checks) and ``lora_ops`` (adapter
  operations), and adds SGLang tensor payloads, memory release and pause.
"""

from diffusion_rollout.server.weights.manager import WeightManager, get_weight_manager

__all__ = ["WeightManager", "get_weight_manager"]
