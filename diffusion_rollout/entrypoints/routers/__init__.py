"""Thin routers: parse with the protocol model, call the engine, encode."""

from __future__ import annotations

from diffusion_rollout.entrypoints.routers.health import router as health_router
from diffusion_rollout.entrypoints.routers.rollout import router as rollout_router

ROUTERS = [health_router, rollout_router]
