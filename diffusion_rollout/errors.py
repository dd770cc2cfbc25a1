"""The one exception hierarchy of the project.

Every failure the server can report is a ``DiffusionRolloutError`` carrying the HTTP status it maps
to, so the engine and the math raise plain exceptions and only the HTTP layer turns them into
responses (``{"error": {"message", "type", "code"}}``). Nothing returns ``(ok, message)`` tuples.
"""

from __future__ import annotations


class DiffusionRolloutError(Exception):
    """Base class. ``status_code`` is what the HTTP layer answers; ``error_type`` names the kind."""

    status_code: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class RequestError(DiffusionRolloutError):
    """A well-formed request that cannot be served (bad step indices, bad sigmas, bad size...)."""

    status_code = 400
    error_type = "invalid_request"


class WeightUpdateError(RequestError):
    """A weight or LoRA update rejected before anything changed (names, shapes, dtypes, payload)."""

    error_type = "invalid_weight_update"


class NotFoundError(DiffusionRolloutError):
    """A named thing (LoRA adapter, module, update group) does not exist."""

    status_code = 404
    error_type = "not_found"


class AuthenticationError(DiffusionRolloutError):
    """No key was sent where one is required."""

    status_code = 401
    error_type = "authentication_error"


class PermissionDeniedError(DiffusionRolloutError):
    """A key was sent but it is not the right one."""

    status_code = 403
    error_type = "permission_denied"


class WeightVersionNotHeldError(DiffusionRolloutError):
    """A rollout asked for ``min_weight_version`` with ``min_weight_version_wait: false`` and the
    server does not hold that version yet (``weight_versions.py`` defines "holds").

    409 (conflict with the server's current state): the request is valid and may succeed once the
    trainer's update lands, so it is neither a 400 nor a 503.
    """

    status_code = 409
    error_type = "weight_version_not_held"


class PayloadTooLargeError(DiffusionRolloutError):
    """The request body is over the configured limit."""

    status_code = 413
    error_type = "payload_too_large"


class QueueFullError(DiffusionRolloutError):
    """The bounded request queue is full; the client should retry after ``retry_after`` seconds."""

    status_code = 429
    error_type = "queue_full"

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ServiceUnavailableError(DiffusionRolloutError):
    """The model is loading, its memory is released, or the server is shutting down."""

    status_code = 503
    error_type = "service_unavailable"


class NotReadyError(ServiceUnavailableError):
    """An expected state, not a fault: the model is loading, generation is paused, memory is
    released, or the server is shutting down. Same 503 and ``error_type`` on the wire; the HTTP
    layer logs it at info once per change of ``state`` (``loading``, ``paused``, ``released``,
    ``stopping``) and at debug otherwise (nobody must act)."""

    def __init__(self, message: str, *, state: str = "unavailable") -> None:
        super().__init__(message)
        self.state = state

    def __reduce__(self):
        # Keeps ``state`` when a replica's error crosses Ray (pickled).
        return (type(self), (self.message,), self.__dict__)


class ContextParallelError(ServiceUnavailableError):
    """A context-parallel engine cannot run: its family cannot be parallelised, or a follower rank
    failed to start, died or stopped answering (the engine then reports itself failed)."""

    error_type = "context_parallel_error"


class RequestTimeoutError(DiffusionRolloutError):
    """A rollout did not finish within ``request_timeout_s`` (queue wait included).

    504 rather than 503: 503 means "not ready, come back" (loading, asleep, shutting down), while this
    request was accepted and ran out of time, which a trainer wants to tell apart (raise the limit,
    shrink the request, or add servers). Queued work is dropped; a batch already running cannot be
    interrupted mid-loop, so it finishes and its result is discarded.
    """

    status_code = 504
    error_type = "request_timeout"


class RequestAbortedError(DiffusionRolloutError):
    """The request was aborted by ``POST /abort_request`` before its batch started.

    499 (the status servers record for a request its own client gave up on): the client asked for
    it, nothing ran, and a retry would be wrong, so it is neither a 503 nor a 5xx.
    """

    status_code = 499
    error_type = "request_aborted"


class GenerationError(DiffusionRolloutError):
    """A failure inside generation; only the requests of the failing batch see it."""

    status_code = 500
    error_type = "generation_error"


class WeightApplyError(DiffusionRolloutError):
    """A weight update failed while copying; the previous weights were restored."""

    status_code = 500
    error_type = "weight_update_failed"


class ReplicasDivergedError(WeightApplyError):
    """Replicas of a cluster no longer hold the same weights (a change failed on only some of them
    and rolling it back failed too), or their checksums differ. The message names the replicas."""

    error_type = "replicas_diverged"


class UntrustedFileError(DiffusionRolloutError):
    """A file or folder the server would load code from, or write into, is not the server's own
    (another owner, writable by others, a symbolic link): refused, never read (own_files.py)."""

    error_type = "untrusted_file"
