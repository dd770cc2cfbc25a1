"""Same-host answers (answer_segments.py, client/segments.py, entrypoints/segment_answer.py): a
rollout answer written by the server into the client's shared-memory file decodes to the engine's
tensors; the server writes only into a file it may; the client never reuses a file a failed request
named, and cleans up after itself and after killed processes."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys

import httpx
import pytest
import torch

from diffusion_rollout.client import AsyncRolloutClient, RolloutClient, async_client, segments, sync_client
from diffusion_rollout.client.segments import AnswerSegments
from diffusion_rollout.entrypoints.segment_answer import SegmentWriter
from diffusion_rollout.protocol import answer_segments, wire
from tests.protocol.test_wire_stream import assert_outputs_are_the_engines, recorded, rollout_fields  # noqa: F401
from tests.reliability_helpers import live_server

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux /dev/shm")

MB = 1 << 20


@pytest.fixture
def pool(monkeypatch, tmp_path):
    """A private pool for the clients (the tiny model's answers are far below the real minimum)."""
    made = AnswerSegments("auto", 64 * MB)
    monkeypatch.setattr(sync_client, "SEGMENTS", made)
    monkeypatch.setattr(async_client, "SEGMENTS", made)
    monkeypatch.setattr(segments, "MIN_BYTES", 1)
    yield made
    made.clear()


def own_files() -> set[str]:
    prefix = f"{answer_segments.PREFIX}{os.getpid()}-"
    return {n for n in os.listdir(answer_segments.SEGMENT_DIR) if n.startswith(prefix)}


def test_an_answer_written_into_the_clients_file_is_the_engines(fresh_server, recorded, pool):  # noqa: F811
    server = fresh_server("sd3")
    with live_server(server) as (url, _):
        client = RolloutClient(url)
        fields = rollout_fields(output_dtype="uint8")
        first = client.generate("a red square", **fields)  # by the socket: sizes the file
        assert pool.written == 0 and not own_files()
        assert_outputs_are_the_engines(first, recorded[-1])
        for seed in (11, 12):
            outputs = client.generate("a red square", **{**fields, "seed": seed})
            assert_outputs_are_the_engines(outputs, recorded[-1])
        assert pool.written == 2
        files = own_files()
        assert len(files) == 1  # one file, reused by the second and third answers
        kept = outputs[0].generated_output.clone()
        client.generate("a red square", **{**fields, "seed": 13})  # overwrites the file
        assert torch.equal(outputs[0].generated_output, kept)  # decoded tensors never view the file
        assert pool.written == 3 and own_files() == files
        client.close()
    pool.clear()
    assert not own_files()


def test_the_async_client_reads_answers_from_its_file(fresh_server, recorded, pool):  # noqa: F811
    server = fresh_server("sd3")

    async def run(url: str) -> None:
        async with AsyncRolloutClient(url) as client:
            fields = rollout_fields()
            await client.generate("a red square", **fields)
            both = await asyncio.gather(
                client.generate("a red square", **{**fields, "seed": 5}),
                client.generate("a red square", **{**fields, "seed": 6}),
            )
            matched = 0
            for outputs in both:  # the two answers, each in its own file
                for payload in recorded[-2:]:
                    try:
                        assert_outputs_are_the_engines(outputs, payload)
                        matched += 1
                    except AssertionError:
                        continue
            assert matched == 2

    with live_server(server) as (url, _):
        asyncio.run(run(url))
    assert pool.written == 2 and len(own_files()) == 2


def post(
    client: httpx.Client, name: str | None, accept: str = wire.MSGPACK, token: str | None = None
) -> httpx.Response:
    headers = {"Accept": accept} | ({answer_segments.HEADER: name} if name else {})
    headers |= {answer_segments.TOKEN_HEADER: token} if token else {}
    body = {"prompt": "a red square", "seed": 3, **{k: v for k, v in rollout_fields().items() if k != "seed"}}
    r = client.post("/rollout/generate", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r


def same_answer(body: bytes, expected: bytes) -> bool:
    """The same outputs (request ids and timings aside): same length, same tensors."""
    got, want = wire.decode(body), wire.decode(expected)
    return len(body) == len(expected) and all(
        torch.equal(g[k], w[k])
        for g, w in zip(got, want, strict=True)
        for k in ("generated_output", "rollout_log_probs")
    )


def test_the_server_writes_only_into_a_file_it_may(served, tmp_path):
    client = served("sd3").client
    plain = post(client, None)
    assert answer_segments.HEADER not in plain.headers
    length = len(plain.content)
    name = f"{answer_segments.PREFIX}test{os.getpid()}"
    path = os.path.join(answer_segments.SEGMENT_DIR, name)

    def declined(r: httpx.Response, why: str) -> None:
        assert r.headers[answer_segments.HEADER] == answer_segments.DECLINED + why
        assert same_answer(r.content, plain.content)  # the whole answer, in the body

    declined(post(client, "../../" + name), "not a segment name")
    declined(post(client, name), "no such segment on this host")
    target = tmp_path / "target"
    target.write_bytes(b"x" * (length + 10))
    os.symlink(target, path)
    try:
        declined(post(client, name), "no such segment on this host")  # a link is not followed
        assert target.read_bytes() == b"x" * (length + 10)
    finally:
        os.unlink(path)
    with open(path, "wb") as f:
        f.truncate(length - 1)
    try:
        declined(post(client, name), f"segment too small for {length} bytes")
        with open(path, "r+b") as f:
            f.truncate(length + 5)
        declined(post(client, name), "segment does not carry this request's token")
        token = answer_segments.new_token()
        with open(path, "r+b") as f:
            f.write(token.encode())
        declined(
            post(client, name, token=answer_segments.new_token()),
            "segment does not carry this request's token",
        )
        written = post(client, name, token=token)
        assert written.headers[answer_segments.HEADER] == answer_segments.WRITTEN
        assert written.headers[answer_segments.LENGTH_HEADER] == str(length) and written.content == b""
        with open(path, "rb") as f:
            assert same_answer(f.read(length), plain.content)  # the body the socket carries
        as_json = post(client, name, accept=wire.JSON)
        assert answer_segments.HEADER not in as_json.headers and as_json.json()
    finally:
        os.unlink(path)


def test_a_peer_not_on_the_loopback_is_declined(served):
    """Only a caller on the server's host can share a file with it: another host's answer comes in
    the body, whatever file and token it names."""
    from fastapi.testclient import TestClient

    name = f"{answer_segments.PREFIX}test-remote{os.getpid()}"
    path = os.path.join(answer_segments.SEGMENT_DIR, name)
    token = answer_segments.new_token()
    with open(path, "wb") as f:
        f.write(token.encode() + bytes(1 << 20))
    try:
        with TestClient(served("sd3").app, client=("203.0.113.7", 40000)) as remote:
            r = post(remote, name, token=token)
        assert r.headers[answer_segments.HEADER] == answer_segments.DECLINED + "not a loopback peer"
        assert len(r.content) > 0
        with open(path, "rb") as f:
            assert f.read(answer_segments.TOKEN_BYTES) == token.encode()  # untouched
    finally:
        os.unlink(path)


def test_a_server_with_same_host_answers_off_says_so(fresh_server):
    client = fresh_server("sd3", same_host_answers=False).client
    r = post(client, f"{answer_segments.PREFIX}anything")
    assert (
        r.headers[answer_segments.HEADER]
        == answer_segments.DECLINED + "same-host answers are off on this server"
    )


def armed(path, size: int) -> str:
    """A file of ``size`` bytes starting with a fresh token, as the client arms its own; the token."""
    token = answer_segments.new_token()
    path.write_bytes(token.encode() + bytes(size - answer_segments.TOKEN_BYTES))
    return token


def test_the_server_lets_go_of_a_file_the_client_removed(tmp_path):
    writer = SegmentWriter(str(tmp_path))
    names = [f"{answer_segments.PREFIX}{i}" for i in range(2)]
    for name in names:
        token = armed(tmp_path / name, 48)
        assert writer.write(name, [b"abc", memoryview(b"defg")], 7, token) is None
    assert (tmp_path / names[0]).read_bytes()[:7] == b"abcdefg" and writer.kept() == 2
    os.unlink(tmp_path / names[0])
    token = armed(tmp_path / names[1], 48)  # rewritten in place: the kept mapping sees the new token
    assert writer.write(names[1], [b"xy"], 2, token) is None
    assert writer.kept() == 1  # the removed file's mapping went at the next answer
    (tmp_path / names[1]).unlink()
    (tmp_path / names[1]).write_bytes(bytes(4))  # replaced by a smaller file of the same name
    assert writer.write(names[1], [b"12345"], 5, token) == "segment too small for 5 bytes"


def test_the_server_writes_only_into_a_file_carrying_the_requests_token(tmp_path):
    """Another client cannot have an answer written over a trainer's file: it cannot know the token
    the trainer wrote into it for its own request. The file is left untouched."""
    writer = SegmentWriter(str(tmp_path))
    name = f"{answer_segments.PREFIX}victim-7"
    token = armed(tmp_path / name, 64)
    before = (tmp_path / name).read_bytes()
    why = "segment does not carry this request's token"
    for guess in (None, "", answer_segments.new_token(), token[:-1], token.upper(), token + "0"):
        assert writer.write(name, [b"intruder"], 8, guess) == why, guess
    assert (tmp_path / name).read_bytes() == before
    assert writer.write(name, [b"answer"], 6, token) is None  # its owner's request is written
    assert (tmp_path / name).read_bytes()[:6] == b"answer"
    # The answer overwrote the token: the same token cannot be replayed for a second write.
    assert writer.write(name, [b"again"], 5, token) == why


def test_a_file_that_cannot_be_reserved_is_declined_not_written(tmp_path, monkeypatch):
    # A sparse file on a full tmpfs: writing through the mapping would be a SIGBUS in the server.
    name = f"{answer_segments.PREFIX}sparse"
    with open(tmp_path / name, "wb") as f:
        f.truncate(64)

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    writer = SegmentWriter(str(tmp_path))
    assert writer.write(name, [b"abc"], 3, None) == "segment cannot be mapped (No space left on device)"
    assert writer.kept() == 0 and (tmp_path / name).read_bytes() == bytes(64)


def test_a_declining_server_is_not_offered_files_again_and_a_small_file_grows(fresh_server, pool):
    server = fresh_server("sd3")
    with live_server(server) as (url, _):
        client = RolloutClient(url)
        fields = rollout_fields()
        client.generate("a red square", **fields)
        server.app.state.segment_writer = None  # the server stops taking files
        client.generate("a red square", **fields)
        assert pool.status(url) == "same-host answers are off on this server"
        assert not own_files()  # the declined request's file is gone
        client.generate("a red square", **fields)
        assert pool.written == 0 and not own_files()  # no file offered any more
        client.close()


def test_a_file_too_small_for_the_answer_is_replaced_by_a_larger_one(fresh_server, pool, monkeypatch):
    monkeypatch.setattr(segments, "_ROUND", 1024)  # files of whole KiB: the tiny answer can outgrow one
    server = fresh_server("sd3")
    with live_server(server) as (url, _):
        client = RolloutClient(url)
        client.generate("a red square", **rollout_fields())
        length = pool._length[url]
        pool._length[url] = length // 4
        client.generate("a red square", **rollout_fields())  # declined: too small, answered by the socket
        assert pool.written == 0 and pool.status(url) is None and pool._length[url] == length
        assert not own_files()
        client.generate("a red square", **rollout_fields())
        assert pool.written == 1 and len(own_files()) == 1
        client.close()


def test_a_failed_request_drops_its_file(pool):
    pool._length["http://127.0.0.1:1"] = 2 * MB
    with pool.lease("http://127.0.0.1:1") as lease:
        assert lease.headers[answer_segments.HEADER] in own_files()
    assert len(own_files()) == 1  # back among the idle ones
    with pytest.raises(RuntimeError), pool.lease("http://127.0.0.1:1") as again:
        # The idle file, lent again with a fresh token (a token is good for one request only).
        assert again.headers[answer_segments.HEADER] == lease.headers[answer_segments.HEADER]
        assert again.headers[answer_segments.TOKEN_HEADER] != lease.headers[answer_segments.TOKEN_HEADER]
        raise RuntimeError("the request failed")
    assert not own_files()  # the server might still write into it: removed, never reused


def test_files_are_offered_only_to_loopback_servers_unless_asked(monkeypatch):
    auto = AnswerSegments("auto", MB)
    assert auto.offers("http://127.0.0.1:30000") and auto.offers("http://localhost:1")
    assert auto.offers("http://[::1]:1") and not auto.offers("http://10.0.0.2:30000")
    assert not auto.offers("http://testserver")
    assert AnswerSegments("1", MB).offers("http://10.0.0.2:30000")
    assert not AnswerSegments("0", MB).offers("http://127.0.0.1:30000")
    monkeypatch.setenv(segments.ENV, "maybe")
    with pytest.raises(ValueError, match=segments.ENV):
        AnswerSegments.from_env()
    monkeypatch.setenv(segments.ENV, "0")
    monkeypatch.setenv(segments.ENV_MB, "3")
    made = AnswerSegments.from_env()
    assert made.mode == "0" and made.capacity_bytes == 3 * MB


def test_files_of_killed_processes_are_removed_and_a_forked_child_leaves_the_parents(pool):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = os.path.join(answer_segments.SEGMENT_DIR, f"{answer_segments.PREFIX}{dead.stdout.strip()}-0-ab")
    alive = os.path.join(answer_segments.SEGMENT_DIR, f"{answer_segments.PREFIX}{os.getppid()}-0-ab")
    for path in (stale, alive):
        open(path, "wb").close()
    try:
        pool._length["http://127.0.0.1:1"] = MB
        with pool.lease("http://127.0.0.1:1"):
            pass
        assert not os.path.exists(stale) and os.path.exists(alive)
    finally:
        for path in (stale, alive):
            if os.path.exists(path):
                os.unlink(path)
    files = own_files()
    assert len(files) == 1
    child = os.fork()
    if child == 0:  # the child drops its copy of the pool: the parent's file must stay
        pool.clear()
        gc.collect()
        os._exit(0)
    os.waitpid(child, 0)
    assert own_files() == files


def test_a_json_client_offers_no_file_and_a_full_shm_falls_back_to_the_socket(
    fresh_server, pool, monkeypatch
):
    server = fresh_server("sd3")
    with live_server(server) as (url, _):
        as_json = RolloutClient(url, wire_format="json")
        for _ in range(2):
            as_json.generate("a red square", **rollout_fields())
        assert pool.written == 0 and pool.status(url) is None and not own_files()
        as_json.close()

        def full(fd, offset, length):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", full)
        client = RolloutClient(url)
        for _ in range(2):
            outputs = client.generate("a red square", **rollout_fields())
        assert len(outputs) == 2 and pool.written == 0 and not own_files()
        assert "No space left on device" in pool.status(url)  # said once, then no file is tried
        client.close()


def test_a_forked_child_gets_free_locks_even_if_one_was_held_at_the_fork():
    # A DataLoader worker forked while a rollout thread decodes must not inherit a held lock.
    from diffusion_rollout.client import receive

    with segments.SEGMENTS._lock, receive.POOL._lock:
        child = os.fork()
        if child == 0:
            ok = segments.SEGMENTS._lock.acquire(timeout=5) and receive.POOL._lock.acquire(timeout=5)
            os._exit(0 if ok else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
