"""The uvicorn server with a graceful shutdown that drains the engine.

On SIGINT/SIGTERM uvicorn stops accepting connections, lets requests in flight finish (at most
``timeout_graceful_shutdown``), then runs the app's lifespan shutdown. ``DrainingServer`` puts the
engine into shutdown first, so from the signal on any rollout that still reaches it (on a connection
already open) gets 503 instead of being queued; work already queued or running keeps going and is
answered. The drain deadline is one for both stages: ``shutdown_grace_s`` from the signal, after
which uvicorn cancels what is left and ``Engine.stop`` fails the rest of the queue with 503.

The port listens before uvicorn runs the app's start-up: uvicorn prints "Application startup
complete." before it binds, and a launcher that takes that line as ready (SGLang's test fixture)
could otherwise connect in between and be refused. Connections made before the accept loop runs wait
in the listen backlog; requests that arrive while the model loads wait for it (``api.md``).
"""

from __future__ import annotations

import logging
import socket
import sys

import uvicorn

from diffusion_rollout.config import ServerConfig


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine) -> None:
        super().__init__(config)
        self.engine = engine

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._listening_early = sockets is None and self.config.fd is None and self.config.uds is None
        if self._listening_early:
            sockets = [_listen(self.config)]
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if getattr(self, "_listening_early", False) and self.started and sockets:
            self._log_started_message(sockets)  # uvicorn logs it only for the sockets it bound itself

    async def shutdown(self, sockets=None) -> None:
        self.engine.begin_shutdown()
        await super().shutdown(sockets)


def _listen(config: uvicorn.Config) -> socket.socket:
    """Bound and listening as uvicorn would bind ``config.host:config.port``, now."""
    family = socket.AF_INET6 if config.host and ":" in config.host else socket.AF_INET
    sock = socket.socket(family=family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
        sock.listen(config.backlog)
    except OSError as exc:
        sock.close()
        logging.getLogger("uvicorn.error").error(exc)
        sys.exit(3)  # uvicorn's STARTUP_FAILURE, as when uvicorn fails to bind
    sock.set_inheritable(True)
    return sock


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
