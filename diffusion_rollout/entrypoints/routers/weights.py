"""Full-weight updates, update groups and checksums (weights.md). Admin key required on every route.

Thin: each route parses its body with a pydantic model (unknown fields are a 422), hands the values
to the engine's ``WeightManager`` and answers ``{"success": true, "message", "weight_version"}``
(``/get_weights_checksum`` answers SGLang's ``{module: sha256_hex}`` and puts the version in the
``X-Weight-Version`` header, percent-encoded UTF-8). Failures are the project's exceptions: 400
with the names that failed, 404 for an unknown module or group, 500 after a rolled-back copy.

``POST /update_weights`` takes the safetensors bytes as the raw body
(``Content-Type: application/octet-stream``) and these query parameters:

- ``target_module`` (default ``transformer``): the component the tensors belong to;
- ``weight_version``: the version to report once applied;
- ``final`` (default true): apply everything staged under this upload now;
- ``upload_id`` (default: ``weight_version``, else ``default``): groups the parts of one update;
- ``part`` (optional, 0-based): numbered parts make a missing part detectable at the final one;
- ``flush_cache`` (default true): also clear the prompt-encoding cache;
- ``partial`` (default false, read on the final part): without it a final part applies only when
  the upload names every parameter of each module it targets (a full update); ``partial=true``
  applies exactly the tensors sent.

A large update sends ``final=false`` parts, then the last one with ``final=true``; parts may target
different modules, and everything is validated and applied together, or nothing is. A refused part
aborts its upload: later parts under that ``upload_id`` are refused too, so a client never commits
half of what it meant to send. Non-final parts
of one upload may arrive concurrently (each is checked while the next is received); the final part
must come last. The body is read straight into a reused buffer (``upload_stream.py``). The query
model and the apply/refuse steps live in ``upload_part.py``, shared with the direct receive listener
(``--upload-port``, ``upload_listener.py``) that serves this same route on a port of its own.
"""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from diffusion_rollout.entrypoints.routers.common import get_weights, require_admin_key
from diffusion_rollout.entrypoints.upload_part import UPLOAD_PATH, UploadQuery, apply_part, refuse_body
from diffusion_rollout.entrypoints.upload_stream import receive_body
from diffusion_rollout.errors import WeightUpdateError

router = APIRouter(dependencies=[Depends(require_admin_key)])

Version = str | int | None


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UpdateFromDiskRequest(_Body):
    model_path: str
    target_modules: list[str] | None = None
    flush_cache: bool = True
    weight_version: Version = None


class UpdateFromTensorRequest(_Body):
    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: Literal["direct", "flattened_bucket"] | None = None
    target_modules: list[str] | None = None
    weight_update_mode: Literal["lora_merge"] | None = None
    lora_alpha: float | None = Field(None, gt=0)
    lora_rank: int | None = Field(None, ge=1)
    weight_version: Version = None
    payload_gpu_uuids: list[str] | None = None
    flush_cache: bool = True


class InitGroupRequest(_Body):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["nccl", "gloo"] = "nccl"
    timeout_s: float = Field(300.0, gt=0, le=3600)


class UpdateFromDistributedRequest(_Body):
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    target_modules: list[str] | None = None
    flush_cache: bool = True
    weight_version: Version = None


class DestroyGroupRequest(_Body):
    group_name: str = "weight_update_group"


class ChecksumRequest(_Body):
    module_names: list[str] | None = None
    # "state_dict": parameters and persistent buffers, as miles hashes a trainer's state_dict().
    algorithm: Literal["sglang", "v2", "state_dict"] = "sglang"


class TensorCheckerRequest(_Body):
    target_module: str
    # One manifest, or SGLang's one per TP rank (this server is one rank: the first is used).
    expected_named_tensors_sha256: dict[str, str] | list[dict[str, str]]


def _manager(request: Request):
    return get_weights(request)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateFromDiskRequest, request: Request) -> dict:
    return await _manager(request).update_from_disk(
        body.model_path, body.target_modules, flush_cache=body.flush_cache, weight_version=body.weight_version
    )


@router.post(UPLOAD_PATH)
async def update_weights(request: Request, query: Annotated[UploadQuery, Query()]) -> dict:
    manager = _manager(request)
    try:
        body = await receive_body(request, manager.receive_buffers)
    except WeightUpdateError as exc:  # cut short or too long: the part fails, and so does its upload
        await refuse_body(manager, exc, query)
    return await apply_part(manager, body, query)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(body: UpdateFromTensorRequest, request: Request) -> dict:
    return await _manager(request).update_from_tensor(
        body.serialized_named_tensors,
        load_format=body.load_format,
        target_modules=body.target_modules,
        weight_update_mode=body.weight_update_mode,
        lora_alpha=body.lora_alpha,
        lora_rank=body.lora_rank,
        weight_version=body.weight_version,
        payload_gpu_uuids=body.payload_gpu_uuids,
        flush_cache=body.flush_cache,
    )


@router.post("/init_weights_update_group")
async def init_weights_update_group(body: InitGroupRequest, request: Request) -> dict:
    return await _manager(request).init_group(**body.model_dump())


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(body: UpdateFromDistributedRequest, request: Request) -> dict:
    return await _manager(request).update_from_distributed(**body.model_dump())


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request, body: DestroyGroupRequest | None = None) -> dict:
    body = body or DestroyGroupRequest()
    return await _manager(request).destroy_group(body.group_name)


@router.post("/get_weights_checksum")
async def get_weights_checksum(request: Request, body: ChecksumRequest | None = None) -> JSONResponse:
    body = body or ChecksumRequest()
    manager = _manager(request)
    sums = await manager.checksums(body.module_names, body.algorithm)
    # Any string is a valid version; a header carries Latin-1 only, so it travels percent-encoded (UTF-8).
    version = quote(str(manager.weight_version), safe="")
    return JSONResponse(sums, headers={"X-Weight-Version": version})


@router.post("/update_weights_from_tensor_checker")
async def update_weights_from_tensor_checker(body: TensorCheckerRequest, request: Request) -> dict:
    expected = body.expected_named_tensors_sha256
    if isinstance(expected, list):
        if not expected:
            raise WeightUpdateError(
                "expected_named_tensors_sha256 is empty", field="expected_named_tensors_sha256"
            )
        expected = expected[0]
    return await _manager(request).check_tensors(body.target_module, expected)
