"""Keys before bodies, exact body limits, header-safe versions, gated server information (issue 17).

Bodies are streamed through ``httpx.ASGITransport`` from a generator that counts the chunks the
server pulled: "memory flat" means the server never asked for the body.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import unquote

import httpx
import pytest
from safetensors.torch import save

from tests.conftest import ServedModel

API_KEY = "api-key-3c1f"
ADMIN_KEY = "admin-key-9d2e"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
CHUNK = b"x" * 2**20


@pytest.fixture(scope="module")
def keyed(tiny_model_path):
    server = ServedModel(tiny_model_path("sd3"), api_key=API_KEY, admin_key=ADMIN_KEY)
    yield server
    server.close()


def stream_post(app, path: str, *, chunks: int, headers: dict[str, str]) -> tuple[int, dict, int]:
    """POST ``chunks`` MiB from a lazy generator; returns (status, error body, chunks pulled)."""
    pulled = 0

    async def body():
        nonlocal pulled
        for _ in range(chunks):
            pulled += 1
            yield CHUNK

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            r = await client.post(path, content=body(), headers=headers)
            return r.status_code, r.json()

    status, payload = asyncio.run(go())
    return status, payload, pulled


@pytest.mark.parametrize(
    "path", ["/update_weights_from_disk", "/update_weights_from_tensor", "/lora/load", "/rollout/generate"]
)
def test_unauthenticated_bodies_are_refused_unread(keyed, path):
    for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 403)):
        got, payload, pulled = stream_post(
            keyed.app, path, chunks=64, headers={**headers, "Content-Type": "application/json"}
        )
        assert got == status, payload
        assert pulled <= 1, f"{path}: the server pulled {pulled} MiB of an unauthenticated body"
        assert "key" in payload["error"]["message"]


def test_body_limits_match_exact_routes(keyed):
    # /update_weights_from_disk is not /update_weights: the JSON limit, announced or streamed.
    limit = keyed.config.max_body_bytes
    status, payload, pulled = stream_post(
        keyed.app,
        "/update_weights_from_disk",
        chunks=limit // len(CHUNK) + 2,
        headers={**ADMIN, "Content-Type": "application/json", "Content-Length": str(limit + 2 * len(CHUNK))},
    )
    assert status == 413 and "max_body_bytes" in payload["error"]["message"]
    assert pulled <= 1
    status, payload, _ = stream_post(
        keyed.app, "/update_weights_from_disk", chunks=limit // len(CHUNK) + 2, headers={**ADMIN}
    )
    assert status == 413 and "max_body_bytes" in payload["error"]["message"]


def test_unicode_weight_version_travels_safely(fresh_server):
    server = fresh_server("sd3")
    version = "步骤-7 ✓ naïve\r\nX-Injected: 1"
    name, param = next(iter(server.engine.pipe.transformer.named_parameters()))
    r = server.client.post(
        "/update_weights",
        params={"weight_version": version, "partial": "true"},
        content=save({name: param.detach() + 1}),
    )
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == version
    r = server.client.post("/get_weights_checksum", json={})
    assert r.status_code == 200, r.text
    assert set(r.json()) >= {"transformer", "vae"}
    assert "x-injected" not in r.headers
    assert unquote(r.headers["x-weight-version"]) == version
    assert server.client.get("/metrics").status_code == 200
    [out] = server.generate(
        {"prompt": "a cat", "seed": 1, "num_inference_steps": 2, "rollout_sde_type": "sde"}
    )
    assert out["weight_version"] == version


def test_a_full_upload_names_every_parameter_unless_partial(fresh_server):
    server = fresh_server("sd3")
    named = dict(server.engine.pipe.transformer.named_parameters())
    half = {n: p.detach() + 1 for n, p in list(named.items())[:40]}
    before = checksum(server)
    r = server.client.post("/update_weights", params={"weight_version": "half"}, content=save(half))
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"transformer has {len(named)} parameters, {len(named) - 40} not sent" in message
    assert "partial=true" in message
    assert checksum(server) == before
    r = server.client.post(
        "/update_weights", params={"weight_version": "half", "partial": "true"}, content=save(half)
    )
    assert r.status_code == 200, r.text
    assert checksum(server) != before


def test_a_refused_part_aborts_its_upload(fresh_server):
    server = fresh_server("sd3")
    named = {n: p.detach() + 1 for n, p in server.engine.pipe.transformer.named_parameters()}
    names = list(named)
    before = checksum(server)
    first = {n: named[n] for n in names[:40]}
    ok = server.client.post(
        "/update_weights", params={"upload_id": "u", "part": 0, "final": "false"}, content=save(first)
    )
    assert ok.status_code == 200, ok.text
    bad = server.client.post(
        "/update_weights", params={"upload_id": "u", "part": 1}, content=b"not safetensors"
    )
    assert bad.status_code == 400
    # The client starts the commit again from part 0, final: refused, even as an explicit partial.
    again = server.client.post(
        "/update_weights", params={"upload_id": "u", "part": 0, "partial": "true"}, content=save(first)
    )
    assert again.status_code == 400 and "upload 'u' was aborted" in again.json()["error"]["message"]
    assert checksum(server) == before


def checksum(server) -> str:
    return server.client.post("/get_weights_checksum", json={"module_names": ["transformer"]}).json()[
        "transformer"
    ]


def test_info_routes_show_paths_and_versions_only_to_admin_callers(keyed):
    folder = str(keyed.path)
    for headers in ({}, {"Authorization": f"Bearer {API_KEY}"}):
        info = keyed.client.get("/server_info", headers=headers).json()
        assert "versions" not in info and "host" not in info and folder not in str(info)
        assert info["model_path"] == keyed.path.name and info["admin_key_required"] is True
        assert keyed.client.get("/model_info", headers=headers).json()["model_path"] == keyed.path.name
        assert keyed.client.get("/v1/model_info", headers=headers).json()["model_path"] == keyed.path.name
        assert folder not in keyed.client.get("/v1/models", headers=headers).text
    info = keyed.client.get("/server_info", headers=ADMIN).json()
    assert info["model_path"] == folder and "torch" in info["versions"]
    assert keyed.client.get("/model_info", headers=ADMIN).json()["model_path"] == folder
    assert keyed.client.get("/v1/models", headers=ADMIN).json()["data"][0]["root"] == folder


def test_readiness_probes_without_a_key_run_at_most_once_per_interval(fresh_server):
    server = fresh_server("sd3", api_key=API_KEY, health_generate_interval_s=3600)
    keyed_call = {"Authorization": f"Bearer {API_KEY}"}
    assert server.client.get("/health_generate").status_code == 200  # the first probe runs
    for _ in range(3):
        stale = time.time() - 100  # no generation succeeded in the last 30 s
        server.engine.last_generate_ok_at = stale
        assert server.client.get("/health_generate").status_code == 200
        assert server.engine.last_generate_ok_at == stale, "a caller without a key made the server generate"
    assert server.client.get("/health_generate", headers=keyed_call).status_code == 200
    assert server.engine.last_generate_ok_at > stale  # a caller with the key still gets a real probe
