"""Asynchronous rollouts with bounded staleness: batches generated ahead while the trainer trains.

``RolloutClient.rollout_stream(make_batch, max_staleness=k)`` keeps ``depth`` (default ``k``)
batches in flight ahead of the batch the trainer is training on and yields them in order;
``AsyncRolloutClient.rollout_stream`` is its asyncio twin (``async for`` / ``async with``).

Design decisions:

- **Versions are counted in the order the trainer pushes them.** The stream starts from the
  server's current version and the trainer reports each push (``stream.pushed(version)``). A batch's
  staleness is the number of versions pushed after the one it was made under. Versions are never
  compared by value (strings or integers, as the server orders them: ``weight_versions.py``).
- **Every request asks for ``min_weight_version`` = the trainer's latest version when it is sent**,
  so the server never runs it on older weights (it waits for an update still on its way). A batch
  sent while the trainer trains on batch ``i`` is therefore at most ``depth`` pushes behind when it
  is yielded, if the trainer pushes once per batch.
- **Staleness is checked when the batch is yielded**, against the trainer's latest push then. A
  batch more than ``max_staleness`` versions behind, made under a version the trainer did not push,
  or whose outputs carry different versions (a batch never mixes versions) is stale: ``"drop"``
  skips it (the next batch index takes its place), ``"regenerate"`` sends the same requests again
  under the latest version. Both are counted in ``stats``.
- **One bookkeeper, two transports.** ``_StreamBook`` holds everything but the sending (versions,
  staleness, the stale rule, request ids, stats); ``RolloutStream`` sends on a thread pool,
  ``AsyncRolloutStream`` as asyncio tasks, so the two cannot drift apart.
- **Stopping cancels what is in flight.** ``close()`` (called on ``with`` exit and when a request
  fails; garbage collection is not relied on) aborts every request the stream sent with
  ``abort_request(rid)``, again until each has answered, so nothing it sent stays queued or waiting
  on the server. Each request carries its own ``rid`` for that.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from diffusion_rollout.client.calls import _merge_item
from diffusion_rollout.errors import RequestAbortedError
from diffusion_rollout.protocol.weight_versions import version_key

logger = logging.getLogger(__name__)

ABORT_DEADLINE_S = 60.0  # closing gives up aborting (and cancels) after this long

OnStale = Literal["drop", "regenerate"]
BatchRequests = Sequence[str | Mapping[str, Any]]


@dataclass
class StreamBatch:
    """One batch as yielded: ``outputs[j]`` answers request ``j`` of ``make_batch(index)``."""

    index: int
    outputs: list[list[Any]]
    weight_version: Any
    staleness: int  # versions the trainer pushed after ``weight_version``, when yielded
    attempts: int = 1  # 1 + how many times it was regenerated
    # When its requests were sent and when the last one answered (``time.perf_counter()``): the
    # span in which the server worked on it, for timelines.
    sent_at: float = 0.0
    answered_at: float = 0.0


@dataclass
class StreamStats:
    yielded: int = 0
    dropped: int = 0
    regenerated: int = 0
    mixed_versions: int = 0  # stale because its outputs carried different versions
    aborted: int = 0  # requests cancelled by close() before they ran
    staleness: Counter = field(default_factory=Counter)  # staleness -> batches yielded


@dataclass
class _InFlight:
    index: int
    requests: list[dict[str, Any]]
    rids: list[str]
    futures: list[Any]  # concurrent.futures.Future (RolloutStream) or asyncio tasks (AsyncRolloutStream)
    attempts: int
    sent_at: float
    answered_at: list[float] = field(default_factory=list)


class _StreamBook:
    """What both streams share: the trainer's pushed versions, the requests of each batch, the
    stale rule and the stats. It sends nothing."""

    def __init__(
        self,
        make_batch: Callable[[int], BatchRequests],
        *,
        max_staleness: int,
        on_stale: OnStale,
        depth: int | None,
        max_batches: int | None,
        fields: dict[str, Any],
    ) -> None:
        if max_staleness < 0 or (depth is not None and depth < 0):
            raise ValueError("max_staleness and depth must be >= 0")
        if on_stale not in ("drop", "regenerate"):
            raise ValueError(f"on_stale must be 'drop' or 'regenerate', not {on_stale!r}")
        self.make_batch = make_batch
        self.max_staleness = max_staleness
        self.on_stale = on_stale
        self.depth = max_staleness if depth is None else depth
        self.max_batches = max_batches
        self.fields = fields
        self.stats = StreamStats()
        self.pushed_versions: list[str] = []  # set by start(): the version the trainer starts from
        self._lock = threading.Lock()
        self._next_index = itertools.count()
        self.exhausted = False
        self._tag = uuid.uuid4().hex[:12]

    def start(self, version: Any) -> None:
        self.pushed_versions = [version_key(version)]

    def pushed(self, version: Any) -> None:
        with self._lock:
            key = version_key(version)
            if key != self.pushed_versions[-1]:
                self.pushed_versions.append(key)

    @property
    def latest_version(self) -> str:
        return self.pushed_versions[-1]

    def staleness_of(self, version: Any) -> int | None:
        key = version_key(version)
        with self._lock:
            for back, pushed in enumerate(reversed(self.pushed_versions)):
                if pushed == key:
                    return back
        return None

    def next_batch(self) -> tuple[int, list[dict[str, Any]]] | None:
        """The next batch index and its requests (None once ``max_batches`` are out)."""
        index = next(self._next_index)
        if self.max_batches is not None and index >= self.max_batches:
            self.exhausted = True
            return None
        return index, [_merge_item(item, self.fields) for item in self.make_batch(index)]

    def jobs(self, index: int, requests: list[dict[str, Any]], attempts: int) -> list[dict[str, Any]]:
        """The requests as sent: each with its own ``rid`` and ``min_weight_version`` = the latest push."""
        wanted = self.latest_version
        return [
            {**request, "rid": f"stream-{self._tag}-{index}-{attempts}-{j}", "min_weight_version": wanted}
            for j, request in enumerate(requests)
        ]

    def judge(self, batch: _InFlight, outputs: list[list[Any]], answered_at: float) -> StreamBatch | None:
        """The batch to yield, or None when it is stale (counted; the caller re-sends it when
        ``on_stale`` is ``"regenerate"``)."""
        versions = {version_key(o.weight_version) for outs in outputs for o in outs}
        version = next(iter(versions)) if len(versions) == 1 else None
        staleness = self.staleness_of(version) if version is not None else None
        if staleness is not None and staleness <= self.max_staleness:
            first = outputs[0][0].weight_version if outputs and outputs[0] else version
            self.stats.yielded += 1
            self.stats.staleness[staleness] += 1
            return StreamBatch(
                batch.index, outputs, first, staleness, batch.attempts, batch.sent_at, answered_at
            )
        if version is None:
            self.stats.mixed_versions += 1
        reason = "mixed versions" if version is None else f"version {version!r} staleness {staleness}"
        if self.on_stale == "drop":
            self.stats.dropped += 1
            logger.info("batch %d is stale (%s): dropped", batch.index, reason)
        else:
            self.stats.regenerated += 1
            logger.info("batch %d is stale (%s): regenerated", batch.index, reason)
        return None


class _StreamFront:
    """The trainer-facing part both streams share (versions and stats read from the book)."""

    _book: _StreamBook

    @property
    def stats(self) -> StreamStats:
        return self._book.stats

    @property
    def latest_version(self) -> str:
        return self._book.latest_version

    def pushed(self, version: Any) -> None:
        """The trainer pushed ``version``: later requests ask for it, staleness counts from it."""
        self._book.pushed(version)

    def staleness_of(self, version: Any) -> int | None:
        """Versions pushed after ``version`` (None for a version the trainer never pushed)."""
        return self._book.staleness_of(version)

    # Each stream has ``_in_flight`` (a deque of _InFlight) and ``_send(index, requests, attempts)``.
    _in_flight: deque[_InFlight]

    def _send(self, index: int, requests: list[dict[str, Any]], attempts: int) -> _InFlight:
        raise NotImplementedError

    def _fill(self) -> None:
        """Keep the batch the trainer waits for plus ``depth`` more in flight."""
        while not self._book.exhausted and len(self._in_flight) < self._book.depth + 1:
            nxt = self._book.next_batch()
            if nxt is None:
                return
            self._in_flight.append(self._send(*nxt, attempts=1))

    def _take(self, batch: _InFlight, outputs: list[list[Any]]) -> StreamBatch | None:
        """The answered batch at the head, judged: the batch to yield, or None (dropped, or sent
        again ahead of the others when ``on_stale`` is ``"regenerate"``)."""
        self._in_flight.popleft()
        ready = self._book.judge(batch, outputs, _answered(batch))
        if ready is None and self._book.on_stale == "regenerate":
            self._in_flight.appendleft(self._send(batch.index, batch.requests, batch.attempts + 1))
        return ready


class RolloutStream(_StreamFront):
    """Iterate for :class:`StreamBatch` objects; see the module docstring. Use as a context manager."""

    def __init__(
        self,
        client: Any,
        make_batch: Callable[[int], BatchRequests],
        *,
        max_staleness: int = 1,
        on_stale: OnStale = "drop",
        depth: int | None = None,
        max_batches: int | None = None,
        initial_version: Any = None,
        max_workers: int = 16,
        **fields: Any,
    ) -> None:
        """``make_batch(i)`` returns batch ``i``'s requests, as ``generate_many`` items (a prompt or
        a mapping of fields with ``prompt``), laid over ``fields``. ``depth`` batches are kept in
        flight ahead (default ``max_staleness``; 0 is synchronous). ``max_batches`` ends the stream
        after that many batch indices. ``initial_version``: the version the trainer starts from
        (default: the server's current one)."""
        self._book = _StreamBook(
            make_batch, max_staleness=max_staleness, on_stale=on_stale, depth=depth,
            max_batches=max_batches, fields=fields,
        )  # fmt: skip
        self.client = client
        self._book.start(
            client.model_info()["weight_version"] if initial_version is None else initial_version
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="rollout-stream")
        self._in_flight: deque[_InFlight] = deque()
        self._closed = False

    def __iter__(self) -> Iterator[StreamBatch]:
        return self

    def __next__(self) -> StreamBatch:
        if self._closed:
            raise StopIteration
        while True:
            self._fill()
            if not self._in_flight:
                raise StopIteration
            batch = self._in_flight[0]  # stays listed while awaited: a close() meanwhile aborts it too
            try:
                outputs = [f.result() for f in batch.futures]
            except BaseException:
                self.close()
                raise
            if self._closed:
                raise StopIteration
            ready = self._take(batch, outputs)
            if ready is not None:
                return ready

    def close(self) -> None:
        """Abort every request still in flight (``abort_request(rid)``) until each has answered."""
        if self._closed:
            return
        self._closed = True
        pending = [(rid, f) for b in self._in_flight for rid, f in zip(b.rids, b.futures, strict=True)]
        self._in_flight.clear()
        for _, f in pending:
            f.cancel()  # not sent yet: never will be
        deadline = time.monotonic() + ABORT_DEADLINE_S
        while True:
            live = [(rid, f) for rid, f in pending if not f.done()]
            if not live or time.monotonic() > deadline:
                break
            # A request may reach the server after an abort for it: abort again until it answers.
            for rid, _ in live:
                try:
                    self.client.abort_request(rid)
                except Exception as exc:  # the server may be gone already; nothing more to cancel
                    logger.info("abort_request(%s) failed while closing the stream: %s", rid, exc)
            concurrent.futures.wait([f for _, f in live], timeout=0.2)
        for _, f in pending:
            if f.done() and not f.cancelled() and isinstance(f.exception(), RequestAbortedError):
                self._book.stats.aborted += 1
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RolloutStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, index: int, requests: list[dict[str, Any]], attempts: int) -> _InFlight:
        jobs = self._book.jobs(index, requests, attempts)
        sent_at = time.perf_counter()
        futures = [self._pool.submit(self._generate, job) for job in jobs]
        in_flight = _InFlight(index, requests, [j["rid"] for j in jobs], futures, attempts, sent_at)
        for f in futures:
            f.add_done_callback(lambda _f: in_flight.answered_at.append(time.perf_counter()))
        return in_flight

    def _generate(self, job: dict[str, Any]) -> list[Any]:
        if self._closed:
            raise RequestAbortedError(f"request {job['rid']} was not sent: the stream was closed")
        return self.client.generate(**job)


class AsyncRolloutStream(_StreamFront):
    """The asyncio twin of :class:`RolloutStream`: ``async with client.rollout_stream(...) as s:
    async for batch in s: ...``; ``aclose()`` aborts what is in flight. Same arguments."""

    def __init__(
        self,
        client: Any,
        make_batch: Callable[[int], BatchRequests],
        *,
        max_staleness: int = 1,
        on_stale: OnStale = "drop",
        depth: int | None = None,
        max_batches: int | None = None,
        initial_version: Any = None,
        **fields: Any,
    ) -> None:
        self._book = _StreamBook(
            make_batch, max_staleness=max_staleness, on_stale=on_stale, depth=depth,
            max_batches=max_batches, fields=fields,
        )  # fmt: skip
        self.client = client
        self._initial_version = initial_version
        self._in_flight: deque[_InFlight] = deque()
        self._closed = False

    async def start(self) -> None:
        """Learn the version the trainer starts from (the server's, unless given); called by
        ``async with`` and by the first ``__anext__``."""
        if not self._book.pushed_versions:
            version = self._initial_version
            if version is None:
                version = (await self.client.model_info())["weight_version"]
            self._book.start(version)

    def __aiter__(self) -> AsyncRolloutStream:
        return self

    async def __anext__(self) -> StreamBatch:
        if self._closed:
            raise StopAsyncIteration
        await self.start()
        while True:
            self._fill()
            if not self._in_flight:
                raise StopAsyncIteration
            batch = self._in_flight[0]
            try:
                outputs = list(await asyncio.gather(*batch.futures))
            except BaseException:
                await self.aclose()
                raise
            if self._closed:
                raise StopAsyncIteration
            ready = self._take(batch, outputs)
            if ready is not None:
                return ready

    async def aclose(self) -> None:
        """Abort every request still in flight (``abort_request(rid)``) until each has answered."""
        if self._closed:
            return
        self._closed = True
        pending = [(rid, t) for b in self._in_flight for rid, t in zip(b.rids, b.futures, strict=True)]
        self._in_flight.clear()
        deadline = time.monotonic() + ABORT_DEADLINE_S
        while True:
            live = [(rid, t) for rid, t in pending if not t.done()]
            if not live or time.monotonic() > deadline:
                break
            for rid, _ in live:
                try:
                    await self.client.abort_request(rid)
                except Exception as exc:  # the server may be gone already; nothing more to cancel
                    logger.info("abort_request(%s) failed while closing the stream: %s", rid, exc)
            await asyncio.wait([t for _, t in live], timeout=0.2)
        for _, t in pending:
            if not t.done():
                t.cancel()  # past the deadline: drop the connection (the server drops its work too)
            elif not t.cancelled() and isinstance(t.exception(), RequestAbortedError):
                self._book.stats.aborted += 1

    async def __aenter__(self) -> AsyncRolloutStream:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _send(self, index: int, requests: list[dict[str, Any]], attempts: int) -> _InFlight:
        jobs = self._book.jobs(index, requests, attempts)
        sent_at = time.perf_counter()
        tasks = [asyncio.ensure_future(self.client.generate(**job)) for job in jobs]
        in_flight = _InFlight(index, requests, [j["rid"] for j in jobs], tasks, attempts, sent_at)
        for t in tasks:
            t.add_done_callback(lambda _t: in_flight.answered_at.append(time.perf_counter()))
        return in_flight


def _answered(batch: _InFlight) -> float:
    """When the batch's last request answered. A result can be read just before its future's
    done-callback ran: then "now" is the answer."""
    complete = len(batch.answered_at) == len(batch.futures)
    return max(batch.answered_at) if complete else time.perf_counter()
