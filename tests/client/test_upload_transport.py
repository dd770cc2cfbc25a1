"""The client's upload transport: large bodies through ``http.client`` (no copy under the GIL).

Real servers (uvicorn on the main port, the direct upload listener on its own), the real client;
``calls._UPLOAD_CHUNK`` is shrunk so that small tiny-model parts count as large uploads.
"""

from __future__ import annotations

import socket

import httpx
import pytest
import torch

from diffusion_rollout.client import RolloutClient, calls
from diffusion_rollout.client.exceptions import RolloutConnectionError, RolloutHTTPError
from diffusion_rollout.client.upload_transport import BodyPassthroughTransport
from diffusion_rollout.client.weights.upload import push_weights
from diffusion_rollout.protocol.checksums import trainer_weights_checksum
from diffusion_rollout.protocol.safetensors_layout import SafetensorsBody
from tests.entrypoints.test_upload_listener import KEY, listener_of, new_weights
from tests.reliability_helpers import live_server


@pytest.fixture
def small_threshold(monkeypatch):
    monkeypatch.setattr(calls, "_UPLOAD_CHUNK", 1024)


def transport_of(client: RolloutClient) -> BodyPassthroughTransport:
    transport = client._http._transport
    assert isinstance(transport, BodyPassthroughTransport)
    return transport


def live_checksum(client: RolloutClient) -> str:
    return client.get_weights_checksum(["transformer"])["transformer"]


@pytest.mark.parametrize("direct", [True, False], ids=["upload_port", "main_port"])
def test_a_verified_push_goes_through_the_passthrough_intact(fresh_server, small_threshold, direct):
    server = fresh_server("sd3", upload_port=0, admin_key=KEY)
    master = new_weights(server, seed=5)
    with live_server(server) as (url, _), RolloutClient(url, admin_key=KEY, timeout=60) as client:
        out = push_weights(
            client,
            master,
            dtype=torch.float32,
            max_part_bytes=16384,
            concurrency=3,
            weight_version="passthrough",
            direct=direct,
        )  # fmt: skip (verify=True: the server's received hashes equal the trainer's)
        transport = transport_of(client)
        assert out.weight_version == "passthrough"
        assert transport.passthrough_requests > 3  # the parts with data; the empty ones are small
        assert live_checksum(client) == trainer_weights_checksum(master.items(), torch.float32)
        if direct:
            assert listener_of(server).stats.parts >= transport.passthrough_requests
        # Kept-alive connections are reused: a second push opens none beyond those of the first.
        idle_before = sum(len(c) for c in transport._idle.values())
        push_weights(client, master, dtype=torch.float32, max_part_bytes=16384, concurrency=3, direct=direct)
        assert 0 < sum(len(c) for c in transport._idle.values()) <= max(idle_before, 3)


def test_a_refusal_through_the_passthrough_is_the_servers_own_answer(fresh_server, small_threshold):
    server = fresh_server("sd3", upload_port=0, admin_key=KEY)
    master = new_weights(server, seed=6)
    with live_server(server) as (url, _), RolloutClient(url, admin_key=KEY, timeout=60) as client:
        before = live_checksum(client)
        client.upload_url(0)  # learn the upload port, as push_weights does
        name, tensor = max(master.items(), key=lambda kv: kv[1].numel())
        body = SafetensorsBody({name: tensor})
        assert len(body) > calls._UPLOAD_CHUNK
        with pytest.raises(RolloutHTTPError) as refused:
            client.update_weights(body, target_module="nope", partial=True, weight_version="x")
        assert 400 <= refused.value.status_code < 500 and "nope" in str(refused.value)
        assert transport_of(client).passthrough_requests >= 1
        assert live_checksum(client) == before  # nothing of it was applied
        # Without the admin key the upload port refuses before the body: the answer still arrives.
        with RolloutClient(url, timeout=60) as anonymous:
            anonymous._remember_upload_url(url, client.model_info())
            with pytest.raises(RolloutHTTPError) as unauthorised:
                anonymous.update_weights(bytes(4096), partial=True, weight_version="x")
            assert unauthorised.value.status_code in (401, 403)
        assert live_checksum(client) == before


def test_a_closed_port_is_a_connection_error(small_threshold):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        with RolloutClient(f"http://127.0.0.1:{port}", timeout=5, admin_key=KEY) as client:
            client._sleep = lambda _: None
            with pytest.raises(RolloutConnectionError):
                client.update_weights(bytes(4096), partial=True, weight_version="x")
            assert transport_of(client).passthrough_requests >= 1


def test_small_bodies_and_everything_else_keep_the_httpx_transport(fresh_server):
    server = fresh_server("sd3", upload_port=0, admin_key=KEY)
    with live_server(server) as (url, _), RolloutClient(url, admin_key=KEY, timeout=60) as client:
        client.model_info()
        client.get_weights_checksum(["transformer"])
        assert transport_of(client).passthrough_requests == 0


def test_only_large_plain_http_uploads_take_the_passthrough(small_threshold):
    octet = {"Content-Type": "application/octet-stream"}
    big, small = bytes(4096), bytes(512)

    def takes(url: str, body: bytes, headers: dict[str, str]) -> bool:
        return BodyPassthroughTransport._takes(httpx.Request("POST", url, content=body, headers=headers))

    assert takes("http://h:1/update_weights", big, octet)
    assert not takes("http://h:1/update_weights", small, octet)  # one slice: nothing to gain
    assert not takes("https://h:1/update_weights", big, octet)  # TLS stays with httpx
    assert not takes("http://h:1/generate", big, {"Content-Type": "application/json"})  # streamed answers
