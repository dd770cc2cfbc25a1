"""CPU tensors shared by file descriptor: fetching the descriptor and mapping its memory.

The sender's ``multiprocessing.resource_sharer`` hands a descriptor to whoever connects to its
address and proves the shared authkey. Here that happens only over an ``AF_UNIX`` path (local by
construction; abstract and non-socket addresses are refused without a connection), authenticated with
this process's authkey, every socket operation bounded by ``timeout_s``. Every descriptor received is
closed whatever happens, and the one mapped must be a regular file at least as large as the storage
it claims to back (a shorter one would fault on access). The recipes that name these descriptors are
checked first, in ``safe_pickle``.
"""

from __future__ import annotations

import array
import os
import socket
import stat
import struct
from multiprocessing import connection as mp_connection
from multiprocessing import process as mp_process
from typing import Any

import torch

from diffusion_rollout.errors import WeightUpdateError


def _refuse(message: str) -> WeightUpdateError:
    return WeightUpdateError(f"tensor payload refused: {message}")


def _set_timeouts(sock: socket.socket, timeout_s: float) -> None:
    # Kernel-level timeouts keep the socket blocking, which multiprocessing's Connection needs.
    sec = int(timeout_s)
    tv = struct.pack("ll", sec, int((timeout_s - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _recv_fds(sock: socket.socket) -> list[int]:
    """The descriptors of one SCM_RIGHTS message (all of them, so the caller can close them all)."""
    fds = array.array("i")
    msg, ancdata, _flags, _addr = sock.recvmsg(1, socket.CMSG_SPACE(16 * fds.itemsize))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if not msg and not fds:
        raise EOFError("the sender closed the connection")
    return list(fds)


def receive_fd(address: str, key: Any, timeout_s: float) -> int:
    """One descriptor from the sender's resource sharer (AF_UNIX, authenticated, time-bounded)."""
    try:
        if address.startswith("\0"):
            raise _refuse("abstract-namespace socket addresses are not accepted")
        if not stat.S_ISSOCK(os.stat(address).st_mode):
            raise _refuse("DupFd address is not a socket")
    except OSError as exc:
        raise _refuse(f"DupFd address is not reachable ({exc.strerror})") from exc
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    try:
        _set_timeouts(sock, timeout_s)
        sock.connect(address)
        conn = mp_connection.Connection(os.dup(sock.fileno()))
        try:
            authkey = mp_process.current_process().authkey
            mp_connection.answer_challenge(conn, authkey)
            mp_connection.deliver_challenge(conn, authkey)
            conn.send((key, os.getpid()))
            fds = _recv_fds(sock)
        finally:
            conn.close()
        if len(fds) != 1:
            raise _refuse(f"the sender passed {len(fds)} descriptors instead of one")
        return fds.pop()
    except WeightUpdateError:
        raise
    except (OSError, EOFError, mp_connection.AuthenticationError, ValueError) as exc:
        raise _refuse(
            f"could not fetch a shared CPU tensor within {timeout_s:g} s ({type(exc).__name__}: {exc}); "
            "descriptors travel only from a live sender sharing this process's multiprocessing authkey"
        ) from exc
    finally:
        for fd in fds:
            os.close(fd)
        sock.close()


def map_shared_storage(storage: Any, timeout_s: float) -> torch.UntypedStorage:
    """``storage`` (a checked ``FdStorage`` recipe: ``ticket`` and ``nbytes``) mapped from the
    sender's shared-memory file; the descriptor is closed whatever happens."""
    fd = receive_fd(storage.ticket.address, storage.ticket.key, timeout_s)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refuse("the shared descriptor is not a shared-memory file")
        if info.st_size < storage.nbytes:
            raise _refuse(
                f"the shared memory holds {info.st_size} bytes, the storage claims {storage.nbytes}"
            )
        return torch.UntypedStorage._new_shared_fd_cpu(fd, storage.nbytes)
    finally:
        os.close(fd)
