"""Same-host answers: what the client and the server agree on (issue #27).

A trainer on the same host as the server may ask for a rollout answer to be written into a
shared-memory file of its own instead of being sent through the socket: the answer's bytes are then
copied twice (into the file by the server, out of it by the client's decode) instead of crossing
TCP loopback, which cost about 0.8 ms per MB after the GPU had finished on an H200 host. The
answer's bytes are exactly the msgpack body the socket would have carried.

- The client creates the file (``/dev/shm/diffusion-rollout-answer-<pid>-<n>``), sized from an
  earlier answer, and names it in the request header :data:`HEADER`.
- The server writes the answer there only if it may (:func:`valid_name`, a regular file of its own
  user, not a link, large enough) and answers ``200`` with an empty body and the headers
  ``x-rollout-answer-segment: written`` and :data:`LENGTH_HEADER`; otherwise it answers as usual,
  in the body, with ``x-rollout-answer-segment: declined: <why>``.
- A file is never reused while a request that named it may still write into it: the client drops
  the file after any failed request.
"""

from __future__ import annotations

import re

__all__ = ["HEADER", "LENGTH_HEADER", "PREFIX", "SEGMENT_DIR", "WRITTEN", "valid_name"]

SEGMENT_DIR = "/dev/shm"
PREFIX = "diffusion-rollout-answer-"
HEADER = "x-rollout-answer-segment"  # request: the file's name; answer: "written" or "declined: ..."
LENGTH_HEADER = "x-rollout-answer-length"  # answer: the bytes written into the file
WRITTEN = "written"
DECLINED = "declined: "

_NAME = re.compile(re.escape(PREFIX) + r"[A-Za-z0-9_-]{1,100}")


def valid_name(name: str) -> bool:
    """A plain file name of the agreed form: no directory, no dots, nothing outside the prefix."""
    return _NAME.fullmatch(name) is not None
