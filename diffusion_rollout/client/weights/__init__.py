"""Trainer-side weight and LoRA pushes (weights.md), each verified with the shared checksum code.

One module per path, all taking the blocking :class:`~diffusion_rollout.client.RolloutClient`
(pushes happen between training steps):

- ``tensors``: named-tensor sources, the trainer-side cast (``dtype="server"`` asks the server once)
  and the per-tensor hash check every path ends with.
- ``upload``: :func:`push_weights` over HTTP in bounded safetensors parts with one atomic commit,
  and :func:`verify_weights_checksum` for whole modules.
- ``lora``: PEFT adapter state dicts and configs, :func:`push_lora` and :func:`verify_lora`.
- ``ipc``: SGLang's same-host ``update_weights_from_tensor`` body and :func:`push_weights_ipc`.
- ``broadcast``: :class:`WeightBroadcaster`, trainer rank 0 of an NCCL/gloo group with the servers.

This package only re-exports; the design decisions are in each module's docstring.
"""

from diffusion_rollout.client.weights.broadcast import WeightBroadcaster
from diffusion_rollout.client.weights.ipc import build_update_weights_from_tensor_request, push_weights_ipc
from diffusion_rollout.client.weights.lora import (
    lora_checksum,
    lora_config_dict,
    lora_state_dict,
    push_lora,
    verify_lora,
)
from diffusion_rollout.client.weights.tensors import DTypeSpec as DTypeSpec
from diffusion_rollout.client.weights.tensors import NamedTensors as NamedTensors
from diffusion_rollout.client.weights.tensors import resolve_dtype
from diffusion_rollout.client.weights.upload import (
    DEFAULT_MAX_PART_BYTES,
    WeightPart,
    push_weights,
    safetensors_parts,
    verify_weights_checksum,
)

__all__ = [
    "DEFAULT_MAX_PART_BYTES",
    "WeightBroadcaster",
    "WeightPart",
    "build_update_weights_from_tensor_request",
    "lora_checksum",
    "lora_config_dict",
    "lora_state_dict",
    "push_lora",
    "push_weights",
    "push_weights_ipc",
    "resolve_dtype",
    "safetensors_parts",
    "verify_lora",
    "verify_weights_checksum",
]
