"""Exceptions the trainer client raises, as members of the project's one hierarchy.

Design decisions:

- An error answer from the server becomes a :class:`RolloutHTTPError` that is *also* the project's
  exception for that status (``QueueFullError`` for 429, ``RequestError`` for 400, ...), so a trainer
  can catch ``RolloutHTTPError`` (anything the server refused), a project class
  (``except QueueFullError``), or both, and the server and the client share one vocabulary.
- The instance carries what a person needs to act: the HTTP ``status_code``, the server's
  ``message`` and ``error_type`` (api.md's ``{"error": {"message", "type", "code"}}``), FastAPI's
  validation ``detail`` when present, the ``X-Request-Id`` to find the server's log line, the URL,
  and ``retry_after`` for 429.
- The server's ``error_type`` picks the class where the status alone is ambiguous (a 400 for a
  rejected weight update is a ``WeightUpdateError``, a 500 after a rolled-back copy is a
  ``WeightApplyError``).
- Failing to reach a server at all (refused connection, timeout) is a :class:`RolloutConnectionError`,
  which has no status code: the server never answered.
- A rollout body that the server's own request model (``protocol/requests.py``) refuses is caught
  before it is sent: a :class:`RequestValidationError`, a ``RequestError`` like the server's 422
  (``except RequestError`` catches both), naming the field.
"""

from __future__ import annotations

from typing import Any

from diffusion_rollout.errors import (
    AuthenticationError,
    DiffusionRolloutError,
    GenerationError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    QueueFullError,
    RequestAbortedError,
    RequestError,
    RequestTimeoutError,
    ServiceUnavailableError,
    WeightApplyError,
    WeightUpdateError,
    WeightVersionNotHeldError,
)

__all__ = [
    "ChecksumMismatchError",
    "RequestValidationError",
    "RolloutConnectionError",
    "RolloutHTTPError",
    "RolloutTimeoutError",
    "error_from_response",
]


class RolloutHTTPError(DiffusionRolloutError):
    """The server answered with an error status.

    Attributes:
        status_code: the HTTP status.
        message: the server's message (names the field and the rule for 4xx).
        error_type: the server's error type (``invalid_request``, ``queue_full``, ...).
        detail: FastAPI's validation errors for 422, else None.
        request_id: the ``X-Request-Id`` of the failed request.
        url: the URL that answered.
        retry_after: seconds from ``Retry-After`` (429), else None.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        error_type: str,
        detail: Any = None,
        request_id: str | None = None,
        url: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        # Not super().__init__: the project classes mixed in below take different keywords.
        Exception.__init__(self, message)
        self.message = message
        self.field = None
        self.status_code = status_code
        self.error_type = error_type
        self.detail = detail
        self.request_id = request_id
        self.url = url
        self.retry_after = retry_after

    def __str__(self) -> str:
        rid = f", request {self.request_id}" if self.request_id else ""
        return f"{self.status_code} {self.error_type}: {self.message} ({self.url or 'server'}{rid})"


class BadRequestError(RolloutHTTPError, RequestError):
    """400: well-formed but not servable."""


class ServerValidationError(RolloutHTTPError, RequestError):
    """422: malformed body or unknown field (``detail`` lists FastAPI's errors)."""


class RequestValidationError(RequestError):
    """A rollout body the request model refuses, found by the client before sending it (nothing was
    sent). ``message`` names each field as the server's 422 would; ``detail`` is pydantic's list of
    errors; ``field`` is the first one's."""

    error_type = "validation_error"

    def __init__(self, message: str, *, field: str | None = None, detail: list[dict[str, Any]] | None = None):
        super().__init__(message, field=field)
        self.detail = detail


class ServerWeightUpdateError(BadRequestError, WeightUpdateError):
    """400 on a weight or LoRA update: rejected before anything changed."""


class ServerAuthenticationError(RolloutHTTPError, AuthenticationError):
    """401: a key is required and none was sent."""


class ServerPermissionDeniedError(RolloutHTTPError, PermissionDeniedError):
    """403: the key sent is not the right one."""


class ServerNotFoundError(RolloutHTTPError, NotFoundError):
    """404: unknown adapter, module, group or path."""


class ServerPayloadTooLargeError(RolloutHTTPError, PayloadTooLargeError):
    """413: the body is over the server's limit (lower ``max_part_bytes``)."""


class ServerQueueFullError(RolloutHTTPError, QueueFullError):
    """429: the server's queue is full; ``retry_after`` says when to come back."""


class ServerUnavailableError(RolloutHTTPError, ServiceUnavailableError):
    """503: loading, memory released, or shutting down."""


class ServerRequestTimeoutError(RolloutHTTPError, RequestTimeoutError):
    """504: the rollout ran out of ``request_timeout_s`` on the server (not retried: it may have run)."""


class ServerRequestAbortedError(RolloutHTTPError, RequestAbortedError):
    """499: the request was aborted (``/abort_request``) before it ran (not retried)."""


class ServerWeightVersionNotHeldError(RolloutHTTPError, WeightVersionNotHeldError):
    """409: the server does not hold the rollout's ``min_weight_version`` (and was told not to wait)."""


class ServerGenerationError(RolloutHTTPError, GenerationError):
    """500 from generation."""


class ServerWeightApplyError(RolloutHTTPError, WeightApplyError):
    """500 while copying weights; the server restored the previous values."""


class ServerInternalError(RolloutHTTPError):
    """Any other error status."""


class RolloutConnectionError(DiffusionRolloutError):
    """The server could not be reached (after the retries the call allows)."""

    error_type = "connection_error"

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.status_code = None


class RolloutTimeoutError(RolloutConnectionError):
    """The server did not answer within the timeout."""

    error_type = "timeout"


class ChecksumMismatchError(DiffusionRolloutError):
    """The server's checksum differs from the one computed on the trainer's tensors."""

    error_type = "checksum_mismatch"

    def __init__(self, message: str, *, expected: Any = None, actual: Any = None) -> None:
        super().__init__(message)
        self.expected = expected
        self.actual = actual


_BY_TYPE: dict[str, type[RolloutHTTPError]] = {
    "invalid_weight_update": ServerWeightUpdateError,
    "weight_update_failed": ServerWeightApplyError,
    "generation_error": ServerGenerationError,
}
_BY_STATUS: dict[int, type[RolloutHTTPError]] = {
    400: BadRequestError,
    401: ServerAuthenticationError,
    403: ServerPermissionDeniedError,
    404: ServerNotFoundError,
    409: ServerWeightVersionNotHeldError,
    413: ServerPayloadTooLargeError,
    422: ServerValidationError,
    429: ServerQueueFullError,
    499: ServerRequestAbortedError,
    503: ServerUnavailableError,
    504: ServerRequestTimeoutError,
}


def error_from_response(
    status_code: int,
    body: Any,
    *,
    text: str = "",
    request_id: str | None = None,
    url: str | None = None,
    retry_after: float | None = None,
) -> RolloutHTTPError:
    """The exception for an error answer; ``body`` is the parsed JSON body or None."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message") or "")
        error_type = str(err.get("type") or f"http_{status_code}")
    elif isinstance(body, dict) and "detail" in body:  # a plain FastAPI/Starlette error body
        message, error_type = str(body["detail"]), f"http_{status_code}"
    else:
        message, error_type = (text or "").strip()[:2000], f"http_{status_code}"
    detail = body.get("detail") if isinstance(body, dict) else None
    cls = _BY_TYPE.get(error_type) or _BY_STATUS.get(status_code) or ServerInternalError
    return cls(
        message or f"HTTP {status_code}",
        status_code=status_code,
        error_type=error_type,
        detail=detail,
        request_id=request_id,
        url=url,
        retry_after=retry_after,
    )
