"""The upload transport: safetensors bytes in an HTTP body (``POST /update_weights``) or through
the upload port (``entrypoints/upload_listener.py``); both deliver the body as a receive buffer.

Parts before the final one are staged by ``WeightManager.stage_upload_part`` as they arrive
(``upload_ops.py``) and answer at once; the final part completes the upload, and only then is there
an update to prepare. The staged tensors were cast and checked finite, and hashed, on arrival; their
receive buffers go back to the pool when the update is over (``Staged.on_finish``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusion_rollout.server.weights.receive import Lease, unpooled
from diffusion_rollout.server.weights.transports.base import Staged, WeightTransport


class UploadTransport(WeightTransport):
    """``{target_module, weight_version?, upload_id?, part?, partial?}`` plus the final part's body."""

    name = "upload"

    async def prepare(self, manager: Any, request: Mapping[str, Any], data: Any = None) -> Staged:
        body = data if isinstance(data, Lease) else unpooled(data if data is not None else b"")
        staged = await manager.stage_upload_part(body, final=True, **request)
        return Staged(
            staged.payload,
            finite_checked=True,
            on_finish=staged.release,
            received_sha256=staged.digests,
            extra={"upload_id": staged.upload_id},
        )
