"""The CUDA IPC transport: SGLang's ``update_weights_from_tensor`` with full weights.

The payload (one entry per GPU, base64 pickles of tensors reduced by ``torch.multiprocessing``) is
decoded by the manager's restricted decoder (``server/weights/ipc.py``, ``safe_pickle.py``); the
entry for this server's GPU is chosen by ``payload_gpu_uuids``. LoRA pairs in the same format
(``weight_update_mode="lora_merge"``) are an adapter load, not a full update, and do not come here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusion_rollout.server.weights.transports.base import Staged, WeightTransport


class TensorTransport(WeightTransport):
    """``{serialized_named_tensors, load_format?, target_modules?, payload_gpu_uuids?}``."""

    name = "tensor"

    async def prepare(self, manager: Any, request: Mapping[str, Any], data: Any = None) -> Staged:
        return Staged(await manager.tensor_payload(**request))
