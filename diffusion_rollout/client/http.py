"""``RolloutClient`` and ``AsyncRolloutClient``: the trainer's HTTP client for a rollout server.

Design decisions:

- **One description per call, two executors.** Every endpoint is described once as a :class:`_Call`
  (method, path, body, which key, whether it may be retried); the sync client (``httpx.Client``,
  threads for concurrency) and the async client (``httpx.AsyncClient``, a semaphore) only differ in
  how they send it, so the two cannot drift apart.
- **Retries follow what a repeat would do.** Reads (health, info, checksums, the LoRA listing) are
  idempotent and retried on transport errors and on 429/502/503/504, with exponential backoff that
  honours ``Retry-After``. A rollout is retried only when the server certainly did no work: a
  refused connection, or an answer of 429 (queue full) or 503 (loading, asleep). A read timeout
  is not retried (the batch may still be running). Updates (weights, LoRA, memory, pause) are
  never retried: a repeated update could apply twice or race a newer one.
- **Several servers.** ``url`` may list several servers (a list, or comma-separated). Rollouts go
  round-robin; updates are sent to every server in order (same bytes, same ``weight_version``) and
  a failure names the server; reads go to one server (``server=`` picks which, default the first).
- **Keys and URLs** come from the arguments or, when absent, from ``DIFFUSION_ROLLOUT_URL``,
  ``DIFFUSION_ROLLOUT_API_KEY`` and ``DIFFUSION_ROLLOUT_ADMIN_KEY`` (read in
  :func:`resolve_connection` only). Generation sends the API key (or the admin key when no API key
  is given: the server accepts it); admin calls send the admin key (or the API key, for a server
  that has only one).
- **Wire.** Bodies go out as JSON; answers come back as msgpack by default (raw tensor bytes, no
  base64) and are decoded with the shared :mod:`diffusion_rollout.wire` codec (off the event loop in
  the async client). ``wire_format="json"`` asks for JSON instead.
- **Tests and embedding.** ``transport=`` takes any httpx transport (``httpx.ASGITransport(app)`` for
  the async client) and ``http_client=`` a ready ``httpx.Client``/``AsyncClient`` (a FastAPI
  ``TestClient`` works), so the real app can be driven without a socket. Constructing a client
  opens no connection and starts nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import httpx

from diffusion_rollout import wire
from diffusion_rollout.client.exceptions import (
    RolloutConnectionError,
    RolloutHTTPError,
    RolloutTimeoutError,
    error_from_response,
)
from diffusion_rollout.client.results import ReplaySettings, RolloutOutput, UpdateResult

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

logger = logging.getLogger(__name__)
T = TypeVar("T")

ENV_URL = "DIFFUSION_ROLLOUT_URL"
ENV_API_KEY = "DIFFUSION_ROLLOUT_API_KEY"
ENV_ADMIN_KEY = "DIFFUSION_ROLLOUT_ADMIN_KEY"
DEFAULT_URL = "http://127.0.0.1:30000"
# Generous read timeout: a large video batch may legitimately take minutes (server default 900 s).
DEFAULT_TIMEOUT = httpx.Timeout(900.0, connect=10.0)

Retry = Literal["idempotent", "refused", "never"]
Auth = Literal["api", "admin", "none"]
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


@dataclass
class _Call:
    """One HTTP call, independent of how it is sent."""

    method: str
    path: str
    auth: Auth
    retry: Retry
    json: Any = None
    content: bytes | None = None
    params: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    timeout: float | httpx.Timeout | None = None
    decode: Literal["json", "wire", "text"] = "json"


def _bool(v: bool) -> str:
    return "true" if v else "false"


def _drop_none(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


# ---------------------------------------------------------------------------- call descriptions
def _jsonable(value: Any) -> Any:
    """Tensors, numpy values and tuples as JSON values (a schedule often arrives as a tensor)."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _generate_call(prompt: str, fields: Mapping[str, Any], timeout) -> tuple[_Call, ReplaySettings]:
    body = {"prompt": prompt, **{k: _jsonable(v) for k, v in _drop_none(fields).items()}}
    call = _Call("POST", "/rollout/generate", "api", "refused", json=body, timeout=timeout, decode="wire")
    return call, ReplaySettings.from_request(body)


def _outputs(decoded: Any, settings: ReplaySettings) -> list[RolloutOutput]:
    if not isinstance(decoded, list):
        raise RolloutConnectionError(f"unexpected /rollout/generate answer: {type(decoded).__name__}")
    return [RolloutOutput.from_dict(d, settings) for d in decoded]


def _lora_load_call(
    name: str,
    *,
    path: str | None,
    data: bytes | None,
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
        return _Call(
            "POST",
            "/lora/load",
            "admin",
            "never",
            content=bytes(data),
            params=params,
            headers={"Content-Type": "application/octet-stream"},
            timeout=timeout,
        )
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


_UPLOAD_CHUNK = 8 << 20


def _slices(data: bytes):
    view = memoryview(data)
    for start in range(0, len(view), _UPLOAD_CHUNK):
        yield bytes(view[start : start + _UPLOAD_CHUNK])


class _ClientBase:
    """Configuration, call building and answer parsing shared by both clients."""

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

    @property
    def url(self) -> str:
        """The first (or only) server URL."""
        return self.urls[0]

    def _next_server(self) -> int:
        with self._rr_lock:
            return next(self._rr) % len(self.urls)

    def _targets(self, server: int | None) -> list[str]:
        return list(self.urls) if server is None else [self.urls[server]]

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
            if len(call.content) > _UPLOAD_CHUNK:
                # httpcore re-slices a bytes body after every socket write, which is quadratic for
                # a multi-GB upload; slices from an iterator with a Content-Length keep it linear.
                kw["content"] = self._body_chunks(call.content)
                kw["headers"]["Content-Length"] = str(len(call.content))
            else:
                kw["content"] = call.content
        if call.params:
            kw["params"] = call.params
        return kw

    def _at_least(self, seconds: float) -> float | None:
        """A per-call timeout only when the default read timeout is shorter than ``seconds``."""
        default = self.timeout if isinstance(self.timeout, httpx.Timeout) else httpx.Timeout(self.timeout)
        return seconds if default.read is not None and default.read < seconds else None

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

    @staticmethod
    def _parse_plain(call: _Call, resp: httpx.Response) -> Any:
        if call.decode == "text":
            return resp.text
        return resp.json()

    @staticmethod
    def _updates(responses: dict[str, Any]) -> UpdateResult:
        return UpdateResult.from_responses(responses)


# ---------------------------------------------------------------------------- sync client
class RolloutClient(_ClientBase):
    """Blocking client (thread-safe). Use as a context manager or call :meth:`close`.

    Args:
        url: server URL, a list of them, or comma-separated; default ``$DIFFUSION_ROLLOUT_URL`` or
            ``http://127.0.0.1:30000``.
        api_key, admin_key: default ``$DIFFUSION_ROLLOUT_API_KEY`` / ``$DIFFUSION_ROLLOUT_ADMIN_KEY``.
        timeout: default for every call (seconds or an ``httpx.Timeout``); calls that may run long
            take a ``timeout=`` of their own.
        retry: the :class:`RetryPolicy`.
        wire_format: ``"msgpack"`` (default) or ``"json"`` for rollout answers.
        max_concurrency: requests in flight in :meth:`generate_many`.
        transport: an ``httpx.BaseTransport`` for the internal ``httpx.Client``.
        http_client: a ready ``httpx.Client`` (e.g. FastAPI's ``TestClient``), used with its own
            default timeout; not closed by us.
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
        transport: httpx.BaseTransport | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        super().__init__(
            url,
            api_key=api_key,
            admin_key=admin_key,
            timeout=timeout,
            retry=retry,
            wire_format=wire_format,
            max_concurrency=max_concurrency,
            headers=headers,
        )
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(
            transport=transport,
            timeout=timeout,
            limits=httpx.Limits(max_connections=max(16, max_concurrency * 2)),
        )
        self._sleep: Callable[[float], None] = time.sleep

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ sending
    def _body_chunks(self, data: bytes):
        return _slices(data)

    def _send(self, call: _Call, url: str) -> httpx.Response:
        attempt = 0
        while True:
            try:
                resp = self._http.request(call.method, url + call.path, **self._request_kwargs(call, url))
            except httpx.TransportError as exc:
                if attempt < self.retry.max_retries and self.retry.retries_error(call.retry, exc):
                    logger.warning("%s %s: %s; retrying", call.method, url + call.path, exc)
                    self._sleep(self.retry.delay(attempt))
                    attempt += 1
                    continue
                raise self._transport_error(exc, url) from exc
            if resp.is_success:
                return resp
            err = self._error(resp, url)
            if attempt < self.retry.max_retries and self.retry.retries_status(call.retry, resp.status_code):
                logger.warning("%s %s: %s; retrying", call.method, url + call.path, err)
                self._sleep(self.retry.delay(attempt, err.retry_after))
                attempt += 1
                continue
            raise err

    def _one(self, call: _Call, server: int = 0) -> Any:
        url = self.urls[server]
        return self._parse_plain(call, self._send(call, url))

    def _all(self, call: _Call, server: int | None) -> UpdateResult:
        return self._updates({u: self._send(call, u).json() for u in self._targets(server)})

    # ------------------------------------------------------------------ health and info
    def health(self, *, server: int = 0) -> dict[str, Any]:
        """``GET /health``: liveness."""
        return self._one(_Call("GET", "/health", "none", "idempotent"), server)

    def health_generate(self, *, server: int = 0) -> dict[str, Any]:
        """``GET /health_generate``: readiness (a 503 while loading, paused or asleep)."""
        return self._one(_Call("GET", "/health_generate", "none", "idempotent"), server)

    def wait_until_ready(self, timeout_s: float = 300.0, interval_s: float = 0.5) -> None:
        """Poll ``/health_generate`` on every server until each answers 200 (or raise a timeout)."""
        deadline = time.monotonic() + timeout_s
        call = _Call("GET", "/health_generate", "none", "never")
        for url in self.urls:
            while True:
                try:
                    self._send(call, url)
                    break
                except (RolloutConnectionError, RolloutHTTPError) as exc:
                    if isinstance(exc, RolloutHTTPError) and exc.status_code not in (502, 503, 504):
                        raise
                    if time.monotonic() > deadline:
                        raise RolloutTimeoutError(
                            f"{url} not ready after {timeout_s} s: {exc}", url=url
                        ) from exc
                    self._sleep(interval_s)

    def model_info(self, *, server: int = 0) -> dict[str, Any]:
        """``GET /model_info``: model path, family, dtype, device, ``weight_version``."""
        return self._one(_Call("GET", "/model_info", "none", "idempotent"), server)

    def server_info(self, *, server: int = 0) -> dict[str, Any]:
        """``GET /server_info``: model info plus versions, limits and queue state."""
        return self._one(_Call("GET", "/server_info", "none", "idempotent"), server)

    def list_models(self, *, server: int = 0) -> dict[str, Any]:
        """``GET /v1/models``."""
        return self._one(_Call("GET", "/v1/models", "none", "idempotent"), server)

    def metrics(self, *, server: int = 0) -> str:
        """``GET /metrics``: Prometheus text (queue depth, batch sizes, latencies, weight updates)."""
        return self._one(_Call("GET", "/metrics", "none", "idempotent", decode="text"), server)

    # ------------------------------------------------------------------ rollouts
    def generate(
        self,
        prompt: str,
        *,
        negative_prompt: str | None = None,
        seed: int | None = None,
        seeds: Sequence[int] | None = None,
        initial_noise_seed: int | None = None,
        generator_device: str | None = None,
        width: int | None = None,
        height: int | None = None,
        num_inference_steps: int | None = None,
        num_outputs_per_prompt: int | None = None,
        guidance_scale: float | None = None,
        true_cfg_scale: float | None = None,
        num_frames: int | None = None,
        fps: int | None = None,
        rollout: bool | None = None,
        rollout_sde_type: str | None = None,
        rollout_noise_level: float | None = None,
        rollout_log_prob_no_const: bool | None = None,
        rollout_log_prob_form: str | None = None,
        rollout_debug_mode: bool | None = None,
        rollout_return_denoising_env: bool | None = None,
        rollout_return_dit_trajectory: bool | None = None,
        rollout_sde_step_indices: Sequence[int] | None = None,
        rollout_return_step_indices: Sequence[int] | None = None,
        image_path: Sequence[str] | None = None,
        suppress_logs: bool | None = None,
        extra_sampling_params: Mapping[str, Any] | None = None,
        sigmas: Sequence[float] | None = None,
        sigmas_are_shifted: bool | None = None,
        flow_shift: float | None = None,
        guidance_scale_2: float | None = None,
        output_dtype: str | None = None,
        return_generated_output: bool | None = None,
        max_sequence_length: int | None = None,
        server: int | None = None,
        timeout: float | httpx.Timeout | None = None,
        **extra_fields: Any,
    ) -> list[RolloutOutput]:
        """``POST /rollout/generate``: one :class:`RolloutOutput` per output, in output order.

        Keyword arguments are api.md's request fields; ``None`` leaves a field out (the server's
        default applies). ``extra_fields`` are sent as they are (the server rejects unknown names
        with 422). ``server`` pins the request to one of several servers (default: round-robin).
        """
        args = dict(locals())
        fields = {k: v for k, v in args.items() if k not in _NOT_FIELDS}
        fields.update(extra_fields)
        return self._generate(prompt, fields, server, timeout)

    def _generate(
        self, prompt: str, fields: Mapping[str, Any], server: int | None, timeout
    ) -> list[RolloutOutput]:
        call, settings = _generate_call(prompt, fields, timeout)
        url = self.urls[self._next_server() if server is None else server]
        resp = self._send(call, url)
        return _outputs(wire.decode(resp.content, resp.headers.get("content-type", wire.MSGPACK)), settings)

    def generate_many(
        self,
        prompts: Sequence[str | Mapping[str, Any]],
        *,
        max_concurrency: int | None = None,
        **fields: Any,
    ) -> list[list[RolloutOutput]]:
        """One ``generate`` per prompt, at most ``max_concurrency`` in flight; answers in input order.

        Each item is a prompt, or a mapping of request fields (with ``prompt``) laid over
        ``fields``: e.g. ``[{"prompt": p, "seed": s} ...]`` with ``num_outputs_per_prompt=G`` shared
        is one GRPO batch of groups. The first failure is raised; requests not yet sent are dropped.
        """
        jobs = [_merge_item(item, fields) for item in prompts]
        limit = max_concurrency or self.max_concurrency
        if limit == 1 or len(jobs) <= 1:
            return [self.generate(**job) for job in jobs]
        with concurrent.futures.ThreadPoolExecutor(max_workers=limit, thread_name_prefix="rollout") as pool:
            futures = [pool.submit(lambda job=job: self.generate(**job)) for job in jobs]
            try:
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise

    # ------------------------------------------------------------------ pause and memory (admin)
    def pause_generation(self, *, server: int | None = None) -> UpdateResult:
        """Stop starting new batches; returns once the batch in flight has finished."""
        return self._all(_Call("POST", "/pause_generation", "admin", "never"), server)

    def continue_generation(self, *, server: int | None = None) -> UpdateResult:
        return self._all(_Call("POST", "/continue_generation", "admin", "never"), server)

    def release_memory_occupation(self, *, server: int | None = None) -> UpdateResult:
        return self._all(_Call("POST", "/release_memory_occupation", "admin", "never"), server)

    def resume_memory_occupation(self, *, server: int | None = None) -> UpdateResult:
        return self._all(_Call("POST", "/resume_memory_occupation", "admin", "never"), server)

    # ------------------------------------------------------------------ weights (admin)
    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        target_modules: Sequence[str] | None = None,
        flush_cache: bool = True,
        weight_version: str | int | None = None,
        server: int | None = None,
        timeout: float | httpx.Timeout | None = None,
    ) -> UpdateResult:
        """Load ``<model_path>/<module>/*.safetensors`` on the server (shared filesystem)."""
        body = _drop_none(
            {
                "model_path": model_path,
                "target_modules": list(target_modules) if target_modules is not None else None,
                "flush_cache": flush_cache,
                "weight_version": weight_version,
            }
        )
        return self._all(
            _Call("POST", "/update_weights_from_disk", "admin", "never", json=body, timeout=timeout), server
        )

    def update_weights(
        self,
        data: bytes,
        *,
        target_module: str = "transformer",
        weight_version: str | int | None = None,
        final: bool = True,
        upload_id: str | None = None,
        part: int | None = None,
        flush_cache: bool = True,
        server: int | None = None,
        timeout: float | httpx.Timeout | None = None,
    ) -> UpdateResult:
        """One part of an HTTP weight upload (safetensors bytes); see ``client.weights.push_weights``."""
        return self._all(
            _upload_call(data, target_module, weight_version, final, upload_id, part, flush_cache, timeout),
            server,
        )

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        target_modules: Sequence[str] | None = None,
        weight_update_mode: str | None = None,
        lora_alpha: float | None = None,
        lora_rank: int | None = None,
        weight_version: str | int | None = None,
        payload_gpu_uuids: Sequence[str] | None = None,
        flush_cache: bool = True,
        server: int | None = None,
        timeout: float | httpx.Timeout | None = None,
    ) -> UpdateResult:
        """SGLang's same-host payload (CUDA IPC handles); see ``client.weights.push_weights_ipc``."""
        body = _tensor_body(locals())
        return self._all(
            _Call("POST", "/update_weights_from_tensor", "admin", "never", json=body, timeout=timeout), server
        )

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: float = 300.0,
        server: int = 0,
    ) -> UpdateResult:
        """Ask one server to join the trainer's process group (blocks until every rank has joined)."""
        # The server answers once every rank has joined: wait at least as long as it may.
        call = _init_group_call(
            master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s,
            self._at_least(timeout_s + 30),
        )  # fmt: skip
        return self._all(call, server)

    def update_weights_from_distributed(
        self,
        *,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        target_modules: Sequence[str] | None = None,
        weight_version: str | int | None = None,
        flush_cache: bool = True,
        server: int = 0,
        timeout: float | httpx.Timeout | None = None,
    ) -> UpdateResult:
        """Announce a broadcast to one server; the trainer then broadcasts each tensor in order."""
        call = _distributed_call(
            names, dtypes, shapes, group_name, target_modules, weight_version, flush_cache, timeout
        )
        return self._all(call, server)

    def destroy_weights_update_group(
        self, group_name: str = "weight_update_group", *, server: int | None = None
    ) -> UpdateResult:
        call = _Call(
            "POST", "/destroy_weights_update_group", "admin", "never", json={"group_name": group_name}
        )
        return self._all(call, server)

    def get_weights_checksum(
        self, module_names: Sequence[str] | None = None, *, algorithm: str = "sglang", server: int = 0
    ) -> dict[str, str]:
        """``{module: sha256_hex}`` of the server's weights (weights.md's algorithms)."""
        return self._one(_checksum_call(module_names, algorithm), server)

    def check_weights(
        self, target_module: str, expected_named_tensors_sha256: Mapping[str, str], *, server: int = 0
    ) -> dict[str, Any]:
        """``/update_weights_from_tensor_checker``: compare per-tensor hashes; raises on mismatch."""
        return self._one(_checker_call(target_module, expected_named_tensors_sha256), server)

    # ------------------------------------------------------------------ LoRA (admin)
    def lora_load(
        self,
        name: str,
        *,
        path: str | None = None,
        data: bytes | None = None,
        target_module: str = "transformer",
        peft_config: Mapping[str, Any] | None = None,
        lora_alpha: float | None = None,
        activate: bool = False,
        mode: str | None = None,
        strength: float | None = None,
        weight_version: str | int | None = None,
        server: int | None = None,
        timeout: float | httpx.Timeout | None = None,
    ) -> UpdateResult:
        """Load (or reload in place) adapter ``name`` from a server path or safetensors bytes."""
        call = _lora_load_call(
            name,
            path=path,
            data=data,
            target_module=target_module,
            peft_config=peft_config,
            lora_alpha=lora_alpha,
            activate=activate,
            mode=mode,
            strength=strength,
            weight_version=weight_version,
            timeout=timeout,
        )
        return self._all(call, server)

    def lora_activate(
        self,
        name: str | None,
        *,
        target_module: str = "transformer",
        mode: str | None = None,
        strength: float | None = None,
        merge_dtype: str | None = None,
        weight_version: str | int | None = None,
        server: int | None = None,
    ) -> UpdateResult:
        """Which adapter rollouts sample from (``None``: the base model), and its mode."""
        return self._all(
            _activate_call(name, target_module, mode, strength, merge_dtype, weight_version), server
        )

    def lora_unload(
        self,
        name: str | None = None,
        *,
        target_module: str = "transformer",
        weight_version: str | int | None = None,
        server: int | None = None,
    ) -> UpdateResult:
        body = _drop_none({"name": name, "target_module": target_module, "weight_version": weight_version})
        return self._all(_Call("POST", "/lora/unload", "admin", "never", json=body), server)

    def lora_list(self, *, server: int = 0) -> dict[str, Any]:
        """``GET /lora``: adapters per module (rank, alpha, checksum), the active one, the mode."""
        return self._one(_Call("GET", "/lora", "admin", "idempotent"), server)


# ---------------------------------------------------------------------------- async client
class AsyncRolloutClient(_ClientBase):
    """The asyncio twin of :class:`RolloutClient` (same methods, awaitable).

    ``transport`` is an ``httpx.AsyncBaseTransport`` (``httpx.ASGITransport(app)`` drives an app in
    process); ``http_client`` a ready ``httpx.AsyncClient``.
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
        transport: httpx.AsyncBaseTransport | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(
            url,
            api_key=api_key,
            admin_key=admin_key,
            timeout=timeout,
            retry=retry,
            wire_format=wire_format,
            max_concurrency=max_concurrency,
            headers=headers,
        )
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(
            transport=transport,
            timeout=timeout,
            limits=httpx.Limits(max_connections=max(16, max_concurrency * 2)),
        )
        self._sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _body_chunks(self, data: bytes):
        async def chunks():
            for piece in _slices(data):
                yield piece

        return chunks()

    async def _send(self, call: _Call, url: str) -> httpx.Response:
        attempt = 0
        while True:
            try:
                resp = await self._http.request(
                    call.method, url + call.path, **self._request_kwargs(call, url)
                )
            except httpx.TransportError as exc:
                if attempt < self.retry.max_retries and self.retry.retries_error(call.retry, exc):
                    logger.warning("%s %s: %s; retrying", call.method, url + call.path, exc)
                    await self._sleep(self.retry.delay(attempt))
                    attempt += 1
                    continue
                raise self._transport_error(exc, url) from exc
            if resp.is_success:
                return resp
            err = self._error(resp, url)
            if attempt < self.retry.max_retries and self.retry.retries_status(call.retry, resp.status_code):
                logger.warning("%s %s: %s; retrying", call.method, url + call.path, err)
                await self._sleep(self.retry.delay(attempt, err.retry_after))
                attempt += 1
                continue
            raise err

    async def _one(self, call: _Call, server: int = 0) -> Any:
        url = self.urls[server]
        return self._parse_plain(call, await self._send(call, url))

    async def _all(self, call: _Call, server: int | None) -> UpdateResult:
        responses = {}
        for u in self._targets(server):  # in order: a failure names the server and stops there
            responses[u] = (await self._send(call, u)).json()
        return self._updates(responses)

    async def health(self, *, server: int = 0) -> dict[str, Any]:
        return await self._one(_Call("GET", "/health", "none", "idempotent"), server)

    async def health_generate(self, *, server: int = 0) -> dict[str, Any]:
        return await self._one(_Call("GET", "/health_generate", "none", "idempotent"), server)

    async def wait_until_ready(self, timeout_s: float = 300.0, interval_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        call = _Call("GET", "/health_generate", "none", "never")
        for url in self.urls:
            while True:
                try:
                    await self._send(call, url)
                    break
                except (RolloutConnectionError, RolloutHTTPError) as exc:
                    if isinstance(exc, RolloutHTTPError) and exc.status_code not in (502, 503, 504):
                        raise
                    if time.monotonic() > deadline:
                        raise RolloutTimeoutError(
                            f"{url} not ready after {timeout_s} s: {exc}", url=url
                        ) from exc
                    await self._sleep(interval_s)

    async def model_info(self, *, server: int = 0) -> dict[str, Any]:
        return await self._one(_Call("GET", "/model_info", "none", "idempotent"), server)

    async def server_info(self, *, server: int = 0) -> dict[str, Any]:
        return await self._one(_Call("GET", "/server_info", "none", "idempotent"), server)

    async def list_models(self, *, server: int = 0) -> dict[str, Any]:
        return await self._one(_Call("GET", "/v1/models", "none", "idempotent"), server)

    async def metrics(self, *, server: int = 0) -> str:
        return await self._one(_Call("GET", "/metrics", "none", "idempotent", decode="text"), server)

    async def generate(
        self,
        prompt: str,
        *,
        server: int | None = None,
        timeout: float | httpx.Timeout | None = None,
        **fields: Any,
    ) -> list[RolloutOutput]:
        """``POST /rollout/generate``; keyword arguments as :meth:`RolloutClient.generate`."""
        call, settings = _generate_call(prompt, fields, timeout)
        url = self.urls[self._next_server() if server is None else server]
        resp = await self._send(call, url)
        media = resp.headers.get("content-type", wire.MSGPACK)
        # Decoding a large trajectory is CPU work: keep it off the event loop.
        decoded = await asyncio.to_thread(wire.decode, resp.content, media)
        return _outputs(decoded, settings)

    async def generate_many(
        self,
        prompts: Sequence[str | Mapping[str, Any]],
        *,
        max_concurrency: int | None = None,
        **fields: Any,
    ) -> list[list[RolloutOutput]]:
        """As :meth:`RolloutClient.generate_many`, with a semaphore bounding the requests in flight."""
        sem = asyncio.Semaphore(max_concurrency or self.max_concurrency)

        async def one(job: dict[str, Any]) -> list[RolloutOutput]:
            async with sem:
                return await self.generate(**job)

        tasks = [asyncio.ensure_future(one(_merge_item(item, fields))) for item in prompts]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def pause_generation(self, *, server: int | None = None) -> UpdateResult:
        return await self._all(_Call("POST", "/pause_generation", "admin", "never"), server)

    async def continue_generation(self, *, server: int | None = None) -> UpdateResult:
        return await self._all(_Call("POST", "/continue_generation", "admin", "never"), server)

    async def release_memory_occupation(self, *, server: int | None = None) -> UpdateResult:
        return await self._all(_Call("POST", "/release_memory_occupation", "admin", "never"), server)

    async def resume_memory_occupation(self, *, server: int | None = None) -> UpdateResult:
        return await self._all(_Call("POST", "/resume_memory_occupation", "admin", "never"), server)

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        target_modules: Sequence[str] | None = None,
        flush_cache: bool = True,
        weight_version: str | int | None = None,
        server: int | None = None,
        timeout: float | httpx.Timeout | None = None,
    ) -> UpdateResult:
        body = _drop_none(
            {
                "model_path": model_path,
                "target_modules": list(target_modules) if target_modules is not None else None,
                "flush_cache": flush_cache,
                "weight_version": weight_version,
            }
        )
        call = _Call("POST", "/update_weights_from_disk", "admin", "never", json=body, timeout=timeout)
        return await self._all(call, server)

    async def update_weights(
        self,
        data: bytes,
        *,
        target_module: str = "transformer",
        weight_version: str | int | None = None,
        final: bool = True,
        upload_id: str | None = None,
        part: int | None = None,
        flush_cache: bool = True,
        server: int | None = None,
        timeout: float | httpx.Timeout | None = None,
    ) -> UpdateResult:
        call = _upload_call(data, target_module, weight_version, final, upload_id, part, flush_cache, timeout)
        return await self._all(call, server)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        target_modules: Sequence[str] | None = None,
        weight_update_mode: str | None = None,
        lora_alpha: float | None = None,
        lora_rank: int | None = None,
        weight_version: str | int | None = None,
        payload_gpu_uuids: Sequence[str] | None = None,
        flush_cache: bool = True,
        server: int | None = None,
        timeout: float | httpx.Timeout | None = None,
    ) -> UpdateResult:
        body = _tensor_body(locals())
        call = _Call("POST", "/update_weights_from_tensor", "admin", "never", json=body, timeout=timeout)
        return await self._all(call, server)

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: float = 300.0,
        server: int = 0,
    ) -> UpdateResult:
        call = _init_group_call(
            master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s,
            self._at_least(timeout_s + 30),
        )  # fmt: skip
        return await self._all(call, server)

    async def update_weights_from_distributed(
        self,
        *,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        target_modules: Sequence[str] | None = None,
        weight_version: str | int | None = None,
        flush_cache: bool = True,
        server: int = 0,
        timeout: float | httpx.Timeout | None = None,
    ) -> UpdateResult:
        call = _distributed_call(
            names, dtypes, shapes, group_name, target_modules, weight_version, flush_cache, timeout
        )
        return await self._all(call, server)

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group", *, server: int | None = None
    ) -> UpdateResult:
        call = _Call(
            "POST", "/destroy_weights_update_group", "admin", "never", json={"group_name": group_name}
        )
        return await self._all(call, server)

    async def get_weights_checksum(
        self, module_names: Sequence[str] | None = None, *, algorithm: str = "sglang", server: int = 0
    ) -> dict[str, str]:
        return await self._one(_checksum_call(module_names, algorithm), server)

    async def check_weights(
        self, target_module: str, expected_named_tensors_sha256: Mapping[str, str], *, server: int = 0
    ) -> dict[str, Any]:
        return await self._one(_checker_call(target_module, expected_named_tensors_sha256), server)

    async def lora_load(
        self,
        name: str,
        *,
        path: str | None = None,
        data: bytes | None = None,
        target_module: str = "transformer",
        peft_config: Mapping[str, Any] | None = None,
        lora_alpha: float | None = None,
        activate: bool = False,
        mode: str | None = None,
        strength: float | None = None,
        weight_version: str | int | None = None,
        server: int | None = None,
        timeout: float | httpx.Timeout | None = None,
    ) -> UpdateResult:
        call = _lora_load_call(
            name,
            path=path,
            data=data,
            target_module=target_module,
            peft_config=peft_config,
            lora_alpha=lora_alpha,
            activate=activate,
            mode=mode,
            strength=strength,
            weight_version=weight_version,
            timeout=timeout,
        )
        return await self._all(call, server)

    async def lora_activate(
        self,
        name: str | None,
        *,
        target_module: str = "transformer",
        mode: str | None = None,
        strength: float | None = None,
        merge_dtype: str | None = None,
        weight_version: str | int | None = None,
        server: int | None = None,
    ) -> UpdateResult:
        call = _activate_call(name, target_module, mode, strength, merge_dtype, weight_version)
        return await self._all(call, server)

    async def lora_unload(
        self,
        name: str | None = None,
        *,
        target_module: str = "transformer",
        weight_version: str | int | None = None,
        server: int | None = None,
    ) -> UpdateResult:
        body = _drop_none({"name": name, "target_module": target_module, "weight_version": weight_version})
        return await self._all(_Call("POST", "/lora/unload", "admin", "never", json=body), server)

    async def lora_list(self, *, server: int = 0) -> dict[str, Any]:
        return await self._one(_Call("GET", "/lora", "admin", "idempotent"), server)


# ---------------------------------------------------------------------------- shared builders
_NOT_FIELDS = {"self", "prompt", "server", "timeout", "extra_fields", "__class__"}


def _merge_item(item: str | Mapping[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    job = dict(shared)
    if isinstance(item, str):
        job["prompt"] = item
    elif isinstance(item, Mapping):
        job.update(item)
        if "prompt" not in job:
            raise ValueError(f"a generate_many item needs a 'prompt': {dict(item)!r}")
    else:
        raise TypeError(f"a generate_many item is a prompt or a mapping of fields, not {type(item).__name__}")
    return job


def _upload_call(data, target_module, weight_version, final, upload_id, part, flush_cache, timeout) -> _Call:
    params = _drop_none(
        {
            "target_module": target_module,
            "weight_version": weight_version,
            "final": _bool(final),
            "upload_id": upload_id,
            "part": part,
            "flush_cache": _bool(flush_cache),
        }
    )
    return _Call(
        "POST",
        "/update_weights",
        "admin",
        "never",
        content=bytes(data),
        params=params,
        headers={"Content-Type": "application/octet-stream"},
        timeout=timeout,
    )


def _tensor_body(args: Mapping[str, Any]) -> dict[str, Any]:
    body = {
        "serialized_named_tensors": list(args["serialized_named_tensors"]),
        "load_format": args["load_format"],
        "target_modules": list(args["target_modules"]) if args["target_modules"] is not None else None,
        "weight_update_mode": args["weight_update_mode"],
        "lora_alpha": args["lora_alpha"],
        "lora_rank": args["lora_rank"],
        "weight_version": args["weight_version"],
        "payload_gpu_uuids": list(args["payload_gpu_uuids"])
        if args["payload_gpu_uuids"] is not None
        else None,
        "flush_cache": args["flush_cache"],
    }
    return _drop_none(body)


def _checksum_call(module_names: Sequence[str] | None, algorithm: str) -> _Call:
    body = _drop_none(
        {"module_names": list(module_names) if module_names is not None else None, "algorithm": algorithm}
    )
    return _Call("POST", "/get_weights_checksum", "admin", "idempotent", json=body)


def _checker_call(target_module: str, expected: Mapping[str, str]) -> _Call:
    body = {"target_module": target_module, "expected_named_tensors_sha256": dict(expected)}
    return _Call("POST", "/update_weights_from_tensor_checker", "admin", "idempotent", json=body)


def _activate_call(name, target_module, mode, strength, merge_dtype, weight_version) -> _Call:
    body = {"name": name, "target_module": target_module}
    body.update(
        _drop_none(
            {"mode": mode, "strength": strength, "merge_dtype": merge_dtype, "weight_version": weight_version}
        )
    )
    return _Call("POST", "/lora/activate", "admin", "never", json=body)


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
            "target_modules": list(target_modules) if target_modules is not None else None,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
        }
    )
    return _Call("POST", "/update_weights_from_distributed", "admin", "never", json=body, timeout=timeout)
