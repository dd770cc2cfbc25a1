"""The client's msgpack reader (diffusion_rollout/protocol/msgpack_views.py) reads what msgpack.unpackb reads,
with bin payloads left in the body as memoryviews, and refuses what is malformed."""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffusion_rollout.protocol import msgpack_views, wire

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, width=32)
    | st.text(max_size=300)
    | st.binary(max_size=70_000)
)
objects = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=40), inner, max_size=20),
    max_leaves=60,
)


@settings(max_examples=300, deadline=None)
@given(objects, st.booleans())
def test_reads_what_unpackb_reads(obj, single_float):
    body = msgpack.packb(obj, use_bin_type=True, use_single_float=single_float)
    # wire._own_bins turns the views into the bytes unpackb gives (the client's decode does so too).
    assert wire._own_bins(msgpack_views.unpack(body)) == msgpack.unpackb(body, raw=False)


def test_bins_are_views_of_the_body_and_hooks_see_every_map():
    body = bytearray(msgpack.packb({"a": [b"x" * 300, {"b": b"yz"}]}, use_bin_type=True))
    seen = []
    out = msgpack_views.unpack(body, object_hook=lambda d: seen.append(sorted(d)) or d)
    assert isinstance(out["a"][0], memoryview) and out["a"][0].obj is not None
    body[body.index(b"x")] = ord("q")  # a view, not a copy
    assert out["a"][0][0] == ord("q")
    assert seen == [["b"], ["a"]]  # inner maps first, as msgpack's object_hook


def test_single_and_double_floats_and_integer_edges():
    for value in (0.1, -1e300, math.inf, 2**64 - 1, -(2**63), -33, -32, 127, 128):
        assert msgpack_views.unpack(msgpack.packb(value)) == msgpack.unpackb(msgpack.packb(value))


@pytest.mark.parametrize(
    "body, message",
    [
        (msgpack.packb({"a": 1})[:-1], "truncated"),
        (msgpack.packb(b"abc", use_bin_type=True)[:-1], "truncated"),
        (msgpack.packb(1) + b"\x01", "bytes after"),
        (msgpack.packb(msgpack.ExtType(1, b"x")), "unsupported msgpack type"),
        (b"\xc1", "unsupported msgpack type"),
        (msgpack.packb({1: 2}), "map key of type int"),
        (b"\x91" * 300 + b"\xc0", "deeper than"),
        (b"\xa2\xff\xfe", "utf-8"),
    ],
)
def test_malformed_bodies_are_value_errors(body, message):
    with pytest.raises(ValueError, match=message):
        msgpack_views.unpack(body)
    with pytest.raises(wire.WireFormatError, match="not valid msgpack"):
        wire.decode(body, alloc=lambda n: None)
