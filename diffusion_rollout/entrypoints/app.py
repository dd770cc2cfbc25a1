"""The FastAPI application factory.

No module-level globals: ``create_app(config, engine=...)`` builds a fresh app whose routers reach
the engine through ``request.app.state.engine``. Without a ready engine the app loads the model in a
background thread at start-up, so ``/health`` answers (and ``/health_generate`` says 503) while
a large model loads; every other request waits for it (``ready_gate.py``). A load that fails leaves the reason (one line) in ``app.state.load_error`` and
calls ``app.state.on_load_failure``: ``serve`` sets it to stop the server and exit non-zero, since a
model that cannot load never will. With ``upload_port`` set, the lifespan also runs the direct
weight-upload listener (``upload_listener.py``) on the app's event loop, as
``app.state.upload_listener``, and stops it at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from fastapi import FastAPI

from diffusion_rollout import __version__
from diffusion_rollout.config import ServerConfig
from diffusion_rollout.entrypoints.auth_gate import AuthGateMiddleware, route_key_levels
from diffusion_rollout.entrypoints.body_limit import BodyLimitMiddleware
from diffusion_rollout.entrypoints.http_errors import install_error_handlers
from diffusion_rollout.entrypoints.msgpack_body import MsgpackBodyMiddleware
from diffusion_rollout.entrypoints.ready_gate import ReadyGateMiddleware
from diffusion_rollout.entrypoints.request_context import RequestContextMiddleware
from diffusion_rollout.entrypoints.routers import ROUTERS
from diffusion_rollout.entrypoints.segment_answer import SegmentWriter
from diffusion_rollout.entrypoints.upload_listener import UploadListener
from diffusion_rollout.server.core.engine import Engine
from diffusion_rollout.server.core.engine_api import RolloutEngine

logger = logging.getLogger(__name__)

# Paths whose bodies are weight payloads and get the larger upload limit.
UPLOAD_PATHS = frozenset(
    {"/update_weights", "/update_weights_from_tensor", "/lora/load", "/set_lora_from_tensor"}
)


def make_engine(config: ServerConfig) -> RolloutEngine:
    """One process (the default), or replicas on Ray when ``config.replicas`` is set."""
    if config.replicas is None:
        return Engine(config)
    # Imported only here: the single-process server never imports Ray.
    from diffusion_rollout.cluster import ClusterEngine

    return ClusterEngine(config, upload_listener=UploadListener)


def load_failure_reason(exc: BaseException) -> str:
    """One line naming why a load failed; a replica's error arrives wrapped by Ray (``.cause``)."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError / ActorDiedError
        if not isinstance(inner, BaseException):
            break
        exc = inner
    text = " ".join(str(exc).split()) or "(no message)"
    return f"{type(exc).__name__}: {text[:500]}"


def create_app(config: ServerConfig | None = None, engine: RolloutEngine | None = None) -> FastAPI:
    config = config or ServerConfig()
    owns_engine = engine is None
    engine = engine or make_engine(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = None
        if engine.status == "loading":

            def _load() -> None:
                try:
                    engine.start()
                except Exception as exc:
                    app.state.load_error = load_failure_reason(exc)
                    logger.error("model load failed: %s", app.state.load_error)
                    logger.debug("model load failure in full", exc_info=True)
                    engine.status = "failed"
                    if app.state.on_load_failure is not None:
                        app.state.on_load_failure()

            loader = threading.Thread(target=_load, name="model-loader", daemon=True)
            loader.start()
        listener = previous = None
        if config.upload_port is not None:
            listener = UploadListener(config, engine, asyncio.get_running_loop(), config.upload_port)
            listener.start()  # a port already taken fails the start-up here, naming it
            previous = getattr(app.state, "upload_listener", None)
            app.state.upload_listener = listener
        try:
            yield
        finally:
            if listener is not None:
                # Off the loop: a part being applied needs the loop to finish and be answered.
                await asyncio.to_thread(listener.stop, config.shutdown_grace_s)
                if getattr(app.state, "upload_listener", None) is listener:
                    app.state.upload_listener = previous  # lifespans of one app may nest (tests)
            if loader is not None:
                loader.join()
            if owns_engine:
                await asyncio.to_thread(engine.stop)

    app = FastAPI(title="diffusion-rollout", version=__version__, lifespan=lifespan)
    app.state.config = config
    app.state.engine = engine
    app.state.upload_listener = None
    app.state.segment_writer = SegmentWriter() if config.same_host_answers else None
    # Why the background load failed (one line), and what to do then: ``serve`` stops the process.
    app.state.load_error = None
    app.state.on_load_failure = None
    install_error_handlers(app)
    # msgpack rollout bodies become JSON innermost: after the key gate and the body limits.
    app.add_middleware(MsgpackBodyMiddleware)
    # Requests that arrive while the model loads or warms up wait for it (inside the key gate: a
    # caller without a key is refused at once rather than held).
    app.add_middleware(ReadyGateMiddleware, engine=engine, wait_s=config.ready_wait_s)
    # Keys before bodies (inside request_context, so refusals carry request ids and are counted).
    key_levels: dict[str, str] = {}
    app.add_middleware(AuthGateMiddleware, config=config, levels=key_levels)

    def body_limit(path: str) -> tuple[int, str]:
        if path in UPLOAD_PATHS:  # exact: /update_weights_from_disk is a small JSON body
            return config.max_upload_bytes, "max_upload_bytes"
        return config.max_body_bytes, "max_body_bytes"

    # Request ids, the Content-Length limit and metrics (added after the key gate: outside it).
    app.add_middleware(RequestContextMiddleware, engine=engine, limit_for=body_limit)
    # Chunked bodies carry no Content-Length: counted as they are read.
    app.add_middleware(BodyLimitMiddleware, limit_for=body_limit)
    for router in ROUTERS:
        app.include_router(router)
    key_levels.update(route_key_levels(app))
    return app
