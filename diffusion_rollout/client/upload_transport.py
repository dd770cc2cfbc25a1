"""An httpx transport that sends large request bodies without copying them under the GIL.

Why it exists: httpcore writes a request body through h11, whose ``Connection.send`` joins every
slice into a new ``bytes`` (``b"".join``), and that copy holds the GIL. A trainer pushing full
weights with several parts in flight (``push_weights``) therefore copies every byte once on what is
in effect one core, and the verification hashes on the same process took from it. The stdlib's
``http.client`` hands each slice to ``socket.sendall`` as it is, which releases the GIL, so the
parts in flight really run in parallel. Measured on an H100 host (SD3.5-medium, 4.49 GB, verified):
3.1-3.7 GB/s to one server and 2.2 per replica to two, against 2.1-2.2 and 1.35-1.38 before
(benchmarks/RESULTS.md#sync-verified, #sync-replicas).

Design decisions:

- **Only where it pays.** A plain-``http`` upload (``Content-Type: application/octet-stream``, what
  weight parts and adapters are sent as) with a ``Content-Length`` above the client's slicing
  threshold (``calls._UPLOAD_CHUNK``: the bodies it already sends as an iterator of views) goes
  through ``http.client``; everything else, TLS and rollout requests included (their answers are
  read into the client's own buffers as they stream), goes to the wrapped httpx transport
  unchanged.
- **httpx semantics kept.** The answer comes back as an ``httpx.Response`` (status, headers, body
  read in full), and failures as httpx's own exceptions (``ConnectError``, ``ConnectTimeout``,
  ``WriteTimeout``, ``ReadTimeout``, ``RemoteProtocolError``), so the client's retry policy and
  error mapping apply as they are. The request's timeouts are honoured (connect, then the longer
  of write and read for the transfer).
- **Keep-alive per host, thread safe.** Idle connections are kept per ``(host, port)`` and reused
  by the next request; a connection is used by one request at a time, and closed when the server
  asked for it or anything went wrong.
"""

from __future__ import annotations

import http.client
import select
import threading
from collections.abc import Iterable

import httpx

from diffusion_rollout.client import calls

MAX_IDLE_PER_HOST = 16


class BodyPassthroughTransport(httpx.BaseTransport):
    """Large plain-HTTP uploads through ``http.client`` (no copy under the GIL); the rest to ``inner``."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner
        self._idle: dict[tuple[str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self.passthrough_requests = 0  # requests sent here (read by tests)

    # ------------------------------------------------------------------ httpx.BaseTransport
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not self._takes(request):
            return self.inner.handle_request(request)
        with self._lock:
            self.passthrough_requests += 1
        return self._send(request)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
        self.inner.close()

    # ------------------------------------------------------------------ the passthrough
    @staticmethod
    def _takes(request: httpx.Request) -> bool:
        if request.url.scheme != "http":
            return False
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/octet-stream":
            return False
        length = request.headers.get("content-length")
        return length is not None and length.isdigit() and int(length) > calls._UPLOAD_CHUNK

    def _connection(self, host: str, port: int, connect_timeout: float | None) -> http.client.HTTPConnection:
        while True:
            with self._lock:
                idle = self._idle.get((host, port))
                conn = idle.pop() if idle else None
            if conn is None:
                return http.client.HTTPConnection(host, port, timeout=connect_timeout)
            if _still_open(conn):
                return conn
            conn.close()  # the server closed it while idle (keep-alive timeout)

    def _release(self, host: str, port: int, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault((host, port), [])
            if len(idle) < MAX_IDLE_PER_HOST:
                idle.append(conn)
                return
        conn.close()

    def _send(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        host, port = url.host, url.port or 80
        timeouts = request.extensions.get("timeout", {})
        transfer = _longest(timeouts.get("write"), timeouts.get("read"))
        conn = self._connection(host, port, timeouts.get("connect"))
        keep = False
        try:
            if conn.sock is None:
                try:
                    conn.connect()
                except TimeoutError as exc:
                    raise httpx.ConnectTimeout(str(exc), request=request) from exc
                except OSError as exc:
                    raise httpx.ConnectError(str(exc), request=request) from exc
            conn.sock.settimeout(transfer)
            try:
                conn.putrequest(
                    request.method, url.raw_path.decode("ascii"), skip_host=True, skip_accept_encoding=True
                )
                for name, value in request.headers.raw:
                    if name.lower() != b"accept-encoding":  # the answer comes back uncompressed
                        conn.putheader(name.decode("latin-1"), value.decode("latin-1"))
                conn.endheaders()
                for piece in _pieces(request.stream):
                    conn.sock.sendall(piece)  # releases the GIL; no copy of the slice
            except TimeoutError as exc:
                raise httpx.WriteTimeout(str(exc), request=request) from exc
            except OSError as exc:
                # The server may have answered early (a refusal) and closed: read that answer.
                answer = _early_answer(conn, request)
                if answer is not None:
                    return answer
                raise httpx.WriteError(str(exc), request=request) from exc
            try:
                resp = conn.getresponse()
                content = resp.read()
            except TimeoutError as exc:
                raise httpx.ReadTimeout(str(exc), request=request) from exc
            except (http.client.HTTPException, OSError) as exc:
                raise httpx.RemoteProtocolError(str(exc), request=request) from exc
            keep = not resp.will_close
            return _response(resp, content, request)
        finally:
            if keep:
                self._release(host, port, conn)
            else:
                conn.close()


def _pieces(stream: Iterable[bytes] | httpx.SyncByteStream) -> Iterable[bytes | memoryview]:
    yield from stream  # type: ignore[misc]


def _still_open(conn: http.client.HTTPConnection) -> bool:
    """An idle kept-alive connection is usable when nothing is readable on it (EOF included)."""
    if conn.sock is None:
        return False
    try:
        readable, _, _ = select.select([conn.sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def _longest(*timeouts: float | None) -> float | None:
    if any(t is None for t in timeouts):
        return None
    return max(t for t in timeouts if t is not None)


def _response(resp: http.client.HTTPResponse, content: bytes, request: httpx.Request) -> httpx.Response:
    return httpx.Response(
        resp.status,
        headers=resp.getheaders(),
        content=content,
        request=request,
        extensions={"http_version": b"HTTP/1.1"},
    )


def _early_answer(conn: http.client.HTTPConnection, request: httpx.Request) -> httpx.Response | None:
    """The answer a server sent before it stopped reading the body (e.g. a 413), if one arrived."""
    try:
        conn.sock.settimeout(1.0)
        resp = conn.getresponse()
        return _response(resp, resp.read(), request)
    except (TimeoutError, http.client.HTTPException, OSError, AttributeError):
        return None
