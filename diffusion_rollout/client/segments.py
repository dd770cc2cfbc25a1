"""The client's side of same-host answers (``diffusion_rollout.protocol.answer_segments``).

A rollout answer from a server on this host can be written by the server into a shared-memory file
of this process instead of crossing TCP loopback: on an H200 host the loopback transfer was the last
~0.8 ms per MB of every video answer, after the GPU had finished. The decoded answer is the same
(the file holds the msgpack body byte for byte) and is decoded exactly as a body is.

- **When.** ``DIFFUSION_ROLLOUT_SAME_HOST_ANSWERS``: ``auto`` (default) offers a file to servers
  whose URL host is a loopback address; ``1`` to every server (a same-host server reached by
  another address); ``0`` never. The first answer from a server always comes through the socket:
  its length sizes the file for the next ones, and answers under :data:`MIN_BYTES` stay on the
  socket. A server that cannot use the file (another host or container, another user, an older
  server, turned off there) is not offered one again.
- **Files.** ``/dev/shm/diffusion-rollout-answer-<pid>-<n>-<random>``, mode 0600, created and
  faulted in once, then reused for later answers (memory already faulted in is several times faster
  to fill than fresh memory). Each request writes a fresh token at the file's start and sends it:
  the server writes only into a file that carries the request's token. A request holds its own file until its answer is decoded; a file goes
  back to the idle ones only after a request that succeeded, because after a failure the server
  may still be writing into it, so it is removed instead. At most
  ``DIFFUSION_ROLLOUT_SAME_HOST_ANSWERS_MB`` (default 2048) of idle files are kept. Files are
  removed when dropped and at exit; a process that was killed leaves its files, and the next
  process that makes one removes the files of this user whose process is gone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import itertools
import logging
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping
from urllib.parse import urlsplit

import numpy as np

from diffusion_rollout.client.exceptions import RolloutConnectionError
from diffusion_rollout.protocol.answer_segments import (
    DECLINED,
    HEADER,
    LENGTH_HEADER,
    PREFIX,
    SEGMENT_DIR,
    TOKEN_BYTES,
    TOKEN_HEADER,
    WRITTEN,
    new_token,
)

__all__ = ["ENV", "ENV_MB", "MIN_BYTES", "AnswerSegments", "Lease"]

logger = logging.getLogger(__name__)

ENV = "DIFFUSION_ROLLOUT_SAME_HOST_ANSWERS"
ENV_MB = "DIFFUSION_ROLLOUT_SAME_HOST_ANSWERS_MB"
MIN_BYTES = 1 << 20  # smaller answers: the socket is as fast as the two copies
_ROUND = 1 << 20  # file sizes are whole MiB, with a sixteenth to spare for a slightly larger answer
# The server's reasons that mean it will never use a file of this process (not "too small").
_NEVER = (
    "no such segment",
    "not a file of the server's user",
    "are off",
    "not a segment name",
    "cannot be mapped",
    "not a loopback peer",
)


def _remove(path: str, pid: int | None = None) -> None:
    if pid is not None and pid != os.getpid():
        return  # a forked child's copy of the parent's file: the parent still uses it
    with contextlib.suppress(OSError):
        os.unlink(path)


class _Segment:
    """One shared-memory file, mapped and faulted in; removed when dropped or at exit."""

    def __init__(self, directory: str, name: str, capacity: int) -> None:
        self.name = name
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        self._remove = weakref.finalize(self, _remove, path, os.getpid())
        try:
            # Reserved, not just sized: a write into a sparse file on a full tmpfs (a container's
            # 64 MB /dev/shm) is a SIGBUS in whichever process writes; this fails cleanly instead.
            os.posix_fallocate(fd, 0, capacity)
            self._map = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED)
        except OSError:
            self._remove()
            raise
        finally:
            os.close(fd)
        self.capacity = capacity
        np.frombuffer(self._map, dtype=np.uint8)[:] = 0  # fault every page in now, not during an answer

    def arm(self) -> str:
        """A fresh token written at the file's start, for the next request (answer_segments)."""
        token = new_token()
        self._map[:TOKEN_BYTES] = token.encode("ascii")
        return token

    def view(self, length: int) -> memoryview:
        return memoryview(self._map)[:length]

    def drop(self) -> None:
        self._remove()


class Lease:
    """One request's file (or none): its request headers, and the answer's body read from it."""

    def __init__(self, owner: AnswerSegments, url: str, segment: _Segment | None) -> None:
        self._owner = owner
        self.url = url
        self.segment = segment
        self.headers = {HEADER: segment.name, TOKEN_HEADER: segment.arm()} if segment is not None else {}

    def body(self, headers: Mapping[str, str], body: bytes | memoryview) -> bytes | memoryview:
        """The answer's body: ``body`` as read from the socket, or the file's bytes when the server
        wrote it there. Learns the answer's length for the server's next file."""
        said = headers.get(HEADER)
        if said == WRITTEN and self.segment is not None:
            raw = headers.get(LENGTH_HEADER, "")
            if not (raw.isascii() and raw.isdigit()) or int(raw) > self.segment.capacity or len(body):
                raise RolloutConnectionError(
                    f"{self.url}: the server says it wrote {raw!r} bytes into a file of {self.segment.capacity}",
                    url=self.url,
                )
            self._owner._learn(self.url, int(raw), written=True)
            return self.segment.view(int(raw))
        if self.segment is not None:
            reason = said[len(DECLINED) :] if said and said.startswith(DECLINED) else "not understood"
            self._owner._declined(self, reason)
        self._owner._learn(self.url, len(body))
        return body


class AnswerSegments:
    """The files of this process, idle or lent to a request (module doc)."""

    def __init__(
        self, mode: str = "auto", capacity_bytes: int = 2048 << 20, directory: str = SEGMENT_DIR
    ) -> None:
        if mode not in ("auto", "1", "0"):
            raise ValueError(f"{ENV} must be auto, 1 or 0, got {mode!r}")
        self.mode = mode
        self.capacity_bytes = capacity_bytes
        self.directory = directory
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._idle: collections.deque[_Segment] = collections.deque()
        self._length: dict[str, int] = {}  # last answer length per server
        self._off: dict[str, str] = {}  # servers that cannot use a file, and why
        self._names = itertools.count()
        self._swept = False
        self.written = 0  # answers read from a file (tests, diagnostics)

    @classmethod
    def from_env(cls) -> AnswerSegments:
        mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
        raw = os.environ.get(ENV_MB, "2048").strip()
        try:
            mb = float(raw)
        except ValueError:
            raise ValueError(f"{ENV_MB} must be a number of MB, got {raw!r}") from None
        return cls(mode, max(0, int(mb * 2**20)))

    def offers(self, url: str) -> bool:
        """Whether a file is offered to this server at all (mode, host, and what it answered)."""
        if self.mode == "0" or url in self._off or not os.path.isdir(self.directory):
            return False
        return self.mode == "1" or _is_loopback(url)

    @contextlib.contextmanager
    def lease(self, url: str, wanted: bool = True) -> Iterator[Lease]:
        """A file for one request to ``url`` (or none; always none unless ``wanted``: a JSON answer
        never goes into a file), kept until the block ends: decode inside it."""
        with self._holding(url, self._take(url) if wanted else None) as lease:
            yield lease

    @contextlib.asynccontextmanager
    async def alease(self, url: str, wanted: bool = True) -> AsyncIterator[Lease]:
        """:meth:`lease` for asyncio: a new file is made and faulted in off the event loop."""
        segment = await asyncio.to_thread(self._take, url) if wanted else None
        with self._holding(url, segment) as lease:
            yield lease

    @contextlib.contextmanager
    def _holding(self, url: str, segment: _Segment | None) -> Iterator[Lease]:
        lease = Lease(self, url, segment)
        try:
            yield lease
        except BaseException:
            if lease.segment is not None:
                lease.segment.drop()  # the server may still write into it: never reuse it
            raise
        if lease.segment is not None:
            self._give_back(lease.segment)

    def _take(self, url: str) -> _Segment | None:
        with self._lock:
            length = self._length.get(url, 0)
            if length < MIN_BYTES or not self.offers(url):
                return None
            for segment in self._idle:
                if length <= segment.capacity:
                    self._idle.remove(segment)
                    return segment
            name = f"{PREFIX}{os.getpid()}-{next(self._names)}-{secrets.token_hex(4)}"
            if not self._swept:
                self._swept = True
                _sweep(self.directory)
        capacity = -(-(length + length // 16) // _ROUND) * _ROUND
        try:
            return _Segment(self.directory, name, capacity)
        except OSError as exc:  # /dev/shm full or not writable: the socket still works
            with self._lock:
                first = url not in self._off
                self._off[url] = f"cannot make a {capacity}-byte file in {self.directory}: {exc.strerror}"
            if first:
                logger.warning(
                    "same-host answers: %s; answers from %s come by the socket", self._off[url], url
                )
            return None

    def _give_back(self, segment: _Segment) -> None:
        with self._lock:
            self._idle.append(segment)
            idle = sum(s.capacity for s in self._idle)
            while self._idle and idle > self.capacity_bytes:
                old = self._idle.popleft()
                idle -= old.capacity
                old.drop()

    def _learn(self, url: str, length: int, written: bool = False) -> None:
        with self._lock:
            self._length[url] = length
            self.written += written

    def _declined(self, lease: Lease, reason: str) -> None:
        lease.segment.drop()  # too small for this answer, or never usable by this server
        lease.segment = None
        if any(phrase in reason for phrase in _NEVER) or reason == "not understood":
            with self._lock:
                first = lease.url not in self._off
                self._off[lease.url] = reason
            if first:
                logger.info(
                    "same-host answers: %s cannot use them (%s); answers come by the socket",
                    lease.url,
                    reason,
                )

    def clear(self) -> None:
        with self._lock:
            for segment in self._idle:
                segment.drop()
            self._reset()

    def status(self, url: str) -> str | None:
        """Why ``url`` is not offered files, or None (tests, diagnostics)."""
        return self._off.get(url)


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _sweep(directory: str) -> None:
    """Remove this user's answer files left by processes that are gone (killed before their exit)."""
    uid = os.geteuid()
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if not entry.name.startswith(PREFIX):
                continue
            pid = entry.name[len(PREFIX) :].split("-", 1)[0]
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                os.kill(int(pid), 0)
            except ProcessLookupError:
                _remove(entry.path)
            except OSError:  # alive under another user (EPERM), or the entry vanished
                continue


SEGMENTS = AnswerSegments.from_env()


def _after_fork() -> None:
    # A child must not share the parent's files, nor inherit a lock another thread held at the fork.
    SEGMENTS._lock = threading.Lock()
    SEGMENTS._reset()


os.register_at_fork(after_in_child=_after_fork)
