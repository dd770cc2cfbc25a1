"""API and admin keys: every route classified, 401 without a key, 403 with a wrong one, keys never
leaked into logs, error bodies, ``/server_info`` or the config's repr, and the loud warning when
binding beyond loopback without an admin key.

The route walk discovers the routes from the app itself, so a router added later that forgets its
key dependency fails here rather than shipping open.
"""

from __future__ import annotations

import logging

import fastapi.routing
import pytest
from fastapi.routing import APIRoute

from diffusion_rollout.config import ServerConfig
from diffusion_rollout.entrypoints.http_errors import SGLANG_RESULT_PATHS
from diffusion_rollout.entrypoints.routers.common import require_admin_key, require_api_key
from tests.reliability_helpers import body, collect_logs

API_KEY = "user-key-7f3a9c"
ADMIN_KEY = "admin-key-b81e44"
# Open on purpose: liveness/readiness/info (no secrets, load balancers and scrapers use them).
PUBLIC = {
    "/health", "/health_generate", "/model_info", "/server_info", "/v1/models", "/metrics",
    "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/v1/model_info", "/weight_version",
}  # fmt: skip
# /abort_request: one rid needs the API key (abort_all the admin key, tests/entrypoints/test_sglang_endpoints.py).
GENERATION = {"/rollout/generate", "/abort_request", "/v1/images/generations"}


def _dependency_calls(dependant) -> set:
    calls = set()
    for dep in dependant.dependencies:
        calls.add(dep.call)
        calls |= _dependency_calls(dep)
    return calls


def _api_routes(app) -> list:
    """Every API route with its effective dependencies (router-level ones included).

    FastAPI >= 0.16x keeps included routers nested in ``app.routes``; ``iter_route_contexts``
    flattens them. The OpenAPI paths are the cross-check that nothing was missed.
    """
    iter_contexts = getattr(fastapi.routing, "iter_route_contexts", None)
    items = list(iter_contexts(app.routes)) if iter_contexts else list(app.routes)
    routes = [i for i in items if isinstance(getattr(i, "original_route", i), APIRoute)]
    assert {r.path for r in routes} == set(app.openapi()["paths"]), "route walk missed routes"
    return routes


def _routes(app) -> list[tuple[str, str]]:
    return [(m, r.path) for r in _api_routes(app) for m in sorted(r.methods) if m != "HEAD"]


@pytest.fixture(scope="module")
def keyed(tiny_model_path):
    from tests.conftest import ServedModel

    server = ServedModel(tiny_model_path("sd3"), api_key=API_KEY, admin_key=ADMIN_KEY)
    yield server
    server.close()


def test_every_route_is_public_generation_or_admin(keyed):
    unclassified = []
    routes = _api_routes(keyed.app)
    assert len(routes) >= 25
    for route in routes:
        if route.path in PUBLIC:
            continue
        calls = _dependency_calls(route.dependant)
        wanted = require_api_key if route.path in GENERATION else require_admin_key
        if wanted not in calls:
            unclassified.append(f"{sorted(route.methods)} {route.path} lacks {wanted.__name__}")
    assert not unclassified, "\n".join(unclassified)


def test_every_guarded_route_answers_401_without_and_403_with_a_wrong_key(keyed):
    client = keyed.client
    checked = 0
    for method, path in _routes(keyed.app):
        if path in PUBLIC:
            continue
        who = "API" if path in GENERATION else "admin"
        for headers, status in (
            ({}, 401),
            ({"Authorization": "Basic " + ADMIN_KEY}, 401),  # another scheme is no key
            ({"Authorization": "Bearer"}, 401),
            ({"Authorization": "Bearer wrong"}, 403),
        ):
            r = client.request(method, path, json={}, headers=headers)
            assert r.status_code == status, (method, path, headers, r.text)
            err = r.json()["error"]
            assert err["code"] == status and who in err["message"]
            if path in SGLANG_RESULT_PATHS:  # SGLang's clients test result.get("success", True)
                assert r.json()["success"] is False and r.json()["message"] == err["message"]
        if path not in GENERATION:  # the generation key opens nothing else
            r = client.request(method, path, json={}, headers={"Authorization": f"Bearer {API_KEY}"})
            assert r.status_code == 403, (method, path)
        checked += 1
    assert checked >= 20  # generation + the weights, LoRA, memory and pause routes


def test_generation_accepts_the_api_key_and_the_admin_key(keyed):
    for key in (API_KEY, ADMIN_KEY):
        r = keyed.client.post("/rollout/generate", json=body(), headers={"Authorization": f"bearer {key}"})
        assert r.status_code == 200, r.text
    ok = keyed.client.post("/get_weights_checksum", json={}, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert ok.status_code == 200


def test_public_routes_need_no_key(keyed):
    for path in ("/health", "/model_info", "/server_info", "/v1/models", "/metrics"):
        assert keyed.client.get(path).status_code == 200, path


def test_unset_keys_leave_routes_open(served):
    srv = served("sd3")
    assert srv.config.api_key is None and srv.config.admin_key is None
    assert srv.client.post("/rollout/generate", json=body()).status_code == 200
    assert srv.client.get("/lora").status_code == 200


def test_keys_are_never_logged_echoed_or_reported(keyed, monkeypatch):
    with collect_logs() as logs:
        for auth in (f"Bearer {API_KEY}", f"Bearer {ADMIN_KEY}", f"Bearer {API_KEY}x", "Bearer " + "k" * 40):
            headers = {"Authorization": auth}
            texts = [
                keyed.client.post("/rollout/generate", json=body(), headers=headers).content,
                keyed.client.post(
                    "/rollout/generate", json=body(num_inference_steps=10**6), headers=headers
                ).text,
                keyed.client.post("/update_weights", content=b"junk", headers=headers).text,
                keyed.client.get("/server_info", headers=headers).text,
            ]
            for t in texts[1:]:
                assert API_KEY not in t and ADMIN_KEY not in t and "k" * 40 not in t
    logged = logs.text()
    assert logs.records, "expected some log lines to inspect"
    assert API_KEY not in logged and ADMIN_KEY not in logged and "k" * 40 not in logged
    info = keyed.client.get("/server_info").json()
    assert info["api_key_required"] is True and info["admin_key_required"] is True
    assert API_KEY not in repr(keyed.config) and ADMIN_KEY not in str(keyed.config)


def test_binding_beyond_loopback_without_admin_key_refuses_unless_allowed(tiny_model_path, monkeypatch):
    from diffusion_rollout.entrypoints import cli, http_server

    started = []

    class _NoServer:
        started = True

        def run(self):
            started.append(True)

    monkeypatch.setattr(http_server, "make_server", lambda app, config: _NoServer())
    # configure_logging would stop the package logger propagating, for every later test's caplog.
    monkeypatch.setattr(cli, "configure_logging", lambda level: None)
    cfg = ServerConfig(model=str(tiny_model_path("sd3")), device="cpu", host="0.0.0.0", port=1)
    with collect_logs(logging.INFO) as logs, pytest.raises(SystemExit) as exited:
        cli.serve(cfg)
    assert exited.value.code == 2 and not started
    assert any("refusing to bind to 0.0.0.0 WITHOUT an admin key" in r.getMessage() for r in logs.records)

    with collect_logs(logging.INFO) as logs:
        cli.serve(cfg.model_copy(update={"allow_insecure_admin": True}))
    assert started
    warnings = [r for r in logs.records if r.levelno >= logging.WARNING]
    assert any("WITHOUT an admin key" in r.getMessage() and "0.0.0.0" in r.getMessage() for r in warnings)

    with collect_logs(logging.INFO) as logs:
        cli.serve(cfg.model_copy(update={"admin_key": ADMIN_KEY}))
        cli.serve(cfg.model_copy(update={"host": "127.0.0.1"}))
    assert not any("WITHOUT an admin key" in r.getMessage() for r in logs.records)
