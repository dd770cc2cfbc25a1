"""The streaming upload path: bodies read into pooled buffers, parsed as views, parts in flight together.

Correctness only (speed lives in ``benchmarks/weight_sync.py``): the bytes that land are the bytes
sent, a multi-part upload with concurrent parts stays atomic, bodies that are cut short or run
long are a clean 4xx that stages and applies nothing, and a receive buffer is reused only when
nothing views it any more.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load, save

from diffusion_rollout.client import RolloutClient
from diffusion_rollout.client.weights.upload import push_weights, safetensors_parts
from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.protocol.checksums import trainer_named_tensors_sha256, trainer_weights_checksum
from diffusion_rollout.protocol.safetensors_layout import SafetensorsBody
from diffusion_rollout.server.weights import get_weight_manager
from diffusion_rollout.server.weights.receive import BufferPool, parse_safetensors, unpooled
from diffusion_rollout.server.weights.updater import finite_flags
from tests.reliability_helpers import PROBE, live_server, wait_until


def new_weights(server, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: p.detach() + 0.05 * torch.randn(p.shape, generator=g)
        for n, p in server.engine.pipe.transformer.named_parameters()
    }


def checksum(server) -> str:
    r = server.client.post("/get_weights_checksum", json={"module_names": ["transformer"]})
    assert r.status_code == 200, r.text
    return r.json()["transformer"]


def error_of(r, status: int) -> str:
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


# ---------------------------------------------------------------------------- layout and parsing
def test_body_round_trips_through_safetensors_and_the_view_parser():
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).bfloat16(),
        "i64": torch.arange(4),
        "flag": torch.tensor(True),
        "empty": torch.zeros(0, 3),
        "f16": torch.randn(2, 2).half(),
    }
    body = SafetensorsBody(tensors, {"peft_config": "{}"})
    raw = bytes(body)
    assert len(raw) == len(body)
    assert b"".join(bytes(s) for s in body.slices(7)) == raw  # slicing loses nothing
    theirs = load(raw)  # the reference reader accepts what the client sends
    assert all(torch.equal(theirs[n], t) and theirs[n].dtype == t.dtype for n, t in tensors.items())

    pool = BufferPool()
    lease = pool.lease(len(raw))
    lease.writable()[:] = raw
    ours, metadata = parse_safetensors(lease)
    assert metadata == {"peft_config": "{}"}
    assert all(torch.equal(ours[n], t) and ours[n].dtype == t.dtype for n, t in tensors.items())
    # Views, not copies: every non-empty tensor lives in the receive buffer.
    assert all(lease.shares_storage(t) for t in ours.values() if t.numel())
    # And a file written by safetensors itself parses to the same tensors.
    again, _ = parse_safetensors(unpooled(save(tensors)))
    assert all(torch.equal(again[n], t) for n, t in tensors.items())


def _with_header(header: bytes, data: bytes = b"\0" * 16) -> bytes:
    return len(header).to_bytes(8, "little") + header + data


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"\x01\x02", "shorter than the 8-byte header length"),
        (_with_header(b'{"a":'), "header is not JSON"),
        (_with_header(b"[1, 2]"), "not a JSON object"),
        (_with_header(b'{"a":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}}'), "unknown dtype"),
        (_with_header(b'{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}'), "invalid shape"),
        (
            _with_header(b'{"a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}}'),
            "outside the 16 data bytes",
        ),
        (_with_header(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}'), "its shape needs 8"),
        (
            _with_header(
                b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                b'"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}'
            ),
            "overlap",
        ),
        ((2**40).to_bytes(8, "little") + b"{}", "does not fit"),
    ],
)
def test_malformed_bodies_are_refused_naming_the_problem(body, problem):
    with pytest.raises(WeightUpdateError) as exc:
        parse_safetensors(unpooled(body))
    assert problem in exc.value.message and "not a valid safetensors file" in exc.value.message


def test_a_buffer_is_reused_only_when_no_view_is_left():
    pool = BufferPool()
    lease = pool.lease(1000)
    lease.writable()[:8] = b"ABCDEFGH"
    kept = lease.data[:8]  # something still looks at the bytes
    lease.release()
    assert pool.stats.deferred == 1 and pool.stats.kept_bytes == 0 and pool.stats.deferred_bytes > 0
    other = pool.lease(1000)
    assert pool.stats.allocated == 2 and pool.stats.reused == 0  # the viewed buffer was not handed out
    other.writable()[:8] = b"ZZZZZZZZ"
    assert bytes(kept.numpy()) == b"ABCDEFGH"  # the held view was not overwritten
    del kept
    other.release()
    # Both are free now: the deferred one was looked at again when ``other`` came back.
    assert pool.stats.deferred_bytes == 0 and pool.stats.kept_bytes == 2 * (1 << 20)
    again = pool.lease(10)
    assert pool.stats.reused == 1 and again.nbytes == 10 and pool.stats.abandoned == 0


def test_a_view_that_outlives_its_lease_briefly_does_not_cost_the_next_upload_a_buffer():
    # The race the deferral is for: the thread that parsed the body drops its result a moment after
    # the event loop released the lease.
    pool = BufferPool()
    lease = pool.lease(100)
    late = lease.data[:4]
    lease.release()
    del late  # the worker thread lets go
    nxt = pool.lease(100)
    assert pool.stats.allocated == 1 and pool.stats.reused == 1 and pool.stats.deferred == 1
    nxt.release()


def test_a_buffer_viewed_for_good_is_let_go_at_the_bound():
    pool = BufferPool(keep_bytes=3 * (1 << 20))
    held = []
    for _ in range(4):
        lease = pool.lease(100)
        held.append(lease.data[:4])
        lease.release()
    # Four deferred MiB buffers over a 3 MiB bound: the oldest was let go, the pool holds 3 MiB.
    assert pool.stats.abandoned == 1 and pool.stats.deferred_bytes == 3 * (1 << 20)
    assert pool.stats.kept_bytes == 0


def test_finite_flags_catch_nan_and_both_infinities_in_every_float_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        clean = torch.randn(100).to(dtype)
        bad = []
        for value in (float("nan"), float("inf"), float("-inf")):
            t = clean.clone()
            t[37] = value
            bad.append(t)
        assert finite_flags([clean, *bad, torch.zeros(0, dtype=dtype)]) == [True, False, False, False, True]


# ---------------------------------------------------------------------------- through the real app
def test_streamed_parts_in_flight_together_land_intact_and_atomically(fresh_server):
    server = fresh_server("sd3")
    master = new_weights(server, seed=21)
    before = checksum(server)
    with live_server(server) as (url, _), RolloutClient(url, timeout=60) as client:
        # Small parts so there are many, three in flight; the server verifies every tensor's
        # SHA-256 against the client's manifest afterwards (verify=True).
        parts = list(safetensors_parts(master, max_part_bytes=4096, dtype=torch.float32))
        assert len(parts) > 6
        out = push_weights(
            client, master, dtype=torch.float32, max_part_bytes=4096, weight_version="streamed", concurrency=3
        )
    assert out.weight_version == "streamed"
    assert checksum(server) == trainer_weights_checksum(master.items(), torch.float32) != before
    manager = get_weight_manager(server.engine)
    assert manager.staging.ids() == []
    # Every part's buffer went back to the pool once the upload was applied.
    assert manager.receive_buffers.stats.abandoned == 0 and manager.receive_buffers.stats.kept_bytes > 0


def test_concurrent_parts_apply_nothing_until_the_final_one(fresh_server):
    server = fresh_server("sd3")
    master = new_weights(server, seed=22)
    names = sorted(master)
    chunks = [names[i::5] for i in range(5)]
    original = checksum(server)

    def send(index: int, final: bool):
        part = {n: master[n] for n in chunks[index]}
        return server.client.post(
            "/update_weights",
            content=bytes(SafetensorsBody(part)),
            params={"upload_id": "u", "part": index, "final": str(final).lower(), "weight_version": "v5"},
        )

    assert send(0, False).status_code == 200  # part 0 opens the upload
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda i: send(i, False), [1, 2, 3]))
    assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
    assert checksum(server) == original  # nothing lands before the final part
    r = send(4, True)
    assert r.status_code == 200 and r.json()["weight_version"] == "v5", r.text
    assert checksum(server) == trainer_weights_checksum(master.items(), torch.float32)
    manifest = trainer_named_tensors_sha256(master.items(), torch.float32)
    r = server.client.post(
        "/update_weights_from_tensor_checker",
        json={"target_module": "transformer", "expected_named_tensors_sha256": manifest},
    )
    assert r.status_code == 200, r.text


def test_bodies_shorter_or_longer_than_announced_are_400_and_stage_nothing(fresh_server):
    server = fresh_server("sd3")
    master = new_weights(server, seed=23)
    raw = save(master)
    original = checksum(server)
    manager = get_weight_manager(server.engine)

    def streamed(data: bytes, length: int, **params):
        def pieces():
            for i in range(0, len(data), 1000):
                yield data[i : i + 1000]

        return server.client.post(
            "/update_weights",
            content=pieces(),
            params=params,
            headers={"Content-Length": str(length), "Content-Type": "application/octet-stream"},
        )

    # A first part staged, then a truncated second part: the whole upload is dropped.
    names = sorted(master)
    half = save({n: master[n] for n in names[:10]})
    assert streamed(half, len(half), upload_id="t", part=0, final="false").status_code == 200
    msg = error_of(streamed(raw[: len(raw) // 2], len(raw), upload_id="t", part=1), 400)
    assert f"ended after {len(raw) // 2} of the {len(raw)} bytes" in msg and "upload 't' was dropped" in msg
    assert manager.staging.ids() == []
    msg = error_of(streamed(raw + b"extra", len(raw), upload_id="t2"), 400)
    assert "longer than its Content-Length" in msg
    assert manager.staging.ids() == []
    assert checksum(server) == original


def test_upload_over_the_limit_is_413_and_applies_nothing(fresh_server):
    server = fresh_server("sd3", max_upload_bytes=4096)
    master = new_weights(server, seed=24)
    raw = save(master)
    original = checksum(server)
    msg = error_of(server.client.post("/update_weights", content=raw), 413)
    assert "max_upload_bytes" in msg

    def pieces():  # chunked: no Content-Length, counted as it arrives
        for i in range(0, len(raw), 1000):
            yield raw[i : i + 1000]

    assert "max_upload_bytes" in error_of(server.client.post("/update_weights", content=pieces()), 413)
    assert get_weight_manager(server.engine).staging.ids() == []
    assert checksum(server) == original


def test_a_client_that_disconnects_mid_body_leaves_nothing_staged(fresh_server):
    server = fresh_server("sd3")
    master = new_weights(server, seed=25)
    raw = save(master)
    original = checksum(server)
    manager = get_weight_manager(server.engine)
    with live_server(server) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:
            head = (
                f"POST /update_weights?upload_id=cut&final=true HTTP/1.1\r\nHost: x\r\n"
                f"Content-Type: application/octet-stream\r\nContent-Length: {len(raw)}\r\n\r\n"
            )
            s.sendall(head.encode() + raw[: len(raw) // 3])
            # Wait until the server has begun reading this body into a receive buffer.
            wait_until(lambda: manager.receive_buffers.stats.allocated == 1, 10, "the body read to start")
        # The socket is closed: the read fails, the buffer goes back and nothing is staged.
        wait_until(
            lambda: manager.receive_buffers.stats.kept_bytes > 0, 10, "the receive buffer to come back"
        )
        assert manager.staging.ids() == []
        with RolloutClient(url, timeout=60) as client:  # and the next upload works, reusing the buffer
            push_weights(client, master, dtype=torch.float32, weight_version="after", verify=False)
    assert manager.receive_buffers.stats.reused >= 1
    assert checksum(server) == trainer_weights_checksum(master.items(), torch.float32) != original


def test_lora_upload_through_the_stream_returns_its_buffer(fresh_server):
    server = fresh_server("sd3")
    tr = server.engine.pipe.transformer
    g = torch.Generator().manual_seed(3)
    tensors = {}
    for path, layer in tr.named_modules():
        if isinstance(layer, torch.nn.Linear) and path.endswith(("attn.to_q", "attn.to_v")):
            tensors[f"{path}.lora_A.weight"] = torch.randn(4, layer.in_features, generator=g)
            tensors[f"{path}.lora_B.weight"] = torch.randn(layer.out_features, 4, generator=g)
    assert tensors
    params = {"name": "s", "target_module": "transformer", "activate": "true", "lora_alpha": 4}
    pool = get_weight_manager(server.engine).receive_buffers
    for _ in range(2):
        r = server.client.post(
            "/lora/load",
            content=bytes(SafetensorsBody(tensors)),
            params=params,
            headers={"Content-Type": "application/octet-stream"},
        )
        assert r.status_code == 200, r.text
    listed = server.client.get("/lora").json()
    assert "s" in str(listed)
    # The second push replaced the tensors in place and reused the first push's buffer.
    assert pool.stats.allocated == 1 and pool.stats.reused == 1 and pool.stats.abandoned == 0


def test_a_refused_part_among_concurrent_ones_fails_the_push_and_applies_nothing(fresh_server):
    from diffusion_rollout.client.exceptions import ServerWeightUpdateError

    server = fresh_server("sd3")
    master = new_weights(server, seed=26)
    names = sorted(master)
    bad = dict(master)
    bad[names[len(names) // 2]] = torch.zeros(3)  # a wrong shape in a middle part
    original = checksum(server)
    with live_server(server) as (url, _), RolloutClient(url, timeout=60) as client:
        with pytest.raises(ServerWeightUpdateError, match="shape mismatch"):
            push_weights(client, bad, dtype=torch.float32, max_part_bytes=4096, concurrency=3, verify=False)
        assert get_weight_manager(server.engine).staging.ids() == []
        # The same client pushes the correct weights afterwards (a new upload id).
        push_weights(client, master, dtype=torch.float32, max_part_bytes=4096, concurrency=3)
    assert checksum(server) == trainer_weights_checksum(master.items(), torch.float32) != original


# ---------------------------------------------------------------------------- interrupted pushes


def probe(server) -> tuple[torch.Tensor, object]:
    [out] = server.generate(PROBE)
    return out["generated_output"], out["weight_version"]


def test_a_push_cut_mid_body_keeps_the_previous_weights_and_a_retry_under_its_id_completes(fresh_server):
    """The main port under uvicorn: part 0 of a numbered upload is staged, then the connection
    carrying part 1 closes a third of the way through its body. Nothing of the push lands (same
    checksum, same version, bit-identical outputs), nothing stays staged, and the trainer's retry,
    ``push_weights`` under the same upload id, restarts the upload from part 0 and applies exactly
    the new weights (the outputs equal those of a server that got them in one piece)."""
    server = fresh_server("sd3")
    master = new_weights(server, seed=27)
    names = sorted(master)
    first, rest = save({n: master[n] for n in names[:10]}), save({n: master[n] for n in names[10:]})
    img0, version0 = probe(server)
    original = checksum(server)
    manager = get_weight_manager(server.engine)
    with live_server(server) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with RolloutClient(url, timeout=60) as client:
            client.update_weights(first, upload_id="retry", part=0, final=False)
        assert manager.staging.ids() == ["retry"]
        with socket.create_connection(("127.0.0.1", port)) as s:
            head = (
                f"POST /update_weights?upload_id=retry&part=1 HTTP/1.1\r\nHost: x\r\n"
                f"Content-Type: application/octet-stream\r\nContent-Length: {len(rest)}\r\n\r\n"
            )
            s.sendall(head.encode() + rest[: len(rest) // 3])
            wait_until(
                lambda: manager.receive_buffers.stats.allocated == 2, 10, "part 1's body read to start"
            )
        # The connection is gone: the part is refused and its upload dropped with part 0.
        wait_until(lambda: manager.staging.ids() == [], 10, "the interrupted upload to be dropped")
        img1, version1 = probe(server)
        assert checksum(server) == original and version1 == version0
        assert torch.equal(img1, img0)

        with RolloutClient(url, timeout=60) as client:  # the retry, under the same id, in 4 parts
            result = push_weights(
                client, master, dtype=torch.float32, upload_id="retry", weight_version="after",
                max_part_bytes=len(rest) // 3,
            )  # fmt: skip
        assert result.weight_version == "after"
        img2, version2 = probe(server)
    assert checksum(server) == trainer_weights_checksum(master.items(), torch.float32) != original
    twin = fresh_server("sd3")  # the same weights pushed in one piece to a server of its own
    assert twin.client.post("/update_weights", content=save(master)).status_code == 200
    expected, _ = probe(twin)
    assert version2 == "after" and torch.equal(img2, expected) and not torch.equal(img2, img0)
    assert manager.staging.ids() == [] and manager.receive_buffers.stats.abandoned == 0
