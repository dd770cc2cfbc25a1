"""``POST /rollout/generate``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from diffusion_rollout.entrypoints.protocol import GenerateRequest
from diffusion_rollout.entrypoints.routers.common import get_engine, require_api_key, wire_response

router = APIRouter()


@router.post("/rollout/generate", dependencies=[Depends(require_api_key)])
async def rollout_generate(body: GenerateRequest, request: Request) -> Response:
    engine = get_engine(request)
    params = body.to_params(request.state.request_id)
    results = await engine.generate(params)
    return await wire_response(request, [r.to_dict() for r in results])
