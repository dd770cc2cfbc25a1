"""The upload port's HTTP/1.1, and only what ``POST /update_weights`` needs of it: a bounded head
parsed by hand (request line, header lines, ``Content-Length``), a socket read into a caller's buffer
with ``recv_into``, and answers rendered from the app's own ``JSONResponse``. ``upload_listener.py``
serves requests with it; nothing here knows about weights.
"""

from __future__ import annotations

import contextlib
import http
import socket
import time
import uuid
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from fastapi.responses import JSONResponse

from diffusion_rollout.errors import DiffusionRolloutError

MAX_REQUEST_LINE = 8192  # bytes; a longer one is a 414
MAX_HEADER_LINE = 8192  # bytes per header line; longer, or more than MAX_HEADERS lines: 431
MAX_HEADERS = 64
MAX_HEAD_BYTES = 64 * 1024  # the whole request head
# Longest a request head may take: from the accept for a connection's first request (an idle socket
# that never authenticates goes within this), from its first byte for the later ones.
HEAD_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 60.0  # an authenticated kept-alive connection with no new request is closed after this
BODY_TIMEOUT_S = 120.0  # longest pause inside a body: the sender stalled, the part is refused
LINGER_S = 0.5  # closing after a refusal: how long to drain what the client still sends
LINGER_BYTES = 4 << 20  # ... and at most how much
RECV_CHUNK = 8 << 20  # most bytes asked of one recv_into
HEAD_READ = 64 * 1024  # head reads may take the first bytes of the body too (copied once, bounded)


class ListenerRefusal(DiffusionRolloutError):
    """A request this listener does not serve (malformed head, other path or method, no length).

    Its status varies (400, 404, 405, 411, 414, 431, 503, 505), so it is set per instance; the type
    is the one the app gives its own HTTP-level refusals (``http_error``).
    """

    error_type = "http_error"

    def __init__(self, status_code: int, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.headers = headers or {}


@dataclass
class Head:
    method: str
    path: str
    query: str
    version: str
    headers: list[tuple[str, str]]  # lower-case names, in order

    def get(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)

    def all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name]

    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for v in self.all("connection") for t in v.split(",")}
        if self.version == "HTTP/1.0":
            return "keep-alive" in tokens
        return "close" not in tokens


class Connection:
    """One client socket and the bytes read from it but not yet used."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = bytearray()
        self.eof = False  # the client closed its sending side
        self.authenticated = False  # holds one of the listener's MAX_CONNECTIONS slots
        self.accepted_at = time.monotonic()

    def read_head(self) -> bytes | None:
        """The next request head (without its blank line); None when the client closed between
        requests, stayed idle past ``IDLE_TIMEOUT_S`` (authenticated) or sent nothing within
        ``HEAD_TIMEOUT_S`` of the accept (not yet). Once its first byte is here, the whole head must
        arrive within ``HEAD_TIMEOUT_S`` (a byte now and then cannot hold a thread for long)."""
        deadline = None if self.authenticated else self.accepted_at + HEAD_TIMEOUT_S
        while True:
            # Blank lines before a request line are allowed (RFC 9112 2.2).
            while self.pending.startswith(b"\r\n"):
                del self.pending[:2]
            end = self.pending.find(b"\r\n\r\n")
            if end >= 0:
                head = bytes(self.pending[:end])
                del self.pending[: end + 4]
                return head
            line_end = self.pending.find(b"\r\n")
            if (line_end < 0 and len(self.pending) > MAX_REQUEST_LINE) or line_end > MAX_REQUEST_LINE:
                raise ListenerRefusal(414, f"the request line is longer than {MAX_REQUEST_LINE} bytes")
            if len(self.pending) > MAX_HEAD_BYTES:
                raise ListenerRefusal(431, f"the request head is longer than {MAX_HEAD_BYTES} bytes")
            if self.pending and deadline is None:
                deadline = time.monotonic() + HEAD_TIMEOUT_S
            wait = IDLE_TIMEOUT_S if deadline is None else deadline - time.monotonic()
            try:
                if wait <= 0:
                    raise TimeoutError
                self.sock.settimeout(wait)
                chunk = self.sock.recv(HEAD_READ)
            except TimeoutError:
                if not self.pending:
                    return None  # an idle keep-alive connection: closed quietly
                raise ListenerRefusal(
                    408, f"the request head did not arrive within {HEAD_TIMEOUT_S:g} s"
                ) from None
            if not chunk:
                self.eof = True
                if not self.pending:
                    return None
                raise ListenerRefusal(400, "the connection closed in the middle of the request head")
            self.pending += chunk

    def read_body(self, view: memoryview) -> int:
        """Fill ``view``; returns how many bytes arrived (fewer: the body ended early)."""
        size = len(view)
        pos = min(size, len(self.pending))
        if pos:  # what the head read took of the body: at most HEAD_READ bytes, copied once
            view[:pos] = self.pending[:pos]
            del self.pending[:pos]
        self.sock.settimeout(BODY_TIMEOUT_S)
        try:
            while pos < size:
                n = self.sock.recv_into(view[pos:], min(size - pos, RECV_CHUNK))
                if n == 0:
                    self.eof = True
                    break
                pos += n
        except OSError:  # reset, timed out, or shut down by stop(): the body is cut short
            pass
        return pos

    def send(self, data: bytes) -> None:
        self.sock.settimeout(HEAD_TIMEOUT_S)
        self.sock.sendall(data)

    def close(self) -> None:
        """Close after the last answer. Closing with unread bytes (a refused body still arriving)
        makes the kernel send a reset, which can destroy that answer before the client reads it, so
        the sending side is shut first and what still arrives is drained, briefly and boundedly."""
        with contextlib.suppress(OSError):
            if not self.eof:
                self.sock.shutdown(socket.SHUT_WR)
                self.sock.settimeout(LINGER_S)
                drained = 0
                while drained < LINGER_BYTES:
                    chunk = self.sock.recv(HEAD_READ)
                    if not chunk:
                        break
                    drained += len(chunk)
        self.sock.close()


def parse_head(raw: bytes) -> Head:
    lines = raw.split(b"\r\n")
    request_line = lines[0]
    if len(request_line) > MAX_REQUEST_LINE:
        raise ListenerRefusal(414, f"the request line is longer than {MAX_REQUEST_LINE} bytes")
    if len(raw) > MAX_HEAD_BYTES:
        raise ListenerRefusal(431, f"the request head is longer than {MAX_HEAD_BYTES} bytes")
    parts = request_line.split(b" ")
    if len(parts) != 3 or not all(parts):
        raise ListenerRefusal(400, "malformed request line: expected 'METHOD /path HTTP/1.1'")
    try:
        method, target, version = (p.decode("ascii") for p in parts)
    except UnicodeDecodeError:
        raise ListenerRefusal(400, "malformed request line: not ASCII") from None
    if not method.isalpha() or not method.isupper():
        raise ListenerRefusal(400, f"malformed request line: invalid method {method[:20]!r}")
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise ListenerRefusal(505, f"HTTP version {version[:20]!r} is not supported; use HTTP/1.1")
    if not target.startswith("/"):
        raise ListenerRefusal(
            400, "malformed request line: the target must be a path ('/update_weights?...')"
        )
    headers = []
    for line in lines[1:]:
        if len(line) > MAX_HEADER_LINE:
            raise ListenerRefusal(431, f"a header line is longer than {MAX_HEADER_LINE} bytes")
        if len(headers) >= MAX_HEADERS:
            raise ListenerRefusal(431, f"more than {MAX_HEADERS} header lines")
        name, sep, value = line.partition(b":")
        # No folded lines, no whitespace in names, no stray CR/LF/NUL anywhere (request smuggling).
        if not sep or not name or name != name.strip() or any(c in line for c in b"\r\n\0"):
            raise ListenerRefusal(400, f"malformed header line {line[:40].decode('latin-1')!r}")
        headers.append((name.decode("latin-1").lower(), value.decode("latin-1").strip()))
    split = urlsplit(target)
    return Head(method, unquote(split.path), split.query, version, headers)


def content_length(head: Head) -> int:
    if head.all("transfer-encoding"):
        raise ListenerRefusal(
            411,
            "Transfer-Encoding (chunked) bodies are not read on the upload port: send a Content-Length "
            "(or use the main port)",
        )
    values = set(head.all("content-length"))
    if not values:
        raise ListenerRefusal(411, "Content-Length is required on the upload port")
    if len(values) > 1:
        raise ListenerRefusal(400, "conflicting Content-Length headers")
    [value] = values
    if not value.isdigit() or len(value) > 19:
        raise ListenerRefusal(400, f"invalid Content-Length {value[:30]!r}")
    return int(value)


def request_id(head: Head | None) -> str:
    rid = head.get("x-request-id") if head is not None else None
    # Echoed in a header and logged: only a short printable token is taken from the client.
    if rid and len(rid) <= 128 and all(33 <= ord(c) <= 126 for c in rid):
        return rid
    return uuid.uuid4().hex


def render(response: JSONResponse, rid: str, keep_alive: bool) -> bytes:
    try:
        phrase = http.HTTPStatus(response.status_code).phrase
    except ValueError:
        phrase = "Unknown"
    lines = [f"HTTP/1.1 {response.status_code} {phrase}"]
    lines += [f"{k.decode('latin-1')}: {v.decode('latin-1')}" for k, v in response.raw_headers]
    lines += [f"x-request-id: {rid}", f"connection: {'keep-alive' if keep_alive else 'close'}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + response.body


