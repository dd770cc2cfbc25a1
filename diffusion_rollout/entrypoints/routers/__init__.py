"""Thin routers: parse with the protocol model, call the engine, encode."""

from __future__ import annotations

from diffusion_rollout.entrypoints.routers.admin import router as admin_router
from diffusion_rollout.entrypoints.routers.health import router as health_router
from diffusion_rollout.entrypoints.routers.lora import router as lora_router
from diffusion_rollout.entrypoints.routers.metrics import router as metrics_router
from diffusion_rollout.entrypoints.routers.openai_images import router as openai_images_router
from diffusion_rollout.entrypoints.routers.rollout import router as rollout_router
from diffusion_rollout.entrypoints.routers.sglang_compat import router as sglang_compat_router
from diffusion_rollout.entrypoints.routers.weights import router as weights_router

ROUTERS = [
    health_router,
    rollout_router,
    weights_router,
    lora_router,
    admin_router,
    metrics_router,
    sglang_compat_router,
    openai_images_router,
]
