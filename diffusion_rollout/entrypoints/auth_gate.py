"""Keys checked from the headers alone, before anything reads a request body.

Design decisions:

- **Pure ASGI, outside the routes.** A FastAPI dependency runs after the body has been read and
  parsed, so an unauthenticated 600 MB body cost its full read, parse and memory before the 401.
  :class:`AuthGateMiddleware` answers 401/403 from the ``Authorization`` header and never calls
  ``receive``: an unauthenticated request costs the server its headers. The routes keep their key
  dependencies too (one rule, ``routers.common.key_error``, applied twice: the second is free).
- **The routes say which key they need.** :func:`route_key_levels` reads each route's
  dependencies (``require_admin_key`` / ``require_api_key``) once the routers are included, so a
  route added later with the usual dependency is gated here without a list to keep in step.
  Paths are matched exactly; a path no route has needs no key (it is a 404 without a body read).
"""

from __future__ import annotations

from collections.abc import Mapping

import fastapi.routing
from fastapi import FastAPI
from starlette.responses import JSONResponse

from diffusion_rollout.entrypoints.http_errors import error_body
from diffusion_rollout.entrypoints.routers.common import key_error, require_admin_key, require_api_key

_STRICTNESS = {"api": 1, "admin": 2}


def _dependency_calls(dependant) -> set:
    calls = set()
    for dep in dependant.dependencies:
        calls.add(dep.call)
        calls |= _dependency_calls(dep)
    return calls


def route_key_levels(app: FastAPI) -> dict[str, str]:
    """``{path: "api" | "admin"}`` for every route guarded by a key dependency (the strictest wins)."""
    iter_contexts = getattr(fastapi.routing, "iter_route_contexts", None)
    routes = list(iter_contexts(app.routes)) if iter_contexts else list(app.routes)
    levels: dict[str, str] = {}
    for route in routes:
        dependant = getattr(route, "dependant", None)
        if dependant is None:
            continue
        calls = _dependency_calls(dependant)
        level = "admin" if require_admin_key in calls else "api" if require_api_key in calls else None
        if level and _STRICTNESS[level] > _STRICTNESS.get(levels.get(route.path, ""), 0):
            levels[route.path] = level
    return levels


class AuthGateMiddleware:
    def __init__(self, app, config, levels: Mapping[str, str]) -> None:
        """``levels`` may be filled after construction (routers are included after middleware)."""
        self.app = app
        self.config = config
        self.levels = levels

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            level = self.levels.get(scope["path"])
            if level is not None:
                authorization = None
                for name, value in scope.get("headers") or ():
                    if name == b"authorization":
                        authorization = value.decode("latin-1")
                        break
                error = key_error(authorization, self.config, level)
                if error is not None:
                    body = error_body(error.message, error.error_type, error.status_code, scope["path"])
                    # Connection: close, so the server stops reading a body nobody will use.
                    response = JSONResponse(
                        body, status_code=error.status_code, headers={"Connection": "close"}
                    )
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)
