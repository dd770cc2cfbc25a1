"""Pause/continue generation and release/resume device memory. Admin key required.

- ``POST /pause_generation``: new work stops starting (requests wait in the queue, they are not
  refused); the answer comes once the batch in flight has finished, so a trainer can push weights
  knowing nothing is running. Weight updates still run while paused.
- ``POST /continue_generation``: queued requests run again.
- ``POST /release_memory_occupation``: weights (and kept LoRA base copies) move to pinned CPU memory,
  the device cache is emptied, rollouts answer 503 until ``POST /resume_memory_occupation`` brings
  back exactly the released bytes. On a CPU-only server both are bookkeeping only.

Bodies are optional. ``mode`` of pause only accepts ``in_place`` (a diffusion batch cannot be
retracted or aborted half way); ``tags`` of release/resume accept SGLang's names, and since this
server holds no KV cache or CUDA graphs, every tag means "the weights".
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict

from diffusion_rollout.entrypoints.routers.common import get_weights, require_admin_key

router = APIRouter(dependencies=[Depends(require_admin_key)])


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["in_place"] = "in_place"


class MemoryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None


def _manager(request: Request):
    return get_weights(request)


@router.post("/pause_generation")
async def pause_generation(request: Request, body: PauseRequest | None = None) -> dict:
    return await _manager(request).pause_generation()


@router.post("/continue_generation")
async def continue_generation(request: Request) -> dict:
    return await _manager(request).continue_generation()


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request, body: MemoryRequest | None = None) -> dict:
    return await _manager(request).release_memory()


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request, body: MemoryRequest | None = None) -> dict:
    return await _manager(request).resume_memory()
