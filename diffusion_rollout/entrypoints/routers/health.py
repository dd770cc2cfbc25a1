"""Liveness, readiness and information endpoints (open: no key needed).

When an admin key is set, callers without it see the model folder's name but not where it lives,
and no library versions or bind address (``/server_info``, ``/model_info``, ``/v1/models``); a
readiness probe (``/health_generate``) without a key runs a generation at most once per
``health_generate_interval_s``. The direct upload listener's port (``weight_upload_port``, null
when it is off) is shown to everyone: the admin key guards it as it guards the main port.
"""

from __future__ import annotations

import asyncio
import platform
import time

from fastapi import APIRouter, Request

from diffusion_rollout import __version__
from diffusion_rollout.entrypoints.http_errors import note_ready
from diffusion_rollout.entrypoints.routers.common import (
    get_engine,
    is_admin,
    key_error,
    model_info_for,
    public_path,
    upload_port,
)
from diffusion_rollout.errors import NotReadyError, ServiceUnavailableError

router = APIRouter()

# /health_generate trusts a generation that succeeded this recently instead of running another.
READY_FRESH_S = 30.0
# Engine states that are no fault (answered 503, logged once per change at info).
EXPECTED_STATES = frozenset({"loading", "warming", "released", "stopping"})


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
async def health(request: Request) -> dict:
    """Liveness: 200 while the process serves HTTP. ``state`` is the engine's (``loading``,
    ``warming``, ``ready``, ...); a compiled server adds ``warmup``: calls done / total, seconds so
    far and an estimate of the rest (readiness itself is ``/health_generate``)."""
    engine = get_engine(request)
    out = {"status": "ok", "state": engine.status}
    warmup = getattr(engine, "warmup_info", None)  # engines without a compile warm-up have none
    info = warmup() if warmup is not None else None
    if info is not None:
        out["warmup"] = {k: v for k, v in info.items() if k != "calls"}
    return out


class ReadinessProbes:
    """When ``/health_generate`` last ran a generation, and how it went (one per app).

    A caller without a key may make the server generate at most once per
    ``health_generate_interval_s``; within it, the last probe's outcome is the answer. Concurrent
    callers share one probe (the lock), so a burst of probes costs one generation.
    """

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.last_at: float | None = None
        self.last_error: str | None = None


def _probes(request: Request) -> ReadinessProbes:
    probes = getattr(request.app.state, "readiness_probes", None)
    if probes is None:
        probes = request.app.state.readiness_probes = ReadinessProbes()
    return probes


def _has_key(request: Request) -> bool:
    cfg = request.app.state.config
    if cfg.api_key is None and cfg.admin_key is None:
        return False  # nobody can prove anything: every caller is rate-limited alike
    level = "api" if cfg.api_key is not None else "admin"
    return key_error(request.headers.get("authorization"), cfg, level) is None


def _progress(engine) -> str:
    """While a compiled server warms up: how far it got, for the 503's message."""
    warmup = getattr(engine, "warmup_info", None)
    info = warmup() if warmup is not None else None
    if engine.status != "warming" or info is None:
        return ""
    left = info["estimate_remaining_s"]
    return (
        f" (compiling for the expected request shapes: {info['done']}/{info['total']} warm-up calls "
        f"done, {info['elapsed_s']:.0f} s so far"
        + (f", about {left:.0f} s left)" if left is not None else ")")
    )


@router.get("/health_generate")
async def health_generate(request: Request) -> dict:
    engine = get_engine(request)
    if engine.status in EXPECTED_STATES:
        raise NotReadyError(f"not ready: {engine.status}{_progress(engine)}", state=engine.status)
    if engine.status != "ready":  # "failed": the load or a context-parallel rank broke
        raise ServiceUnavailableError(f"not ready: {engine.status}")
    if engine.queue_stats().paused:
        raise NotReadyError("generation is paused", state="paused")

    def fresh() -> bool:
        return bool(engine.last_generate_ok_at and time.time() - engine.last_generate_ok_at < READY_FRESH_S)

    if fresh():
        note_ready(request.app)
        return {"status": "ok"}
    probes = _probes(request)
    async with probes.lock:
        if fresh():  # a probe that finished while this caller waited answers for it too
            note_ready(request.app)
            return {"status": "ok"}
        interval = request.app.state.config.health_generate_interval_s
        recent = probes.last_at is not None and time.monotonic() - probes.last_at < interval
        if recent and not _has_key(request):
            if probes.last_error is not None:
                raise ServiceUnavailableError(f"the last readiness probe failed: {probes.last_error}")
            note_ready(request.app)
            return {"status": "ok"}
        probes.last_at = time.monotonic()
        try:
            await engine.readiness_probe()
        except Exception as exc:
            probes.last_error = f"{type(exc).__name__}: {exc}"[:300]
            raise
        probes.last_error = None
    note_ready(request.app)
    return {"status": "ok"}


@router.get("/model_info")
async def model_info(request: Request) -> dict:
    info = model_info_for(request)
    info["is_generation"] = True
    return info


@router.get("/server_info")
async def server_info(request: Request) -> dict:
    engine = get_engine(request)
    cfg = engine.config
    stats = engine.queue_stats()
    replicas = await engine.replica_info()
    if not is_admin(request):
        # Paths and library versions help an attacker more than an operator who has the admin key.
        return {
            **engine.model_info(),
            "model_path": public_path(engine.model_path),
            "limits": cfg.limits(),
            "queue_depth": stats.depth,
            "paused": stats.paused,
            "api_key_required": cfg.api_key is not None,
            "admin_key_required": True,
            "weight_upload_port": upload_port(request),
            "rewards": list(cfg.reward_specs()),
            "uptime_s": time.time() - engine.started_at,
        }
    runner = getattr(engine, "rewards", None)  # a cluster front's replicas score their own
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
        "weight_upload_port": upload_port(request),
        "rewards": runner.info() if runner is not None else cfg.reward_specs(),
        "uptime_s": time.time() - engine.started_at,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    engine = get_engine(request)
    path = engine.model_path if is_admin(request) else public_path(engine.model_path)
    return {
        "object": "list",
        "data": [{"id": path or "demo", "object": "model", "owned_by": "diffusion-rollout", "root": path}],
    }
