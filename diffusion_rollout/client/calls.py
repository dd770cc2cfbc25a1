"""Call descriptions: every endpoint of the rollout server as a :class:`_Call`, built the same for both clients.

Design decisions:

- **One description per call, two executors.** A :class:`_Call` holds everything about one request
  that does not depend on how it is sent: method, path, body (JSON, raw bytes or query parameters),
  which key it needs, whether a repeat is harmless, how the answer is decoded. The builders here
  are the only place a request body is put together; ``RolloutClient`` and ``AsyncRolloutClient``
  just send what they return, so the two clients cannot drift apart.
- **Retry class per call.** ``"idempotent"`` for reads, ``"refused"`` for rollouts (repeated only
  when the server certainly did no work), ``"never"`` for updates (a repeat could apply twice or
  race a newer one); :class:`~diffusion_rollout.client.base.RetryPolicy` turns that into decisions.
- **``None`` means "leave it out".** Optional fields are dropped, so the server's defaults apply;
  tensors and tuples are turned into JSON values (a schedule often arrives as a tensor).
- **A rollout body is checked before it is sent** with the server's own model
  (``protocol/requests.py``'s ``GenerateRequest``), so a bad field fails at once, naming the field,
  without a round trip (:func:`_check_generate_body`); a valid body is sent exactly as built.
- **Large bodies in slices.** Raw bodies over ``_UPLOAD_CHUNK`` go out as an iterator of slices
  with a ``Content-Length`` (see ``_ClientBase._request_kwargs``): httpcore re-slices one big
  ``bytes`` body after every socket write, which is quadratic for a multi-GB upload. Tests shrink
  ``_UPLOAD_CHUNK`` here to exercise the sliced path with a small payload.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from diffusion_rollout.client.exceptions import RequestValidationError, RolloutConnectionError
from diffusion_rollout.client.receive import decode_answer
from diffusion_rollout.client.results import ReplaySettings, RolloutOutput
from diffusion_rollout.protocol import lean, wire
from diffusion_rollout.protocol.safetensors_layout import SafetensorsBody

Retry = Literal["idempotent", "refused", "never"]
Auth = Literal["api", "admin", "none"]

_UPLOAD_CHUNK = 8 << 20
# generate()'s own arguments that are not request fields.
_NOT_FIELDS = {"self", "prompt", "server", "timeout", "extra_fields", "__class__"}


@dataclass
class _Call:
    """One HTTP call, independent of how it is sent."""

    method: str
    path: str
    auth: Auth
    retry: Retry
    json: Any = None
    content: bytes | SafetensorsBody | None = None
    params: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    timeout: float | httpx.Timeout | None = None
    decode: Literal["json", "wire", "text"] = "json"


def _bool(v: bool) -> str:
    return "true" if v else "false"


def _drop_none(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _octet_call(path: str, data, params: dict[str, Any], timeout) -> _Call:
    """An admin upload of safetensors bytes (never retried: an update is not idempotent).

    ``data``: bytes-like, or a :class:`SafetensorsBody` (sent from the tensors' memory, no copy).
    """
    return _Call(
        "POST",
        path,
        "admin",
        "never",
        content=data if isinstance(data, SafetensorsBody) else bytes(data),
        params=params,
        headers={"Content-Type": "application/octet-stream"},
        timeout=timeout,
    )


def _jsonable(value: Any) -> Any:
    """Tensors, numpy values and tuples as JSON values (a schedule often arrives as a tensor); bytes
    (an input image file for ``image_data``) as base64 text."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _slices(data: bytes | SafetensorsBody):
    # Views, not copies: httpcore's h11 writer copies each slice once on its way to the socket.
    if isinstance(data, SafetensorsBody):
        yield from data.slices(_UPLOAD_CHUNK)
        return
    view = memoryview(data)
    for start in range(0, len(view), _UPLOAD_CHUNK):
        yield view[start : start + _UPLOAD_CHUNK]


def _optional_list(values: Sequence[Any] | None) -> list[Any] | None:
    return list(values) if values is not None else None


# ---------------------------------------------------------------------------- reads and switches
def _info_call(path: str, decode: Literal["json", "text"] = "json", *, admin: bool = False) -> _Call:
    """An idempotent ``GET`` (health, info, models, metrics); unauthenticated unless ``admin`` (then
    with the admin key, for the answer's full form)."""
    return _Call("GET", path, "admin" if admin else "none", "idempotent", decode=decode)


def _ready_call() -> _Call:
    # Not retried by the policy: ``wait_until_ready`` polls with its own interval and deadline.
    return _Call("GET", "/health_generate", "none", "never")


def _admin_switch_call(path: str) -> _Call:
    """A bodiless admin ``POST`` (pause, continue, release and resume memory)."""
    return _Call("POST", path, "admin", "never")


def _abort_call(rid: str | None, abort_all: bool) -> _Call:
    """SGLang's ``/abort_request``: one request needs the API key, ``abort_all`` the admin key."""
    body = {"rid": rid or "", "abort_all": abort_all}
    return _Call("POST", "/abort_request", "admin" if abort_all else "api", "never", json=body)


# ---------------------------------------------------------------------------- rollouts
# Request fields that carry tensors (precomputed conditioning): sent as tensors, not as lists.
TENSOR_FIELDS = frozenset(
    {"prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds", "negative_pooled_prompt_embeds"}
)


def _generate_call(prompt: str | None, fields: Mapping[str, Any], timeout) -> tuple[_Call, ReplaySettings]:
    values = _drop_none({"prompt": prompt, **fields})
    tensors = {k: v.detach().cpu() for k, v in values.items() if k in TENSOR_FIELDS}
    body = {k: _jsonable(v) for k, v in values.items() if k not in TENSOR_FIELDS}
    if "prompt" not in body and not tensors:
        raise ValueError("generate needs a prompt (or prompt_embeds)")
    if body.get("rollout_return_denoising_env") and "lean_response" not in body:
        # This client understands the lean form (lean.py): the shared conditioning travels once.
        body["lean_response"] = True
    _check_generate_body({**body, **tensors})
    settings = ReplaySettings.from_request(body)
    if tensors:  # a msgpack body: raw tensor bytes, no base64 (api.md, wire format)
        content = wire.encode({**body, **tensors})
        headers = {"Content-Type": wire.MSGPACK}
        call = _Call(
            "POST", "/rollout/generate", "api", "refused", content=content, headers=headers,
            timeout=timeout, decode="wire",
        )  # fmt: skip
        return call, settings
    call = _Call("POST", "/rollout/generate", "api", "refused", json=body, timeout=timeout, decode="wire")
    return call, settings


def _check_generate_body(body: dict[str, Any]) -> None:
    """Validate a ``/rollout/generate`` body with the server's request model; a refusal is a
    :class:`RequestValidationError` naming each field as the server's 422 does. Skipped where
    pydantic cannot be imported. The body itself is not changed."""
    try:
        from pydantic import ValidationError

        from diffusion_rollout.protocol.requests import GenerateRequest
    except ImportError:  # pragma: no cover - pydantic is a dependency; a trimmed install may lack it
        return
    try:
        GenerateRequest.model_validate(dict(body))
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        where = [".".join(str(x) for x in e.get("loc", ())) or "body" for e in errors]
        message = "; ".join(f"{w}: {e.get('msg')}" for w, e in zip(where, errors, strict=True))
        detail = [{k: e[k] for k in ("loc", "msg", "type") if k in e} for e in errors]
        raise RequestValidationError(
            message or "invalid request body", field=where[0] if where else None, detail=detail
        ) from None


def _outputs(decoded: Any, settings: ReplaySettings) -> list[RolloutOutput]:
    if not isinstance(decoded, list):
        raise RolloutConnectionError(f"unexpected /rollout/generate answer: {type(decoded).__name__}")
    try:
        decoded = lean.from_lean(decoded)
    except ValueError as exc:
        raise RolloutConnectionError(f"malformed lean /rollout/generate answer: {exc}") from None
    return [RolloutOutput.from_dict(d, settings) for d in decoded]


def _wire_outputs(body, media_type: str, settings: ReplaySettings) -> list[RolloutOutput]:
    """The outputs of a ``/rollout/generate`` answer body (any buffer)."""
    try:
        decoded = decode_answer(body, media_type)
    except wire.WireFormatError as exc:
        raise RolloutConnectionError(f"malformed /rollout/generate answer: {exc}") from None
    return _outputs(decoded, settings)


def _merge_item(item: str | Mapping[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    job = dict(shared)
    if isinstance(item, str):
        job["prompt"] = item
    elif isinstance(item, Mapping):
        job.update(item)
        if "prompt" not in job and "prompt_embeds" not in job:
            raise ValueError(f"a generate_many item needs a 'prompt' (or 'prompt_embeds'): {list(item)!r}")
    else:
        raise TypeError(f"a generate_many item is a prompt or a mapping of fields, not {type(item).__name__}")
    return job


# ---------------------------------------------------------------------------- full weights
def _disk_call(model_path, target_modules, flush_cache, weight_version, timeout) -> _Call:
    body = _drop_none(
        {
            "model_path": model_path,
            "target_modules": _optional_list(target_modules),
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
    )
    return _Call("POST", "/update_weights_from_disk", "admin", "never", json=body, timeout=timeout)


def _upload_call(
    data, target_module, weight_version, final, upload_id, part, flush_cache, timeout, partial=False
) -> _Call:
    params = _drop_none(
        {
            "target_module": target_module,
            "weight_version": weight_version,
            "final": _bool(final),
            "upload_id": upload_id,
            "part": part,
            "flush_cache": _bool(flush_cache),
            "partial": _bool(True) if partial else None,  # absent = a full update (the server default)
        }
    )
    return _octet_call("/update_weights", data, params, timeout)


def _tensor_call(args: Mapping[str, Any]) -> _Call:
    """``/update_weights_from_tensor`` from the ``locals()`` of ``update_weights_from_tensor``."""
    body = {
        "serialized_named_tensors": list(args["serialized_named_tensors"]),
        "load_format": args["load_format"],
        "target_modules": _optional_list(args["target_modules"]),
        "weight_update_mode": args["weight_update_mode"],
        "lora_alpha": args["lora_alpha"],
        "lora_rank": args["lora_rank"],
        "weight_version": args["weight_version"],
        "payload_gpu_uuids": _optional_list(args["payload_gpu_uuids"]),
        "flush_cache": args["flush_cache"],
    }
    return _Call(
        "POST",
        "/update_weights_from_tensor",
        "admin",
        "never",
        json=_drop_none(body),
        timeout=args["timeout"],
    )


def _init_group_call(
    master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s, timeout
) -> _Call:
    body = {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
        "timeout_s": timeout_s,
    }
    return _Call("POST", "/init_weights_update_group", "admin", "never", json=body, timeout=timeout)


def _distributed_call(
    names, dtypes, shapes, group_name, target_modules, weight_version, flush_cache, timeout
) -> _Call:
    body = _drop_none(
        {
            "names": list(names),
            "dtypes": [str(d) for d in dtypes],
            "shapes": [list(map(int, s)) for s in shapes],
            "group_name": group_name,
            "target_modules": _optional_list(target_modules),
            "weight_version": weight_version,
            "flush_cache": flush_cache,
        }
    )
    return _Call("POST", "/update_weights_from_distributed", "admin", "never", json=body, timeout=timeout)


def _destroy_group_call(group_name: str) -> _Call:
    return _Call("POST", "/destroy_weights_update_group", "admin", "never", json={"group_name": group_name})


def _checksum_call(module_names: Sequence[str] | None, algorithm: str) -> _Call:
    body = _drop_none({"module_names": _optional_list(module_names), "algorithm": algorithm})
    return _Call("POST", "/get_weights_checksum", "admin", "idempotent", json=body)


def _checker_call(target_module: str, expected: Mapping[str, str]) -> _Call:
    body = {"target_module": target_module, "expected_named_tensors_sha256": dict(expected)}
    return _Call("POST", "/update_weights_from_tensor_checker", "admin", "idempotent", json=body)


# ---------------------------------------------------------------------------- LoRA
def _lora_load_call(
    name: str,
    *,
    path: str | None,
    data: bytes | SafetensorsBody | None,
    target_module: str,
    peft_config: Mapping[str, Any] | None,
    lora_alpha: float | None,
    activate: bool,
    mode: str | None,
    strength: float | None,
    weight_version: str | int | None,
    timeout,
) -> _Call:
    if (path is None) == (data is None):
        raise ValueError("pass exactly one of path (on the server) or data (safetensors bytes)")
    if data is not None:
        params = _drop_none(
            {
                "name": name,
                "target_module": target_module,
                "peft_config": json.dumps(peft_config) if peft_config is not None else None,
                "lora_alpha": lora_alpha,
                "activate": _bool(activate),
                "mode": mode,
                "strength": strength,
                "weight_version": weight_version,
            }
        )
        return _octet_call("/lora/load", data, params, timeout)
    body = _drop_none(
        {
            "name": name,
            "target_module": target_module,
            "path": path,
            "peft_config": peft_config,
            "lora_alpha": lora_alpha,
            "activate": activate,
            "mode": mode,
            "strength": strength,
            "weight_version": weight_version,
        }
    )
    return _Call("POST", "/lora/load", "admin", "never", json=body, timeout=timeout)


def _activate_call(name, target_module, mode, strength, merge_dtype, weight_version) -> _Call:
    body = {"name": name, "target_module": target_module}
    body.update(
        _drop_none(
            {"mode": mode, "strength": strength, "merge_dtype": merge_dtype, "weight_version": weight_version}
        )
    )
    return _Call("POST", "/lora/activate", "admin", "never", json=body)


def _unload_call(name, target_module, weight_version) -> _Call:
    body = _drop_none({"name": name, "target_module": target_module, "weight_version": weight_version})
    return _Call("POST", "/lora/unload", "admin", "never", json=body)


def _lora_list_call() -> _Call:
    return _Call("GET", "/lora", "admin", "idempotent")
