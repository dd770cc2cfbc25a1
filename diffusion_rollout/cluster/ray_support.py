"""Ray as an optional dependency: importing it on demand, unwrapping what replicas raise, the session.

Kept apart from ``engine.py`` so that the front and the weight fan-out (``weights.py``) share these
without importing each other; nothing here imports Ray until it is called.
"""

from __future__ import annotations

import contextlib
from typing import Any

from diffusion_rollout.config import ServerConfig
from diffusion_rollout.errors import DiffusionRolloutError, ServiceUnavailableError

RAY_MISSING = "replicas need Ray: pip install 'diffusion-rollout[ray]'"


def import_ray():
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - the [ray] extra is not installed
        raise RuntimeError(RAY_MISSING) from exc
    return ray


def unwrap(exc: BaseException) -> BaseException:
    """The project's exception a replica raised, out of Ray's wrapper; else ``exc``."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, DiffusionRolloutError):
        return cause
    if isinstance(exc, DiffusionRolloutError):
        return exc
    ray = import_ray()
    if isinstance(exc, ray.exceptions.RayActorError):
        return ServiceUnavailableError(f"a replica died: {type(exc).__name__}")
    if isinstance(exc, ray.exceptions.RayTaskError) and cause is not None:
        return cause
    return exc


class ReplicaRestartedError(ServiceUnavailableError):
    """A replica whose process Ray restarted, asked for work before the front re-synced it.

    Ray re-creates a dead actor on its own and sends later calls to the new process, which the front
    may not have heard about yet (nothing it sent the old one failed). Such a process holds the
    weights of the model folder, not the cluster's, so it refuses everything but the front's
    recovery calls with this error; the front takes the answer as the replica's death
    (:func:`replica_lost`): it retries the work elsewhere and re-syncs the replica first."""


def replica_lost(exc: BaseException) -> bool:
    """Whether a failed replica call means the process is gone or was replaced by a fresh one."""
    return isinstance(exc, import_ray().exceptions.RayActorError) or isinstance(
        unwrap(exc), ReplicaRestartedError
    )


def ray_init_kwargs(config: ServerConfig) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"include_dashboard": False}
    if config.ray_address:
        kwargs["address"] = config.ray_address
    return kwargs


@contextlib.contextmanager
def ray_session(config: ServerConfig):
    """Start Ray (or join ``config.ray_address``) in the calling thread, shut it down on exit.

    ``serve`` uses this from the main thread: Ray started from another thread (the app's loader)
    leaves its dashboard and runtime-env agent processes running after ``ray.shutdown()``. A
    ``ClusterEngine`` started inside finds Ray running and leaves it to this session."""
    ray = import_ray()
    started = not ray.is_initialized()
    if started:
        ray.init(**ray_init_kwargs(config))
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()
