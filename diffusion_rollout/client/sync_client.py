"""``RolloutClient``: the blocking HTTP client for a rollout server (thread-safe).

Design decisions:

- **Sends what** :mod:`diffusion_rollout.client.calls` **describes.** Every method builds its
  :class:`~diffusion_rollout.client.calls._Call` there and sends it with one ``httpx.Client``;
  retry decisions, headers and error mapping come from
  :class:`~diffusion_rollout.client.base._ClientBase`. The asyncio twin
  (:mod:`diffusion_rollout.client.async_client`) has the same methods over the same descriptions.
- **Concurrency with threads.** :meth:`RolloutClient.generate_many` runs at most
  ``max_concurrency`` requests on a thread pool; the httpx connection pool is sized to match.
- **Tests and embedding.** ``transport=`` takes any httpx transport and ``http_client=`` a ready
  ``httpx.Client`` (a FastAPI ``TestClient`` works), so the real app can be driven without a socket.
  Constructing a client opens no connection and starts nothing.
- ``generate`` lists api.md's request fields as keyword arguments (for discovery and editors);
  ``None`` leaves a field out, so the server's default applies.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx

from diffusion_rollout.client.base import DEFAULT_TIMEOUT, RetryPolicy, WireFormat, _ClientBase
from diffusion_rollout.client.calls import (
    _NOT_FIELDS,
    _abort_call,
    _admin_switch_call,
    _Call,
    _generate_call,
    _info_call,
    _merge_item,
    _ready_call,
    _slices,
    _wire_outputs,
)
from diffusion_rollout.client.exceptions import RolloutConnectionError, RolloutHTTPError
from diffusion_rollout.client.receive import read_body
from diffusion_rollout.client.results import RolloutOutput, UpdateResult
from diffusion_rollout.client.segments import SEGMENTS
from diffusion_rollout.client.stream import RolloutStream
from diffusion_rollout.client.sync_weights import SyncWeightsMixin
from diffusion_rollout.client.upload_transport import BodyPassthroughTransport
from diffusion_rollout.protocol import wire

if TYPE_CHECKING:
    import torch

__all__ = ["RolloutClient"]


class RolloutClient(SyncWeightsMixin, _ClientBase):
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
        if transport is None:
            # Large uploads (full-weight parts) go out without a copy under the GIL
            # (upload_transport.py); a caller's own transport is used as it is.
            transport = BodyPassthroughTransport(httpx.HTTPTransport(limits=self._http_limits()))
        self._http = http_client or httpx.Client(transport=transport, timeout=timeout)
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

    def _request(self, call: _Call, url: str, stream: bool) -> httpx.Response:
        kwargs = self._request_kwargs(call, url)
        if not stream:
            return self._http.request(call.method, url + call.path, **kwargs)
        return self._http.send(self._http.build_request(call.method, url + call.path, **kwargs), stream=True)

    def _send(self, call: _Call, url: str, *, stream: bool = False) -> httpx.Response:
        """The successful answer to ``call``; with ``stream`` its body is left unread (the caller
        reads it with :func:`read_body` and closes it)."""
        attempt = 0
        while True:
            try:
                resp = self._request(call, url, stream)
                if stream and not resp.is_success:
                    resp.read()  # the error answer's message
            except httpx.TransportError as exc:
                delay = self._delay_after_transport_error(call, url, attempt, exc)
            else:
                if resp.is_success:
                    return resp
                delay = self._delay_after_error_status(call, url, attempt, resp)
            self._sleep(delay)
            attempt += 1

    def _one(self, call: _Call, server: int = 0) -> Any:
        url = self.urls[server]
        return self._parse_plain(call, self._send(call, url))

    def _all(self, call: _Call, server: int | None) -> UpdateResult:
        return self._updates({u: self._send(call, u).json() for u in self._targets(server)})

    # ------------------------------------------------------------------ health and info
    def health(self, *, server: int = 0) -> dict[str, Any]:
        """``GET /health``: liveness."""
        return self._one(_info_call("/health"), server)

    def health_generate(self, *, server: int = 0) -> dict[str, Any]:
        """``GET /health_generate``: readiness (a 503 while loading, paused or asleep)."""
        return self._one(_info_call("/health_generate"), server)

    def wait_until_ready(self, timeout_s: float = 300.0, interval_s: float = 0.5) -> None:
        """Poll ``/health_generate`` on every server until each answers 200 (or raise a timeout)."""
        deadline = time.monotonic() + timeout_s
        call = _ready_call()
        for url in self.urls:
            while True:
                try:
                    self._send(call, url)
                    break
                except (RolloutConnectionError, RolloutHTTPError) as exc:
                    self._raise_unless_starting(exc, url, deadline, timeout_s)
                self._sleep(interval_s)

    def model_info(self, *, server: int = 0) -> dict[str, Any]:
        """``GET /model_info``: model path, family, dtype, device, ``weight_version``."""
        return self._one(_info_call("/model_info"), server)

    def server_info(self, *, server: int = 0, admin: bool = False) -> dict[str, Any]:
        """``GET /server_info``: model info plus versions, limits and queue state; with ``admin``
        (the admin key), the full form: paths, library versions, speed, each reward's account."""
        return self._one(_info_call("/server_info", admin=admin), server)

    def list_models(self, *, server: int = 0) -> dict[str, Any]:
        """``GET /v1/models``."""
        return self._one(_info_call("/v1/models"), server)

    def metrics(self, *, server: int = 0) -> str:
        """``GET /metrics``: Prometheus text (queue depth, batch sizes, latencies, weight updates)."""
        return self._one(_info_call("/metrics", decode="text"), server)

    # ------------------------------------------------------------------ rollouts
    def generate(
        self,
        prompt: str | None = None,
        *,
        negative_prompt: str | None = None,
        prompt_embeds: torch.Tensor | None = None,
        pooled_prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        negative_pooled_prompt_embeds: torch.Tensor | None = None,
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
        image_data: Sequence[bytes | str] | None = None,
        suppress_logs: bool | None = None,
        extra_sampling_params: Mapping[str, Any] | None = None,
        sigmas: Sequence[float] | None = None,
        sigmas_are_shifted: bool | None = None,
        flow_shift: float | None = None,
        guidance_scale_2: float | None = None,
        output_dtype: str | None = None,
        return_generated_output: bool | None = None,
        max_sequence_length: int | None = None,
        rewards: Sequence[str] | None = None,
        reward_metadata: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        return_output: bool | None = None,
        server: int | None = None,
        timeout: float | httpx.Timeout | None = None,
        **extra_fields: Any,
    ) -> list[RolloutOutput]:
        """``POST /rollout/generate``: one :class:`RolloutOutput` per output, in output order.

        Keyword arguments are api.md's request fields; ``None`` leaves a field out (the server's
        default applies). ``prompt_embeds`` and friends (one prompt's row, the server's dtype) replace
        the prompt text, which is then optional, a label; such a body travels as msgpack. ``extra_fields`` are sent as they are (the server rejects unknown names
        with 422). ``server`` pins the request to one of several servers (default: round-robin).
        ``rewards`` names rewards the server scores (``serve --reward``): each output's
        ``rewards`` holds them, ``None`` for a failed one (``reward_errors`` says why); with
        ``return_output=False`` no pixels travel.
        """
        args = dict(locals())
        fields = {k: v for k, v in args.items() if k not in _NOT_FIELDS}
        fields.update(extra_fields)
        return self._generate(prompt, fields, server, timeout)

    def _generate(
        self, prompt: str | None, fields: Mapping[str, Any], server: int | None, timeout
    ) -> list[RolloutOutput]:
        call, settings = _generate_call(prompt, fields, timeout)
        url = self._rollout_url(server)
        # Same-host answers (client/segments.py): the server may write a msgpack answer into a file.
        with SEGMENTS.lease(url, wanted=self.wire_format == "msgpack") as answer:
            call.headers.update(answer.headers)
            resp = self._send(call, url, stream=True)
            try:
                body = read_body(resp)
            except httpx.TransportError as exc:
                raise self._transport_error(exc, url) from exc
            finally:
                resp.close()
            body = answer.body(resp.headers, body)
            self._count_answer(body)
            return _wire_outputs(body, resp.headers.get("content-type", wire.MSGPACK), settings)

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

    def rollout_stream(
        self,
        make_batch: Callable[[int], Sequence[str | Mapping[str, Any]]],
        *,
        max_staleness: int = 1,
        on_stale: str = "drop",
        depth: int | None = None,
        max_batches: int | None = None,
        **fields: Any,
    ) -> RolloutStream:
        """Batches generated ahead while the trainer trains, at most ``max_staleness`` pushes behind
        (``client/stream.py``): ``for batch in stream: train(batch); push(...); stream.pushed(v)``.
        ``make_batch(i)`` gives batch ``i``'s requests as ``generate_many`` items over ``fields``;
        ``on_stale`` is ``"drop"`` or ``"regenerate"``; ``close()`` (or ``with``) aborts what is in
        flight."""
        return RolloutStream(
            self,
            make_batch,
            max_staleness=max_staleness,
            on_stale=on_stale,
            depth=depth,
            max_batches=max_batches,
            **fields,
        )

    # ------------------------------------------------------------------ pause and memory (admin)
    def abort_request(
        self, rid: str | None = None, *, abort_all: bool = False, server: int | None = None
    ) -> UpdateResult:
        """Drop the queued work of the rollout sent with ``rid=...`` (on every server: any may hold
        it); it answers 499 ``request_aborted``, a batch already running finishes."""
        return self._all(_abort_call(rid, abort_all), server)

    def pause_generation(self, *, server: int | None = None) -> UpdateResult:
        """Stop starting new batches; returns once the batch in flight has finished."""
        return self._all(_admin_switch_call("/pause_generation"), server)

    def continue_generation(self, *, server: int | None = None) -> UpdateResult:
        return self._all(_admin_switch_call("/continue_generation"), server)

    def release_memory_occupation(self, *, server: int | None = None) -> UpdateResult:
        return self._all(_admin_switch_call("/release_memory_occupation"), server)

    def resume_memory_occupation(self, *, server: int | None = None) -> UpdateResult:
        return self._all(_admin_switch_call("/resume_memory_occupation"), server)
