"""Every CPU-testable weight transport through the one interface: prepare, then commit or rollback.

The phases are driven directly on a started engine's ``WeightTransactions`` (what a cluster replica
calls), on the real tiny SD3 model: prepare then commit lands exactly the trainer's tensors and the
version; prepare then rollback (before or after the commit) leaves every tensor bit-identical; a
prepare that fails changes nothing and leaves nothing staged.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch
from safetensors.torch import save, save_file

from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.server.weights import TRANSPORTS, get_weight_manager
from diffusion_rollout.server.weights.transports import Staged, WeightTransport
from diffusion_rollout.testing import free_port
from tests.conftest import ServedModel
from tests.server.weights.test_weights_distributed import TRAINER, tensors_of

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def server(tiny_model_path):
    s = ServedModel(tiny_model_path("sd3"), allow_cpu_ipc=True)
    yield s
    s.close()


def run(coro):
    return asyncio.run(coro)


def live(server) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in server.engine.pipe.transformer.state_dict().items()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    differ = [n for n in want if not torch.equal(got[n], want[n])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


def new_weights(server, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: p.detach().float() + 0.05 * torch.randn(p.shape, generator=g)
        for n, p in server.engine.pipe.transformer.named_parameters()
    }


def ipc_entry(pairs) -> str:
    """What SGLang's ``MultiprocessingSerializer`` makes of ``[(name, tensor)]``."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(pairs))
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def request_for(source: str, tensors: dict[str, torch.Tensor], tmp_path: Path) -> tuple[dict, object]:
    """(request, data) that carry ``tensors`` for ``transformer`` through the transport ``source``."""
    if source == "disk":
        folder = tmp_path / f"ckpt-{len(list(tmp_path.iterdir()))}"
        (folder / "transformer").mkdir(parents=True)
        save_file(
            {n: t.contiguous() for n, t in tensors.items()}, folder / "transformer" / "model.safetensors"
        )
        return {"model_path": str(folder), "target_modules": ["transformer"]}, None
    if source == "upload":
        request = {"target_module": "transformer", "weight_version": None, "upload_id": None, "part": None}
        return {**request, "partial": False}, save({n: t.contiguous() for n, t in tensors.items()})
    if source == "tensor":
        entry = ipc_entry((f"transformer.{n}", t) for n, t in tensors.items())
        return {"serialized_named_tensors": [entry], "target_modules": ["transformer"]}, None
    raise AssertionError(source)


CPU_TRANSPORTS = ["disk", "upload", "tensor"]


def test_every_transport_is_behind_the_interface():
    assert set(TRANSPORTS) == {"disk", "upload", "tensor", "distributed"}
    assert all(isinstance(t, WeightTransport) and t.name == n for n, t in TRANSPORTS.items())


@pytest.mark.parametrize("source", CPU_TRANSPORTS)
def test_prepare_then_commit_lands_the_tensors_and_the_version(server, source, tmp_path):
    manager = get_weight_manager(server.engine)
    master = new_weights(server, 1)
    before = live(server)
    request, data = request_for(source, master, tmp_path)
    summary = run(manager.transactions.prepare("t1", source, request, data=data))
    assert "transformer" in summary
    assert_same(live(server), before)  # prepared, not applied
    version = run(manager.transactions.commit("t1", f"{source}-1"))
    manager.transactions.finish("t1")
    assert version == server.engine.weight_version == f"{source}-1"
    after = live(server)
    assert_same({n: after[n] for n in master}, master)
    assert manager.staging.ids() == [] and manager.receive_buffers.stats.abandoned == 0


@pytest.mark.parametrize("source", CPU_TRANSPORTS)
@pytest.mark.parametrize("committed", [False, True], ids=["prepared", "committed"])
def test_rollback_leaves_the_model_bit_identical(server, source, committed, tmp_path):
    manager = get_weight_manager(server.engine)
    before, version, count = live(server), server.engine.weight_version, manager.updates_applied
    request, data = request_for(source, new_weights(server, 2), tmp_path)
    run(manager.transactions.prepare("t2", source, request, data=data))
    if committed:  # a cluster whose other replica failed rolls back an applied update
        run(manager.transactions.commit("t2", "never-kept"))
        assert server.engine.weight_version == "never-kept"
        assert not torch.equal(live(server)["pos_embed.proj.weight"], before["pos_embed.proj.weight"])
    assert run(manager.transactions.rollback("t2")) is committed
    manager.transactions.finish("t2")
    assert_same(live(server), before)
    assert server.engine.weight_version == version and manager.updates_applied == count
    # Nothing of it can be committed afterwards.
    with pytest.raises(WeightUpdateError, match="no prepared update"):
        run(manager.transactions.commit("t2", "late"))
    assert_same(live(server), before)
    assert manager.staging.ids() == [] and manager.receive_buffers.stats.abandoned == 0


def failing_requests(server, source: str, tmp_path: Path) -> list[tuple[dict, object, str]]:
    """(request, data, words of the refusal): one the transport refuses, one the validation refuses."""
    good = new_weights(server, 3)
    ghost = {**good, "ghost.weight": torch.zeros(2, 2)}
    request, data = request_for(source, ghost, tmp_path)
    cases = [(request, data, "ghost.weight")]
    if source == "disk":
        cases.append(
            ({"model_path": str(tmp_path / "nowhere"), "target_modules": ["transformer"]}, None, "folder")
        )
    elif source == "upload":
        _, body = request_for(source, good, tmp_path)
        cases.append((request, body[: len(body) // 2], "upload"))
    else:
        cases.append(({**request, "serialized_named_tensors": ["not base64 pickle!"]}, None, "not base64"))
    return cases


@pytest.mark.parametrize("source", CPU_TRANSPORTS)
def test_a_failing_prepare_changes_nothing(server, source, tmp_path):
    manager = get_weight_manager(server.engine)
    before, version = live(server), server.engine.weight_version
    for i, (request, data, words) in enumerate(failing_requests(server, source, tmp_path)):
        with pytest.raises(WeightUpdateError, match=words):
            run(manager.transactions.prepare(f"bad{i}", source, request, data=data))
        with pytest.raises(WeightUpdateError, match="no prepared update"):
            run(manager.transactions.commit(f"bad{i}", "x"))
        manager.transactions.finish(f"bad{i}")
    assert_same(live(server), before)
    assert server.engine.weight_version == version
    assert manager.staging.ids() == [] and manager.receive_buffers.stats.abandoned == 0


def test_an_unknown_transport_is_refused(server):
    manager = get_weight_manager(server.engine)
    with pytest.raises(WeightUpdateError, match="unknown update source 'carrier-pigeon'"):
        run(manager.transactions.prepare("t", "carrier-pigeon", {}))


def test_a_transport_object_plugs_into_the_same_phases(server):
    """The interface as a new transport sees it: return staged tensors, the rest is shared."""
    manager = get_weight_manager(server.engine)
    master = new_weights(server, 4)
    finished = []

    class InMemory(WeightTransport):
        name = "in-memory"

        async def prepare(self, manager, request, data=None):
            return Staged(
                {"transformer": list(request["tensors"].items())}, on_finish=lambda: finished.append(1)
            )

    out = run(manager.transactions.update(InMemory(), {"tensors": master}, weight_version="mem-1"))
    assert out["success"] and out["weight_version"] == "mem-1" and finished == [1]
    after = live(server)
    assert_same({n: after[n] for n in master}, master)


def test_distributed_transport_prepare_commit_and_rollback(server, tmp_path):
    """The NCCL protocol on gloo: a trainer process broadcasts three announced rounds."""
    manager = get_weight_manager(server.engine)
    params = list(server.engine.pipe.transformer.named_parameters())
    announce = {
        "names": [n for n, _ in params],
        "shapes": [list(p.shape) for _, p in params],
        "dtypes": ["float32"] * len(params),
    }
    rounds = [
        {"seed": 1, **announce},
        {"seed": 2, **announce},
        {"seed": 3, "names": ["ghost.weight"], "shapes": [[3, 3]], "dtypes": ["float32"]},
    ]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"rounds": rounds}))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(spec), str(port)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        run(manager.init_group(
            master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2,
            group_name="trainer_sync", backend="gloo", timeout_s=60,
        ))  # fmt: skip

        def request(r):
            return {**{k: r[k] for k in ("names", "dtypes", "shapes")}, "group_name": "trainer_sync"}

        txns = manager.transactions
        run(txns.prepare("d1", "distributed", request(rounds[0])))
        run(txns.commit("d1", "dist-1"))
        txns.finish("d1")
        committed = live(server)
        sent = dict(tensors_of(rounds[0]))
        assert_same({n: committed[n] for n in sent}, sent)

        run(txns.prepare("d2", "distributed", request(rounds[1])))
        assert run(txns.rollback("d2")) is False
        txns.finish("d2")
        assert_same(live(server), committed)

        with pytest.raises(WeightUpdateError, match=r"ghost\.weight"):
            run(txns.prepare("d3", "distributed", request(rounds[2])))
        assert_same(live(server), committed)
        assert server.engine.weight_version == "dist-1"

        run(manager.destroy_group("trainer_sync"))
        out, _ = trainer.communicate("leave\n", timeout=60)
        assert trainer.returncode == 0, out
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)


def test_the_single_engine_path_gives_upload_buffers_back_to_the_pool(server):
    """``update`` (prepare, commit, finish) drops its views into the receive buffers before it gives
    them back, so the pool keeps them for the next upload instead of deferring them."""
    manager = get_weight_manager(server.engine)
    master = new_weights(server, 5)
    body = save({n: t.contiguous() for n, t in master.items()})
    pool = manager.receive_buffers.stats
    deferred = pool.deferred
    for i in range(2):
        lease = manager.receive_buffers.lease(len(body))
        lease.writable()[:] = memoryview(body)
        out = run(manager.upload_part(lease, target_module="transformer", weight_version=f"pool-{i}"))
        assert out["weight_version"] == f"pool-{i}" and out["upload_id"] == f"pool-{i}"
    assert pool.deferred == deferred and pool.reused >= 1
    after = live(server)
    assert_same({n: after[n] for n in master}, master)


@pytest.mark.parametrize("source", CPU_TRANSPORTS)
def test_the_single_engine_path_refuses_in_its_one_worker_job_and_changes_nothing(server, source, tmp_path):
    """``update`` validates inside the commit's worker job: a refusal there still changes nothing."""
    manager = get_weight_manager(server.engine)
    before, version, count = live(server), server.engine.weight_version, manager.updates_applied
    for request, data, words in failing_requests(server, source, tmp_path):
        with pytest.raises(WeightUpdateError, match=words):
            run(manager.transactions.update(source, request, data=data, weight_version="never"))
    assert_same(live(server), before)
    assert server.engine.weight_version == version and manager.updates_applied == count
    assert manager.staging.ids() == [] and manager.receive_buffers.stats.abandoned == 0
