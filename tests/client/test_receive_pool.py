"""The client's pool of receive buffers (client/receive.py): a buffer is read into again only once
nothing made from it is alive, never beyond its byte cap, and answers read through it over a real
socket decode to the engine's tensors."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch

from diffusion_rollout.client import RolloutClient, receive
from diffusion_rollout.client.receive import ReceivePool
from diffusion_rollout.protocol import wire
from tests.protocol.test_wire_stream import assert_outputs_are_the_engines, recorded, rollout_fields  # noqa: F401
from tests.reliability_helpers import live_server

MB = 1 << 20


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def decoded_like_the_wire(buffer: np.ndarray) -> torch.Tensor:
    """A tensor over part of the buffer, made as ``wire.decode`` makes them (a memoryview slice)."""
    return torch.from_numpy(np.frombuffer(memoryview(buffer)[16:1024], dtype=np.float32))


def test_a_buffer_is_reused_only_after_everything_made_from_it_is_gone():
    pool = ReceivePool(64 * MB)
    first = pool.take(4 * MB)
    first[:] = 7
    tensor = decoded_like_the_wire(first)
    first_at = address(first)
    del first
    gc.collect()
    second = pool.take(4 * MB)  # the tensor still holds the first buffer
    second_at = address(second)
    assert second_at != first_at and pool.reused == 0 and pool.idle_bytes == 0
    second[:] = 9
    assert torch.equal(tensor.view(torch.uint8), torch.full((1008,), 7, dtype=torch.uint8))
    del tensor  # now the first buffer is free
    gc.collect()
    assert pool.idle_bytes == 4 * MB
    again = pool.take(4 * MB)
    assert pool.reused == 1 and address(again) == first_at  # the same memory, handed out once more
    assert again[0] == 7  # as it was left: recycled, not zeroed


def test_only_the_same_length_is_reused_and_small_answers_bypass_the_pool():
    pool = ReceivePool(64 * MB)
    a = pool.take(2 * MB)
    del a
    gc.collect()
    assert pool.idle_bytes == 2 * MB
    b = pool.take(3 * MB)
    assert pool.reused == 0 and pool.idle_bytes == 2 * MB and b.nbytes == 3 * MB
    small = pool.take(receive.POOL_MIN_BYTES - 1)
    assert small.base is None  # a plain array: it never comes back to the pool
    del small
    gc.collect()
    assert pool.idle_bytes == 2 * MB


def test_the_cap_drops_the_longest_idle_buffers_first_and_zero_turns_the_pool_off():
    pool = ReceivePool(5 * MB)
    a, b, c = pool.take(2 * MB), pool.take(2 * MB), pool.take(3 * MB)
    b_at, c_at = address(b), address(c)
    del a, b  # given back in this order
    gc.collect()
    assert pool.idle_bytes == 4 * MB
    del c
    gc.collect()
    assert pool.idle_bytes == 5 * MB  # 2 + 2 + 3 is over the cap: the first 2 MB buffer went
    held = [pool.take(3 * MB), pool.take(2 * MB), pool.take(2 * MB)]
    assert address(held[0]) == c_at and address(held[1]) == b_at
    assert pool.reused == 2 and address(held[2]) not in (b_at, c_at)  # no third one idle
    assert pool.take(6 * MB).base is None  # over the cap: never pooled
    off = ReceivePool(0)
    x = off.take(4 * MB)
    assert x.base is None
    del x
    gc.collect()
    assert off.idle_bytes == 0


def test_the_cap_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("DIFFUSION_ROLLOUT_RECEIVE_POOL_MB", "0")
    assert ReceivePool.from_env().capacity_bytes == 0
    monkeypatch.setenv("DIFFUSION_ROLLOUT_RECEIVE_POOL_MB", "1.5")
    assert ReceivePool.from_env().capacity_bytes == int(1.5 * MB)
    monkeypatch.delenv("DIFFUSION_ROLLOUT_RECEIVE_POOL_MB")
    assert ReceivePool.from_env().capacity_bytes == 2048 * MB
    monkeypatch.setenv("DIFFUSION_ROLLOUT_RECEIVE_POOL_MB", "lots")
    with pytest.raises(ValueError, match="DIFFUSION_ROLLOUT_RECEIVE_POOL_MB"):
        ReceivePool.from_env()


def test_answers_over_a_real_socket_reuse_the_pool_and_stay_the_engines(
    fresh_server,
    recorded,  # noqa: F811
    monkeypatch,
):
    pool = ReceivePool(64 * MB)
    monkeypatch.setattr(receive, "POOL", pool)
    monkeypatch.setattr(receive, "POOL_MIN_BYTES", 1)  # the tiny model's answers are small
    server = fresh_server("sd3")
    with live_server(server) as (url, _):
        client = RolloutClient(url)
        first = client.generate("a red square", **rollout_fields(output_dtype="uint8"))
        assert_outputs_are_the_engines(first, recorded[-1])
        kept = [o.generated_output.clone() for o in first]
        second = client.generate("a red square", **{**rollout_fields(output_dtype="uint8"), "seed": 11})
        # The first body was decoded and let go: the second was read into its buffer; the first
        # answer's tensors are alive, so their memory was not handed out.
        after_second = pool.reused
        assert after_second == 1
        assert_outputs_are_the_engines(second, recorded[-1])
        assert all(torch.equal(o.generated_output, k) for o, k in zip(first, kept, strict=True))
        del first, second
        gc.collect()
        third = client.generate("a red square", **{**rollout_fields(output_dtype="uint8"), "seed": 12})
        assert pool.reused > after_second + 1  # the body's buffer and the dropped tensors' memory
        assert_outputs_are_the_engines(third, recorded[-1])
        client.close()


def test_decoded_tensors_own_pooled_memory_apart_from_the_body(monkeypatch):
    pool = ReceivePool(64 * MB)
    monkeypatch.setattr(receive, "POOL", pool)
    payload = {"x": torch.arange(MB // 2, dtype=torch.float32), "small": torch.ones(3), "raw": [b"ab"]}
    body = bytearray(wire.encode(payload))
    out = receive.decode_answer(memoryview(body), wire.MSGPACK)
    body[:] = bytes(len(body))  # the tensors are copies: the body can go
    assert torch.equal(out["x"], payload["x"]) and torch.equal(out["small"], payload["small"])
    assert out["raw"] == [b"ab"] and type(out["raw"][0]) is bytes  # as msgpack.unpackb gives it
    assert pool.idle_bytes == 0
    out["x"].add_(1)  # writable, its own memory
    del out
    gc.collect()
    assert pool.idle_bytes == 2 * MB  # x's memory is back; "small" never came from the pool


def test_a_buffer_dropped_while_its_thread_holds_the_pool_lock_is_filed_later():
    # __del__ can run inside take() (a collection started by an allocation there): give_back must
    # not wait for the lock its own thread holds.
    pool = ReceivePool(64 * MB)
    held = [pool.take(2 * MB)]

    def drop_under_the_lock() -> None:
        with pool._lock:
            held.clear()
            gc.collect()

    worker = threading.Thread(target=drop_under_the_lock, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive()  # no deadlock
    assert pool.idle_bytes == 2 * MB  # filed by the next holder of the lock
    again = pool.take(2 * MB)
    assert pool.reused == 1 and pool.idle_bytes == 0 and again.nbytes == 2 * MB


@pytest.mark.parametrize("writable", [True, False])
def test_a_large_tensor_decodes_exactly_from_a_writable_or_readonly_body(writable):
    # Above wire.PARALLEL_COPY_BYTES a writable body is copied by torch's threads, a read-only
    # one (bytes) by numpy: the same bytes either way.
    x = torch.randn(3 * MB // 2)  # 6 MB of float32
    assert x.nbytes > wire.PARALLEL_COPY_BYTES
    encoded = wire.encode({"x": x})
    body = memoryview(bytearray(encoded)) if writable else encoded
    out = receive.decode_answer(body, wire.MSGPACK)
    assert torch.equal(out["x"], x)
