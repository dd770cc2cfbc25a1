"""A compiled server remembers the request shapes it served in its compile cache, and the next start
warms them before ready (server/speed/served_shapes.py).

Units (the fast path): the file is written once per new shape, privately and atomically, bounded to
the most recent shapes; a corrupt, oversized, group-writable, linked or foreign-owned file is ignored
with a warning; ``--warmup-shapes`` wins over the remembered shapes and
``--no-warmup-remembered-shapes`` turns them off; a remembered shape whose warm-up fails is skipped
and forgotten; the precompiled blocks capture, while loaded, the kinds of call they have no artifact
for. Integration (slow): two real ``serve --speed fast`` processes on one ``--compile-cache``, neither
given ``--warmup-shapes``: the first serves a 48x32 request, the second warms 48x32 before ready,
answers it without compiling and saves its precompiled blocks once idle after ready
(server/speed/idle_save.py), and a third loads them all. Units of that put-off save: a weight change
drops it, released memory and a busy worker delay it.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from diffusion_rollout.config import ServerConfig
from diffusion_rollout.errors import RequestError
from diffusion_rollout.server.speed import served_shapes
from diffusion_rollout.server.speed.compiled_start import CompiledStart
from diffusion_rollout.server.speed.served_shapes import FILE, MAX_SHAPES, ServedShapes
from diffusion_rollout.server.speed.warmup import Shape, Warmup, run_warmup


def _private_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "key"
    folder.mkdir(mode=0o700)
    return folder


def _doc(folder: Path) -> dict:
    return json.loads((folder / FILE).read_text())


# --------------------------------------------------------------------------- the file
def test_each_new_shape_is_written_once_privately_most_recent_first(tmp_path, monkeypatch):
    folder = _private_folder(tmp_path)
    writes = []
    real = served_shapes.write_private
    monkeypatch.setattr(served_shapes, "write_private", lambda p, d: (writes.append(p), real(p, d)))
    shapes = ServedShapes(folder)
    assert shapes.load() == []
    shapes.served((512, 512, None, None))
    shapes.served((512, 512, None, None))  # the same shape again: nothing written
    shapes.served((768, 512, 33, 226))
    assert len(writes) == 2
    doc = _doc(folder)
    assert doc["version"] == 1
    assert [(e["width"], e["height"], e["frames"], e["max_sequence_length"]) for e in doc["shapes"]] == [
        (768, 512, 33, 226),
        (512, 512, None, None),
    ]
    assert stat.S_IMODE(os.stat(folder / FILE).st_mode) == 0o600
    assert [p.name for p in folder.iterdir()] == [FILE]  # no temporary file left behind

    # The next start reads them back, remembered, the most recent first.
    again = ServedShapes(folder)
    loaded = again.load()
    assert loaded == [Shape(768, 512, 33, 226), Shape(512, 512)]
    assert all(s.remembered for s in loaded) and str(loaded[0]) == "768x512x33 (max_sequence_length=226)"
    again.served((512, 512, None, None))  # served by a second process: counted, moved to the front
    first = _doc(folder)["shapes"][0]
    assert (first["width"], first["starts"]) == (512, 2)


def test_the_file_keeps_the_most_recently_served_shapes(tmp_path, monkeypatch):
    folder = _private_folder(tmp_path)
    shapes = ServedShapes(folder)
    clock = iter(range(1000, 2000))
    monkeypatch.setattr(served_shapes.time, "time", lambda: float(next(clock)))
    for i in range(MAX_SHAPES + 3):
        shapes.served((64 * (i + 1), 64, None, None))
    widths = [e["width"] for e in _doc(folder)["shapes"]]
    assert widths == [64 * (i + 1) for i in reversed(range(3, MAX_SHAPES + 3))]
    assert len(ServedShapes(folder).load()) == MAX_SHAPES


@pytest.mark.parametrize(
    "content",
    [
        b"\x00\xffnot json",
        b"[1, 2, 3]",
        json.dumps({"version": 2, "shapes": []}).encode(),
        json.dumps({"version": 1, "shapes": [{"width": -512, "height": 512}]}).encode(),
        json.dumps({"version": 1, "shapes": [{"width": True, "height": 512}]}).encode(),
        json.dumps({"version": 1, "shapes": [{"width": "512", "height": 512}]}).encode(),
        json.dumps({"version": 1, "shapes": [{"width": 10**9, "height": 512}]}).encode(),
        json.dumps({"version": 1, "shapes": [{"width": 512, "height": 512, "frames": 1.5}]}).encode(),
        b" " * (served_shapes.MAX_BYTES + 1),
    ],
    ids=["bytes", "list", "version", "negative", "bool", "string", "huge", "float-frames", "oversized"],
)
def test_a_malformed_file_is_ignored_with_a_warning_and_replaced_later(tmp_path, caplog, content):
    folder = _private_folder(tmp_path)
    (folder / FILE).write_bytes(content)
    os.chmod(folder / FILE, 0o600)
    shapes = ServedShapes(folder)
    with caplog.at_level(logging.WARNING, logger="diffusion_rollout.server.speed.served_shapes"):
        assert shapes.load() == []
    assert shapes.ignored and "ignoring" in caplog.text and str(folder / FILE) in caplog.text
    assert shapes.report()["ignored"] == shapes.ignored
    shapes.served((512, 512, None, None))
    assert [e["width"] for e in _doc(folder)["shapes"]] == [512]


def _valid(folder: Path) -> Path:
    path = folder / FILE
    path.write_text(json.dumps({"version": 1, "shapes": [{"width": 512, "height": 512}]}))
    os.chmod(path, 0o600)
    return path


def test_a_file_others_can_write_or_a_link_is_not_read(tmp_path, caplog):
    folder = _private_folder(tmp_path)
    path = _valid(folder)
    assert ServedShapes(folder).load() == [Shape(512, 512)]
    os.chmod(path, 0o666)
    shapes = ServedShapes(folder)
    with caplog.at_level(logging.WARNING):
        assert shapes.load() == []
    assert "writable by group or others" in shapes.ignored
    os.chmod(path, 0o600)
    path.rename(folder / "elsewhere.json")
    path.symlink_to(folder / "elsewhere.json")
    shapes = ServedShapes(folder)
    assert shapes.load() == [] and "link" in shapes.ignored
    shapes.served((256, 256, None, None))  # the link is replaced, never written through
    assert (
        not path.is_symlink()
        and json.loads((folder / "elsewhere.json").read_text())["shapes"][0]["width"] == 512
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_of_another_user_is_not_read(tmp_path):
    folder = _private_folder(tmp_path)
    path = _valid(folder)
    os.chown(path, 4242, 4242)
    shapes = ServedShapes(folder)
    assert shapes.load() == [] and "owned by uid 4242" in shapes.ignored


def test_a_refused_cache_neither_reads_nor_records_shapes(tmp_path):
    root = tmp_path / "cache"
    root.mkdir(mode=0o777)  # writable by others, not sticky: the cache is refused
    os.chmod(root, 0o777)
    start = CompiledStart()
    start.open_cache(ServerConfig(device="cpu", compile_cache=str(root)), None, "cpu", torch.float32)
    try:
        assert start.cache is not None and not start.cache.trusted
        assert start.served is None
        start.note_served(SimpleNamespace(width=64, height=64, num_frames=None, max_sequence_length=None))
        assert not any(p.name == FILE for p in root.rglob("*"))
    finally:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


# --------------------------------------------------------------------------- the warm-up's shapes
def _engine(warmup_shapes: str | None = None, remembered: bool = True) -> SimpleNamespace:
    config = SimpleNamespace(warmup_shapes=warmup_shapes, warmup_remembered_shapes=remembered)
    return SimpleNamespace(config=config, adapter=SimpleNamespace(default_size=lambda: (1024, 1024)))


def _start_with(folder: Path, shapes: list[tuple]) -> CompiledStart:
    writer = ServedShapes(folder)
    for key in reversed(shapes):
        writer.served(key)
    start = CompiledStart()
    start.served = ServedShapes(folder)
    return start


def test_remembered_shapes_are_warmed_after_the_default_unless_warmup_shapes_says_otherwise(tmp_path, caplog):
    folder = _private_folder(tmp_path)
    keys = [(512, 512, None, None), (1024, 1024, None, None), (512, 512, None, 77)]
    with caplog.at_level(logging.INFO, logger="diffusion_rollout.server.speed.compiled_start"):
        shapes = _start_with(folder, keys)._shapes(_engine())
    assert shapes == [Shape(1024, 1024), Shape(512, 512), Shape(512, 512, None, 77)]
    assert [s.remembered for s in shapes] == [False, True, True]
    assert "also the 2 shape(s) earlier starts served" in caplog.text and "512x512" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="diffusion_rollout.server.speed.compiled_start"):
        assert _start_with(folder, [])._shapes(_engine("768x768")) == [Shape(768, 768)]
    assert "--warmup-shapes given" in caplog.text
    assert _start_with(folder, [])._shapes(_engine("none")) == []
    with caplog.at_level(logging.INFO, logger="diffusion_rollout.server.speed.compiled_start"):
        assert _start_with(folder, [])._shapes(_engine(remembered=False)) == [Shape(1024, 1024)]
    assert "--no-warmup-remembered-shapes" in caplog.text
    assert CompiledStart()._shapes(_engine()) == [Shape(1024, 1024)]  # no compile cache


def test_the_option_is_on_by_default_and_can_be_turned_off():
    assert ServerConfig(device="cpu").warmup_remembered_shapes is True
    assert ServerConfig(device="cpu", warmup_remembered_shapes=False).warmup_remembered_shapes is False
    help_text = ServerConfig.model_fields["warmup_remembered_shapes"].description
    assert "served_shapes.json" in help_text and "off: the default size only" in help_text


class _FakeEngine:
    """Enough of an engine for ``run_warmup``: plans refuse one width, the worker runs nothing."""

    def __init__(self, refuse_width: int) -> None:
        self.refuse_width = refuse_width
        self.adapter = SimpleNamespace(is_video=False, image_inputs=False)
        self.loaded = SimpleNamespace(speed=SimpleNamespace(compile_stats=None))
        self.planned: list[tuple[int, int, int | None]] = []
        done = SimpleNamespace(result=lambda: None)
        self.worker = SimpleNamespace(submit=lambda job: done)

    def plan(self, params):
        if params.width == self.refuse_width:
            raise RequestError(f"width={params.width} exceeds max_width")
        self.planned.append((params.width, params.num_outputs_per_prompt, params.max_sequence_length))
        call = SimpleNamespace(width=params.width, height=params.height, num_frames=None,
                               max_sequence_length=params.max_sequence_length)  # fmt: skip
        return SimpleNamespace(call=call, job=lambda request_id: None)


def test_a_remembered_shape_that_fails_is_skipped_and_forgotten(tmp_path, caplog):
    folder = _private_folder(tmp_path)
    start = _start_with(folder, [(4096, 512, None, None), (512, 512, None, 77)])
    engine = _FakeEngine(refuse_width=4096)
    shapes = start._shapes(_engine())
    warmup = Warmup(shapes=shapes, batches=[2, 1])
    with caplog.at_level(logging.WARNING):
        warmed = run_warmup(engine, warmup)
    assert engine.planned == [(1024, 2, None), (1024, 1, None), (512, 2, 77), (512, 1, 77)]
    assert warmed == {(1024, 1024, None, None), (512, 512, None, 77)}
    assert warmup.done == warmup.total == 6 and warmup.state == "done"
    assert warmup.report()["skipped"][0]["shape"] == "4096x512" and "max_width" in caplog.text
    assert warmup.report()["remembered_shapes"] == ["4096x512", "512x512 (max_sequence_length=77)"]
    start.served.forget([s for s in shapes if str(s) == "4096x512"])
    assert [e["width"] for e in _doc(folder)["shapes"]] == [512]
    # A shape the operator asked for still fails the start.
    with pytest.raises(RequestError):
        run_warmup(_FakeEngine(refuse_width=4096), Warmup(shapes=[Shape(4096, 512)], batches=[1]))


# --------------------------------------------------------------------------- precompiled blocks
def test_loaded_precompiled_blocks_still_capture_the_calls_they_have_no_artifact_for(tmp_path):
    from diffusion_rollout.server.speed.precompiled_blocks import (
        PrecompiledBlocks,
        call_signature,
        structure_digest,
    )

    block = torch.nn.Linear(4, 4)
    block._compiled_call_impl = block.forward  # as compile_block leaves it, minus the compile
    blocks = PrecompiledBlocks(tmp_path / "blocks")
    blocks.attach([block])
    known = torch.zeros(2, 3, 4)
    ran = []
    key = (structure_digest(block), call_signature((known,), {}))
    blocks._table[key] = lambda b, x: ran.append(x.shape) or b.forward(x)
    blocks.active, blocks.loaded, blocks._examples = True, 1, {}  # as load() leaves them
    with torch.no_grad():
        block(torch.zeros(3, 3, 4))  # the same kind (batch >= 2): the artifact serves it
        assert blocks.captured() == 0 and ran == [torch.Size([3, 3, 4])]
        block(torch.zeros(2, 5, 4))  # a new shape: the ordinary path, captured for the save
    assert blocks.captured() == 1 and len(ran) == 1
    blocks.stop_capture()
    assert blocks.captured() == 0


def _captured_blocks(tmp_path):
    from diffusion_rollout.server.speed.precompiled_blocks import PrecompiledBlocks

    block = torch.nn.Linear(4, 4)
    block._compiled_call_impl = block.forward
    blocks = PrecompiledBlocks(tmp_path / "blocks")
    blocks.attach([block])
    blocks.active, blocks.loaded, blocks._examples = True, 1, {}  # a restart: load() found artifacts
    with torch.no_grad():
        block(torch.zeros(2, 5, 4))
    return block, blocks


def test_a_held_capture_records_nothing_more_and_a_weight_change_drops_its_save(tmp_path, caplog):
    block, blocks = _captured_blocks(tmp_path)
    blocks.hold_capture()  # ready: the captured kind waits for the first idle moment
    with torch.no_grad():
        block(torch.zeros(2, 7, 4))  # served after ready: not captured
    assert blocks.captured() == 1 and blocks.save_pending
    assert blocks.report()["save"].startswith("pending")
    with caplog.at_level(logging.INFO, logger="diffusion_rollout"):
        blocks.turn_off("the weights changed")
    assert not blocks.save_pending and blocks.captured() == 0 and blocks.not_saved == 1
    assert "save" not in blocks.report() and "1 kind(s) not saved (the weights changed" in caplog.text
    assert blocks.save() == 0 and not (tmp_path / "blocks").exists()  # nothing left to save


class _IdleEngine:
    """What run_when_idle reads of an engine: status, the worker's queue, and an exclusive job."""

    def __init__(self) -> None:
        self.status = "ready"
        self.worker = SimpleNamespace(depth=0, busy=False)
        self.ran: list[float] = []

    def submit_exclusive(self, fn):
        import concurrent.futures

        fut = concurrent.futures.Future()
        fut.set_result(fn())
        return fut


def _wait(cond, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("busy_for_s", [0.0, 1.0])
def test_the_put_off_save_runs_once_the_worker_has_been_idle(monkeypatch, busy_for_s):
    import time

    from diffusion_rollout.server.speed import idle_save

    monkeypatch.setattr(idle_save, "IDLE_S", 0.5)
    monkeypatch.setattr(idle_save, "POLL_S", 0.02)
    engine = _IdleEngine()
    engine.worker.busy = busy_for_s > 0
    t0 = time.monotonic()
    idle_save.run_when_idle(engine, lambda: engine.ran.append(time.monotonic() - t0), lambda: True, "test")
    time.sleep(busy_for_s)
    engine.worker.busy = False
    _wait(lambda: engine.ran)
    assert len(engine.ran) == 1 and engine.ran[0] >= busy_for_s + 0.5  # idle 0.5 s after the last work


@pytest.mark.parametrize("change", ["dropped", "stopping", "released then back"])
def test_the_put_off_save_waits_out_released_memory_and_never_runs_once_dropped_or_stopping(
    monkeypatch, change
):
    import time

    from diffusion_rollout.server.speed import idle_save

    monkeypatch.setattr(idle_save, "IDLE_S", 0.3)
    monkeypatch.setattr(idle_save, "POLL_S", 0.02)
    engine, wanted = _IdleEngine(), [True]
    engine.status = "released" if change == "released then back" else "ready"
    engine.worker.depth = 1  # a queued rollout: not idle yet
    idle_save.run_when_idle(engine, lambda: engine.ran.append(1), lambda: wanted[0], "test")
    if change == "dropped":
        wanted[0] = False
    elif change == "stopping":
        engine.status = "stopping"
    engine.worker.depth = 0
    time.sleep(1.0)
    if change == "released then back":
        assert engine.ran == []  # offloaded weights are not idle time
        engine.status = "ready"
        _wait(lambda: engine.ran)
        assert engine.ran == [1]
    else:
        assert engine.ran == []


# --------------------------------------------------------------------------- two real servers
@pytest.mark.slow
def test_a_restart_warms_the_shape_the_last_process_served(tiny_model_path, tmp_path):
    """Neither server is given ``--warmup-shapes``: the first warms the default size and serves a
    48x32 request (a foreground compile); the second warms the default and 48x32 before ready, and its
    48x32 request compiles nothing."""
    from tests.server.speed.test_compile_warmup import ServeProcess

    model, cache = tiny_model_path("sd3"), tmp_path / "compile-cache"
    body = {"prompt": "a red square", "seed": 1, "num_outputs_per_prompt": 2, "width": 48, "height": 32,
            "num_inference_steps": 2, "guidance_scale": 4.5, "return_generated_output": False}  # fmt: skip

    def generate(server: ServeProcess) -> None:
        r = httpx.post(server.base + "/rollout/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text[:2000]

    first = ServeProcess(model, cache, tmp_path / "serve-0.log", warmup_shapes=None)
    try:
        info = first.info()["speed"]["compile"]
        default = info["warmup"]["shapes"]
        assert "48x32" not in default and info["warmup"]["remembered_shapes"] == []
        generate(first)
        info = first.info()["speed"]["compile"]
        assert info["recompiles"] > 0  # compiled in the foreground
        path = Path(info["served_shapes"]["file"])
        assert info["served_shapes"]["shapes"] == ["48x32"]
    finally:
        first.stop()
    assert path.parent == Path(info["cache"]["folder"]) and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [(e["width"], e["height"]) for e in json.loads(path.read_text())["shapes"]] == [(48, 32)]

    second = ServeProcess(model, cache, tmp_path / "serve-1.log", warmup_shapes=None)
    try:
        warm = second.info()["speed"]["compile"]
        assert warm["warmup"]["shapes"] == [*default, "48x32"], warm["warmup"]
        assert warm["warmup"]["remembered_shapes"] == ["48x32"]
        assert "also the 1 shape(s) earlier starts served" in second.log.read_text()
        # Its 48x32 blocks had no artifact: the save waited for ready and then for the idle server.
        pre = warm["precompiled"]
        assert pre["loaded"] > 0 and pre["saved"] == 0, pre
        generate(second)
        assert second.info()["speed"]["compile"]["recompiles"] == 0
        deadline = time.monotonic() + 120
        while "save" in (pre := second.info()["speed"]["compile"]["precompiled"]):  # until saved
            assert time.monotonic() < deadline, pre
            time.sleep(0.5)
        assert pre["saved"] > 0 and pre["not_saved"] == 0 and pre["save_s"] > 0, pre
        log = second.log.read_text()
        assert (
            log.index("engine ready") < log.index("the server has been idle") < log.index("artifact(s) saved")
        )
    finally:
        second.stop()

    third = ServeProcess(model, cache, tmp_path / "serve-2.log", warmup_shapes=None)
    try:
        info = third.info()["speed"]["compile"]
        assert info["precompiled"]["loaded"] == pre["loaded"] + pre["saved"], info["precompiled"]
        assert info["precompiled"]["saved"] == 0 and "save" not in info["precompiled"]  # nothing left to save
        generate(third)
        assert third.info()["speed"]["compile"]["recompiles"] == 0
    finally:
        third.stop()
