"""Everything a rollout client does except sending: connection settings, retries, headers, errors.

Design decisions:

- **Retries follow what a repeat would do.** Reads (health, info, checksums, the LoRA listing) are
  idempotent and retried on transport errors and on 429/502/503/504, with exponential backoff that
  honours ``Retry-After``. A rollout is retried only when the server certainly did no work: a
  refused connection, or an answer of 429 (queue full) or 503 (loading, asleep). A read timeout
  is not retried (the batch may still be running). Updates (weights, LoRA, memory, pause) are
  never retried: a repeated update could apply twice or race a newer one. The decision for one
  failed attempt is made here (:meth:`_ClientBase._delay_after_transport_error`,
  :meth:`_ClientBase._delay_after_error_status`); the clients only sleep and repeat, blocking or
  awaiting.
- **Several servers.** ``url`` may list several servers (a list, or comma-separated). Rollouts go
  round-robin (a lock-guarded counter, so threads share it safely); updates are sent to every
  server in order (same bytes, same ``weight_version``) and a failure names the server; reads go to
  one server (``server=`` picks which, default the first).
- **Keys and URLs** come from the arguments or, when absent, from ``DIFFUSION_ROLLOUT_URL``,
  ``DIFFUSION_ROLLOUT_API_KEY`` and ``DIFFUSION_ROLLOUT_ADMIN_KEY`` (read in
  :func:`resolve_connection` only). Generation sends the API key (or the admin key when no API key
  is given: the server accepts it); admin calls send the admin key (or the API key, for a server
  that has only one).
- **Wire.** Bodies go out as JSON; rollout answers are asked for as msgpack by default (raw tensor
  bytes, no base64) through ``Accept``; ``wire_format="json"`` asks for JSON instead.
- **Weight parts take the direct port when there is one.** A server started with
  ``--upload-port`` advertises ``weight_upload_port`` in ``/model_info``; ``upload_url(server)``
  asks for it and keeps it (``push_weights`` asks at the start of every push, so a restarted server
  is followed), and ``update_weights`` then sends full-weight parts to that port on the same host
  (:func:`direct_upload_url`), where they are read straight into the receive buffers. The answer
  is the same; ``direct=False`` keeps the main port. ``update_weights`` itself never asks (an
  update stays one request, never retried); a connection error on the direct port forgets it, and
  a 503 from it (its slots all taken) sends that part to the main port instead.
- Error answers become the exception classes of :mod:`diffusion_rollout.client.exceptions`
  (status, message, request id, ``Retry-After``); transport failures become
  :class:`RolloutConnectionError` / :class:`RolloutTimeoutError` naming the server.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from diffusion_rollout.client import calls
from diffusion_rollout.client.calls import Retry, _Call
from diffusion_rollout.client.exceptions import (
    RolloutConnectionError,
    RolloutHTTPError,
    RolloutTimeoutError,
    error_from_response,
)
from diffusion_rollout.client.results import UpdateResult
from diffusion_rollout.protocol import wire

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_URL",
    "ENV_ADMIN_KEY",
    "ENV_API_KEY",
    "ENV_URL",
    "RetryPolicy",
    "WireFormat",
    "resolve_connection",
]

logger = logging.getLogger(__name__)

ENV_URL = "DIFFUSION_ROLLOUT_URL"
ENV_API_KEY = "DIFFUSION_ROLLOUT_API_KEY"
ENV_ADMIN_KEY = "DIFFUSION_ROLLOUT_ADMIN_KEY"
DEFAULT_URL = "http://127.0.0.1:30000"
# Generous read timeout: a large video batch may legitimately take minutes (server default 900 s).
DEFAULT_TIMEOUT = httpx.Timeout(900.0, connect=10.0)
# Answers that mean "still starting" while waiting for readiness.
_NOT_READY_STATUSES = (502, 503, 504)

WireFormat = Literal["msgpack", "json"]


def resolve_connection(
    url: str | Sequence[str] | None = None, api_key: str | None = None, admin_key: str | None = None
) -> tuple[list[str], str | None, str | None]:
    """Server URLs and keys from the arguments, else from the environment, else the local default."""
    raw = url if url is not None else os.environ.get(ENV_URL) or DEFAULT_URL
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    urls = [u.strip().rstrip("/") for u in items if u and u.strip()]
    if not urls:
        raise ValueError("no server URL given")
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"server URL {u!r} must start with http:// or https://")
    api_key = api_key if api_key is not None else os.environ.get(ENV_API_KEY) or None
    admin_key = admin_key if admin_key is not None else os.environ.get(ENV_ADMIN_KEY) or None
    return urls, api_key, admin_key


def direct_upload_url(url: str, info: Mapping[str, Any]) -> str | None:
    """The direct upload listener of the server at ``url``: ``weight_upload_port`` of its
    ``/model_info`` on the same host, or None when it advertises none or ``url`` is not plain
    ``http://host[:port]`` (TLS or a path prefix mean a proxy in front, which would not carry the
    other port)."""
    port = info.get("weight_upload_port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"http://{host}:{port}"


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently retryable calls are repeated (see the module docstring)."""

    max_retries: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    idempotent_statuses: frozenset[int] = frozenset({429, 502, 503, 504})
    refused_statuses: frozenset[int] = frozenset({429, 503})

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        if retry_after is not None:
            return min(max(0.0, retry_after), self.max_backoff_s)
        return min(self.backoff_s * (2**attempt), self.max_backoff_s)

    def retries_status(self, retry: Retry, status: int) -> bool:
        if retry == "idempotent":
            return status in self.idempotent_statuses
        if retry == "refused":
            return status in self.refused_statuses
        return False

    def retries_error(self, retry: Retry, exc: httpx.TransportError) -> bool:
        if retry == "idempotent":
            return True
        # The request never reached the server: repeating a rollout is safe.
        return retry == "refused" and isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))


class _ClientBase:
    """Configuration, request building, retry decisions and answer parsing shared by both clients.

    A subclass supplies ``_body_chunks`` (the sliced body as a sync or async iterator) and the
    sending methods.
    """

    def __init__(
        self,
        url: str | Sequence[str] | None = None,
        *,
        api_key: str | None = None,
        admin_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        wire_format: WireFormat = "msgpack",
        max_concurrency: int = 8,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.urls, self.api_key, self.admin_key = resolve_connection(url, api_key, admin_key)
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        if wire_format not in ("msgpack", "json"):
            raise ValueError("wire_format must be 'msgpack' or 'json'")
        self.wire_format = wire_format
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        self.max_concurrency = max_concurrency
        self.extra_headers = dict(headers or {})
        self._rr = itertools.count()
        self._rr_lock = threading.Lock()
        # Bytes of rollout answers received (socket or same-host segment): what a trainer weighs
        # when it decides whether pixels should travel (serve --reward, return_output=false).
        self.received_answer_bytes = 0
        # Main URL -> its direct upload URL (None: it has none), as last advertised.
        self._upload_urls: dict[str, str | None] = {}

    def _count_answer(self, body: bytes | memoryview) -> None:
        with self._rr_lock:
            self.received_answer_bytes += len(body)

    @property
    def url(self) -> str:
        """The first (or only) server URL."""
        return self.urls[0]

    def _http_limits(self) -> httpx.Limits:
        return httpx.Limits(max_connections=max(16, self.max_concurrency * 2))

    # ------------------------------------------------------------------ where calls go
    def _next_server(self) -> int:
        with self._rr_lock:
            return next(self._rr) % len(self.urls)

    def _rollout_url(self, server: int | None) -> str:
        """The pinned server, else the next one round-robin."""
        return self.urls[self._next_server() if server is None else server]

    def _targets(self, server: int | None) -> list[str]:
        return list(self.urls) if server is None else [self.urls[server]]

    def _known_upload_url(self, url: str) -> str | None:
        """Where weight parts for ``url`` go, if already asked (else None)."""
        if url not in self._upload_urls:
            return None
        return self._upload_urls[url] or url

    def _remember_upload_url(self, url: str, info: Mapping[str, Any]) -> str:
        direct = direct_upload_url(url, info)
        self._upload_urls[url] = direct
        return direct or url

    @staticmethod
    def _direct_port_busy(exc: BaseException, target: str, url: str) -> bool:
        """Whether a part refused by ``url``'s direct upload port (``target``) goes to the main port
        instead: the port answered 503 (all its authenticated slots taken, by a push of another
        trainer or by connections held open). The main port serves the same route; a refusal there
        is the answer."""
        if target == url or getattr(exc, "status_code", None) != 503:
            return False
        logger.warning("%s: the direct upload port is busy (%s); sending the part to the main port", url, exc)
        return True

    def _forget_upload_url(self, url: str) -> None:
        # A restarted server may listen on another port: ask again next time.
        self._upload_urls.pop(url, None)

    # ------------------------------------------------------------------ building requests
    def _headers(self, call: _Call) -> dict[str, str]:
        h = dict(self.extra_headers)
        key = None
        if call.auth == "api":
            key = self.api_key or self.admin_key
        elif call.auth == "admin":
            key = self.admin_key or self.api_key
        if key:
            h["Authorization"] = f"Bearer {key}"
        if call.decode == "wire":
            h["Accept"] = wire.JSON if self.wire_format == "json" else wire.MSGPACK
        h.update(call.headers)
        return h

    def _request_kwargs(self, call: _Call, url: str) -> dict[str, Any]:
        kw: dict[str, Any] = {"headers": self._headers(call)}
        if call.timeout is not None:
            # Otherwise the httpx client's own default (``timeout`` for clients made here).
            kw["timeout"] = call.timeout
        if call.json is not None:
            kw["json"] = call.json
        if call.content is not None:
            # Read through the module so tests can shrink the slice size.
            if len(call.content) > calls._UPLOAD_CHUNK:
                # httpcore re-slices a bytes body after every socket write, which is quadratic for
                # a multi-GB upload; slices from an iterator with a Content-Length keep it linear.
                kw["content"] = self._body_chunks(call.content)
                kw["headers"]["Content-Length"] = str(len(call.content))
            else:
                kw["content"] = bytes(call.content)
        if call.params:
            kw["params"] = call.params
        return kw

    def _body_chunks(self, data: bytes):
        raise NotImplementedError

    def _at_least(self, seconds: float) -> float | None:
        """A per-call timeout only when the default read timeout is shorter than ``seconds``."""
        default = self.timeout if isinstance(self.timeout, httpx.Timeout) else httpx.Timeout(self.timeout)
        return seconds if default.read is not None and default.read < seconds else None

    # ------------------------------------------------------------------ failures and retries
    @staticmethod
    def _error(resp: httpx.Response, url: str) -> RolloutHTTPError:
        try:
            body = resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            body = None
        retry_after = None
        raw = resp.headers.get("retry-after")
        if raw is not None:
            try:
                retry_after = float(raw)
            except ValueError:
                retry_after = None
        return error_from_response(
            resp.status_code,
            body,
            text=resp.text if body is None else "",
            request_id=resp.headers.get("x-request-id"),
            url=url,
            retry_after=retry_after,
        )

    @staticmethod
    def _transport_error(exc: httpx.TransportError, url: str) -> RolloutConnectionError:
        cls = RolloutTimeoutError if isinstance(exc, httpx.TimeoutException) else RolloutConnectionError
        return cls(f"{url}: {type(exc).__name__}: {exc}", url=url)

    def _delay_after_transport_error(
        self, call: _Call, url: str, attempt: int, exc: httpx.TransportError
    ) -> float:
        """Seconds to wait before repeating ``call`` after ``exc``; raises when it is not repeated."""
        if attempt < self.retry.max_retries and self.retry.retries_error(call.retry, exc):
            logger.warning("%s %s: %s; retrying", call.method, url + call.path, exc)
            return self.retry.delay(attempt)
        raise self._transport_error(exc, url) from exc

    def _delay_after_error_status(self, call: _Call, url: str, attempt: int, resp: httpx.Response) -> float:
        """Seconds to wait before repeating ``call`` after an error answer; raises when it is not repeated."""
        err = self._error(resp, url)
        if attempt < self.retry.max_retries and self.retry.retries_status(call.retry, resp.status_code):
            logger.warning("%s %s: %s; retrying", call.method, url + call.path, err)
            return self.retry.delay(attempt, err.retry_after)
        raise err

    @staticmethod
    def _raise_unless_starting(
        exc: RolloutConnectionError | RolloutHTTPError, url: str, deadline: float, timeout_s: float
    ) -> None:
        """While waiting for readiness: re-raise real errors, and any error once the deadline passed."""
        if isinstance(exc, RolloutHTTPError) and exc.status_code not in _NOT_READY_STATUSES:
            raise exc
        if time.monotonic() > deadline:
            raise RolloutTimeoutError(f"{url} not ready after {timeout_s} s: {exc}", url=url) from exc

    # ------------------------------------------------------------------ answers
    @staticmethod
    def _parse_plain(call: _Call, resp: httpx.Response) -> Any:
        if call.decode == "text":
            return resp.text
        return resp.json()

    @staticmethod
    def _updates(responses: dict[str, Any]) -> UpdateResult:
        return UpdateResult.from_responses(responses)
