"""The direct receive listener (``--upload-port``): ``POST /update_weights`` read with ``recv_into``.

Through the real app and real sockets: uploads through the listener land bit-identical to the same
uploads through the main port and answer the same JSON; keys, limits and the query are checked from
the head alone; a body cut short stages nothing; hostile heads get a 4xx and the listener keeps
serving; the project's client finds the port and uses it; shutdown leaves no thread behind.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save

from diffusion_rollout.client import AsyncRolloutClient, RolloutClient
from diffusion_rollout.client.weights.upload import push_weights, safetensors_parts
from diffusion_rollout.config import ServerConfig
from diffusion_rollout.entrypoints.app import create_app
from diffusion_rollout.entrypoints.cli import build_parser
from diffusion_rollout.entrypoints.upload_wire import MAX_HEADER_LINE, MAX_HEADERS, MAX_REQUEST_LINE
from diffusion_rollout.protocol.checksums import trainer_weights_checksum
from diffusion_rollout.protocol.safetensors_layout import SafetensorsBody
from diffusion_rollout.server.weights import get_weight_manager
from tests.reliability_helpers import PROBE, live_server, wait_until

KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


def new_weights(server, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: p.detach() + 0.05 * torch.randn(p.shape, generator=g)
        for n, p in server.engine.pipe.transformer.named_parameters()
    }


def checksum(server) -> str:
    r = server.client.post("/get_weights_checksum", json={"module_names": ["transformer"]}, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["transformer"]


def listener_of(server):
    listener = server.app.state.upload_listener
    assert listener is not None and listener.running
    return listener


class RawConnection:
    """One TCP connection to the listener, speaking HTTP/1.1 by hand (to send what clients never would)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=20)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, head: str, body: bytes = b"") -> tuple[int, dict[str, str], dict]:
        self.send(head.encode("latin-1") + body)
        return self.response()

    def response(self) -> tuple[int, dict[str, str], dict]:
        while b"\r\n\r\n" not in self.buffer:
            chunk = self.sock.recv(65536)
            assert chunk, f"the listener closed without an answer (got {self.buffer!r})"
            self.buffer += chunk
        raw, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = raw.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        length = int(headers["content-length"])
        while len(self.buffer) < length:
            chunk = self.sock.recv(65536)
            assert chunk, "the listener closed in the middle of its answer"
            self.buffer += chunk
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status_line.split(" ")[1]), headers, json.loads(body)

    def closed_by_server(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


def upload_head(length: int | None, query: str = "", *, auth: bool = True, extra: str = "") -> str:
    lines = [f"POST /update_weights{'?' + query if query else ''} HTTP/1.1", "Host: test"]
    if auth:
        lines.append(f"Authorization: Bearer {KEY}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return "\r\n".join(lines) + "\r\n" + extra + "\r\n"


def small_part(server) -> bytes:
    """One tensor of the model with its current values: a valid, harmless partial upload."""
    name, p = next(iter(server.engine.pipe.transformer.named_parameters()))
    return bytes(SafetensorsBody({name: p.detach().clone()}))


def main_port_answer(server, query: dict, body: bytes, headers: dict) -> tuple[int, dict]:
    r = server.client.post(
        "/update_weights",
        params=query,
        content=body,
        headers={"Content-Type": "application/octet-stream", **headers},
    )
    return r.status_code, r.json()


def untimed(answer: dict) -> dict:
    return {**answer, "message": re.sub(r"in [0-9.]+ s\b", "in <t> s", answer["message"])}


# ---------------------------------------------------------------------------- bit-identical results
def test_a_multi_part_upload_through_the_listener_equals_the_same_upload_through_the_main_port(fresh_server):
    direct = fresh_server("sd3", upload_port=0, admin_key=KEY)
    main = fresh_server("sd3", admin_key=KEY)
    assert checksum(direct) == checksum(main)  # the same tiny model: the same weights to start from
    master = new_weights(direct, seed=31)
    parts = list(safetensors_parts(master, max_part_bytes=16 * 1024, dtype=torch.float32))
    assert len(parts) > 4
    listener = listener_of(direct)
    url = f"http://127.0.0.1:{listener.port}"

    def query(i: int) -> dict:
        return {
            "upload_id": "up",
            "part": i,
            "final": str(i == len(parts) - 1).lower(),
            "weight_version": "w1",
        }

    answers = []
    # One keep-alive connection carries every part (a real HTTP client, not hand-made requests).
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        for i, part in enumerate(parts):
            r = client.post("/update_weights", params=query(i), content=bytes(part.body))
            assert r.status_code == 200, r.text
            answers.append(r.json())
    expected = [main_port_answer(main, query(i), bytes(p.body), AUTH) for i, p in enumerate(parts)]
    # The same JSON for every part (but for how long the final copy took).
    assert [(200, untimed(a)) for a in answers] == [(st, untimed(a)) for st, a in expected]
    assert listener.stats.parts == len(parts) and listener.stats.connections == 1

    for (name, a), (_, b) in zip(
        direct.engine.pipe.transformer.named_parameters(),
        main.engine.pipe.transformer.named_parameters(),
        strict=True,
    ):
        assert torch.equal(a, b), name
    assert checksum(direct) == checksum(main) == trainer_weights_checksum(master.items(), torch.float32)
    manager = get_weight_manager(direct.engine)
    assert manager.staging.ids() == [] and manager.receive_buffers.stats.abandoned == 0
    assert manager.receive_buffers.stats.kept_bytes > 0  # the bodies landed in pooled buffers


def test_a_refused_part_answers_like_the_main_port_and_keeps_the_connection(fresh_server):
    server = fresh_server("sd3", upload_port=0, admin_key=KEY)
    before = checksum(server)
    name, p = next(iter(server.engine.pipe.transformer.named_parameters()))
    bad = bytes(SafetensorsBody({name: torch.zeros(p.numel() + 1)}))
    conn = RawConnection(listener_of(server).port)
    try:
        status, headers, body = conn.request(upload_head(len(bad), "partial=true"), bad)
        assert (status, body) == main_port_answer(server, {"partial": "true"}, bad, AUTH)
        assert status == 400 and "shape mismatch" in body["error"]["message"]
        assert headers["connection"] == "keep-alive" and headers["x-request-id"]
        # The body was read whole, so the same connection carries the next part.
        good = small_part(server)
        status, _, body = conn.request(upload_head(len(good), "partial=true&weight_version=same"), good)
        assert status == 200 and body["weight_version"] == "same", body
    finally:
        conn.close()
    assert checksum(server) == before


# ---------------------------------------------------------------------------- checks before the body
def test_keys_limits_and_the_query_are_answered_before_the_body_is_read(fresh_server):
    server = fresh_server("sd3", upload_port=0, admin_key=KEY, max_upload_bytes=4096)
    port = listener_of(server).port
    pool = get_weight_manager(server.engine).receive_buffers
    wrong = {"Authorization": "Bearer wrong"}
    cases = [  # (query, headers, declared length, status, words in the message)
        ({}, {}, 2000, 401, "missing admin key"),
        ({}, wrong, 2000, 403, "wrong admin key"),
        ({}, AUTH, 10_000, 413, "max_upload_bytes"),
        ({"finale": "true"}, AUTH, 2000, 422, "unknown field 'query.finale'"),
        ({"part": "two"}, AUTH, 2000, 422, "query.part"),
    ]
    for query, headers, declared, status, words in cases:
        head = "\r\n".join(
            [f"POST /update_weights?{'&'.join(f'{k}={v}' for k, v in query.items())} HTTP/1.1"]
            + [f"{k}: {v}" for k, v in headers.items()]
            + [f"Content-Length: {declared}", "", ""]
        )
        conn = RawConnection(port)
        try:
            # Only the head is sent: an answer that comes without the body proves it was not awaited.
            conn.send(head.encode())
            got, _, body = conn.response()
            assert got == status and words in body["error"]["message"], (query, body)
            assert conn.closed_by_server()  # the unread body would be out of step: closed
        finally:
            conn.close()
        # The main port answers the same JSON (sent a body of the declared size).
        assert main_port_answer(server, query, b"\0" * declared, headers) == (got, body)
    assert pool.stats.allocated == 0 and pool.stats.reused == 0  # no receive buffer was leased


def test_expect_100_continue_is_granted_only_after_the_checks(fresh_server):
    server = fresh_server("sd3", upload_port=0, admin_key=KEY)
    port = listener_of(server).port
    good = small_part(server)
    conn = RawConnection(port)
    try:  # curl's way with large bodies: the head, then the body once the server says go
        conn.send(upload_head(len(good), "partial=true", extra="Expect: 100-continue\r\n").encode())
        while b"\r\n\r\n" not in conn.buffer:
            conn.buffer += conn.sock.recv(65536)
        interim, conn.buffer = conn.buffer.split(b"\r\n\r\n", 1)
        assert interim == b"HTTP/1.1 100 Continue"
        conn.send(good)
        status, _, body = conn.response()
        assert status == 200 and body["success"], body
    finally:
        conn.close()
    conn = RawConnection(port)
    try:  # refused: the final answer comes instead of the 100, and the body is never asked for
        head = upload_head(
            len(good), auth=False, extra="Authorization: Bearer no\r\nExpect: 100-continue\r\n"
        )
        status, _, body = conn.request(head)
        assert status == 403 and conn.closed_by_server(), body
    finally:
        conn.close()


# ---------------------------------------------------------------------------- bodies cut short
def test_a_truncated_body_stages_nothing_and_the_next_upload_works(fresh_server):
    server = fresh_server("sd3", upload_port=0, admin_key=KEY)
    master = new_weights(server, seed=32)
    original = checksum(server)
    manager = get_weight_manager(server.engine)
    port = listener_of(server).port
    names = sorted(master)
    first = bytes(SafetensorsBody({n: master[n] for n in names[:10]}))
    rest = bytes(SafetensorsBody({n: master[n] for n in names[10:]}))

    conn = RawConnection(port)
    try:
        status, _, body = conn.request(upload_head(len(first), "upload_id=t&part=0&final=false"), first)
        assert status == 200 and manager.staging.ids() == ["t"], body
        # The second part stops after a third of its bytes; the client closes its sending side.
        conn.send(upload_head(len(rest), "upload_id=t&part=1").encode() + rest[: len(rest) // 3])
        conn.sock.shutdown(socket.SHUT_WR)
        status, _, body = conn.response()
        message = body["error"]["message"]
        assert status == 400 and body["error"]["type"] == "invalid_weight_update"
        assert f"the body ended after {len(rest) // 3} of the {len(rest)} bytes" in message
        assert "upload 't' was dropped" in message
        assert conn.closed_by_server()
    finally:
        conn.close()
    assert manager.staging.ids() == [] and checksum(server) == original

    # A client that vanishes mid-body (no answer possible) leaves nothing staged either.
    conn = RawConnection(port)
    conn.send(upload_head(len(rest), "upload_id=gone").encode() + rest[:100])
    conn.close()
    listener = listener_of(server)
    wait_until(lambda: listener.stats.requests == 3, 10, "the cut-short request to be handled")
    assert manager.staging.ids() == [] and checksum(server) == original

    # A cut-short body's buffer may be left to the garbage collector rather than pooled (whether a
    # view of it is still alive when it is released depends on when the collector last ran): that
    # costs one allocation, not correctness. A whole upload must give its buffer back.
    abandoned = manager.receive_buffers.stats.abandoned
    whole = bytes(SafetensorsBody(master))
    conn = RawConnection(port)
    try:
        status, _, body = conn.request(upload_head(len(whole), "weight_version=after"), whole)
    finally:
        conn.close()
    assert status == 200 and body["weight_version"] == "after", body
    assert checksum(server) == trainer_weights_checksum(master.items(), torch.float32) != original
    assert manager.receive_buffers.stats.abandoned == abandoned


# ---------------------------------------------------------------------------- hostile input
HOSTILE = [
    ("garbage request line", "GARBAGE\r\n\r\n", 400, "malformed request line"),
    ("binary junk", "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 x y\r\n\r\n", 400, "malformed request line"),
    ("request line too long", f"POST /update_weights?upload_id={'a' * MAX_REQUEST_LINE} HTTP/1.1\r\n\r\n",
     414, "request line is longer"),
    ("no line end at all", "X" * (MAX_REQUEST_LINE + 100), 414, "request line is longer"),
    ("header line too long", upload_head(10, extra=f"X-Big: {'b' * MAX_HEADER_LINE}\r\n"), 431,
     "header line is longer"),
    ("too many headers", upload_head(10, extra="".join(f"X-H{i}: v\r\n" for i in range(MAX_HEADERS))), 431,
     f"more than {MAX_HEADERS} header lines"),
    ("malformed header", upload_head(10, extra="no colon here\r\n"), 400, "malformed header line"),
    ("folded header", upload_head(10, extra=" folded: v\r\n"), 400, "malformed header line"),
    ("missing Content-Length", upload_head(None), 411, "Content-Length is required"),
    ("chunked", upload_head(None, extra="Transfer-Encoding: chunked\r\n"), 411, "Transfer-Encoding (chunked)"),
    ("conflicting lengths", upload_head(10, extra="Content-Length: 11\r\n"), 400, "conflicting Content-Length"),
    ("negative length", upload_head(None, extra="Content-Length: -5\r\n"), 400, "invalid Content-Length"),
    ("unknown query parameter", upload_head(10, "finale=true"), 422, "unknown field 'query.finale'"),
    ("bad boolean", upload_head(10, "final=maybe"), 422, "query.final"),
    ("other path", "POST /update_weights_from_disk HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", 404,
     "serves only POST /update_weights"),
    ("other method", "GET /update_weights HTTP/1.1\r\n" + f"Authorization: Bearer {KEY}\r\n\r\n", 405,
     "Method Not Allowed"),
    ("HTTP/2 preface", "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505, "HTTP version 'HTTP/2.0'"),
    ("HTTP/0.9 version", "POST /update_weights HTTP/0.9\r\n\r\n", 505, "HTTP version"),
]  # fmt: skip


def test_hostile_requests_get_a_4xx_and_the_listener_keeps_serving(fresh_server):
    server = fresh_server("sd3", upload_port=0, admin_key=KEY)
    port = listener_of(server).port
    good = small_part(server)
    for label, raw, status, words in HOSTILE:
        conn = RawConnection(port)
        try:
            conn.send(raw.encode("latin-1"))
            got, headers, body = conn.response()
            assert got == status, (label, body)
            assert body["error"]["code"] == status and words in body["error"]["message"], (label, body)
            assert headers["connection"] == "close" and conn.closed_by_server(), label
        finally:
            conn.close()
        # Still serving: a valid part on a new connection.
        conn = RawConnection(port)
        try:
            got, _, body = conn.request(upload_head(len(good), "partial=true"), good)
        finally:
            conn.close()
        assert got == 200 and body["success"], (label, body)
    # The main port answers the query refusals alike (the same model, the same message).
    assert main_port_answer(server, {"finale": "true"}, good, AUTH)[0] == 422
    assert listener_of(server).stats.refused == len(HOSTILE)


def test_slow_heads_and_too_many_connections_are_bounded(fresh_server, monkeypatch):
    from diffusion_rollout.entrypoints import upload_listener, upload_wire

    monkeypatch.setattr(upload_wire, "HEAD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(upload_listener, "MAX_CONNECTIONS", 2)
    server = fresh_server("sd3", upload_port=0, admin_key=KEY)
    listener = listener_of(server)
    slow = RawConnection(listener.port)
    try:
        slow.send(b"POST /update_weights HTTP/1.1\r\nHost: x\r\n")  # and then nothing more
        status, _, body = slow.response()
        assert status == 408 and "did not arrive within 0.5 s" in body["error"]["message"]
        assert slow.closed_by_server()
    finally:
        slow.close()
    # A connection that sends nothing is closed within the head timeout, without an answer.
    silent = RawConnection(listener.port)
    try:
        assert silent.closed_by_server() and silent.buffer == b""
    finally:
        silent.close()
    wait_until(lambda: listener.open_connections == 0, 10, "the connections to end")
    # Two authenticated connections hold the two slots (their bodies never come); a third gets 503.
    holders = [RawConnection(listener.port) for _ in range(2)]
    try:
        for h in holders:
            h.send(upload_head(1000, "partial=true").encode())
        wait_until(lambda: listener.authenticated_connections == 2, 10, "two authenticated connections")
        extra = RawConnection(listener.port)
        try:
            status, headers, body = extra.request(upload_head(10, "partial=true"), b"0123456789")
            assert status == 503 and body["error"]["message"].startswith(
                "more than 2 authenticated upload connections are open"
            )
            assert headers["retry-after"] == "1" and extra.closed_by_server()
        finally:
            extra.close()
        assert listener.authenticated_connections == 2
    finally:
        for conn in holders:
            conn.close()
    # Once those are gone, the port serves again.
    good = small_part(server)
    wait_until(lambda: listener.authenticated_connections == 0, 10, "the holders to end")
    conn = RawConnection(listener.port)
    try:
        status, _, body = conn.request(upload_head(len(good), "partial=true"), good)
    finally:
        conn.close()
    assert status == 200, body


def test_idle_sockets_without_the_key_never_keep_a_push_out(fresh_server):
    """More idle sockets than the listener keeps unauthenticated: none takes a slot, the oldest are
    closed as new ones arrive, and a push through the project's client goes to the direct port."""
    from diffusion_rollout.entrypoints.upload_listener import MAX_CONNECTIONS, MAX_UNAUTHENTICATED

    server = fresh_server("sd3", upload_port=0, admin_key=KEY)
    master = new_weights(server, seed=41)
    n_parts = len(list(safetensors_parts(master, max_part_bytes=8192, dtype=torch.float32))) + 2
    with live_server(server) as (url, _), RolloutClient(url, admin_key=KEY, timeout=60) as client:
        listener = listener_of(server)
        idle = [RawConnection(listener.port) for _ in range(MAX_CONNECTIONS + 16)]
        try:
            wait_until(lambda: listener.stats.connections == len(idle), 10, "the idle sockets to be accepted")
            assert listener.authenticated_connections == 0
            assert listener.stats.dropped_unauthenticated == len(idle) - MAX_UNAUTHENTICATED
            out = push_weights(client, master, dtype=torch.float32, max_part_bytes=8192, concurrency=3,
                               weight_version="past-idle")  # fmt: skip
        finally:
            for conn in idle:
                conn.close()
        assert out.weight_version == "past-idle" and listener.stats.parts == n_parts
        assert 'route="/update_weights"' not in client.metrics()  # every part took the direct port
    assert checksum(server) == trainer_weights_checksum(master.items(), torch.float32)


def test_a_direct_port_with_every_slot_taken_sends_the_part_to_the_main_port(fresh_server, monkeypatch):
    from diffusion_rollout.entrypoints import upload_listener

    monkeypatch.setattr(upload_listener, "MAX_CONNECTIONS", 1)
    server = fresh_server("sd3", upload_port=0, admin_key=KEY)
    part = small_part(server)
    with live_server(server) as (url, _), RolloutClient(url, admin_key=KEY, timeout=60) as client:
        listener = listener_of(server)
        assert client.upload_url(0) == f"http://127.0.0.1:{listener.port}"
        holder = RawConnection(listener.port)  # authenticated; its body never comes
        try:
            holder.send(upload_head(1000, "partial=true").encode())
            wait_until(lambda: listener.authenticated_connections == 1, 10, "the slot to be taken")
            out = client.update_weights(part, partial=True, weight_version="fell-back")
        finally:
            holder.close()
        assert out.weight_version == "fell-back"
        metrics = client.metrics()
        assert 'route="upload_port:/update_weights",code="503"} 1' in metrics
        assert 'route="/update_weights",code="200"} 1' in metrics

        async def async_part() -> str:
            holder = RawConnection(listener.port)
            try:
                holder.send(upload_head(1000, "partial=true").encode())
                wait_until(lambda: listener.authenticated_connections == 1, 10, "the slot to be taken")
                async with AsyncRolloutClient(url, admin_key=KEY, timeout=60) as aclient:
                    await aclient.upload_url(0)
                    return (
                        await aclient.update_weights(part, partial=True, weight_version="async")
                    ).weight_version
            finally:
                holder.close()

        wait_until(lambda: listener.authenticated_connections == 0, 10, "the first holder to end")
        assert asyncio.run(async_part()) == "async"
        assert 'route="/update_weights",code="200"} 2' in client.metrics()


# ---------------------------------------------------------------------------- discovery and the client
def test_the_client_finds_the_advertised_port_and_sends_parts_there(fresh_server):
    server = fresh_server("sd3", upload_port=0, admin_key=KEY)
    master = new_weights(server, seed=33)
    # push_weights opens a multi-part upload with an empty part 0 and commits it with an empty part.
    n_parts = len(list(safetensors_parts(master, max_part_bytes=8192, dtype=torch.float32))) + 2
    with live_server(server) as (url, _), RolloutClient(url, admin_key=KEY, timeout=60) as client:
        listener = listener_of(server)  # the live server's own (each lifespan starts one)
        assert client.model_info()["weight_upload_port"] == listener.port
        assert client.server_info()["weight_upload_port"] == listener.port
        assert client.upload_url(0) == f"http://127.0.0.1:{listener.port}" != url

        out = push_weights(client, master, dtype=torch.float32, max_part_bytes=8192, concurrency=3,
                           weight_version="direct")  # fmt: skip
        assert out.weight_version == "direct"
        assert listener.stats.parts == n_parts
        metrics = client.metrics()
        assert f'route="upload_port:/update_weights",code="200"}} {n_parts}' in metrics
        assert 'route="/update_weights"' not in metrics  # nothing went to the main port
        after_direct = checksum(server)
        assert after_direct == trainer_weights_checksum(master.items(), torch.float32)

        # The switch keeps the main port; the result is the same.
        again = push_weights(client, master, dtype=torch.float32, max_part_bytes=8192, concurrency=3,
                             weight_version="main", direct=False)  # fmt: skip
        assert again.weight_version == "main" and listener.stats.parts == n_parts
        assert f'route="/update_weights",code="200"}} {n_parts}' in client.metrics()
        assert checksum(server) == after_direct

        async def async_part() -> tuple[str, str]:
            async with AsyncRolloutClient(url, admin_key=KEY, timeout=60) as aclient:
                found = await aclient.upload_url(0)
                out = await aclient.update_weights(small_part(server), partial=True, weight_version="async")
                return found, out.weight_version

        # The asyncio client takes the same port.
        assert asyncio.run(async_part()) == (f"http://127.0.0.1:{listener.port}", "async")
        assert listener.stats.parts == n_parts + 1


def test_a_server_without_the_listener_advertises_none_and_the_client_keeps_the_main_port(served):
    server = served("sd3")
    assert server.client.get("/model_info").json()["weight_upload_port"] is None
    assert server.client.get("/server_info").json()["weight_upload_port"] is None
    with RolloutClient("http://testserver", http_client=server.client) as client:
        assert client.upload_url(0) == "http://testserver"


# ---------------------------------------------------------------------------- configuration and shutdown
def test_upload_port_is_a_typed_option_with_a_cli_flag():
    assert ServerConfig().upload_port is None
    assert ServerConfig(upload_port=0).upload_port == 0
    with pytest.raises(ValueError, match="upload_port=30000 is the main port"):
        ServerConfig(port=30000, upload_port=30000)
    with pytest.raises(ValueError):
        ServerConfig(upload_port=70000)
    assert build_parser().parse_args(["serve", "--upload-port", "31000"]).upload_port == 31000


def test_a_taken_upload_port_fails_the_start_up(fresh_server):
    server = fresh_server("sd3")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        app = create_app(server.config.model_copy(update={"upload_port": port}), engine=server.engine)
        with pytest.raises(OSError), TestClient(app):
            pass


def test_shutdown_closes_the_port_and_leaves_no_thread(fresh_server):
    server = fresh_server("sd3")
    app = create_app(server.config.model_copy(update={"upload_port": 0}), engine=server.engine)
    manager = get_weight_manager(server.engine)
    good = small_part(server)
    with TestClient(app):
        listener = app.state.upload_listener
        port = listener.port
        idle = RawConnection(port)  # kept alive after one request, then idle
        status, _, _ = idle.request(upload_head(len(good), "partial=true", auth=False), good)
        assert status == 200
        busy = RawConnection(port)  # in the middle of a body when the server stops
        busy.send(upload_head(len(good) * 4, "upload_id=late", auth=False).encode() + good)
        stats = manager.receive_buffers.stats
        wait_until(lambda: stats.allocated + stats.reused >= 2, 10, "the body read to start")
        assert any(t.name.startswith("upload-") for t in threading.enumerate())
    try:
        assert [t.name for t in threading.enumerate() if t.name.startswith("upload-")] == []
        assert app.state.upload_listener is None
        assert idle.closed_by_server()
        status, _, body = busy.response()  # the cut-short body still got its answer
        assert status == 400 and "truncated upload" in body["error"]["message"]
        assert manager.staging.ids() == []
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        idle.close()
        busy.close()
    # The engine keeps serving the main app (it belongs to the fixture, not to this app).
    assert server.client.get("/health").status_code == 200


def test_parts_in_flight_on_several_connections_land_atomically(fresh_server):
    server = fresh_server("sd3", upload_port=0, admin_key=KEY)
    master = new_weights(server, seed=34)
    names = sorted(master)
    chunks = [names[i::5] for i in range(5)]
    original = checksum(server)
    port = listener_of(server).port

    def send(index: int, final: bool):
        body = bytes(SafetensorsBody({n: master[n] for n in chunks[index]}))
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=60) as client:
            q = {"upload_id": "c", "part": index, "final": str(final).lower(), "weight_version": "v5"}
            return client.post("/update_weights", params=q, content=body)

    assert send(0, False).status_code == 200  # part 0 opens the upload
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda i: send(i, False), [1, 2, 3]))
    assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
    assert checksum(server) == original  # nothing lands before the final part
    r = send(4, True)
    assert r.status_code == 200 and r.json()["weight_version"] == "v5", r.text
    assert checksum(server) == trainer_weights_checksum(master.items(), torch.float32)


# ---------------------------------------------------------------------------- interrupted pushes


def probe(client: RolloutClient) -> tuple[torch.Tensor, object]:
    [out] = client.generate(**PROBE)
    return out.generated_output, out.weight_version


def test_a_push_cut_on_the_upload_port_keeps_the_previous_weights_and_a_retry_under_its_id_completes(
    fresh_server,
):
    """The direct port: part 0 staged, then the connection carrying part 1 vanishes mid-body. The
    server keeps its weights, version and bit-identical outputs; a one-part commit of the same id
    is refused (it would apply part 0 alone); the trainer's retry, ``push_weights`` under the same
    upload id, restarts the upload at part 0 and lands exactly the new weights."""
    server = fresh_server("sd3", upload_port=0, admin_key=KEY)
    master = new_weights(server, seed=34)
    names = sorted(master)
    first = bytes(SafetensorsBody({n: master[n] for n in names[:10]}))
    rest = bytes(SafetensorsBody({n: master[n] for n in names[10:]}))
    original = checksum(server)
    manager = get_weight_manager(server.engine)
    with live_server(server) as (url, _), RolloutClient(url, admin_key=KEY, timeout=60) as client:
        img0, version0 = probe(client)
        listener = listener_of(server)
        conn = RawConnection(listener.port)
        try:
            status, _, body = conn.request(
                upload_head(len(first), "upload_id=again&part=0&final=false"), first
            )
            assert status == 200 and manager.staging.ids() == ["again"], body
            conn.send(upload_head(len(rest), "upload_id=again&part=1").encode() + rest[: len(rest) // 2])
        finally:
            conn.close()
        wait_until(lambda: listener.stats.requests == 2, 10, "the cut-short part to be refused")
        assert manager.staging.ids() == [] and checksum(server) == original
        img1, version1 = probe(client)
        assert version1 == version0 and torch.equal(img1, img0)

        # Re-sending part 0 as a one-part commit would apply a tenth of the model: refused.
        conn = RawConnection(listener.port)
        try:
            status, _, body = conn.request(
                upload_head(len(first), "upload_id=again&part=0&partial=true"), first
            )
        finally:
            conn.close()
        assert status == 400 and "upload 'again' was aborted" in body["error"]["message"], body
        assert checksum(server) == original

        result = push_weights(
            client,
            master,
            dtype=torch.float32,
            upload_id="again",
            weight_version="after",
            max_part_bytes=8192,
        )
        assert result.weight_version == "after"
        img2, version2 = probe(client)
    assert checksum(server) == trainer_weights_checksum(master.items(), torch.float32) != original
    twin = fresh_server("sd3")  # the same weights in one piece, on a server of its own
    assert twin.client.post("/update_weights", content=save(master)).status_code == 200
    [expected] = twin.generate(PROBE)
    assert version2 == "after" and torch.equal(img2, expected["generated_output"])
    assert not torch.equal(img2, img0) and manager.staging.ids() == []
