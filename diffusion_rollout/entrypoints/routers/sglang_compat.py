"""SGLang routes that trainers call and that have no other home here.

- ``POST /abort_request`` (SGLang's LLM-side route; ``{rid, abort_all}``): a trainer that
  over-samples cancels the tail. The queued work of request ``rid`` (the ``rid`` it sent with
  ``/rollout/generate``, or its ``X-Request-Id``) is dropped and that request answers 499
  ``request_aborted``; a request whose batch already runs finishes normally. The engine does the
  work (``Engine.abort``), so a cluster engine can fan it out to its replicas. The API key suffices
  for one ``rid``; ``abort_all`` needs the admin key.
- ``POST /set_lora_from_tensor`` (Relax's SGLang patch; ``{lora_name, target, strength,
  serialized_tensors, merge_mode}``): ``serialized_tensors`` is base64 of ``torch.save`` of the
  adapter's tensors, decoded without arbitrary pickle (``server/weights/torch_blob.py``), loaded as
  adapter ``lora_name`` and activated, merged into the kept pristine base (``merge_mode`` ``auto``
  or ``merge``, the default) or dynamic (``dynamic``). Admin key.
- ``GET /v1/model_info``, ``GET /weight_version``: SGLang's info routes (public, like ``/model_info``).

Fields with no effect here are accepted and reported in ``ignored_fields`` (``protocol/dialects.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from diffusion_rollout.entrypoints.routers.common import (
    get_engine,
    get_weights,
    model_info_for,
    require_admin_key,
    require_api_key,
)
from diffusion_rollout.entrypoints.routers.lora import sglang_targets
from diffusion_rollout.protocol.dialects import set_noop_fields, with_ignored
from diffusion_rollout.protocol.lora_options import LoraLoadOptions
from diffusion_rollout.server.weights import decode_named_tensors

router = APIRouter()


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AbortRequest(_Body):
    rid: str = Field("", max_length=256)
    abort_all: bool = False
    # SGLang's AbortReq carries these for its own scheduler; nothing to finish here.
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None


class SetLoraFromTensorRequest(_Body):
    serialized_tensors: str = Field(min_length=1)
    lora_name: str = Field("default", min_length=1)
    target: str = "transformer"
    strength: float = 1.0
    merge_mode: Literal["auto", "merge", "dynamic"] | None = None
    lora_alpha: float | None = Field(None, gt=0)
    weight_version: str | int | None = None


@router.post("/abort_request", dependencies=[Depends(require_api_key)])
async def abort_request(body: AbortRequest, request: Request) -> dict:
    if body.abort_all:
        require_admin_key(request)
    out = await get_engine(request).abort(body.rid or None, abort_all=body.abort_all)
    message = (
        f"{out['dropped']} queued request(s) dropped, {out['running']} running request(s) left to finish"
    )
    result = {"success": True, "message": message, **out}
    return with_ignored(result, "/abort_request", set_noop_fields(body, ("finished_reason", "abort_message")))


@router.post("/set_lora_from_tensor", dependencies=[Depends(require_admin_key)])
async def set_lora_from_tensor(body: SetLoraFromTensorRequest, request: Request) -> dict:
    manager = get_weights(request)
    modules = sglang_targets(manager, body.target)
    tensors = await asyncio.to_thread(
        decode_named_tensors, body.serialized_tensors, max_bytes=request.app.state.config.max_upload_bytes
    )
    mode = "dynamic" if body.merge_mode == "dynamic" else "merged"
    out: dict[str, Any] = {}
    adapted = 0
    for module in modules:
        out = await manager.load_lora_tensors(
            target_module=module,
            name=body.lora_name,
            named_tensors=tensors,
            options=LoraLoadOptions(lora_alpha=body.lora_alpha, activate=True, mode=mode, strength=body.strength),
            weight_version=body.weight_version,
            source="set_lora_from_tensor",
        )
        adapted += out["adapted_layers"]
    return {**out, "adapted_layers": adapted}


@router.get("/v1/model_info")
async def v1_model_info(request: Request) -> dict:
    return model_info_for(request)  # the path only for admin callers, as /model_info


@router.get("/weight_version")
async def weight_version(request: Request) -> dict:
    return {"weight_version": get_engine(request).weight_version}
