"""Writing a rollout answer into the caller's shared-memory file (``answer_segments``).

Why the mappings are kept: a file mapped afresh for every answer costs one page fault per 4 KiB
page written (about 30 000 for a video answer); a mapping kept from the previous answer into the
same file is already populated. A kept mapping is checked against the file on every use (same
device, inode and size, still there) and dropped when the file is gone, so a client that removed
its file does not leave the server holding that memory for longer than until the next answer. It is
dropped, never closed: a write in another thread may still hold a view of it, and the mapping goes
away with the last view.
"""

from __future__ import annotations

import collections
import mmap
import os
import stat
import threading
from collections.abc import Sequence

import numpy as np

from diffusion_rollout.protocol import wire
from diffusion_rollout.protocol.answer_segments import SEGMENT_DIR, TOKEN_BYTES, token_matches, valid_name

__all__ = ["SegmentWriter"]

_KEEP = 32  # mappings kept at most: a trainer's requests in flight, each with its own file


class _Mapping:
    def __init__(self, fd: int, st: os.stat_result) -> None:
        self.key = (st.st_dev, st.st_ino, st.st_size)
        self.map = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


class SegmentWriter:
    """Writes answers into callers' files; returns why not when it may not (the answer then goes in
    the body)."""

    def __init__(self, directory: str = SEGMENT_DIR) -> None:
        self.directory = directory
        self._maps: collections.OrderedDict[str, _Mapping] = collections.OrderedDict()
        self._lock = threading.Lock()

    def write(
        self, name: str, buffers: Sequence[bytes | memoryview], length: int, token: str | None
    ) -> str | None:
        """Write the ``length`` bytes of ``buffers`` at the start of the file ``name``, which must
        start with the request's ``token``; None when written, else the reason (a short phrase for
        the answer's header)."""
        if not valid_name(name):
            return "not a segment name"
        mapping = self._mapping(name, length)
        if isinstance(mapping, str):
            return mapping
        # The caller proves the file is its own: only it could have written this request's token
        # there. Without the check any client could have an answer written over another trainer's.
        if not token_matches(mapping.map[:TOKEN_BYTES], token):
            return "segment does not carry this request's token"
        dest = np.frombuffer(mapping.map, dtype=np.uint8, count=length)
        pos = 0
        for buffer in buffers:
            part = np.frombuffer(buffer, dtype=np.uint8)
            wire.copy_into(dest[pos : pos + part.size], part)
            pos += part.size
        if pos != length:  # the encoder's own count disagrees: a bug, never a half answer
            raise RuntimeError(f"answer buffers hold {pos} bytes, announced {length}")
        return None

    def _mapping(self, name: str, length: int) -> _Mapping | str:
        path = os.path.join(self.directory, name)
        with self._lock:
            self._prune()
            kept = self._maps.get(name)
            if kept is not None:
                self._maps.move_to_end(name)
                return kept if kept.key[2] >= length else f"segment too small for {length} bytes"
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return "no such segment on this host"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                return "segment not a file of the server's user"
            if st.st_size < length:
                return f"segment too small for {length} bytes"
            # The client reserves its files; a sparse one (made otherwise) on a full tmpfs would
            # make this process's write a SIGBUS, so reserve it here too (quick when it already is).
            os.posix_fallocate(fd, 0, st.st_size)
            mapping = _Mapping(fd, st)
        except OSError as exc:
            return f"segment cannot be mapped ({exc.strerror or exc})"
        finally:
            os.close(fd)
        with self._lock:
            self._maps[name] = mapping
            while len(self._maps) > _KEEP:
                self._maps.popitem(last=False)
        return mapping

    def _prune(self) -> None:
        """Drop kept mappings whose file is gone or was replaced (lock held)."""
        for name, kept in list(self._maps.items()):
            try:
                st = os.stat(os.path.join(self.directory, name), follow_symlinks=False)
            except OSError:
                del self._maps[name]
                continue
            if (st.st_dev, st.st_ino, st.st_size) != kept.key:
                del self._maps[name]

    def kept(self) -> int:
        """Mappings kept (tests)."""
        with self._lock:
            return len(self._maps)
