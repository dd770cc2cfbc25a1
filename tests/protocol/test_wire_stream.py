"""The msgpack wire codec without copies: the buffers-and-views encoder writes exactly the bytes of the
previous encoder (safetensors' own ``save`` per tensor, then ``msgpack.packb``; kept as the baseline
in ``benchmarks/wire_codec.py``), the decoder gives tensors equal to safetensors' own ``load`` and
rejects malformed files, and the answer goes through the real app and a real uvicorn socket under a
Content-Length into the clients' preallocated buffer."""

from __future__ import annotations

import asyncio
import json
import struct

import httpx
import msgpack
import numpy as np
import pytest
import torch
from safetensors.torch import save as st_save

from benchmarks.wire_codec import previous_decode, previous_encode
from diffusion_rollout.client import AsyncRolloutClient, RolloutClient, RolloutConnectionError
from diffusion_rollout.client.receive import decode_answer, read_body
from diffusion_rollout.protocol import lean, wire
from diffusion_rollout.protocol.safetensors_layout import SAFETENSORS_DTYPE
from tests.reliability_helpers import live_server

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64, torch.bool]


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


def random_tensor(shape, dtype, gen) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 250, shape, generator=gen).to(dtype)


def payload() -> dict:
    """Nested outputs with every dtype sent, 0-d, empty, non-contiguous and large tensors."""
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(300, 200, generator=gen)  # 240 KB: goes out as a view
    per_dtype = {str(d): random_tensor((3, 5), d, gen) for d in DTYPES}
    return {
        "outputs": [
            {
                "generated_output": random_tensor((3, 128, 128), torch.uint8, gen),
                "latents": random_tensor((3, 16, 32, 32), torch.bfloat16, gen),
                "log_probs": torch.randn(10, generator=gen),
                "scalar": torch.tensor(2.5, dtype=torch.float16),
                "empty": torch.zeros(2, 0, 3, dtype=torch.int64),
                "flags": torch.tensor([True, False]),
                "sde_step_indices": [0, 1, 2],
                "seed": 7,
                "inference_time_s": 0.25,
                "peak_memory_mb": None,
            }
        ],
        "dtypes": per_dtype,
        "views": (big.t(), big[::3], big[7:9], big.expand(2, 300, 200)[1], big),
        "scalars": [True, False, -1, 2**40, -(2**63), 1.5, "text", "é", b"raw", None, {}, []],
        "same_tensor_twice": [big, big],
    }


# ---------------------------------------------------------------------------- encoding
def test_chunked_encode_is_byte_identical_to_the_previous_encoder():
    obj = payload()
    reference = previous_encode(obj)
    buffers, length = wire.encode_chunks(obj)
    assert b"".join(buffers) == reference and length == len(reference)
    assert wire.encode(obj) == reference
    # Large tensors are pieces of their own, small ones coalesced: a few dozen writes at most.
    assert any(isinstance(b, memoryview) for b in buffers) and len(buffers) < 30


def test_large_contiguous_tensors_are_sent_from_their_own_memory():
    t = torch.randn(256, 256)  # 256 KB
    buffers, _ = wire.encode_chunks({"x": t, "column": t[:, 0], "tail": t[128:]})
    views = [b for b in buffers if isinstance(b, memoryview)]
    pointers = {np.frombuffer(v, dtype=np.uint8).ctypes.data for v in views}
    assert pointers == {t.data_ptr(), t[128:].data_ptr()}  # the strided column was copied
    t[200, 0] = 123.0  # the views see later writes: nothing was copied
    assert torch.equal(wire.decode(b"".join(buffers))["x"], t)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", list(SAFETENSORS_DTYPE))
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 5), (2, 0, 3), (4, 1, 7, 2)])
def test_every_safetensors_dtype_and_shape_matches_safetensors(dtype, shape):
    itemsize = torch.empty((), dtype=dtype).element_size()
    high = 2 if dtype is torch.bool else 256
    t = torch.randint(0, high, (*shape, itemsize), dtype=torch.uint8).view(dtype).squeeze(-1)
    assert t.shape == shape
    assert wire.encode({"t": t}) == previous_encode({"t": t})
    assert wire.tensor_to_envelope(t)["data"] == st_save({"t": t.contiguous()})
    decoded = wire.decode(wire.encode([t]))[0]
    expected = previous_decode(previous_encode([t]))[0]
    assert decoded.dtype == expected.dtype and decoded.shape == expected.shape
    assert torch.equal(bits(decoded), bits(expected))  # bit patterns: random floats include NaN


def test_bin_header_sizes_at_their_boundaries():
    # A file of 8 + header + n bytes crosses msgpack's bin8 -> bin16 -> bin32 limits near these n.
    for n in [*range(150, 260), *range(65_400, 65_540)]:
        t = torch.arange(n, dtype=torch.int64).to(torch.uint8)
        assert wire.encode([t]) == previous_encode([t]), n


# ---------------------------------------------------------------------------- decoding
def test_decode_equals_safetensors_load_and_tensors_own_writable_memory():
    obj = payload()
    body = bytearray(previous_encode(obj))
    decoded = wire.decode(body)
    assert_same(decoded, previous_decode(bytes(body)))
    assert_same(wire.decode(memoryview(body)), decoded)
    assert_same(wire.decode(np.frombuffer(body, dtype=np.uint8)), decoded)
    start = np.frombuffer(body, dtype=np.uint8).ctypes.data
    for t in [*decoded["views"], decoded["outputs"][0]["latents"], decoded["outputs"][0]["scalar"]]:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # its own compact memory
        assert not start <= t.data_ptr() < start + len(body)  # not a view of the body
        t.view(-1)[0:1] = 1  # writable, without warnings (they are errors here)
    assert bytes(body) == previous_encode(obj)  # writing to a tensor left the body alone


def test_json_decodes_to_the_same_tensors():
    obj = payload()
    del obj["scalars"]  # JSON has no bytes type
    assert_same(wire.decode(wire.encode(obj, wire.JSON), wire.JSON), wire.decode(wire.encode(obj)))


def envelope_body(data, **fields) -> bytes:
    env = {"__tensor__": True, "data": data, "shape": [2, 2], "dtype": "torch.float32", **fields}
    return msgpack.packb([{k: v for k, v in env.items() if v is not None}], use_bin_type=True)


def st_file(header: dict | bytes, data: bytes, header_len: int | None = None) -> bytes:
    """A safetensors file written by hand, so it can be wrong in one chosen way."""
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


GOOD = {"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
MALFORMED = [
    (envelope_body(b"\x01\x02"), "shorter than the 8-byte header length"),
    (envelope_body(st_file(GOOD, bytes(16), header_len=2**40)), "header length"),
    (envelope_body(st_file(GOOD, bytes(16), header_len=500)), "header length"),
    (envelope_body(st_file(b"{not json", bytes(16))), "not JSON"),
    (envelope_body(st_file({"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 64]}}, bytes(16))), "offsets"),
    (envelope_body(st_file(GOOD, bytes(40))), "do not span"),
    (envelope_body(st_file({"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]}}, bytes(24))), "do not span"),
    (envelope_body(st_file({"t": {"dtype": "F32", "shape": [3, 2], "data_offsets": [0, 16]}}, bytes(16))), "shape needs"),
    (envelope_body(st_file({"t": {"dtype": "Q7", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(16))), "unknown dtype"),
    (envelope_body(st_file({"x": GOOD["t"]}, bytes(16))), "one tensor named 't'"),
    (envelope_body(st_file({**GOOD, "u": {"dtype": "U8", "shape": [0], "data_offsets": [16, 16]}}, bytes(16))), "one tensor"),
    (envelope_body(st_file(GOOD, bytes(16)), dtype="torch.bfloat16"), "envelope says"),
    (envelope_body(st_file(GOOD, bytes(16)), shape=[4]), "envelope says"),
    (envelope_body(st_file({"t": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}}, b"\x01\x02"), shape=[2], dtype="torch.bool"), "bool"),
    (envelope_body(st_file({"t": {"dtype": "F32", "shape": [0, 2**64], "data_offsets": [0, 0]}}, b""), shape=None), "not a valid torch shape"),
    (envelope_body(st_file({"t": {"dtype": "F32", "shape": [0, 2**63 - 1, 2], "data_offsets": [0, 0]}}, b""), shape=[0, 2**63 - 1, 2]), "not a valid torch shape"),
    (envelope_body(12345), "not bytes"),
    (previous_encode([torch.ones(4)])[:-30], "not valid msgpack"),
]  # fmt: skip


@pytest.mark.parametrize("client", [False, True], ids=["unpackb", "client_in_place"])
@pytest.mark.parametrize(("body", "message"), MALFORMED)
def test_malformed_bodies_are_rejected_with_a_clear_error(body, message, client):
    # The client's decode (msgpack_views, tensor data read in place) refuses the same bodies alike.
    with pytest.raises(wire.WireFormatError, match=message):
        if client:
            decode_answer(memoryview(body), wire.MSGPACK)
        else:
            wire.decode(body)


def test_malformed_json_envelopes_are_rejected():
    good = wire.encode([torch.ones(2, 2)], wire.JSON)
    with pytest.raises(wire.WireFormatError, match="not base64"):
        wire.decode(good.replace(b'"data":"', b'"data":"!!'), wire.JSON)
    with pytest.raises(wire.WireFormatError, match="not valid JSON"):
        wire.decode(good[:-5], wire.JSON)


# ---------------------------------------------------------------------------- the response
def test_wire_response_sends_the_tensor_memory_under_one_content_length():
    from starlette.requests import Request

    from diffusion_rollout.entrypoints.routers.common import wire_response

    big = torch.randn(256, 256)
    obj = [{"x": big, "log_probs": torch.randn(10), "seed": 1}]
    sent: list[dict] = []

    async def go() -> None:
        request = Request({"type": "http", "method": "POST", "headers": [(b"accept", wire.MSGPACK.encode())]})
        response = await wire_response(request, obj)

        async def send(message) -> None:
            sent.append(message)

        await response({"type": "http", "method": "POST"}, None, send)

    asyncio.run(go())
    start, *bodies = sent
    headers = dict(start["headers"])
    assert headers[b"content-type"] == wire.MSGPACK.encode() and b"transfer-encoding" not in headers
    assert int(headers[b"content-length"]) == sum(len(m["body"]) for m in bodies)
    assert [m["more_body"] for m in bodies] == [True] * (len(bodies) - 1) + [False]
    assert b"".join(m["body"] for m in bodies) == previous_encode(obj)
    [view] = [m["body"] for m in bodies if isinstance(m["body"], memoryview)]
    assert np.frombuffer(view, dtype=np.uint8).ctypes.data == big.data_ptr()  # not a copy


def test_a_large_tensor_goes_out_in_slices_of_its_own_memory():
    """Body messages are at most SEND_CHUNK bytes (one h11 join each holds the GIL that long), every
    slice of the big tensor a view of its memory, and the bytes are the previous encoder's."""
    from starlette.requests import Request

    from diffusion_rollout.entrypoints.buffers_response import SEND_CHUNK
    from diffusion_rollout.entrypoints.routers.common import wire_response

    big = torch.randn(SEND_CHUNK // 4 * 3 + 1234)  # 3 slices and a tail
    obj = [{"x": big, "seed": 1}]
    sent: list[dict] = []

    async def go() -> None:
        request = Request({"type": "http", "method": "POST", "headers": [(b"accept", wire.MSGPACK.encode())]})

        async def send(message) -> None:
            sent.append(message)

        await (await wire_response(request, obj))({"type": "http", "method": "POST"}, None, send)

    asyncio.run(go())
    bodies = [m["body"] for m in sent[1:]]
    assert max(len(b) for b in bodies) == SEND_CHUNK
    assert b"".join(bodies) == previous_encode(obj)
    views = [b for b in bodies if isinstance(b, memoryview)]
    assert len(views) == 4 and sum(len(v) for v in views) == big.numel() * 4
    starts = [np.frombuffer(v, dtype=np.uint8).ctypes.data for v in views]
    assert starts == [big.data_ptr() + i * SEND_CHUNK for i in range(4)]  # views, not copies


# ---------------------------------------------------------------------------- the client's buffer
class Answer(httpx.SyncByteStream):
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def __iter__(self):
        yield from self.pieces


def answering(pieces: list[bytes], length: int, media: str = wire.MSGPACK) -> RolloutClient:
    def handle(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": media, "content-length": str(length)}
        return httpx.Response(200, headers=headers, stream=Answer(pieces))

    return RolloutClient("http://s", transport=httpx.MockTransport(handle))


def test_a_body_unlike_its_content_length_or_malformed_is_a_connection_error():
    body = msgpack.packb([{"request_id": "r", "prompt": "x", "seed": 1, "weight_version": 0}])
    [out] = answering([body[:5], body[5:]], len(body)).generate("x")
    assert out.seed == 1
    with pytest.raises(RolloutConnectionError, match="ended after"):
        answering([body[:5]], len(body)).generate("x")
    with pytest.raises(RolloutConnectionError, match="does not fit in memory"):
        answering([body], 2**62).generate("x")  # refused before anything is allocated
    with pytest.raises(RolloutConnectionError, match="longer than its Content-Length"):
        answering([body, b"extra"], len(body)).generate("x")
    with pytest.raises(RolloutConnectionError, match="malformed /rollout/generate answer"):
        answering([envelope_body(b"\x00" * 12)], len(envelope_body(b"\x00" * 12))).generate("x")


# ---------------------------------------------------------------------------- end to end
SMALL = {"num_inference_steps": 2, "width": 64, "height": 64, "max_sequence_length": 16}


@pytest.fixture
def recorded(monkeypatch):
    """The payloads the router handed to the encoder (the engine's outputs), with every tensor
    sent as its own view so the buffers really travel as memoryviews."""
    seen: list = []
    encode_chunks = wire.encode_chunks

    def record(payload):
        seen.append(payload)
        return encode_chunks(payload)

    monkeypatch.setattr(wire, "encode_chunks", record)
    monkeypatch.setattr(wire, "COALESCE_BYTES", 1)
    return seen


def rollout_fields(**kw) -> dict:
    return dict(
        seed=3,
        num_outputs_per_prompt=2,
        rollout_return_dit_trajectory=True,
        rollout_return_denoising_env=True,
        rollout_debug_mode=True,
        **SMALL,
        **kw,
    )


def assert_outputs_are_the_engines(outputs, payload) -> None:
    for o, expected in zip(outputs, lean.from_lean(payload), strict=True):
        assert torch.equal(o.generated_output, expected["generated_output"])
        assert torch.equal(o.rollout_log_probs, expected["rollout_log_probs"])
        assert torch.equal(o.dit_trajectory.latents, expected["dit_trajectory"]["latents"])
        assert_same(o.denoising_env, expected["denoising_env"])
        assert_same(o.rollout_debug_tensors, expected["rollout_debug_tensors"])


def test_clients_get_the_engines_tensors_through_the_app(served, recorded):
    server = served("sd3")
    sync = RolloutClient("http://testserver", http_client=server.client)
    outputs = sync.generate("a red square", **rollout_fields())  # the client asks for the lean form
    assert recorded and lean.is_ref(recorded[-1][1]["denoising_env"])
    assert_outputs_are_the_engines(outputs, recorded[-1])

    async def go():
        transport = httpx.ASGITransport(app=server.app)
        async with AsyncRolloutClient("http://testserver", transport=transport) as c:
            return await c.generate("a red square", **rollout_fields(output_dtype="uint8"))

    outputs = asyncio.run(go())
    assert outputs[0].generated_output.dtype == torch.uint8
    assert_outputs_are_the_engines(outputs, recorded[-1])


@pytest.mark.parametrize("send_chunk", [None, 4096], ids=["whole", "sliced"])
def test_a_real_socket_answer_has_a_content_length_and_fills_the_preallocated_buffer(
    fresh_server, recorded, monkeypatch, send_chunk
):
    if send_chunk is not None:  # the tiny answer then goes out in many slices, through uvicorn's h11
        monkeypatch.setattr("diffusion_rollout.entrypoints.buffers_response.SEND_CHUNK", send_chunk)
    server = fresh_server("sd3")  # private: uvicorn's shutdown puts the engine into its drain
    request = {"prompt": "a red square", **rollout_fields(output_dtype="uint8"), "lean_response": True}
    with live_server(server) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/rollout/generate", json=request) as resp:
            assert resp.status_code == 200 and "transfer-encoding" not in resp.headers
            body = read_body(resp)
        assert isinstance(body, memoryview) and int(resp.headers["content-length"]) == len(body)
        assert bytes(body) == previous_encode(recorded[-1])
        assert_same(lean.from_lean(wire.decode(body)), lean.from_lean(recorded[-1]))
        outputs = RolloutClient(url).generate("a red square", **rollout_fields())
        assert_outputs_are_the_engines(outputs, recorded[-1])
