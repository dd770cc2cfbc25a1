"""``RolloutClient.rollout_stream``: batches ahead of the trainer with bounded staleness.

Through the real app on the tiny SD3 model, with LoRA pushes between batches as a trainer makes
them: staleness never exceeds ``max_staleness``, every batch has one version (and each output one),
stale batches are dropped or regenerated and counted, and closing the stream leaves nothing queued
or waiting on the server. The mixed-version rule is checked on a scripted client (a real server
runs one request's outputs under one version, so it cannot be made to mix on purpose).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from diffusion_rollout.client import RolloutClient, RolloutStream
from diffusion_rollout.errors import RequestAbortedError
from tests.reliability_helpers import wait_until
from tests.server.weights.test_lora import adapter, load_bytes

REQUEST = {"width": 32, "height": 32, "num_inference_steps": 2, "max_sequence_length": 16}


def make_batch(i: int) -> list[dict]:
    return [{"prompt": f"prompt {i}", "seed": 100 * i + j} for j in range(2)]


def push(srv, stream: RolloutStream, version: str, tensors_seed: int = 4) -> None:
    cfg, tensors = adapter("default", seed=tensors_seed)
    load_bytes(srv, "default", tensors, cfg, activate="true", weight_version=version)
    stream.pushed(version)


def uniform_version(batch) -> None:
    versions = {str(o.weight_version) for outs in batch.outputs for o in outs}
    assert versions == {str(batch.weight_version)}, versions


@pytest.mark.parametrize("k", [0, 1, 2])
def test_staleness_never_exceeds_k_and_pushes_land_between_batches(fresh_server, k):
    srv = fresh_server("sd3")
    client = RolloutClient("http://testserver", http_client=srv.client)
    seen = []
    with client.rollout_stream(make_batch, max_staleness=k, max_batches=5, **REQUEST) as stream:
        for it, batch in enumerate(stream):
            assert batch.index == it and len(batch.outputs) == 2
            assert 0 <= batch.staleness <= k
            uniform_version(batch)
            seen.append(batch.staleness)
            push(srv, stream, f"v{it + 1}", tensors_seed=it)
    assert stream.stats.yielded == 5 and stream.stats.dropped == stream.stats.regenerated == 0
    assert sum(stream.stats.staleness.values()) == 5 and max(stream.stats.staleness) <= k
    if k == 0:
        assert seen == [0] * 5  # synchronous: each batch is requested after the last push
    assert srv.engine.worker.depth == 0


def _let_in_flight_finish(stream: RolloutStream) -> None:
    wait_until(lambda: all(f.done() for b in stream._in_flight for f in b.futures), 30, "in-flight batches")


@pytest.mark.parametrize("on_stale", ["drop", "regenerate"])
def test_stale_batches_are_dropped_or_regenerated_and_counted(fresh_server, on_stale):
    """Depth 1 with max_staleness 0: the batch made ahead is one push behind when its turn comes."""
    srv = fresh_server("sd3")
    client = RolloutClient("http://testserver", http_client=srv.client)
    got = []
    stream = client.rollout_stream(
        make_batch, max_staleness=0, depth=1, on_stale=on_stale, max_batches=4, **REQUEST
    )
    with stream:
        for it, batch in enumerate(stream):
            assert batch.staleness == 0
            uniform_version(batch)
            assert str(batch.weight_version) == stream.latest_version
            got.append((batch.index, batch.attempts))
            _let_in_flight_finish(stream)  # the next batch is made under the version before the push
            push(srv, stream, f"v{it + 1}", tensors_seed=it)
    if on_stale == "drop":
        assert got == [(0, 1), (2, 1)]  # 1 and 3 were made one version behind
        assert stream.stats.dropped == 2 and stream.stats.regenerated == 0
    else:
        assert got == [(0, 1), (1, 2), (2, 2), (3, 2)]
        assert stream.stats.regenerated == 3 and stream.stats.dropped == 0
    assert stream.stats.yielded == len(got) and stream.stats.staleness == {0: len(got)}


def test_closing_the_stream_aborts_queued_and_waiting_requests(fresh_server):
    srv = fresh_server("sd3")
    worker = srv.engine.worker
    client = RolloutClient("http://testserver", http_client=srv.client)
    errors: list = []

    def consume(stream: RolloutStream) -> None:
        try:
            next(stream)
        except (RequestAbortedError, StopIteration) as exc:
            errors.append(exc)

    # Queued: the worker is paused, three batches (the one awaited and two ahead) sit in its queue.
    worker.pause()
    stream = client.rollout_stream(make_batch, max_staleness=2, **REQUEST)
    t = threading.Thread(target=consume, args=(stream,))
    t.start()
    wait_until(lambda: worker.depth == 6, 30, "three batches of two requests to be queued")
    stream.close()
    t.join(30)
    assert worker.depth == 0 and stream.stats.aborted == 6 and len(errors) == 1
    worker.resume()
    assert srv.client.get("/server_info").json()["queue_depth"] == 0
    assert worker.batches_run == 0  # nothing the stream sent ever ran

    # Waiting: the trainer announced a version the server never got; requests wait for it.
    stream = client.rollout_stream(make_batch, max_staleness=1, **REQUEST)
    stream.pushed("not-yet")
    t = threading.Thread(target=consume, args=(stream,))
    t.start()
    waits = srv.engine.version_gate.waiting_requests
    wait_until(lambda: len(waits()) == 4, 30, "two batches to wait for their version")
    stream.close()
    t.join(30)
    assert not waits() and worker.depth == 0 and stream.stats.aborted == 4
    cfg, tensors = adapter("default", seed=4)
    load_bytes(srv, "default", tensors, cfg, activate="true", weight_version="not-yet")
    wait_until(lambda: worker.depth == 0 and not worker.busy, 5)
    assert worker.batches_run == 0


class _ScriptedServer:
    """``generate`` answers with versions from a script: request j of batch i gets script[i][j]."""

    def __init__(self, script):
        self.script = script
        self.sent = []

    def model_info(self):
        return {"weight_version": 0}

    def generate(self, **job):
        self.sent.append(job)
        _, _, index, attempt, j = job["rid"].split("-")
        version = self.script[(int(index), int(attempt))][int(j)]
        return [SimpleNamespace(weight_version=version)]

    def abort_request(self, rid):
        raise AssertionError("nothing is in flight")


@pytest.mark.parametrize("on_stale", ["drop", "regenerate"])
def test_a_batch_whose_outputs_carry_different_versions_is_never_yielded(on_stale):
    server = _ScriptedServer({(0, 1): [0, 0], (1, 1): [0, "7"], (1, 2): [0, 0], (2, 1): [0, 0]})
    stream = RolloutStream(server, make_batch, max_staleness=3, on_stale=on_stale, max_batches=3, depth=0)
    with stream:
        got = [(b.index, b.attempts, b.weight_version) for b in stream]
    assert stream.stats.mixed_versions == 1
    if on_stale == "drop":
        assert got == [(0, 1, 0), (2, 1, 0)]
    else:
        assert got == [(0, 1, 0), (1, 2, 0), (2, 1, 0)]
    assert all(job["min_weight_version"] == "0" for job in server.sent)


# --------------------------------------------------------------------------- off-policy correction
def test_tis_loss_against_hand_computed_values():
    import math

    import torch

    from diffusion_rollout.client import clipped_policy_loss, tis_policy_loss

    log_prob = torch.tensor([0.0, 0.1, -0.2], requires_grad=True)
    old = torch.tensor([0.0, 0.0, 0.0])
    behaviour = torch.tensor([0.0, -1.0, 0.5])
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, stats = tis_policy_loss(log_prob, old, behaviour, adv, clip_range=0.05, tis_cap=2.0)
    # w = min(exp(old - behaviour), 2) = [1, min(e, 2) = 2, exp(-0.5)]
    w = [1.0, 2.0, math.exp(-0.5)]
    r = [1.0, math.exp(0.1), math.exp(-0.2)]
    per = [
        max(-1.0 * r[0], -1.0 * 1.0),
        max(2.0 * r[1], 2.0 * 1.05),  # -A r with A = -2
        max(-0.5 * r[2], -0.5 * 0.95),
    ]
    expected = sum(wi * pi for wi, pi in zip(w, per, strict=True)) / 3
    assert abs(float(loss.detach()) - expected) < 1e-6
    assert stats["tis_weight_max"] == 2.0 and abs(stats["tis_capped_frac"] - 1 / 3) < 1e-7
    assert abs(stats["tis_weight_min"] - math.exp(-0.5)) < 1e-6
    loss.backward()  # the weight carries no gradient; the surrogate does
    assert abs(float(log_prob.grad[0]) + 1.0 / 3) < 1e-7  # d/dlp of w * (-A r) at r = 1: -1/3
    # On-policy (old == behaviour): exactly the clipped loss.
    lp = torch.tensor([0.01, -0.02, 0.03])
    on, _ = tis_policy_loss(lp, old, old, adv, clip_range=0.05)
    plain, _ = clipped_policy_loss(lp, old, adv, clip_range=0.05)
    assert torch.equal(on, plain)


def test_ratio_stats_by_staleness_against_hand_computed_values():
    import torch

    from diffusion_rollout.client import ratio_stats_by_staleness

    stats = ratio_stats_by_staleness(
        [
            (0, torch.tensor([1.0, 1.0])),
            (1, torch.tensor([1.5, 0.75])),
            (1, torch.tensor([1.25])),
            (2, torch.tensor([0.5])),
        ]
    )
    assert stats == {
        0: {"count": 2, "mean": 0.0, "min": 0.0, "max": 0.0},
        1: {"count": 3, "mean": 1 / 3, "min": 0.25, "max": 0.5},  # (0.5 + 0.25 + 0.25) / 3
        2: {"count": 1, "mean": 0.5, "min": 0.5, "max": 0.5},
    }
    assert ratio_stats_by_staleness([]) == {}


# --------------------------------------------------------------------------- the asyncio twin
def _async_client(srv):
    import httpx

    from diffusion_rollout.client import AsyncRolloutClient

    return AsyncRolloutClient("http://testserver", transport=httpx.ASGITransport(app=srv.app))


def test_async_stream_bounds_staleness_and_pushes_land_between_batches(fresh_server):
    import asyncio

    srv = fresh_server("sd3")

    async def main():
        seen = []
        async with (
            _async_client(srv) as client,
            client.rollout_stream(make_batch, max_staleness=1, max_batches=4, **REQUEST) as stream,
        ):
            async for batch in stream:
                assert batch.index == len(seen) and len(batch.outputs) == 2
                uniform_version(batch)
                assert batch.sent_at <= batch.answered_at
                seen.append(batch.staleness)
                # The push waits for the batch running on the server: it lands between batches.
                await asyncio.to_thread(push, srv, stream, f"v{len(seen)}", len(seen))
        return seen, stream.stats

    seen, stats = asyncio.run(main())
    assert seen[0] == 0 and all(0 <= s <= 1 for s in seen) and 1 in seen
    assert stats.yielded == 4 and stats.dropped == stats.regenerated == 0
    assert srv.engine.worker.depth == 0


def test_async_stream_closing_aborts_what_is_queued(fresh_server):
    import asyncio

    srv = fresh_server("sd3")
    worker = srv.engine.worker
    worker.pause()

    async def main():
        async with _async_client(srv) as client:
            stream = client.rollout_stream(make_batch, max_staleness=2, **REQUEST)
            waiter = asyncio.ensure_future(stream.__anext__())
            for _ in range(600):
                if worker.depth == 6:
                    break
                await asyncio.sleep(0.05)
            assert worker.depth == 6, "three batches of two requests queued"
            await stream.aclose()
            with pytest.raises((RequestAbortedError, StopAsyncIteration)):
                await waiter
            return stream.stats

    stats = asyncio.run(main())
    assert worker.depth == 0 and stats.aborted == 6
    worker.resume()
    assert worker.batches_run == 0  # nothing the stream sent ever ran
