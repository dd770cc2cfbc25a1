"""Full-weight pushes over HTTP: bounded safetensors parts, one atomic commit, checksum verification.

Design decisions:

- **Bounded parts, one commit.** :func:`push_weights` packs named tensors into safetensors parts of
  at most ``max_part_bytes`` (a larger single tensor travels alone), sends them with
  ``final=false`` and numbered ``part``, and commits with an empty last part (``final=true``): the
  server stages the parts and applies all or nothing. A push that fits in one part is one request. The iterator is consumed lazily with one part of
  look-ahead, so an FSDP trainer can feed gathered shards without holding the whole model twice.
  Each push gets its own ``upload_id`` so stale parts of an earlier failed push never mix in.
- **No copies, parts in flight together.** A part is a :class:`SafetensorsBody`: the header and
  views of the (cast) tensors, sent in slices, so nothing is serialised before the socket. An empty
  part 0 opens the upload on the server, then every part with data travels with up to
  ``concurrency - 1`` others on separate connections (the server checks and hashes some while it
  receives others), and the empty commit goes last, after every other part was accepted. Parts
  with data never travel alone: a part 0 or a final part with data did, at one connection's speed.
  The bodies go out through ``client/upload_transport.py`` (no copy under the GIL). Together: 3.1-3.7
  GB/s verified on an H100 host, against 2.1-2.2 before (benchmarks/RESULTS.md#sync-verified).
  Per-tensor hashes for verification start on the hashing threads (``checksums.hash_pool``) as
  soon as a part is packed, while parts are sent.
- **The direct port when the server has one.** A server started with ``--upload-port`` advertises
  it (``weight_upload_port``); the parts then go there (``direct=True``, the default), where they
  are read from the socket straight into the receive buffers, while the verification and every
  other call stay on the main port. The port is asked again at every push, so a restarted server is
  followed. ``direct=False`` sends everything to the main port; the result is the same.
- **Verification with the same code, off the critical path.** Per-tensor SHA-256
  (``checksums.tensor_sha256``) of every cast tensor is computed while the parts are sent, and checked
  with ``/update_weights_from_tensor_checker`` after the commit. The server hashed the bytes it
  received while receiving them (``server/weights/received_digests.py``), so the check reads
  nothing back from the GPU; whole-module checksums (:func:`verify_weights_checksum`) use
  ``checksums.trainer_weights_checksum``. A mismatch raises :class:`ChecksumMismatchError`.
- Only the blocking :class:`RolloutClient` is accepted: pushes happen between training steps.
"""

from __future__ import annotations

import collections
import functools
import logging
import sys
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from diffusion_rollout.client.calls import _upload_call
from diffusion_rollout.client.exceptions import ChecksumMismatchError
from diffusion_rollout.client.results import UpdateResult
from diffusion_rollout.client.weights.tensors import (
    DTypeSpec,
    NamedTensors,
    _cast,
    _check_manifest,
    _named,
    resolve_dtype,
)
from diffusion_rollout.protocol.checksums import (
    submit_tensors_sha256,
    tensors_sha256,
    trainer_weights_checksum,
    weights_checksum,
)
from diffusion_rollout.protocol.safetensors_layout import SafetensorsBody

if TYPE_CHECKING:
    from diffusion_rollout.client.sync_client import RolloutClient

__all__ = [
    "DEFAULT_MAX_PART_BYTES",
    "WeightPart",
    "push_weights",
    "safetensors_parts",
    "verify_weights_checksum",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_PART_BYTES = 512 * 2**20
# Parts in flight: the server checks and hashes a received part before it answers, so the wire
# idles on a connection meanwhile; more connections keep it busy (benchmarks/RESULTS.md#sync-verified).
DEFAULT_CONCURRENCY = 4


@dataclass
class WeightPart:
    """One safetensors body of a multi-part upload (views of its tensors) and what it holds."""

    body: SafetensorsBody
    names: list[str]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def data(self) -> bytes:
        """The body as one ``bytes`` (a copy; sending uses ``body`` directly)."""
        return bytes(self.body)

    @property
    def num_bytes(self) -> int:
        return len(self.body)

    @functools.cached_property
    def sha256(self) -> dict[str, str]:
        """Per-tensor SHA-256 of the cast tensors (``checksums.tensor_sha256``, on several cores),
        computed once."""
        return tensors_sha256(self.tensors)


def safetensors_parts(
    named_tensors: NamedTensors,
    *,
    max_part_bytes: int = DEFAULT_MAX_PART_BYTES,
    dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
) -> Iterator[WeightPart]:
    """Cast and pack named tensors into safetensors bodies of at most ``max_part_bytes`` of tensor data.

    A single tensor larger than the bound travels alone. Repeated names are an error.
    """
    if max_part_bytes < 1:
        raise ValueError("max_part_bytes must be positive")
    seen: set[str] = set()
    batch: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> WeightPart:
        return WeightPart(SafetensorsBody(batch), list(batch), dict(batch))

    for name, tensor in _named(named_tensors):
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        t = _cast(name, tensor, dtype).cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        if batch and size + nbytes > max_part_bytes:
            yield flush()
            batch, size = {}, 0
        batch[name] = t
        size += nbytes
    if batch:
        yield flush()


def _lookahead(parts: Iterator[WeightPart]) -> Iterator[tuple[WeightPart, bool]]:
    prev = next(parts, None)
    if prev is None:
        raise ValueError("nothing to push: no named tensors")
    for part in parts:
        yield prev, False
        prev = part
    yield prev, True


def push_weights(
    client: RolloutClient,
    named_tensors: NamedTensors,
    *,
    target_module: str = "transformer",
    dtype: DTypeSpec = "server",
    max_part_bytes: int = DEFAULT_MAX_PART_BYTES,
    weight_version: str | int | None = None,
    upload_id: str | None = None,
    flush_cache: bool = True,
    verify: bool = True,
    server: int | None = None,
    timeout: float | None = None,
    partial: bool = False,
    concurrency: int = DEFAULT_CONCURRENCY,
    direct: bool = True,
) -> UpdateResult:
    """Upload full weights over HTTP in bounded parts and apply them atomically with the last one.

    ``named_tensors`` is a state dict, an iterator of ``(name, tensor)`` (e.g. FSDP-gathered) or a
    module (its base parameters). Names may carry the ``"<target_module>."`` prefix. The server
    applies the push only if it names every parameter of the module, unless ``partial=True`` (then
    exactly the tensors sent are applied). With ``verify``
    the server checks every tensor's SHA-256 afterwards (raises :class:`ChecksumMismatchError`).
    ``concurrency``: how many parts with data are in flight at once (1 sends them one by one).
    ``direct``: send the parts to each server's direct upload port when it advertises one (False:
    the main port).
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    cast_to = resolve_dtype(client, dtype, server=server or 0)
    replicas = _learn_upload_urls(client, server) if direct else []
    upload_id = upload_id or uuid.uuid4().hex
    manifest: dict[str, str] = {}
    parts = safetensors_parts(named_tensors, max_part_bytes=max_part_bytes, dtype=cast_to)

    # Where the parts go: each replica's own upload port (a cluster that advertises them; the
    # commit follows at the front), or the one server (its upload port when it has one).
    targets: list[str | None] = list(replicas) or [None]

    def send(index: int, part: WeightPart, last: bool, url: str | None) -> UpdateResult | None:
        if url is not None:
            call = _upload_call(
                part.body, target_module, weight_version, False, upload_id, index, flush_cache, timeout, partial
            )  # fmt: skip
            client._send(call, url)
            return None
        result = client.update_weights(
            part.body,
            target_module=target_module,
            weight_version=weight_version,
            final=last,
            upload_id=upload_id,
            part=index,
            flush_cache=flush_cache,
            server=server,
            timeout=timeout,
            partial=partial,
            direct=direct,
        )
        logger.debug(
            "pushed part %d (%d tensors, %.1f MiB)%s", index, len(part.names), part.num_bytes / 2**20,
            " and committed" if last else "",
        )  # fmt: skip
        return result

    # One task per part and target: with replicas, each keeps about ``concurrency`` parts in flight
    # of its own instead of every part waiting for the slowest replica before the next one starts.
    limit = concurrency * len(targets)
    in_flight: collections.deque[Future] = collections.deque()
    hashes: dict[str, Future] = {}  # hashed on the hashing threads while the parts travel
    empty = WeightPart(SafetensorsBody({}), [])
    with ThreadPoolExecutor(max_workers=limit, thread_name_prefix="push-weights") as pool:
        try:
            index = 0
            for part, last in _lookahead(parts):
                if verify:
                    hashes.update(submit_tensors_sha256(part.tensors))
                if last and index == 0 and not replicas:
                    # One part: it opens the upload and commits it in one request.
                    result = send(0, part, True, None)
                    break
                if index == 0:
                    # An empty part 0 opens the upload (on every target), so that every part with
                    # data travels alongside others (a part 0 with data went alone).
                    for opened in [pool.submit(send, 0, empty, False, url) for url in targets]:
                        opened.result()
                    index = 1
                for url in targets:
                    while len(in_flight) >= limit:
                        in_flight.popleft().result()
                    in_flight.append(pool.submit(send, index, part, False, url))
                index += 1
            else:
                while in_flight:
                    in_flight.popleft().result()
                # The commit, an empty final part after every other part was accepted: at a
                # cluster front it applies the staged upload on every replica or on none
                # (cluster/weights.py).
                result = client.update_weights(
                    empty.body, target_module=target_module, weight_version=weight_version,
                    final=True, upload_id=upload_id, part=index, flush_cache=flush_cache, server=server,
                    timeout=timeout, partial=partial, direct=direct and not replicas,
                )  # fmt: skip
                logger.info("committed upload %s: %d parts to %d target(s)", upload_id, index, len(targets))
        finally:
            for future in in_flight:
                future.cancel()
            if verify and sys.exc_info()[0] is not None:
                for future in hashes.values():
                    future.cancel()
    if verify:
        manifest.update({name: future.result() for name, future in hashes.items()})
        _check_manifest(client, target_module, manifest, server)
    return result


def _learn_upload_urls(client: RolloutClient, server: int | None) -> list[str]:
    """One ``/model_info`` per target server, asked again at every push (a restarted server may
    listen elsewhere): its direct upload port is remembered for ``update_weights``, and the replicas'
    own upload ports (``replica_upload_urls`` of a cluster front) are returned, empty unless every
    target advertises them."""
    replicas: list[str] | None = []
    for index in range(len(client.urls)) if server is None else [server]:
        info = client.model_info(server=index)
        client._remember_upload_url(client.urls[index], info)
        found = info.get("replica_upload_urls")
        replicas = replicas + found if replicas is not None and found else None
    return replicas or []


def verify_weights_checksum(
    client: RolloutClient,
    named_tensors: NamedTensors,
    *,
    target_module: str = "transformer",
    dtype: DTypeSpec = "server",
    algorithm: str = "sglang",
    server: int | None = None,
) -> str:
    """Compare the server's ``/get_weights_checksum`` of a whole module with the trainer's tensors.

    ``named_tensors`` must be *all* of the module's parameters (e.g. the trainer's module). Returns
    the checksum; raises :class:`ChecksumMismatchError` naming the server that differs.
    """
    cast_to = resolve_dtype(client, dtype, server=server or 0)
    pairs = [(n.removeprefix(target_module + "."), t) for n, t in _named(named_tensors)]
    if cast_to is None:
        local = weights_checksum(pairs, algorithm)  # type: ignore[arg-type]
    else:
        local = trainer_weights_checksum(pairs, cast_to, algorithm=algorithm)  # type: ignore[arg-type]
    for index in range(len(client.urls)) if server is None else [server]:
        remote = client.get_weights_checksum([target_module], algorithm=algorithm, server=index)[
            target_module
        ]
        if remote != local:
            raise ChecksumMismatchError(
                f"{client.urls[index]}: {target_module} checksum {remote} != trainer's {local}",
                expected=local,
                actual=remote,
            )
    return local
