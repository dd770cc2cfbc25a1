"""Liveness, readiness and information endpoints."""

from __future__ import annotations

import platform
import time

from fastapi import APIRouter, Request

from diffusion_rollout import __version__
from diffusion_rollout.entrypoints.routers.common import get_engine
from diffusion_rollout.errors import ServiceUnavailableError

router = APIRouter()

# /health_generate trusts a generation that succeeded this recently instead of running another.
READY_FRESH_S = 30.0


def _versions() -> dict[str, str]:
    import diffusers
    import torch
    import transformers

    out = {
        "diffusion_rollout": __version__,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    try:
        import peft

        out["peft"] = peft.__version__
    except ImportError:  # peft is a dependency, but info must never fail
        pass
    return out


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/health_generate")
async def health_generate(request: Request) -> dict:
    engine = get_engine(request)
    if engine.status != "ready":
        raise ServiceUnavailableError(f"not ready: {engine.status}")
    if engine.queue_stats().paused:
        raise ServiceUnavailableError("generation is paused")
    fresh = engine.last_generate_ok_at and time.time() - engine.last_generate_ok_at < READY_FRESH_S
    if not fresh:
        await engine.readiness_probe()
    return {"status": "ok"}


@router.get("/model_info")
async def model_info(request: Request) -> dict:
    info = get_engine(request).model_info()
    info["is_generation"] = True
    return info


@router.get("/server_info")
async def server_info(request: Request) -> dict:
    engine = get_engine(request)
    cfg = engine.config
    stats = engine.queue_stats()
    replicas = await engine.replica_info()
    return {
        **engine.model_info(),
        **({"replicas": replicas} if replicas is not None else {}),
        "versions": _versions(),
        "limits": cfg.limits(),
        "speed": engine.speed_info(),
        "queue_depth": stats.depth,
        "paused": stats.paused,
        "host": cfg.host,
        "port": cfg.port,
        "api_key_required": cfg.api_key is not None,
        "admin_key_required": cfg.admin_key is not None,
        "uptime_s": time.time() - engine.started_at,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    engine = get_engine(request)
    return {
        "object": "list",
        "data": [
            {
                "id": engine.model_path or "demo",
                "object": "model",
                "owned_by": "diffusion-rollout",
                "root": engine.model_path,
            }
        ],
    }
