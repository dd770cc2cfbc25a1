"""Pause/continue generation and release/resume device memory. Admin key required.

- ``POST /pause_generation``: new work stops starting (requests wait in the queue, they are not
  refused); the answer comes once the batch in flight has finished, so a trainer can push weights
  knowing nothing is running. Weight updates still run while paused.
- ``POST /continue_generation``: queued requests run again.
- ``POST /release_memory_occupation``: weights (and kept LoRA base copies) move to pinned CPU memory,
  the device cache is emptied, rollouts answer 503 until ``POST /resume_memory_occupation`` brings
  back exactly the released bytes. On a CPU-only server both are bookkeeping only.

Bodies are optional. ``mode`` of pause takes SGLang's values: ``in_place`` (default), ``abort``
(queued requests are aborted first, as ``/abort_request`` with ``abort_all``; the running batch
finishes) and ``retract``, which runs as ``in_place`` (a diffusion batch cannot be put back half way;
queued requests simply wait) and is reported in ``ignored_fields``. ``tags`` of release/resume
accept SGLang's names, and since this server holds no KV cache or CUDA graphs, every tag means "the
weights"; SGLang's ``cpu_backup_tags`` and Relax's ``weights_only`` change nothing here (the weights
are always what moves) and are reported in ``ignored_fields``.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict

from diffusion_rollout.entrypoints.routers.common import get_engine, get_weights, require_admin_key
from diffusion_rollout.protocol.dialects import set_noop_fields, with_ignored

router = APIRouter(dependencies=[Depends(require_admin_key)])


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["in_place", "abort", "retract"] = "in_place"


Tag = Literal["weights", "kv_cache", "cuda_graph"]


class MemoryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tags: list[Tag] | None = None
    cpu_backup_tags: list[Tag] | None = None
    weights_only: bool | None = None


_MEMORY_NOOP = ("cpu_backup_tags", "weights_only")


def _manager(request: Request):
    return get_weights(request)


@router.post("/pause_generation")
async def pause_generation(request: Request, body: PauseRequest | None = None) -> dict:
    mode = body.mode if body else "in_place"
    aborted = await get_engine(request).abort(abort_all=True) if mode == "abort" else None
    out = await _manager(request).pause_generation()
    if aborted is not None:
        out = {**out, "aborted": aborted["dropped"]}
    return with_ignored(out, "/pause_generation", ["mode"] if mode == "retract" else [])


@router.post("/continue_generation")
async def continue_generation(request: Request) -> dict:
    return await _manager(request).continue_generation()


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request, body: MemoryRequest | None = None) -> dict:
    out = await _manager(request).release_memory()
    return with_ignored(
        out, "/release_memory_occupation", set_noop_fields(body, _MEMORY_NOOP) if body else []
    )


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request, body: MemoryRequest | None = None) -> dict:
    out = await _manager(request).resume_memory()
    return with_ignored(out, "/resume_memory_occupation", set_noop_fields(body, _MEMORY_NOOP) if body else [])
