"""Named LoRA adapters (weights.md) and SGLang's ``/v1/*lora*`` routes. Admin key required.

``POST /lora/load`` has two forms, chosen by ``Content-Type``:

- ``application/json``: ``{name, target_module?, path, peft_config?, lora_alpha?, activate?, mode?,
  strength?, weight_version?}``. ``path`` is on the server: a PEFT folder (``adapter_model.safetensors``
  + ``adapter_config.json``), a diffusers LoRA folder (``pytorch_lora_weights.safetensors``) or one
  ``.safetensors`` file.
- ``application/octet-stream``: the body is one safetensors file (keys ``<layer>.lora_A.weight`` /
  ``<layer>.lora_B.weight``); ``name``, ``target_module``, ``lora_alpha``, ``activate``, ``mode``,
  ``strength``, ``weight_version`` and ``peft_config`` (JSON text) come as query parameters. The
  config may instead travel inside the file, as JSON under the safetensors metadata key
  ``peft_config`` (diffusers' ``lora_adapter_metadata`` is read too) so one body is self-describing.

Without any config the payload describes the adapter: exactly its layers are wrapped, the rank
comes from ``lora_A``, alpha is ``lora_alpha`` or the rank. Loading a name that exists replaces its
tensors in place. ``/lora/activate`` picks the adapter rollouts use (``null``: the base model) and
optionally the mode (``dynamic`` or ``merged``). SGLang's routes map onto the same operations:
``/v1/set_lora`` loads (when ``lora_path`` is given) and activates, ``/v1/merge_lora_weights`` and
``/v1/unmerge_lora_weights`` switch between merged and dynamic mode, ``/v1/list_loras`` lists.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from diffusion_rollout.entrypoints.routers.common import get_weights, require_admin_key
from diffusion_rollout.entrypoints.upload_stream import receive_body
from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.protocol.lora_options import LoraLoadFields, LoraLoadOptions, ModeName

router = APIRouter(dependencies=[Depends(require_admin_key)])

Version = str | int | None


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoraLoadRequest(_Body, LoraLoadFields):
    # The load options (lora_alpha, activate, mode, strength) come from LoraLoadFields.
    name: str = Field(min_length=1)
    target_module: str = "transformer"
    path: str | None = None
    peft_config: dict[str, Any] | None = None
    weight_version: Version = None


class LoraActivateRequest(_Body):
    name: str | None
    target_module: str = "transformer"
    mode: ModeName | None = None
    strength: float | None = None
    merge_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    weight_version: Version = None


class LoraUnloadRequest(_Body):
    name: str | None = None
    target_module: str = "transformer"
    weight_version: Version = None


class SetLoraRequest(_Body):
    lora_nickname: str | list[str]
    lora_path: str | list[str | None] | None = None
    target: str | list[str] = "all"
    strength: float | list[float] = 1.0
    # SGLang: "merge" and "auto" (merged here: one device, no FSDP shards) or "dynamic".
    merge_mode: Literal["auto", "merge", "dynamic"] | None = None
    lora_alpha: float | list[float | None] | None = None


class MergeLoraRequest(_Body):
    target: str = "all"
    strength: float | None = None


class UnmergeLoraRequest(_Body):
    target: str = "all"


def _manager(request: Request):
    return get_weights(request)


def _validated(model: type[BaseModel], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from exc


_UPLOAD_QUERY = set(LoraLoadRequest.model_fields) - {"path"}


@router.post("/lora/load")
async def lora_load(request: Request) -> dict:
    manager = _manager(request)
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "application/octet-stream":
        query = dict(request.query_params)
        unknown = sorted(set(query) - _UPLOAD_QUERY)
        if unknown:
            raise RequestValidationError(
                [
                    {"loc": ("query", k), "msg": "unknown query parameter", "type": "extra_forbidden"}
                    for k in unknown
                ]
            )
        if "peft_config" in query:
            try:
                query["peft_config"] = json.loads(query["peft_config"])
            except json.JSONDecodeError as exc:
                raise WeightUpdateError(f"peft_config is not JSON: {exc}", field="peft_config") from exc
        body = _validated(LoraLoadRequest, query)
        data = await receive_body(request, manager.receive_buffers)
        return await manager.load_lora(
            target_module=body.target_module,
            name=body.name,
            data=data,
            peft_config=body.peft_config,
            options=body.load_options(),
            weight_version=body.weight_version,
        )
    try:
        raw = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestValidationError(
            [
                {
                    "loc": ("body",),
                    "msg": f"send JSON or application/octet-stream ({exc})",
                    "type": "json_invalid",
                }
            ]
        ) from exc
    body = _validated(LoraLoadRequest, raw)
    if body.path is None:
        raise WeightUpdateError("send 'path' in JSON, or the safetensors bytes as application/octet-stream")
    return await manager.load_lora(
        target_module=body.target_module,
        name=body.name,
        path=body.path,
        peft_config=body.peft_config,
        options=body.load_options(),
        weight_version=body.weight_version,
    )


@router.post("/lora/activate")
async def lora_activate(body: LoraActivateRequest, request: Request) -> dict:
    return await _manager(request).activate_lora(
        target_module=body.target_module,
        name=body.name,
        mode=body.mode,
        strength=body.strength,
        merge_dtype=body.merge_dtype,
        weight_version=body.weight_version,
    )


@router.post("/lora/unload")
async def lora_unload(body: LoraUnloadRequest, request: Request) -> dict:
    return await _manager(request).unload_lora(
        target_module=body.target_module, name=body.name, weight_version=body.weight_version
    )


@router.get("/lora")
async def lora_list(request: Request) -> dict:
    manager = _manager(request)
    return {"weight_version": manager.weight_version, "modules": await manager.describe_lora()}


# ---------------------------------------------------------------------------- SGLang compatibility
def sglang_targets(manager, target: str) -> list[str]:
    """SGLang's ``target``: ``all`` (every transformer), or a module name."""
    if target == "all":
        names = [n for n in manager.module_names() if n.startswith("transformer")]
        if not names:
            raise WeightUpdateError("this pipeline has no transformer module", field="target")
        return names
    return manager.targets([target])


def _per_nickname(value: Any, n: int, field: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise WeightUpdateError(f"{field} has {len(value)} items but lora_nickname has {n}", field=field)
        return value
    return [value] * n


@router.post("/v1/set_lora")
async def set_lora(body: SetLoraRequest, request: Request) -> dict:
    manager = _manager(request)
    nicknames = body.lora_nickname if isinstance(body.lora_nickname, list) else [body.lora_nickname]
    paths = _per_nickname(body.lora_path, len(nicknames), "lora_path")
    targets = _per_nickname(body.target, len(nicknames), "target")
    strengths = _per_nickname(body.strength, len(nicknames), "strength")
    alphas = _per_nickname(body.lora_alpha, len(nicknames), "lora_alpha")
    mode = {None: None, "dynamic": "dynamic"}.get(body.merge_mode, "merged")
    plan = []
    for nickname, path, target, strength, alpha in zip(
        nicknames, paths, targets, strengths, alphas, strict=True
    ):
        plan.extend((nickname, path, module, strength, alpha) for module in sglang_targets(manager, target))
    modules = [module for _, _, module, _, _ in plan]
    if len(set(modules)) != len(modules):
        raise WeightUpdateError(
            "one active adapter per module: two nicknames target the same module", field="target"
        )
    out: dict = {}
    for nickname, path, module, strength, alpha in plan:
        if path is not None:
            out = await manager.load_lora(
                target_module=module,
                name=nickname,
                path=path,
                options=LoraLoadOptions(lora_alpha=alpha, activate=True, mode=mode, strength=strength),
            )
        else:
            out = await manager.activate_lora(
                target_module=module, name=nickname, mode=mode, strength=strength
            )
    out["message"] = f"active: {', '.join(f'{m}={n!r}' for n, _, m, _, _ in plan)}"
    return out


@router.post("/v1/merge_lora_weights")
async def merge_lora_weights(request: Request, body: MergeLoraRequest | None = None) -> dict:
    body = body or MergeLoraRequest()
    manager = _manager(request)
    described = await manager.describe_lora()
    out: dict = {}
    for module in sglang_targets(manager, body.target):
        active = described.get(module, {}).get("active")
        if active is None:
            if body.target == "all":
                continue
            raise WeightUpdateError(f"{module} has no active LoRA adapter to merge", field="target")
        out = await manager.activate_lora(
            target_module=module, name=active, mode="merged", strength=body.strength
        )
    if not out:
        raise WeightUpdateError("no module has an active LoRA adapter to merge", field="target")
    return out


@router.post("/v1/unmerge_lora_weights")
async def unmerge_lora_weights(request: Request, body: UnmergeLoraRequest | None = None) -> dict:
    body = body or UnmergeLoraRequest()
    manager = _manager(request)
    described = await manager.describe_lora()
    out = manager.result("nothing was merged")
    for module in sglang_targets(manager, body.target):
        if module in described:
            out = await manager.set_lora_mode(target_module=module, mode="dynamic")
    return out


@router.get("/v1/list_loras")
async def list_loras(request: Request) -> dict:
    manager = _manager(request)
    described = await manager.describe_lora()
    loaded, active = [], {}
    for module, state in described.items():
        for name, info in state["adapters"].items():
            loaded.append({"nickname": name, "path": info["source"], "target": module, "rank": info["rank"]})
        if state["active"] is not None:
            info = state["adapters"][state["active"]]
            active[module] = [
                {
                    "nickname": state["active"],
                    "path": info["source"],
                    "merged": state["merged"],
                    "mode": state["mode"],
                    "strength": info["strength"],
                }
            ]
    return {"loaded_adapters": loaded, "active": active, "weight_version": manager.weight_version}
