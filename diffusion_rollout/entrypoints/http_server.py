"""The uvicorn server with a graceful shutdown that drains the engine.

On SIGINT/SIGTERM uvicorn stops accepting connections, lets requests in flight finish (at most
``timeout_graceful_shutdown``), then runs the app's lifespan shutdown. ``DrainingServer`` puts the
engine into shutdown first, so from the signal on any rollout that still reaches it (on a connection
already open) gets 503 instead of being queued; work already queued or running keeps going and is
answered. The drain deadline is one for both stages: ``shutdown_grace_s`` from the signal, after
which uvicorn cancels what is left and ``Engine.stop`` fails the rest of the queue with 503.
"""

from __future__ import annotations

import uvicorn

from diffusion_rollout.config import ServerConfig


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets=None) -> None:
        self.engine.begin_shutdown()
        await super().shutdown(sockets)


def make_server(app, config: ServerConfig) -> DrainingServer:
    """A uvicorn server for ``app`` (from ``create_app``) bound as ``config`` says; run with ``.run()``."""
    uconfig = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        http=config.http_parser,
        access_log=False,  # request lines carry no keys, but nothing of a request is logged by default
        timeout_graceful_shutdown=config.shutdown_grace_s,
    )
    return DrainingServer(uconfig, app.state.engine)
