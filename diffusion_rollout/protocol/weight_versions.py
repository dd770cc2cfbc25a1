"""Which weight versions a server holds, in the order it applied them (``min_weight_version``).

A rollout may ask for weights at least as new as ``min_weight_version``. Trainers send versions as
strings or integers with no order of their own ("lora-a", 7, "step-12"), so "at least as new" is
defined by the order the server applied them, not by comparing the values.

The rule:

- Versions compare as text: ``7`` and ``"7"`` are the same version (query strings turn one into the
  other on the way to the server).
- The server keeps the sequence of versions it has held, starting with its initial one (``0``).
  Applying a version appends it; applying the current version again changes nothing.
- The server **holds at least v** when v is its current version or one it held before the current
  one: after an update to v it satisfies v and every version applied before v.
- Applying a version the server held earlier (a cluster rolling a failed change back, or a trainer
  re-pushing an older version) makes it current again and forgets the versions applied after it:
  the server no longer holds them, so a request for them waits again.
- A version the server never held is not held: a request for it waits until an update to it lands
  (504 at ``request_timeout_s``), or answers 409 at once with ``min_weight_version_wait: false``.
- A fresh or restarted server holds only its initial version until the trainer pushes. A trainer
  re-pushes its current weights with its current version after a restart (it must, the weights
  are gone) and asks for the latest version it pushed; versions from before the restart are not
  held and are waited for. A restarted cluster replica copies the sequence with the weights from a
  serving peer (``server/weights/replica_state.py``).

The check is made when the request is queued: it then runs on the held version or a later one
(weight updates queue behind the rollouts already queued, never under a running batch).

Waiters are woken from the thread that applies the update (the engine's worker) through their own
event loop, so a waiting request costs no polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from diffusion_rollout.errors import RequestAbortedError, RequestTimeoutError, WeightVersionNotHeldError

logger = logging.getLogger(__name__)

Version = Any


def version_key(version: Version) -> str:
    """The comparable form of a version: its text (``7`` and ``"7"`` are one version)."""
    return str(version)


class VersionHistory:
    """The versions a server has held, oldest first; the last is the current one."""

    def __init__(self, versions: Iterable[Version] = (0,)) -> None:
        self._versions: list[Version] = []
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        for v in versions:
            self._append(v)
        if not self._versions:
            raise ValueError("a version history starts with the initial version")

    def _append(self, version: Version) -> None:
        keys = [version_key(v) for v in self._versions]
        key = version_key(version)
        if key in keys:
            del self._versions[keys.index(key) + 1 :]  # back to an earlier version: a rollback
        else:
            self._versions.append(version)

    @property
    def current(self) -> Version:
        return self._versions[-1]

    def as_list(self) -> list[Version]:
        with self._lock:
            return list(self._versions)

    def holds(self, version: Version) -> bool:
        """True when ``version`` is the current version or one held before it (module docstring)."""
        key = version_key(version)
        with self._lock:
            return any(version_key(v) == key for v in self._versions)

    def record(self, version: Version) -> None:
        """``version`` is now the current one; wake every waiter (any thread)."""
        with self._lock:
            self._append(version)
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_wake, fut)

    def replace(self, versions: Iterable[Version]) -> None:
        """Take another server's sequence (a replica re-synced from a peer)."""
        fresh = VersionHistory(versions)
        with self._lock:
            self._versions = fresh._versions
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_wake, fut)

    def changed(self) -> asyncio.Future:
        """A future of the running loop that completes at the next change of the sequence."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._waiters.append((loop, fut))
        return fut

    def describe(self, limit: int = 8) -> str:
        versions = self.as_list()
        shown = ", ".join(repr(v) for v in versions[-limit:])
        return shown if len(versions) <= limit else f"..., {shown}"


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class VersionGate:
    """Where a request with ``min_weight_version`` waits before it is queued (one engine) or
    dispatched (a cluster's front): 409 when it does not wait, 504 at its deadline, and ``abort``
    reaches it while it waits. One per engine, used from one event loop.

    ``holds(v)`` says whether the engine (or some serving replica) holds ``v``; ``histories()`` are
    the sequences whose changes may satisfy it; ``describe()`` says what is held, for messages.
    """

    def __init__(
        self,
        holds: Callable[[Version], bool],
        histories: Callable[[], Iterable[VersionHistory]],
        describe: Callable[[], str],
        on_timeout: Callable[[], None] = lambda: None,
    ) -> None:
        self._holds, self._histories, self._describe = holds, histories, describe
        self._on_timeout = on_timeout  # the engine counts it as a cancelled request
        self._by_rid: dict[str, list[asyncio.Future]] = {}

    def check(self, wanted: Version) -> None:
        """409 at once unless ``wanted`` is held (callers that never wait)."""
        if not self._holds(wanted):
            raise WeightVersionNotHeldError(
                f"min_weight_version={wanted!r} is not held: {self._describe()}; it is satisfied once an "
                "update with that version lands (send min_weight_version_wait=true to wait for it)",
                field="min_weight_version",
            )

    async def admit(self, rid: str, wanted: Version, wait: bool, deadline: float, timeout_s: float) -> None:
        """Return once ``wanted`` is held; 409 when not ``wait``ing, 504 at the monotonic ``deadline``."""
        if not wait or self._holds(wanted):
            self.check(wanted)
            return
        logger.info("request %s waits for weight_version %r (%s)", rid, wanted, self._describe())
        with self._waiting(rid) as aborted:
            held = await _wait_until(lambda: self._holds(wanted), self._histories, aborted, deadline)
        if not held:
            self._on_timeout()
            raise RequestTimeoutError(
                f"request did not get min_weight_version={wanted!r} within request_timeout_s={timeout_s:g} s "
                f"(limit request_timeout_s; {self._describe()}); nothing was queued"
            )

    def waiting_requests(self) -> set[str]:
        """The request ids waiting now."""
        return set(self._by_rid)

    def abort(self, rid: str | None, abort_all: bool) -> int:
        """Fail the waits of request ``rid`` (of every request with ``abort_all``); how many failed."""
        dropped = 0
        for request_id, waits in self._by_rid.items():
            if abort_all or request_id == rid:
                for aborted in waits:
                    if not aborted.done():
                        aborted.set_exception(
                            RequestAbortedError(f"request {request_id} was aborted before it started")
                        )
                        dropped += 1
        return dropped

    @contextlib.contextmanager
    def _waiting(self, rid: str) -> Iterator[asyncio.Future]:
        aborted = asyncio.get_running_loop().create_future()
        waits = self._by_rid.setdefault(rid, [])
        waits.append(aborted)
        try:
            yield aborted
        finally:
            waits.remove(aborted)
            if not waits:
                del self._by_rid[rid]


async def _wait_until(
    satisfied: Callable[[], bool],
    histories: Callable[[], Iterable[VersionHistory]],
    aborted: asyncio.Future,
    deadline: float,
) -> bool:
    """Wait until ``satisfied()`` (re-checked at every change of any of ``histories()``); False at
    the monotonic ``deadline``; raises the abort's exception when ``aborted`` fails first."""
    while not satisfied():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        changes = [h.changed() for h in histories()]
        try:
            await asyncio.wait({*changes, aborted}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for fut in changes:
                fut.cancel()
        if aborted.done():
            raise aborted.exception()
    return True
