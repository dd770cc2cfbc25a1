"""Maps the project's exceptions to the one error shape of api.md.

``{"error": {"message": str, "type": str, "code": int}}``; FastAPI's validation errors keep their
``detail`` list next to it so clients that parse either form keep working, and SGLang's weight, LoRA
and memory routes add its ``success``/``message`` keys (``SGLANG_RESULT_PATHS``). :func:`response_for` is
the whole mapping as one function, so a responder outside FastAPI (the direct upload listener)
answers exactly what the app would.

Logging is for operators: a ``NotReadyError`` (loading, paused, released, shutting down) is an
expected state that a readiness probe may hit every half second, so it is logged at info once when
the state first shows (per app, ``log_not_ready``; ``note_ready`` closes it) and at debug on every later request;
other 5xx stay errors, one line per request.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from diffusion_rollout.errors import DiffusionRolloutError, NotReadyError, QueueFullError

logger = logging.getLogger(__name__)


# SGLang's weight, LoRA and memory routes answer a failure as ``{"success": false, "message": ...}``
# and its clients test ``result.get("success", True)``: on these routes the error body carries those
# two keys beside the project's ``error`` object, and a missing required field is SGLang's 400
# ("model_path is required"), not FastAPI's 422. ``/update_weights`` (this project's own upload
# route, also served by the upload listener) keeps the plain shape.
SGLANG_RESULT_PATHS = frozenset(
    {
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_tensor_checker",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
        "/set_lora_from_tensor",
        "/v1/set_lora",
        "/v1/merge_lora_weights",
        "/v1/unmerge_lora_weights",
        "/lora/load",
        "/lora/activate",
        "/lora/unload",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    }
)


def error_body(message: str, error_type: str, code: int, path: str | None = None) -> dict:
    body: dict = {"error": {"message": message, "type": error_type, "code": code}}
    if path in SGLANG_RESULT_PATHS:
        body = {"success": False, "message": message, **body}
    return body


def error_response(exc: DiffusionRolloutError, path: str | None = None) -> JSONResponse:
    headers = {}
    if isinstance(exc, QueueFullError):
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    return JSONResponse(
        error_body(exc.message, exc.error_type, exc.status_code, path),
        status_code=exc.status_code,
        headers=headers,
    )


def _missing_fields(exc: RequestValidationError) -> list[str]:
    """The names of missing required top-level fields, when those are the body's only faults."""
    errors = exc.errors()
    if not errors or any(e.get("type") != "missing" for e in errors):
        return []
    return [".".join(str(x) for x in e.get("loc", ()) if x != "body") for e in errors]


def _describe_validation(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown field '{where}'")
        else:
            parts.append(f"{where}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request body"


def validation_response(exc: RequestValidationError, path: str | None = None) -> JSONResponse:
    missing = _missing_fields(exc) if path in SGLANG_RESULT_PATHS else []
    if missing:
        message = "; ".join(f"{name} is required" for name in missing)
        return JSONResponse(error_body(message, "invalid_request", 400, path), status_code=400)
    body = error_body(_describe_validation(exc), "validation_error", 422, path)
    body["detail"] = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in exc.errors()]
    return JSONResponse(body, status_code=422)


def http_exception_response(exc: StarletteHTTPException, path: str | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(str(exc.detail), "http_error", exc.status_code, path),
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


def internal_error_response(exc: BaseException, path: str | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(f"internal error: {type(exc).__name__}: {exc}", "internal_error", 500, path), 500
    )


def response_for(exc: BaseException) -> JSONResponse:
    """The app's answer to ``exc`` (no logging: the caller knows the request to name)."""
    if isinstance(exc, DiffusionRolloutError):
        return error_response(exc)
    if isinstance(exc, RequestValidationError):
        return validation_response(exc)
    if isinstance(exc, StarletteHTTPException):
        return http_exception_response(exc)
    return internal_error_response(exc)


def log_not_ready(app: FastAPI, exc: NotReadyError) -> None:
    """Info once when ``exc.state`` first shows (per app), debug on every later request."""
    if getattr(app.state, "not_ready", None) != exc.state:
        app.state.not_ready = exc.state
        logger.info("not serving generation (%s): %s", exc.state, exc.message)
    else:
        logger.debug("still not serving generation (%s): %s", exc.state, exc.message)


def note_ready(app: FastAPI) -> None:
    """A readiness check passed: the state logged by ``log_not_ready`` (if any) is over."""
    previous = getattr(app.state, "not_ready", None)
    if previous is not None:
        app.state.not_ready = None
        logger.info("serving generation again (was: %s)", previous)


def install_error_handlers(app: FastAPI) -> None:
    app.state.not_ready = None

    @app.exception_handler(DiffusionRolloutError)
    async def _ours(request: Request, exc: DiffusionRolloutError) -> JSONResponse:
        if isinstance(exc, NotReadyError):
            log_not_ready(request.app, exc)
        elif exc.status_code >= 500:
            logger.error("%s %s failed: %s", request.method, request.url.path, exc.message)
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_exception_response(exc, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error in %s %s", request.method, request.url.path)
        return internal_error_response(exc)
