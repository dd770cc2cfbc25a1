"""Work a compiled server puts off until it is idle after ready.

Why: a restart whose warm-up compiles a shape an earlier start served (server/speed/served_shapes.py)
must also save that shape's precompiled blocks (server/speed/precompiled_blocks.py), and the save
traces and verifies every new kind of block: on one H200 (SD3.5-medium) it held ready back by 26.5 s,
so that restart's first answer came no sooner than without remembering the shape. A trainer leaves
the server idle before its first rollout (loading its own model) and between rollouts (its loss and
optimizer step): the save fits there.

Design decisions:

- **Idle** is no job queued or running on the worker for ``IDLE_S`` seconds in a row, watched by one
  daemon thread. ``IDLE_S`` is longer than a trainer's readiness poll, so a trainer that sends its
  first rollout as soon as it sees ready gets it answered before the save starts.
- The save then runs as an exclusive job, between batches, as a weight update does; a request that
  arrives during it waits for it, as it waited for the whole start before.
- A weight or module change first drops the save (``PrecompiledBlocks.turn_off``): the artifacts
  would be off for the rest of the process anyway, and tracing changed blocks is not what the next
  start loads. A stopping server drops it too; one whose memory is released waits for it back.
- A cold start still saves before ready: its first answer waits for a compile in the foreground
  anyway, and the restart that follows finds every kind it warmed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffusion_rollout.server.core.engine import Engine

logger = logging.getLogger(__name__)

IDLE_S = 3.0
POLL_S = 0.25


def run_when_idle(
    engine: Engine, job: Callable[[], None], still_wanted: Callable[[], bool], what: str
) -> None:
    """Start a daemon thread that submits ``job`` as an exclusive worker job once ``engine`` has been
    idle for ``IDLE_S`` seconds, unless ``still_wanted()`` turns false or the engine stops first."""

    def watch() -> None:
        idle_since = None
        while still_wanted() and engine.status not in ("stopping", "failed"):
            now = time.monotonic()
            # Released memory (weights offloaded) is not idle: the save waits for the weights' return.
            if engine.worker.depth or engine.worker.busy or engine.status != "ready":
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since >= IDLE_S:
                logger.info("%s: the server has been idle %.0f s, starting", what, IDLE_S)
                try:
                    engine.submit_exclusive(job).result()
                except Exception as exc:  # the server goes on serving; the next start traces instead
                    logger.warning("%s: failed (%s: %s)", what, type(exc).__name__, exc)
                return
            time.sleep(POLL_S)

    threading.Thread(target=watch, name="idle-save", daemon=True).start()
