"""Same-host answers: what the client and the server agree on.

A trainer on the same host as the server may ask for a rollout answer to be written into a
shared-memory file of its own instead of being sent through the socket: the answer's bytes are then
copied twice (into the file by the server, out of it by the client's decode) instead of crossing
TCP loopback, which cost about 0.8 ms per MB after the GPU had finished on an H200 host. The
answer's bytes are exactly the msgpack body the socket would have carried.

- The client creates the file (``/dev/shm/diffusion-rollout-answer-<pid>-<n>``), sized from an
  earlier answer, and names it in the request header :data:`HEADER`. Before every request it writes
  a fresh random token (:func:`new_token`) at the start of the file and sends it in
  :data:`TOKEN_HEADER`: the proof that the file is the caller's own, which a client that cannot read
  the file (another trainer, another host) cannot give.
- The server writes the answer there only if it may: a loopback peer, :func:`valid_name`, a regular
  file of its own user, not a link, large enough, and the file starts with the request's token
  (:func:`token_matches`). It then answers ``200`` with an empty body and the headers
  ``x-rollout-answer-segment: written`` and :data:`LENGTH_HEADER`; otherwise it answers as usual,
  in the body, with ``x-rollout-answer-segment: declined: <why>``.
- A file is never reused while a request that named it may still write into it: the client drops
  the file after any failed request.
"""

from __future__ import annotations

import hmac
import re
import secrets

__all__ = [
    "HEADER",
    "LENGTH_HEADER",
    "PREFIX",
    "SEGMENT_DIR",
    "TOKEN_BYTES",
    "TOKEN_HEADER",
    "WRITTEN",
    "new_token",
    "token_matches",
    "valid_name",
]

SEGMENT_DIR = "/dev/shm"
PREFIX = "diffusion-rollout-answer-"
HEADER = "x-rollout-answer-segment"  # request: the file's name; answer: "written" or "declined: ..."
LENGTH_HEADER = "x-rollout-answer-length"  # answer: the bytes written into the file
TOKEN_HEADER = "x-rollout-answer-token"  # request: the token the file starts with
TOKEN_BYTES = 32  # 16 random bytes as lowercase hex
WRITTEN = "written"
DECLINED = "declined: "

_NAME = re.compile(re.escape(PREFIX) + r"[A-Za-z0-9_-]{1,100}")
_TOKEN = re.compile(f"[0-9a-f]{{{TOKEN_BYTES}}}")


def valid_name(name: str) -> bool:
    """A plain file name of the agreed form: no directory, no dots, nothing outside the prefix."""
    return _NAME.fullmatch(name) is not None


def new_token() -> str:
    """A fresh request token: :data:`TOKEN_BYTES` characters, unguessable."""
    return secrets.token_hex(TOKEN_BYTES // 2)


def token_matches(file_start: bytes, token: str | None) -> bool:
    """Whether the file starts with ``token`` (a well-formed one; compared in constant time)."""
    if token is None or _TOKEN.fullmatch(token) is None:
        return False
    return hmac.compare_digest(bytes(file_start[:TOKEN_BYTES]), token.encode("ascii"))
