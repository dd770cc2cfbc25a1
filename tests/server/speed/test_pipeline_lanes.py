"""Pipeline lanes (``pipeline_lanes``): several pipeline calls in flight at once (server/speed/lanes.py).

- The worker: batches of two lanes overlap; an admin job waits for every running batch and blocks
  both lanes while it runs; nothing starts past an admin job queued before it.
- The engine, through the real HTTP app on the CPU: every output of a two-lane server (trajectory,
  log-probs, conditioning, image) is bit-identical to the one-lane server's, both lanes ran, the
  lanes share the modules and own their schedulers; a weight update between lanes' batches lands
  for both; the options that cannot run twice at once are refused.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from pydantic import ValidationError

from diffusion_rollout.config import ServerConfig
from diffusion_rollout.models import FAMILIES, IMAGE_FAMILIES, build_tiny_pipeline
from diffusion_rollout.server.core.worker import Job, Worker
from tests.batch_helpers import generate_together
from tests.client.test_replay import REPLAY
from tests.conftest import ServedModel
from tests.server.families.test_families_ltx2 import BASE as LTX2_BASE
from tests.server.families.test_image_cond import IMAGE_B64, call_defaults
from tests.server.speed.test_speed_options import assert_same_tree

IN_MEMORY = "qwenimage-edit"


# --------------------------------------------------------------------------- the worker
class Recorder:
    """A ``run_batch`` that logs (event, lane, time) and holds each batch until released."""

    def __init__(self, worker_ref: list) -> None:
        self.log: list[tuple[str, int, object]] = []
        self.lock = threading.Lock()
        self.worker_ref = worker_ref
        self.hold = threading.Event()

    def run_batch(self, jobs: list[Job]) -> None:
        lane = self.worker_ref[0].lane_index()
        with self.lock:
            self.log.append(("start", lane, jobs[0].payload))
        assert self.hold.wait(10)
        with self.lock:
            self.log.append(("end", lane, jobs[0].payload))
        for j in jobs:
            j.future.set_result(j.payload)


def _worker(lanes: int):
    ref: list = []
    rec = Recorder(ref)
    w = Worker(rec.run_batch, max_queue_depth=16, max_batch_samples=1, lanes=lanes)
    ref.append(w)
    return w, rec


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_two_lanes_run_two_batches_at_once_and_an_admin_job_waits_for_both():
    w, rec = _worker(2)
    w.start()
    try:
        a = w.submit(Job(payload="a", batch_key="k"))
        b = w.submit(Job(payload="b", batch_key="k"))
        _wait(lambda: len(rec.log) == 2)  # both started before either ended: they overlap
        assert sorted(lane for _, lane, _ in rec.log) == [0, 1]
        seen_during_admin: list[list] = []

        def admin():
            with rec.lock:
                seen_during_admin.append(list(rec.log))
            return "admin"

        adm = w.submit(Job(payload=admin, batch_key=None))
        c = w.submit(Job(payload="c", batch_key="k"))  # queued after the admin job
        time.sleep(0.1)
        assert not adm.done() and not c.done()  # the admin job waits for the running batches
        assert [e for e, _, _ in rec.log] == ["start", "start"]  # and c does not jump ahead of it
        rec.hold.set()
        assert [f.result(10) for f in (a, b, adm, c)] == ["a", "b", "admin", "c"]
        # When the admin job ran, both batches had ended and c had not started.
        assert [(e, p) for e, _, p in seen_during_admin[0]].count(("end", "a")) == 1
        assert all(p != "c" for _, _, p in seen_during_admin[0])
        assert len(seen_during_admin[0]) == 4
        assert sum(w.batches_per_lane) == 3 and w.batches_run == 3
    finally:
        rec.hold.set()
        w.stop(grace_s=5)


def test_no_batch_starts_while_an_admin_job_runs():
    w, rec = _worker(2)
    rec.hold.set()
    inside = threading.Event()
    release = threading.Event()

    def admin():
        inside.set()
        assert release.wait(10)
        return "done"

    w.start()
    try:
        adm = w.submit(Job(payload=admin, batch_key=None))
        assert inside.wait(10)
        later = w.submit(Job(payload="x", batch_key="k"))
        time.sleep(0.1)
        assert rec.log == [] and not later.done()  # the idle lane waits for the admin job
        release.set()
        assert adm.result(10) == "done" and later.result(10) == "x"
    finally:
        release.set()
        w.stop(grace_s=5)


def test_one_lane_is_one_thread_named_as_before():
    w, _ = _worker(1)
    assert [t.name for t in w._threads] == ["rollout-worker"]
    with pytest.raises(ValueError, match="lanes"):
        Worker(lambda jobs: None, max_queue_depth=1, max_batch_samples=1, lanes=0)


# --------------------------------------------------------------------------- the engine
def _bodies(family: str) -> list[dict]:
    # LTX-2's tiny call defaults hold pipeline-only guidance terms; its tests' request fields instead.
    fields = (
        {k: v for k, v in LTX2_BASE.items() if k != "prompt"} if family == "ltx2" else call_defaults(family)
    )
    base = {**fields, **REPLAY, "lean_response": False, "num_outputs_per_prompt": 2}
    if family in IMAGE_FAMILIES:
        base["image_data"] = [IMAGE_B64]
    prompts = ["a red square on a table", "a blue circle", "a red square on a table", "green"]
    return [{**base, "prompt": p, "seed": 100 + 7 * i} for i, p in enumerate(prompts)]


@pytest.mark.parametrize("family", [*FAMILIES, *(f for f in IMAGE_FAMILIES if f != IN_MEMORY)])
def test_two_lanes_give_the_one_lane_outputs_bit_for_bit(served, fresh_server, family):
    two = fresh_server(family, pipeline_lanes=2, max_batch_size=2, batch_wait_ms=0)
    _assert_lanes_match(family, served(family), two)


def test_two_lanes_give_the_one_lane_outputs_for_an_in_memory_model():
    # Qwen-Image-Edit's tiny model cannot be saved here (its processor needs torchvision to save):
    # two engines over two in-memory builds of the same seed, one lane and two.
    one = ServedModel(None, pipeline=build_tiny_pipeline(IN_MEMORY))
    two = ServedModel(
        None, pipeline=build_tiny_pipeline(IN_MEMORY), pipeline_lanes=2, max_batch_size=2, batch_wait_ms=0
    )
    try:
        _assert_lanes_match(IN_MEMORY, one, two)
    finally:
        one.close()
        two.close()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sd3", "flux", "wan", "ltx2", "flux-kontext"])
def test_two_lanes_on_cuda_give_the_one_lane_outputs_bit_for_bit(fresh_server, family):
    # Two CUDA streams at different priorities, encodings shared across them, bf16 kernels.
    cuda = {"device": "cuda", "dtype": "bfloat16", "max_batch_size": 2, "batch_wait_ms": 0}
    _assert_lanes_match(family, fresh_server(family, **cuda), fresh_server(family, pipeline_lanes=2, **cuda))


def _assert_lanes_match(family: str, one, two) -> None:
    """Requests sent to ``two`` (lanes) at once give what ``one`` gives them one by one."""
    bodies = _bodies(family)
    got = generate_together(two, bodies)
    assert all(g is not None for g in got)
    # Both lanes ran batches (four requests of two outputs, at most two outputs per batch).
    lanes = two.client.get("/server_info").json()["speed"]["pipeline_lanes"]
    assert lanes["lanes"] == 2 and all(n > 0 for n in lanes["batches_per_lane"]), lanes
    for body, outs in zip(bodies, got, strict=True):
        ref = one.generate(body)
        for r, o in zip(ref, outs, strict=True):
            for key in ("generated_output", "rollout_log_probs", "dit_trajectory", "denoising_env"):
                assert_same_tree(r[key], o[key])
            assert o["exact"] is True


def test_lanes_share_the_modules_and_own_their_schedulers(fresh_server):
    srv = fresh_server("wan", pipeline_lanes=3)
    lanes = srv.engine._lanes
    assert [lane.index for lane in lanes] == [0, 1, 2] and lanes[0].loaded is srv.engine.loaded
    base = srv.engine.loaded
    for lane in lanes[1:]:
        assert lane.pipe is not base.pipe
        assert lane.pipe.transformer is base.pipe.transformer and lane.pipe.vae is base.pipe.vae
        assert lane.pipe.scheduler is not base.pipe.scheduler
        assert lane.pipe.tokenizer is not base.pipe.tokenizer  # fast tokenizers are not thread-safe
        # Wan swaps in its rollout scheduler per call: each lane has its own.
        assert lane.loaded.rollout_scheduler is not base.rollout_scheduler
        assert lane.adapter.pipe is lane.pipe and lane.adapter.loaded is lane.loaded
        assert dict(lane.pipe.config) == dict(base.pipe.config)


def test_a_weight_update_reaches_every_lane(fresh_server):
    srv = fresh_server("sd3", pipeline_lanes=2, max_batch_size=2, batch_wait_ms=0)
    bodies = _bodies("sd3")
    before = generate_together(srv, bodies)
    r = srv.client.post(
        "/update_weights_from_disk", json={"model_path": str(srv.path), "weight_version": "v2"}
    )
    assert r.status_code == 200, r.text
    same = generate_together(srv, bodies)  # the same weights reloaded: the same bits on every lane
    for b, s in zip(before, same, strict=True):
        for x, y in zip(b, s, strict=True):
            assert torch.equal(x["generated_output"], y["generated_output"])
            assert y["weight_version"] == "v2"
    with torch.no_grad():  # a changed transformer is seen by both lanes' next batches
        srv.engine.pipe.transformer.proj_out.bias.add_(0.5)
    changed = generate_together(srv, bodies)
    assert all(
        not torch.equal(x["generated_output"], y["generated_output"])
        for b, c in zip(before, changed, strict=True)
        for x, y in zip(b, c, strict=True)
    )


def test_feature_cache_is_refused_with_lanes(fresh_server):
    srv = fresh_server("sd3", pipeline_lanes=2)
    body = {**_bodies("sd3")[0], "rollout": False, "feature_cache": {"kind": "taylorseer"}}
    r = srv.generate(body, expect=400)
    assert "feature_cache" in r.text and "pipeline_lanes" in r.text


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"compile": True}, "compile"),
        ({"context_parallel": 2}, "context_parallel"),
        ({"pipeline_lanes": 0}, "pipeline_lanes"),
        ({"pipeline_lanes": 9}, "pipeline_lanes"),
    ],
)
def test_options_that_cannot_run_twice_at_once_are_refused(fields, needle):
    with pytest.raises(ValidationError, match=needle):
        ServerConfig(**{"device": "cpu", "pipeline_lanes": 2, **fields})


def test_the_cli_takes_pipeline_lanes():
    from diffusion_rollout.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--pipeline-lanes", "2"])
    assert args.pipeline_lanes == 2
