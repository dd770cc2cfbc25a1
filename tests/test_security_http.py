"""Keys before bodies, exact body limits, header-safe versions, gated server information (issue 17).

Bodies are streamed through ``httpx.ASGITransport`` from a generator that counts the chunks the
server pulled: "memory flat" means the server never asked for the body.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

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
