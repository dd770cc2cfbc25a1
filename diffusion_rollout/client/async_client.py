"""``AsyncRolloutClient``: the asyncio twin of ``RolloutClient`` (same methods, awaitable).

Design decisions:

- **Same descriptions, another executor.** Every method builds the same
  :class:`~diffusion_rollout.client.calls._Call` as :class:`~diffusion_rollout.client.RolloutClient`
  and awaits it on one ``httpx.AsyncClient``; retry decisions, headers and error mapping come from
  :class:`~diffusion_rollout.client.base._ClientBase`, so the two clients cannot drift apart.
- **Concurrency with a semaphore.** :meth:`AsyncRolloutClient.generate_many` bounds the requests in
  flight with ``asyncio.Semaphore(max_concurrency)``; on the first failure the others are cancelled.
- **The event loop stays free.** Decoding a rollout answer (a large trajectory) runs in a thread;
  a large upload body is streamed from an async iterator of slices.
- ``generate`` takes api.md's request fields as ``**fields`` (documented on
  :meth:`RolloutClient.generate`). ``transport=`` is an ``httpx.AsyncBaseTransport``
  (``httpx.ASGITransport(app)`` drives an app in process); ``http_client=`` a ready
  ``httpx.AsyncClient``. Constructing a client opens no connection and starts nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import httpx

from diffusion_rollout.client.base import DEFAULT_TIMEOUT, RetryPolicy, WireFormat, _ClientBase
from diffusion_rollout.client.calls import (
    _abort_call,
    _activate_call,
    _admin_switch_call,
    _Call,
    _checker_call,
    _checksum_call,
    _destroy_group_call,
    _disk_call,
    _distributed_call,
    _generate_call,
    _info_call,
    _init_group_call,
    _lora_list_call,
    _lora_load_call,
    _merge_item,
    _ready_call,
    _slices,
    _tensor_call,
    _unload_call,
    _upload_call,
    _wire_outputs,
)
from diffusion_rollout.client.exceptions import RolloutConnectionError, RolloutHTTPError
from diffusion_rollout.client.receive import aread_body
from diffusion_rollout.client.results import RolloutOutput, UpdateResult
from diffusion_rollout.client.segments import SEGMENTS
from diffusion_rollout.client.stream import AsyncRolloutStream
from diffusion_rollout.protocol import wire
from diffusion_rollout.protocol.safetensors_layout import SafetensorsBody

__all__ = ["AsyncRolloutClient"]


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
            transport=transport, timeout=timeout, limits=self._http_limits()
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

    async def _request(self, call: _Call, url: str, stream: bool) -> httpx.Response:
        kwargs = self._request_kwargs(call, url)
        if not stream:
            return await self._http.request(call.method, url + call.path, **kwargs)
        request = self._http.build_request(call.method, url + call.path, **kwargs)
        return await self._http.send(request, stream=True)

    async def _send(self, call: _Call, url: str, *, stream: bool = False) -> httpx.Response:
        """As :meth:`RolloutClient._send` (with ``stream`` the body is read by :func:`aread_body`)."""
        attempt = 0
        while True:
            try:
                resp = await self._request(call, url, stream)
                if stream and not resp.is_success:
                    await resp.aread()  # the error answer's message
            except httpx.TransportError as exc:
                delay = self._delay_after_transport_error(call, url, attempt, exc)
            else:
                if resp.is_success:
                    return resp
                delay = self._delay_after_error_status(call, url, attempt, resp)
            await self._sleep(delay)
            attempt += 1

    async def _one(self, call: _Call, server: int = 0) -> Any:
        url = self.urls[server]
        return self._parse_plain(call, await self._send(call, url))

    async def _all(self, call: _Call, server: int | None) -> UpdateResult:
        responses = {}
        for u in self._targets(server):  # in order: a failure names the server and stops there
            responses[u] = (await self._send(call, u)).json()
        return self._updates(responses)

    async def health(self, *, server: int = 0) -> dict[str, Any]:
        return await self._one(_info_call("/health"), server)

    async def health_generate(self, *, server: int = 0) -> dict[str, Any]:
        return await self._one(_info_call("/health_generate"), server)

    async def wait_until_ready(self, timeout_s: float = 300.0, interval_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        call = _ready_call()
        for url in self.urls:
            while True:
                try:
                    await self._send(call, url)
                    break
                except (RolloutConnectionError, RolloutHTTPError) as exc:
                    self._raise_unless_starting(exc, url, deadline, timeout_s)
                await self._sleep(interval_s)

    async def model_info(self, *, server: int = 0) -> dict[str, Any]:
        return await self._one(_info_call("/model_info"), server)

    async def server_info(self, *, server: int = 0, admin: bool = False) -> dict[str, Any]:
        return await self._one(_info_call("/server_info", admin=admin), server)

    async def list_models(self, *, server: int = 0) -> dict[str, Any]:
        return await self._one(_info_call("/v1/models"), server)

    async def metrics(self, *, server: int = 0) -> str:
        return await self._one(_info_call("/metrics", decode="text"), server)

    async def generate(
        self,
        prompt: str | None = None,
        *,
        server: int | None = None,
        timeout: float | httpx.Timeout | None = None,
        **fields: Any,
    ) -> list[RolloutOutput]:
        """``POST /rollout/generate``; keyword arguments as :meth:`RolloutClient.generate`."""
        call, settings = _generate_call(prompt, fields, timeout)
        url = self._rollout_url(server)
        # Same-host answers (client/segments.py): the server may write a msgpack answer into a file.
        async with SEGMENTS.alease(url, wanted=self.wire_format == "msgpack") as answer:
            call.headers.update(answer.headers)
            resp = await self._send(call, url, stream=True)
            try:
                body = await aread_body(resp)
            except httpx.TransportError as exc:
                raise self._transport_error(exc, url) from exc
            finally:
                await resp.aclose()
            body = answer.body(resp.headers, body)
            self._count_answer(body)
            media = resp.headers.get("content-type", wire.MSGPACK)
            # Decoding a large trajectory is CPU work: keep it off the event loop.
            return await asyncio.to_thread(_wire_outputs, body, media, settings)

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

    def rollout_stream(
        self,
        make_batch: Callable[[int], Sequence[str | Mapping[str, Any]]],
        *,
        max_staleness: int = 1,
        on_stale: str = "drop",
        depth: int | None = None,
        max_batches: int | None = None,
        **fields: Any,
    ) -> AsyncRolloutStream:
        """The asyncio twin of :meth:`RolloutClient.rollout_stream` (``client/stream.py``):
        ``async with client.rollout_stream(make_batch, max_staleness=k) as stream:
        async for batch in stream: ...; stream.pushed(v)``; leaving it aborts what is in flight."""
        return AsyncRolloutStream(
            self,
            make_batch,
            max_staleness=max_staleness,
            on_stale=on_stale,
            depth=depth,
            max_batches=max_batches,
            **fields,
        )

    async def abort_request(
        self, rid: str | None = None, *, abort_all: bool = False, server: int | None = None
    ) -> UpdateResult:
        """Drop the queued work of the rollout sent with ``rid=...`` (on every server: any may hold
        it); it answers 499 ``request_aborted``, a batch already running finishes."""
        return await self._all(_abort_call(rid, abort_all), server)

    async def pause_generation(self, *, server: int | None = None) -> UpdateResult:
        return await self._all(_admin_switch_call("/pause_generation"), server)

    async def continue_generation(self, *, server: int | None = None) -> UpdateResult:
        return await self._all(_admin_switch_call("/continue_generation"), server)

    async def release_memory_occupation(self, *, server: int | None = None) -> UpdateResult:
        return await self._all(_admin_switch_call("/release_memory_occupation"), server)

    async def resume_memory_occupation(self, *, server: int | None = None) -> UpdateResult:
        return await self._all(_admin_switch_call("/resume_memory_occupation"), server)

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
        call = _disk_call(model_path, target_modules, flush_cache, weight_version, timeout)
        return await self._all(call, server)

    async def update_weights(
        self,
        data: bytes | SafetensorsBody,
        *,
        target_module: str = "transformer",
        weight_version: str | int | None = None,
        final: bool = True,
        upload_id: str | None = None,
        part: int | None = None,
        flush_cache: bool = True,
        server: int | None = None,
        timeout: float | httpx.Timeout | None = None,
        partial: bool = False,
        direct: bool = True,
    ) -> UpdateResult:
        call = _upload_call(
            data, target_module, weight_version, final, upload_id, part, flush_cache, timeout, partial
        )
        responses = {}
        for url in self._targets(server):  # in order: a failure names the server and stops there
            target = (self._known_upload_url(url) if direct else None) or url
            try:
                responses[url] = (await self._send(call, target)).json()
            except RolloutConnectionError:
                if target != url:
                    self._forget_upload_url(url)
                raise
            except RolloutHTTPError as exc:
                if not self._direct_port_busy(exc, target, url):
                    raise
                responses[url] = (await self._send(call, url)).json()
        return self._updates(responses)

    async def upload_url(self, server: int = 0, *, refresh: bool = False) -> str:
        """Where full-weight parts for ``server`` go (see ``RolloutClient.upload_url``)."""
        url = self.urls[server]
        known = None if refresh else self._known_upload_url(url)
        if known is not None:
            return known
        call = _info_call("/model_info")
        return self._remember_upload_url(url, self._parse_plain(call, await self._send(call, url)))

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
        return await self._all(_tensor_call(locals()), server)

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
        return await self._all(_destroy_group_call(group_name), server)

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
        data: bytes | SafetensorsBody | None = None,
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
        return await self._all(_unload_call(name, target_module, weight_version), server)

    async def lora_list(self, *, server: int = 0) -> dict[str, Any]:
        return await self._one(_lora_list_call(), server)
