"""``GET /metrics``: the engine's Prometheus text (``server/core/metrics.py`` records, this renders).

Open like ``/health``: it carries counts and timings, never keys, prompts or request ids, and a
scraper should not need the admin key.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from diffusion_rollout.entrypoints.routers.common import get_engine
from diffusion_rollout.server.core.metrics import CONTENT_TYPE

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(content=await get_engine(request).metrics_text(), media_type=CONTENT_TYPE)
