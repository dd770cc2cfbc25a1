"""A real server in the benchmark's own process: the app for an engine, served by uvicorn on
127.0.0.1 in a daemon thread, with an ``httpx`` client.

The server under test is the real stack (the FastAPI app, its routers, the msgpack body), so what is
timed is what a trainer waits for; the engine is built here, so stock pipelines can run on the same
weights in the same process while the server is idle. Timed rollouts are sent from a trainer
process (:meth:`LoopbackServer.remote`, ``benchmarks/remote_clients.py``). A ``serve`` started as a
user starts it (a subprocess) goes through ``diffusion_rollout.testing`` instead.
"""

from __future__ import annotations

import contextlib
from typing import Any

from benchmarks.remote_clients import TRAINERS, RemoteClients, post_rollout
from diffusion_rollout.testing import free_port, serve_in_thread


class LoopbackServer:
    """The app for ``engine`` served by uvicorn on 127.0.0.1 in a daemon thread, plus a client."""

    def __init__(self, engine, config) -> None:
        import httpx
        import uvicorn

        from diffusion_rollout.entrypoints.app import create_app

        self.engine = engine
        self.config = config
        self.app = create_app(config, engine=engine)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        uv_config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            access_log=False,
            http=config.http_parser,
        )
        self._server = uvicorn.Server(uv_config)
        self._serving = contextlib.ExitStack()
        self._serving.enter_context(serve_in_thread(self._server, name="bench-uvicorn", stop_timeout_s=10))
        self.client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(1200.0))
        self._remotes: dict[str, RemoteClients] = {}

    def new_client(self):
        import httpx

        return httpx.Client(base_url=self.url, timeout=httpx.Timeout(1200.0))

    def generate(self, body: dict[str, Any], client=None) -> tuple[list[dict[str, Any]], int]:
        """POST /rollout/generate (msgpack) and decode; returns (results, response bytes)."""
        return post_rollout(client or self.client, body)

    def post_json(self, path: str, body: Any = None, **kw) -> dict[str, Any]:
        r = self.client.post(path, json=body, **kw)
        if r.status_code != 200:
            raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:2000]}")
        return r.json()

    def post_bytes(self, path: str, data: bytes, params: dict[str, Any] | None = None) -> dict[str, Any]:
        # Streamed in 1 MiB slices with an explicit length: httpcore writes a single ``bytes`` body
        # with ``buffer = buffer[n:]`` after every ``send``, which copies the rest each time
        # (quadratic: a 1 GiB body took about 50 s on loopback; streamed, about 3 s).
        r = self.client.post(
            path,
            content=byte_slices(data),
            params=params,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(len(data))},
        )
        if r.status_code != 200:
            raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:2000]}")
        return r.json()

    def remote(self, trainer: str = "default") -> RemoteClients:
        """HTTP clients in another process (started on first use), as a trainer would be; another
        ``trainer`` of :data:`TRAINERS` is a second such process reading answers otherwise, for
        side-by-side rows."""
        if trainer not in self._remotes:
            self._remotes[trainer] = RemoteClients(self.url, env=TRAINERS[trainer])
        return self._remotes[trainer]

    def close(self) -> None:
        for remote in self._remotes.values():
            remote.close()
        self._remotes.clear()
        with contextlib.suppress(Exception):
            self.client.close()
        self._serving.close()


def byte_slices(data: bytes, size: int = 2**20):
    """``data`` as views of ``size`` bytes, for a streamed request body (see ``post_bytes``)."""
    view = memoryview(data)
    for i in range(0, len(view), size):
        yield view[i : i + size]
