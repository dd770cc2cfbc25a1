"""The direct receive listener: ``POST /update_weights`` on a port of its own, read with ``recv_into``.

Why it exists: under uvicorn every byte of a weight upload is copied several times on the one
event-loop thread that all parts in flight share (socket read into a new ``bytes``, the parser's
buffer, the ASGI body chunk, then the receive buffer); on an H200 host that capped uploads at
about a third of what a bare loopback socket moves (benchmarks/RESULTS.md). ASGI offers no way to
read the socket into our own buffer, so this module serves the one route that needs it itself.

Design decisions:

- **One job, stdlib only.** A thread per connection (a trainer keeps a few open, one per part in
  flight) speaks just enough HTTP/1.1 for ``POST /update_weights?<query>``: a bounded request line
  and header block (``MAX_REQUEST_LINE``, ``MAX_HEADER_LINE``, ``MAX_HEADERS``), ``Content-Length``
  required (chunked bodies are a 411 naming it: they stay on the main port), keep-alive for the
  parts that follow. Other paths are 404, other methods 405. The HTTP/1.1 itself (head parsing,
  the bounded socket reads, rendering answers) is ``upload_wire.py``; this module serves requests.
- **Checks before the body, body straight into the buffer.** The declared length against
  ``max_upload_bytes`` (413), the admin key (401/403, the app's own ``key_error``) and the query
  (422, ``UploadQuery`` shared with the route) are answered from the head alone, and the connection
  is then closed without reading the body. An accepted body is read with ``sock.recv_into`` into a
  buffer leased from the weight manager's ``receive_buffers`` pool (pinned on CUDA): the kernel
  copies each byte once, into the memory the tensors are then views of, and ``recv_into`` releases
  the GIL, so parts in flight are received in parallel.
- **Same semantics as the route.** The part is applied by the same ``apply_part`` coroutine
  (``upload_part.py``), run on the app's event loop with ``run_coroutine_threadsafe`` (the manager's
  state is the loop's), and errors are answered with the app's own mapping
  (``http_errors.response_for``): the same JSON and status for the same outcome. A body that ends
  early (the client closed, reset or stalled past ``BODY_TIMEOUT_S``) is the route's 400
  "truncated" refusal through ``refuse_part``: nothing of it is staged and its upload is dropped.
- **The server never dies because of a request.** Every failure of a connection ends that
  connection only; hostile heads get a 4xx and a close.
- **A connection is authenticated before it takes a slot.** A new connection must send its first
  request head within ``upload_wire.HEAD_TIMEOUT_S`` of being accepted (no idle grace), and it counts against
  ``MAX_CONNECTIONS`` only once that head has passed the admin-key check; more authenticated
  connections than that get 503 (the client then sends the part to the main port). Connections not
  yet authenticated are at most ``MAX_UNAUTHENTICATED``: one more closes the oldest of them. So
  sockets opened by someone without the key, idle or trickling bytes, cannot keep a push out: they
  never hold a slot, and they are gone within seconds or as soon as newer ones arrive.
- **Clean stop.** :meth:`UploadListener.stop` closes the listening socket, shuts the read side of
  every open connection (a blocked read returns at once; an answer being prepared still goes out)
  and joins every thread; the threads are daemons, so a stuck one can never hold the process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from diffusion_rollout.config import ServerConfig
from diffusion_rollout.entrypoints.http_errors import response_for
from diffusion_rollout.entrypoints.request_context import declared_length_error
from diffusion_rollout.entrypoints.routers.common import key_error
from diffusion_rollout.entrypoints.upload_part import (
    UPLOAD_PATH,
    UploadQuery,
    apply_part,
    refuse_body,
    truncated_body_error,
)
from diffusion_rollout.entrypoints.upload_wire import (
    Connection,
    Head,
    ListenerRefusal,
    content_length,
    parse_head,
    render,
    request_id,
)
from diffusion_rollout.errors import DiffusionRolloutError, ServiceUnavailableError, WeightUpdateError
from diffusion_rollout.logging_utils import request_id_var
from diffusion_rollout.server.weights import Lease, unpooled

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 64  # authenticated connections served at once; one more gets 503
MAX_UNAUTHENTICATED = 64  # connections that have not passed the key check yet; one more closes the oldest
METRICS_ROUTE = "upload_port:" + UPLOAD_PATH  # /metrics label: which port answered


@dataclass
class ListenerStats:
    """What the listener did since it started (read by tests and the benchmark)."""

    connections: int = 0  # connections accepted
    requests: int = 0  # requests answered
    parts: int = 0  # bodies received whole and handed to the manager
    dropped_unauthenticated: int = 0  # closed to make room (more than MAX_UNAUTHENTICATED at once)
    bytes: int = 0  # body bytes received into receive buffers
    refused: int = 0  # answers with a status of 400 or more
    # Seconds summed over connections (where a push's time goes; read by benchmarks/replica_push):
    lease_s: float = 0.0  # waiting for a receive buffer (a new one is allocated, pinned on CUDA)
    recv_s: float = 0.0  # reading bodies from the socket
    apply_s: float = 0.0  # checking, hashing and staging received parts, until the answer
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


class UploadListener:
    """``POST /update_weights`` for ``engine`` on ``config.host:port`` (see the module docstring).

    ``loop`` is the app's running event loop: parts are applied there. :meth:`start` binds and
    returns the port (``port=0`` picks a free one); :meth:`stop` closes everything.
    """

    def __init__(
        self,
        config: ServerConfig,
        engine,
        loop: asyncio.AbstractEventLoop,
        port: int,
        *,
        stage_only: bool = False,
        host: str | None = None,
    ) -> None:
        """``stage_only``: a replica's listener (``cluster/replica.py``): it stages non-final parts
        and refuses ``final=true``, which must reach the cluster front (it commits on every replica
        or none). ``host``: the address to bind (default ``config.host``)."""
        self.config = config
        self.engine = engine
        self.loop = loop
        self.stage_only = stage_only
        self.host = host or config.host
        self.requested_port = port
        self.port: int | None = None
        self.stats = ListenerStats()
        self._sock: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[socket.socket, threading.Thread] = {}
        # Not yet past the key check, oldest first (a dict keeps the order of insertion).
        self._unauthenticated: dict[socket.socket, None] = {}
        self._authenticated = 0
        self._lock = threading.Lock()
        self._stopping = False
        self._serial = 0

    @property
    def running(self) -> bool:
        return self._sock is not None and not self._stopping

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    @property
    def authenticated_connections(self) -> int:
        with self._lock:
            return self._authenticated

    # ------------------------------------------------------------------ life cycle
    def start(self) -> int:
        host = self.host
        family = socket.getaddrinfo(host, self.requested_port, type=socket.SOCK_STREAM)[0][0]
        self._sock = socket.create_server((host, self.requested_port), family=family, backlog=64)
        # A fallback wake-up for the accept loop on systems where closing the socket does not.
        self._sock.settimeout(0.5)
        self.port = self._sock.getsockname()[1]
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"upload-listener-{self.port}", daemon=True
        )
        self._accept_thread.start()
        logger.info("weight-upload listener on %s:%d (POST %s)", host, self.port, UPLOAD_PATH)
        return self.port

    def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting, end every connection (answers being prepared still go out), join threads."""
        with self._lock:
            if self._stopping or self._sock is None:
                return
            self._stopping = True
        deadline = time.monotonic() + timeout
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() on Linux
        self._sock.close()
        if self._accept_thread is not None:
            self._accept_thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            conns = list(self._conns.items())
        for sock, _ in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RD)  # a blocked read returns; the write side stays open
        for _, thread in conns:
            if thread.ident is not None:  # started (the accept loop starts each right after adding it)
                thread.join(max(0.0, deadline - time.monotonic()))
        left = [t.name for _, t in conns if t.is_alive()]
        if left:
            logger.warning("weight-upload listener stopped with %d connection(s) still busy", len(left))
        logger.info("weight-upload listener on port %s stopped", self.port)

    def _accept_loop(self) -> None:
        assert self._sock is not None  # set by start() before this thread exists
        while not self._stopping:
            try:
                sock, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopping:
                    break
                logger.warning("weight-upload listener: accept failed: %s", exc)
                time.sleep(0.1)  # e.g. out of file descriptors: do not spin
                continue
            oldest = None
            with self._lock:
                stopping = self._stopping
                if not stopping:
                    self._serial += 1
                    thread = threading.Thread(
                        target=self._serve, args=(sock,), name=f"upload-conn-{self._serial}", daemon=True
                    )
                    self._conns[sock] = thread
                    self._unauthenticated[sock] = None
                    if len(self._unauthenticated) > MAX_UNAUTHENTICATED:
                        oldest = next(iter(self._unauthenticated))
                        del self._unauthenticated[oldest]
            self.stats.add(connections=1)
            if stopping:
                self._refuse_and_close(sock, ListenerRefusal(503, "the server is shutting down"))
                continue
            if oldest is not None:  # its thread's read returns at once and closes it
                self.stats.add(dropped_unauthenticated=1)
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)
            thread.start()

    def _refuse_and_close(self, sock: socket.socket, refusal: ListenerRefusal) -> None:
        try:
            sock.settimeout(1.0)
            sock.sendall(self._answer(refusal, "-", None, keep_alive=False))
        except OSError:
            pass
        finally:
            sock.close()

    # ------------------------------------------------------------------ one connection
    def _serve(self, sock: socket.socket) -> None:
        conn = Connection(sock)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # answers are one small write
            while not self._stopping and self._one_request(conn):
                pass
        except OSError:
            pass  # the client went away: nothing to answer
        except Exception:  # a bug must end this connection, never the listener
            logger.exception("weight-upload listener: connection failed")
        finally:
            conn.close()
            with self._lock:
                self._conns.pop(sock, None)
                self._unauthenticated.pop(sock, None)
                if conn.authenticated:
                    self._authenticated -= 1

    def _one_request(self, conn: Connection) -> bool:
        """Read and answer one request; whether the connection may carry another."""
        head = None
        try:
            raw = conn.read_head()
            if raw is None:
                return False
            head = parse_head(raw)
        except ListenerRefusal as refusal:
            conn.send(self._answer(refusal, request_id(None), None, keep_alive=False))
            return False
        rid = request_id(head)
        token = request_id_var.set(rid)  # log lines of this request (and of the coroutines it runs)
        try:
            response, body_read = self._handle(head, conn)
        except OSError:
            raise  # the client went away (writing "100 Continue"): nobody to answer
        except Exception as exc:
            response, body_read = exc, False
        finally:
            request_id_var.reset(token)
        # Before the body was read the connection is out of step with the client: close it.
        keep_alive = body_read and head.keep_alive() and not self._stopping
        conn.send(self._answer(response, rid, head, keep_alive=keep_alive))
        return keep_alive

    def _handle(self, head: Head, conn: Connection) -> tuple[JSONResponse | BaseException, bool]:
        """The answer to one request (a response, or the exception to answer), and whether its body
        was read whole (only then is the connection still in step with the client)."""
        if head.path != UPLOAD_PATH:
            raise ListenerRefusal(404, f"Not Found: this port serves only POST {UPLOAD_PATH}")
        declared = head.get("content-length")
        if declared is not None and declared.isdigit():
            too_large = declared_length_error(int(declared), self.config.max_upload_bytes, "max_upload_bytes")
            if too_large is not None:
                raise too_large
        denied = key_error(head.get("authorization"), self.config, "admin")
        if denied is not None:
            raise denied
        self._take_slot(conn)
        if head.method != "POST":
            raise ListenerRefusal(405, "Method Not Allowed", headers={"Allow": "POST"})
        length = content_length(head)
        query = UploadQuery.from_pairs(parse_qsl(head.query, keep_blank_values=True))
        if self.stage_only and query.final:
            raise WeightUpdateError(
                "this is a replica's upload port: it stages parts (final=false); send the final part "
                "to the cluster front, which applies the upload on every replica or on none",
                field="final",
            )
        manager = self.engine.weights()
        if head.version == "HTTP/1.1" and (head.get("expect") or "").lower() == "100-continue":
            conn.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        body, received = self._receive(conn, manager.receive_buffers, length)
        if body is None:
            error = truncated_body_error(received, length)
            try:
                self._on_loop(refuse_body(manager, error, query))
            except WeightUpdateError as refused:
                return refused, False
            return error, False
        self.stats.add(parts=1)
        t0 = time.perf_counter()
        try:
            result = self._on_loop(apply_part(manager, body, query))
        except Exception as exc:
            return exc, True
        finally:
            self.stats.add(apply_s=time.perf_counter() - t0)
        return JSONResponse(jsonable_encoder(result)), True

    def _take_slot(self, conn: Connection) -> None:
        """An authenticated connection's slot (kept until it closes), or 503 when all are taken."""
        if conn.authenticated:
            return
        with self._lock:
            self._unauthenticated.pop(conn.sock, None)  # never evicted from here on
            if self._authenticated >= MAX_CONNECTIONS:
                raise ListenerRefusal(
                    503,
                    f"more than {MAX_CONNECTIONS} authenticated upload connections are open; send the part "
                    "to the main port",
                    headers={"Retry-After": "1"},
                )
            self._authenticated += 1
            conn.authenticated = True

    def _receive(self, conn: Connection, pool, length: int) -> tuple[Lease | None, int]:
        """The body in a pooled buffer, or ``(None, bytes received)`` when it ended early."""
        if length == 0:
            return unpooled(b""), 0
        t0 = time.perf_counter()
        lease = pool.lease(length)
        view = lease.writable()
        t1 = time.perf_counter()
        try:
            received = conn.read_body(view)
        except BaseException:
            view.release()
            lease.release()
            raise
        view.release()  # a live view would keep the buffer out of the pool
        self.stats.add(bytes=received, lease_s=t1 - t0, recv_s=time.perf_counter() - t1)
        if received < length:
            lease.release()
            return None, received
        return lease, received

    def _on_loop(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the app's event loop and wait for it (this thread has nothing else to do)."""
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:  # the loop is closed: the app has shut down
            coro.close()
            raise ServiceUnavailableError("the server is shutting down") from None
        while True:
            try:
                return future.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                if self.loop.is_closed():
                    future.cancel()
                    raise ServiceUnavailableError("the server is shutting down") from None
            except concurrent.futures.CancelledError:
                raise ServiceUnavailableError("the server is shutting down") from None

    # ------------------------------------------------------------------ answers
    def _answer(
        self, outcome: JSONResponse | BaseException, rid: str, head: Head | None, *, keep_alive: bool
    ) -> bytes:
        if isinstance(outcome, JSONResponse):
            response = outcome
        else:
            response = response_for(outcome)
            if isinstance(outcome, ListenerRefusal):
                response.headers.update(outcome.headers)
            self._log_failure(outcome, head)
        status = response.status_code
        self.stats.add(requests=1, refused=int(status >= 400))
        route = METRICS_ROUTE if head is not None and head.path == UPLOAD_PATH else "upload_port:unmatched"
        self.engine.metrics.http_response(head.method if head else "-", route, status)
        return render(response, rid, keep_alive)

    @staticmethod
    def _log_failure(exc: BaseException, head: Head | None) -> None:
        where = f"{head.method} {head.path}" if head is not None else "a request"
        if isinstance(exc, DiffusionRolloutError):
            if exc.status_code >= 500:
                logger.error("upload port: %s failed: %s", where, exc.message)
        elif not isinstance(exc, RequestValidationError):
            logger.error("upload port: unexpected error in %s", where, exc_info=exc)
