"""Holds requests that arrive while the model loads or warms up until it serves (pure ASGI).

Launchers take ``/health`` answering 200, or uvicorn's "Application startup complete." line, as
"ready" (SGLang's test fixture, Relax, the SGLang router, the published scripts), and their next
request must be served. Two designs meet that: open the port only once the model serves, or hold
requests that arrive earlier. This server holds them, because the port being open while loading is
worth keeping: ``/health`` reports ``state`` and a compiled server's warm-up progress throughout
(operators and this project's launch harness read them), ``/health_generate`` answers 503 for those
who probe readiness, and a load failure is reported on the port before the process exits. A held
request waits at most ``ready_wait_s``; then it gets a 503 naming the state and the wait, never a
silent hang. A load that fails lets the held requests through to the route's own answer (503).

Only the routes that describe the server answer at once (health, metrics, the info routes, whose
``status`` says ``loading``; launchers and this project's harness poll ``/model_info`` for it, and
holding each poll would only pile up requests whose clients have timed out). Everything else
(generation, weights, LoRA, memory) waits, since each needs the model.
"""

from __future__ import annotations

import asyncio
import logging
import time

from diffusion_rollout.entrypoints.http_errors import error_response, log_not_ready
from diffusion_rollout.errors import NotReadyError

logger = logging.getLogger(__name__)

# Engine states that end by themselves; requests wait them out.
WAITED_STATES = frozenset({"loading", "warming"})
# Routes that describe the server and so must answer while it loads.
IMMEDIATE_PATHS = frozenset(
    {
        "/health",
        "/health_generate",
        "/metrics",
        "/model_info",
        "/server_info",
        "/v1/models",
        "/v1/model_info",
        "/weight_version",
        "/openapi.json",
        "/docs",
        "/redoc",
    }
)
POLL_S = 0.05


class ReadyGateMiddleware:
    def __init__(self, app, *, engine, wait_s: float) -> None:
        self.app = app
        self.engine = engine
        self.wait_s = wait_s

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] in IMMEDIATE_PATHS
            or self.engine.status not in WAITED_STATES
        ):
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self.wait_s
        state = self.engine.status
        logger.debug("%s %s waits for the model (%s)", scope["method"], scope["path"], state)
        while self.engine.status in WAITED_STATES:
            state = self.engine.status
            if time.monotonic() >= deadline:
                exc = NotReadyError(
                    f"model still {state} after waiting {self.wait_s:g} s (ready_wait_s); "
                    "GET /health shows its state",
                    state=state,
                )
                log_not_ready(scope["app"], exc)
                await error_response(exc)(scope, receive, send)
                return
            await asyncio.sleep(POLL_S)
        await self.app(scope, receive, send)
