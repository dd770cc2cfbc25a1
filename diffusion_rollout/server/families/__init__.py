"""Family adapters: the engine's only knowledge of each pipeline's argument names."""

from __future__ import annotations

from typing import Any

from diffusion_rollout.errors import RequestError
from diffusion_rollout.server.families.base import CallSettings, FamilyAdapter
from diffusion_rollout.server.families.flux import FluxAdapter
from diffusion_rollout.server.families.flux2_klein import Flux2KleinAdapter
from diffusion_rollout.server.families.flux_kontext import FluxKontextAdapter
from diffusion_rollout.server.families.hunyuanvideo15 import HunyuanVideo15Adapter
from diffusion_rollout.server.families.ltx2 import LTX2Adapter
from diffusion_rollout.server.families.qwenimage import QwenImageAdapter
from diffusion_rollout.server.families.qwenimage_edit import QwenImageEditAdapter
from diffusion_rollout.server.families.sd3 import SD3Adapter
from diffusion_rollout.server.families.wan import WanAdapter
from diffusion_rollout.server.families.wan_i2v import WanI2VAdapter
from diffusion_rollout.server.families.zimage import ZImageAdapter

ADAPTERS: list[type[FamilyAdapter]] = [
    SD3Adapter,
    FluxAdapter,
    QwenImageAdapter,
    WanAdapter,
    Flux2KleinAdapter,
    ZImageAdapter,
    HunyuanVideo15Adapter,
    LTX2Adapter,
]
# Image-conditioned families (families/image_cond.py).
ADAPTERS += [FluxKontextAdapter, WanI2VAdapter, QwenImageEditAdapter]


def register(adapter: type[FamilyAdapter]) -> None:
    """Add a family adapter (for families defined outside this package)."""
    if adapter not in ADAPTERS:
        ADAPTERS.append(adapter)


def adapter_for(pipe: Any) -> FamilyAdapter:
    """The adapter whose pipeline class matches ``pipe`` (by class name, so subclasses need listing)."""
    cls_name = type(pipe).__name__
    for a in ADAPTERS:
        if cls_name in a.pipeline_classes:
            return a(pipe)
    known = sorted(c for a in ADAPTERS for c in a.pipeline_classes)
    raise RequestError(f"unsupported pipeline class {cls_name}; supported: {', '.join(known)}", field="model")


__all__ = ["ADAPTERS", "CallSettings", "FamilyAdapter", "adapter_for", "register"]
