"""The blocking client's weight and LoRA methods (admin), apart from its rollout methods.

:class:`~diffusion_rollout.client.sync_client.RolloutClient` mixes them in; they send the calls
:mod:`diffusion_rollout.client.calls` describes through the client's ``_send``, ``_one`` and
``_all``, so retries, headers and error mapping stay those of the client. Kept in a module of their
own because weight sync is a subsystem of its own (a new transport or LoRA option changes this file
and ``calls``, not the rollout path).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from diffusion_rollout.client.calls import (
    _activate_call,
    _checker_call,
    _checksum_call,
    _destroy_group_call,
    _disk_call,
    _distributed_call,
    _info_call,
    _init_group_call,
    _lora_list_call,
    _lora_load_call,
    _tensor_call,
    _unload_call,
    _upload_call,
)
from diffusion_rollout.client.exceptions import RolloutConnectionError, RolloutHTTPError
from diffusion_rollout.client.results import UpdateResult
from diffusion_rollout.protocol.safetensors_layout import SafetensorsBody

__all__ = ["SyncWeightsMixin"]


class SyncWeightsMixin:
    """Weight updates, checksums and LoRA for :class:`RolloutClient` (needs its ``_send``, ``_one``,
    ``_all``, ``_targets`` and upload-port bookkeeping)."""

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
        call = _disk_call(model_path, target_modules, flush_cache, weight_version, timeout)
        return self._all(call, server)

    def update_weights(
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
        """One part of an HTTP weight upload (safetensors bytes); see ``client.weights.push_weights``.

        ``direct``: send it to the server's direct upload port when this client knows it (learned by
        :meth:`upload_url`, which ``push_weights`` calls at every push); False: always the main
        port. The answer is the same. One request per server either way (two when the direct port
        answers 503, its slots all taken: the part then goes to the main port); nothing is asked here.
        """
        call = _upload_call(
            data, target_module, weight_version, final, upload_id, part, flush_cache, timeout, partial
        )
        responses = {}
        for url in self._targets(server):  # in order: a failure names the server and stops there
            target = (self._known_upload_url(url) if direct else None) or url
            try:
                responses[url] = self._send(call, target).json()
            except RolloutConnectionError:
                if target != url:
                    self._forget_upload_url(url)
                raise
            except RolloutHTTPError as exc:
                if not self._direct_port_busy(exc, target, url):
                    raise
                responses[url] = self._send(call, url).json()
        return self._updates(responses)

    def upload_url(self, server: int = 0, *, refresh: bool = False) -> str:
        """Where full-weight parts for ``server`` go: its direct upload port (``weight_upload_port``
        of ``/model_info``, on the same host) when it has one, else its main URL. Asked once and
        kept (``update_weights`` sends there from then on); ``refresh`` asks again."""
        url = self.urls[server]
        known = None if refresh else self._known_upload_url(url)
        if known is not None:
            return known
        call = _info_call("/model_info")
        return self._remember_upload_url(url, self._parse_plain(call, self._send(call, url)))

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
        return self._all(_tensor_call(locals()), server)

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
        return self._all(_destroy_group_call(group_name), server)

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
        return self._all(_unload_call(name, target_module, weight_version), server)

    def lora_list(self, *, server: int = 0) -> dict[str, Any]:
        """``GET /lora``: adapters per module (rank, alpha, checksum), the active one, the mode."""
        return self._one(_lora_list_call(), server)
