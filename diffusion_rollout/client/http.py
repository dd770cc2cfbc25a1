"""The HTTP client's public names under their original import path (``diffusion_rollout.client.http``).

Nothing is defined here; ``DEFAULT_TIMEOUT`` and the ``WireFormat``/``Retry``/``Auth`` aliases are
re-exported too, outside ``__all__`` as before. The client is split by job:
:mod:`~diffusion_rollout.client.calls` describes every endpoint once,
:mod:`~diffusion_rollout.client.base` holds connection settings, retries and error mapping, and
:mod:`~diffusion_rollout.client.sync_client` / :mod:`~diffusion_rollout.client.async_client` send
the calls. Private helpers are deliberately not re-exported: patch them where they live (e.g.
``client.calls._UPLOAD_CHUNK``), so a stale patch fails loudly instead of silently changing nothing.
"""

from diffusion_rollout.client.async_client import AsyncRolloutClient
from diffusion_rollout.client.base import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT
from diffusion_rollout.client.base import (
    DEFAULT_URL,
    ENV_ADMIN_KEY,
    ENV_API_KEY,
    ENV_URL,
    RetryPolicy,
    resolve_connection,
)
from diffusion_rollout.client.base import WireFormat as WireFormat
from diffusion_rollout.client.calls import Auth as Auth
from diffusion_rollout.client.calls import Retry as Retry
from diffusion_rollout.client.sync_client import RolloutClient

__all__ = [
    "DEFAULT_URL",
    "ENV_ADMIN_KEY",
    "ENV_API_KEY",
    "ENV_URL",
    "AsyncRolloutClient",
    "RetryPolicy",
    "RolloutClient",
    "resolve_connection",
]
