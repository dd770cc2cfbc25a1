"""Replicas on Ray behind the same FastAPI app: a local Ray instance, two tiny CPU replicas.

Ray starts once for the module (2 CPUs, a small object store) and is always shut down. The
single-process server of ``conftest.served`` is the reference for bit-identical outputs.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save

from diffusion_rollout.protocol import wire
from diffusion_rollout.protocol.checksums import trainer_weights_checksum
from diffusion_rollout.testing import free_port
from tests.server.weights.test_lora import adapter

REPO = Path(__file__).resolve().parents[2]

BODY = {
    "prompt": "a red square",
    "seed": 11,
    "width": 32,
    "height": 32,
    "max_sequence_length": 16,
    "num_inference_steps": 3,
    "rollout_debug_mode": False,
    "rollout_return_dit_trajectory": True,
}


@pytest.fixture(scope="module")
def cluster(tiny_model_path):
    import ray
    from fastapi.testclient import TestClient

    from diffusion_rollout.cluster import ClusterEngine
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.app import create_app

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False)
    engine = None
    try:
        config = ServerConfig(
            model=str(tiny_model_path("sd3")), device="cpu", dtype="float32", replicas=2, gpus_per_replica=0,
            reward=["jpeg=jpeg_compressibility"],
        )
        engine = ClusterEngine(config)
        engine.start()
        app = create_app(config, engine=engine)
        with TestClient(app) as client:
            yield SimpleNamespace(engine=engine, client=client, ray=ray)
    finally:
        if engine is not None:
            engine.stop(grace_s=5)
        ray.shutdown()


def generate(client, body: dict) -> list[dict]:
    r = client.post("/rollout/generate", json=body, headers={"Accept": "application/msgpack"})
    assert r.status_code == 200, r.text[:2000]
    return wire.decode(r.content, r.headers["content-type"])


def replicas(client) -> list[dict]:
    info = client.get("/server_info").json()
    return info["replicas"]


def checksum(client) -> str:
    r = client.post("/get_weights_checksum", json={"module_names": ["transformer"]})
    assert r.status_code == 200, r.text
    return r.json()["transformer"]


def assert_same_output(a: dict, b: dict) -> None:
    assert torch.equal(a["generated_output"], b["generated_output"])
    assert torch.equal(a["rollout_log_probs"], b["rollout_log_probs"])
    assert torch.equal(a["dit_trajectory"]["latents"], b["dit_trajectory"]["latents"])


def assert_versions_agree(client) -> object:
    info = client.get("/server_info").json()
    versions = {r["weight_version"] for r in info["replicas"]}
    assert versions == {info["weight_version"]}, info["replicas"]
    return info["weight_version"]


def test_single_process_app_does_not_import_ray(tiny_model_path):
    code = (
        "import sys\n"
        "from diffusion_rollout.config import ServerConfig\n"
        "from diffusion_rollout.entrypoints.app import create_app\n"
        f"create_app(ServerConfig(model={str(tiny_model_path('sd3'))!r}, device='cpu'))\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
        "print('no ray')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "no ray" in out.stdout, out.stderr[-2000:]


def test_server_info_lists_replicas(cluster):
    info = cluster.client.get("/server_info").json()
    assert info["weight_update_ranks"] == 2 and info["num_replicas"] == 2
    assert info["placement"] is None and info["replica_upload_urls"] is None  # defaults: no option set
    assert [r["replica_id"] for r in info["replicas"]] == [0, 1]
    assert len({r["pid"] for r in info["replicas"]}) == 2  # two processes
    for r in info["replicas"]:
        assert r["state"] == "serving" and r["status"] == "ready" and r["device"] == "cpu"
        assert r["node"]
    assert cluster.client.get("/health_generate").status_code == 200


def test_outputs_are_bit_identical_to_the_single_process_server(cluster, served):
    [reference] = served("sd3").generate(BODY)
    before = [r["served_requests"] for r in replicas(cluster.client)]
    # Two requests in a row: equal load, so the router alternates and each replica serves one.
    outs = [generate(cluster.client, BODY)[0] for _ in range(2)]
    after = [r["served_requests"] for r in replicas(cluster.client)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]
    for out in outs:
        assert_same_output(out, reference)
        assert out["weight_version"] == reference["weight_version"]


def test_concurrent_rollouts_spread_over_both_replicas(cluster):
    before = [r["served_requests"] for r in replicas(cluster.client)]
    bodies = [{**BODY, "seed": 100 + i, "num_outputs_per_prompt": 2} for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda b: generate(cluster.client, b), bodies))
    assert all(len(r) == 2 for r in results)
    assert [o["seed"] for r in results for o in r] == [100 + i + k for i in range(8) for k in range(2)]
    after = [r["served_requests"] for r in replicas(cluster.client)]
    served_now = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(served_now) == 8 and all(n > 0 for n in served_now), served_now
    text = cluster.client.get("/metrics").text
    assert 'diffusion_rollout_images_total{replica="0"}' in text
    assert 'diffusion_rollout_images_total{replica="1"}' in text
    total = next(line for line in text.splitlines() if line.startswith("diffusion_rollout_images_total "))
    per = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("diffusion_rollout_images_total{replica=")
    ]
    assert float(total.split()[-1]) == sum(per) >= 16


@pytest.mark.slow
def test_a_replica_runs_pipeline_lanes(cluster, tiny_model_path):
    # Beside the module's two replicas (which hold Ray's 2 CPUs), one replica at a time without a
    # CPU reserved: one lane, then two. Both get the same thread settings from Ray, so their outputs
    # compare bit for bit (the single-process server runs with the test process's threads).
    from fastapi.testclient import TestClient

    from diffusion_rollout.cluster import ClusterEngine
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.app import create_app

    bodies = [{**BODY, "seed": 300 + 10 * i, "num_outputs_per_prompt": 2} for i in range(4)]

    def run(lanes: int):
        config = ServerConfig(
            model=str(tiny_model_path("sd3")), device="cpu", dtype="float32", replicas=1, gpus_per_replica=0,
            cpus_per_replica=0, pipeline_lanes=lanes, max_batch_size=2, batch_wait_ms=0,
        )  # fmt: skip
        engine = ClusterEngine(config)
        try:
            engine.start()
            with TestClient(create_app(config, engine=engine)) as client:
                with concurrent.futures.ThreadPoolExecutor(4) as pool:
                    results = list(pool.map(lambda b: generate(client, b), bodies))
                return results, client.get("/server_info").json()["speed"]["pipeline_lanes"]
        finally:
            engine.stop(grace_s=5)

    one, _ = run(1)
    two, lanes = run(2)
    assert lanes["lanes"] == 2 and sum(lanes["batches_per_lane"]) == 4, lanes
    for a, b in zip(one, two, strict=True):
        for x, y in zip(a, b, strict=True):
            assert_same_output(y, x)


def test_replicas_score_rewards_on_their_own(cluster):
    from diffusion_rollout.rewards import jpeg_compressibility

    assert not hasattr(cluster.engine, "rewards")  # the front loads none: each replica scores its own
    assert cluster.client.get("/server_info").json()["rewards"] == {"jpeg": "jpeg_compressibility"}
    body = {**BODY, "num_outputs_per_prompt": 2, "output_dtype": "uint8", "rewards": ["jpeg"]}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: generate(cluster.client, {**body, "seed": 100 + i}), range(4)))
    for outs in answers:
        images = torch.stack([o["generated_output"] for o in outs])
        expected = jpeg_compressibility()(images, [BODY["prompt"]] * 2)
        assert torch.equal(torch.tensor([o["rewards"]["jpeg"] for o in outs]), expected)
    bad = cluster.client.post("/rollout/generate", json={**body, "rewards": ["nope"]})
    assert bad.status_code == 400 and "rewards" in bad.json()["error"]["message"]


def test_full_update_fans_out_all_or_nothing(cluster, served):
    client, engine = cluster.client, cluster.engine
    reference = served("sd3").engine.pipe.transformer  # read only: names and shapes
    params = {n: p.detach().clone() for n, p in reference.named_parameters()}
    start_sum, start_version = checksum(client), assert_versions_agree(client)

    # Refused by validation (a wrong shape): no replica changes.
    name = next(iter(params))
    bad = {name: torch.zeros(3, 3)}
    r = client.post(
        "/update_weights", content=save(bad), headers={"Content-Type": "application/octet-stream"}
    )
    assert r.status_code == 400 and name in r.json()["error"]["message"], r.text
    assert checksum(client) == start_sum and assert_versions_agree(client) == start_version

    # Valid everywhere, but replica 1 fails while copying: replica 0 rolls back too.
    new = {
        n: p + 0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5))
        for n, p in params.items()
    }
    cluster.ray.get(engine.replicas[1].actor.inject_copy_fault.remote())
    r = client.post(
        "/update_weights",
        content=save(new),
        params={"weight_version": "v-fail"},
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 500 and "replica 1" in r.json()["error"]["message"], r.text
    assert checksum(client) == start_sum and assert_versions_agree(client) == start_version

    # Applied on every replica: same bytes everywhere (checksum agreement), same version, and
    # rollouts report it.
    r = client.post(
        "/update_weights",
        content=save(new),
        params={"weight_version": "v-new"},
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 200 and r.json()["weight_version"] == "v-new", r.text
    assert assert_versions_agree(client) == "v-new"
    assert checksum(client) == trainer_weights_checksum(new.items(), torch.float32)
    outs = [generate(client, BODY)[0] for _ in range(2)]
    assert {o["weight_version"] for o in outs} == {"v-new"}
    assert_same_output(outs[0], outs[1])

    # Back to the original weights for the other tests.
    r = client.post(
        "/update_weights", content=save(params), headers={"Content-Type": "application/octet-stream"}
    )
    assert r.status_code == 200, r.text
    assert checksum(client) == start_sum


def test_a_part_cut_short_is_400_and_drops_its_upload_on_every_replica(cluster, served):
    from fastapi.testclient import TestClient

    from diffusion_rollout.entrypoints.app import create_app
    from diffusion_rollout.errors import WeightUpdateError

    client, engine, ray = cluster.client, cluster.engine, cluster.ray
    reference = served("sd3").engine.pipe.transformer
    g = torch.Generator().manual_seed(7)
    new = {n: p.detach() + 0.01 * torch.randn(p.shape, generator=g) for n, p in reference.named_parameters()}
    names = sorted(new)
    first, rest = save({n: new[n] for n in names[:10]}), save({n: new[n] for n in names[10:]})
    start_sum, start_version = checksum(client), assert_versions_agree(client)
    octet = {"Content-Type": "application/octet-stream"}

    def dropped_on_every_replica(upload_id: str, received: int) -> None:
        # Each replica, asked directly, refuses the upload's next part and says why it was dropped.
        kwargs = {"target_module": "transformer", "upload_id": upload_id, "part": 2, "final": False}
        reason = f"upload '{upload_id}' was aborted (part 1 failed: the body ended after {received} of"
        for replica in engine.replicas:
            with pytest.raises(WeightUpdateError, match=re.escape(reason)):
                ray.get(replica.actor.manager_call.remote("upload_part", kwargs, first))

    # Main port: the second part's body is shorter than its Content-Length.
    q = {"upload_id": "cut-route", "part": 0, "final": "false"}
    r = client.post("/update_weights", content=first, params=q, headers=octet)
    assert r.status_code == 200 and r.json()["staged_tensors"] == 10, r.text
    short = len(rest) // 2
    r = client.post(
        "/update_weights",
        content=iter([rest[:short]]),  # streamed: the declared length stands
        params={"upload_id": "cut-route", "part": 1},
        headers={**octet, "Content-Length": str(len(rest))},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_weight_update", r.text
    message = r.json()["error"]["message"]
    assert f"the body ended after {short} of the {len(rest)} bytes" in message
    assert "upload 'cut-route' was dropped, none of its parts will be applied" in message
    dropped_on_every_replica("cut-route", short)

    # Upload port: the client disconnects in the middle of the second part's body.
    app = create_app(engine.config.model_copy(update={"upload_port": 0}), engine=engine)
    with TestClient(app):
        listener = app.state.upload_listener

        def head(length: int, query: str) -> bytes:
            return f"POST /update_weights?{query} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()

        with socket.create_connection(("127.0.0.1", listener.port), timeout=60) as s:
            s.sendall(head(len(first), "upload_id=cut-port&part=0&final=false") + first)
            answer = b""
            while b'"staged_tensors"' not in answer:
                chunk = s.recv(65536)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            s.sendall(head(len(rest), "upload_id=cut-port&part=1") + rest[:100])
        wait_for(lambda: listener.stats.requests == 2, 60, "the cut-short part to be refused")
        assert listener.stats.refused == 1
    dropped_on_every_replica("cut-port", 100)

    assert checksum(client) == start_sum and assert_versions_agree(client) == start_version

    # The trainer's retry under the cut upload's id restarts it on every replica and lands whole.
    from diffusion_rollout.client import RolloutClient
    from diffusion_rollout.client.weights import push_weights

    trainer = RolloutClient("http://testserver", http_client=client)
    push_weights(trainer, new, dtype=torch.float32, upload_id="cut-route", weight_version="retried")
    assert assert_versions_agree(client) == "retried"
    assert checksum(client) == trainer_weights_checksum(new.items(), torch.float32) != start_sum
    original = {n: p.detach() for n, p in reference.named_parameters()}
    r = client.post(
        "/update_weights", content=save(original), params={"weight_version": start_version}, headers=octet
    )
    assert r.status_code == 200 and checksum(client) == start_sum, r.text


def test_checksum_names_the_replica_that_differs(cluster, served):
    client, engine, ray = cluster.client, cluster.engine, cluster.ray
    reference = served("sd3").engine.pipe.transformer
    params = {n: p.detach().clone() for n, p in reference.named_parameters()}
    name = next(iter(params))
    changed = {name: params[name] + 1}
    replica1 = engine.replicas[1].actor
    start = checksum(client)
    # Behind the front's back (an operator's mistake, a fault): replica 1 alone gets new values.
    # (With the front's version, so only the bytes differ.)
    kwargs = {"target_module": "transformer", "partial": True, "weight_version": engine.weight_version}
    ray.get(replica1.manager_call.remote("upload_part", kwargs, save(changed)))
    r = client.post("/get_weights_checksum", json={"module_names": ["transformer"]})
    assert r.status_code == 500 and "replica 1: transformer" in r.json()["error"]["message"], r.text
    ray.get(replica1.manager_call.remote("upload_part", kwargs, save({name: params[name]})))
    assert checksum(client) == start
    assert_versions_agree(client)


def test_too_many_replicas_fail_at_once(cluster, tiny_model_path):
    from diffusion_rollout.cluster import ClusterEngine
    from diffusion_rollout.config import ServerConfig

    config = ServerConfig(model=str(tiny_model_path("sd3")), device="cpu", replicas=8, gpus_per_replica=0)
    with pytest.raises(ValueError, match="8 replicas need CPU 8 but the Ray cluster has CPU 2"):
        ClusterEngine(config).start()


def test_lora_load_and_activate_fan_out(cluster):
    client, engine, ray = cluster.client, cluster.engine, cluster.ray
    import json

    [base] = generate(client, BODY)
    cfg, tensors = adapter("default", seed=4)

    def described() -> list[dict]:
        return ray.get([r.actor.manager_call.remote("describe_lora", {}) for r in engine.replicas])

    # A payload that matches no layer is refused on every replica; nothing changes anywhere.
    version = assert_versions_agree(client)
    ghost = {"nowhere.lora_A.weight": torch.zeros(4, 8), "nowhere.lora_B.weight": torch.zeros(8, 4)}
    r = client.post(
        "/lora/load",
        content=save(ghost, metadata={"peft_config": json.dumps(cfg)}),
        params={"name": "ghost"},
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 400, r.text
    assert assert_versions_agree(client) == version
    assert all("ghost" not in d.get("transformer", {}).get("adapters", {}) for d in described())

    r = client.post(
        "/lora/load",
        content=save(tensors, metadata={"peft_config": json.dumps(cfg)}),
        params={"name": "default", "activate": "true", "weight_version": "lora-1"},
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 200 and r.json()["weight_version"] == "lora-1", r.text
    assert assert_versions_agree(client) == "lora-1"
    d0, d1 = described()
    assert d0 == d1 and d0["transformer"]["active"] == "default"
    outs = [generate(client, BODY)[0] for _ in range(2)]  # one on each replica
    assert_same_output(outs[0], outs[1])
    assert not torch.equal(outs[0]["generated_output"], base["generated_output"])

    r = client.post("/lora/unload", json={"name": "default", "weight_version": "lora-off"})
    assert r.status_code == 200, r.text
    assert assert_versions_agree(client) == "lora-off"
    assert_same_output(generate(client, BODY)[0], base)


def test_lora_change_failing_on_one_replica_rolls_back_every_replica(cluster):
    """A LoRA change that fails on replica 1 while replica 0 applies it: both come back exactly."""
    client, engine, ray = cluster.client, cluster.engine, cluster.ray
    import json

    cfg, tensors = adapter("default", seed=4)
    _, replacement = adapter("default", seed=6)  # same layout: an in-place reload
    _, other = adapter("default", seed=7)

    def load(name: str, body: dict, **params) -> object:
        return client.post(
            "/lora/load",
            content=save(body, metadata={"peft_config": json.dumps(cfg)}),
            params={"name": name, **params},
            headers={"Content-Type": "application/octet-stream"},
        )

    def state() -> tuple:
        described = ray.get([r.actor.manager_call.remote("describe_lora", {}) for r in engine.replicas])
        return described, assert_versions_agree(client), checksum(client)

    def fails_and_rolls_back(send) -> None:
        ray.get(engine.replicas[1].actor.inject_lora_fault.remote())
        r = send()
        error = r.json()["error"]
        assert r.status_code == 500 and "replica 1" in error["message"], r.text
        assert "every replica was rolled back" in error["message"], r.text
        assert state() == before
        assert client.get("/lora").json()["modules"] == before[0][0]

    assert load("default", tensors, activate="true", weight_version="lora-a").status_code == 200
    for mode in ("dynamic", "merged"):
        r = client.post("/lora/activate", json={"name": "default", "mode": mode, "weight_version": mode})
        assert r.status_code == 200, r.text
        before = state()
        assert before[0][0] == before[0][1] and before[0][0]["transformer"]["mode"] == mode
        outs = [generate(client, BODY)[0] for _ in range(2)]  # one on each replica

        fails_and_rolls_back(lambda: load("other", other, activate="true"))  # a new adapter
        fails_and_rolls_back(lambda: load("default", replacement))  # old tensors back bit for bit
        fails_and_rolls_back(lambda: client.post("/lora/activate", json={"name": None, "strength": None}))
        fails_and_rolls_back(lambda: client.post("/lora/activate", json={"name": "default", "strength": 0.5}))
        fails_and_rolls_back(lambda: client.post("/lora/unload", json={"name": "default"}))
        again = [generate(client, BODY)[0] for _ in range(2)]
        for a, b in zip(outs, again, strict=True):
            assert_same_output(a, b)
        assert_same_output(again[0], again[1])

    assert client.post("/lora/unload", json={"name": "default"}).status_code == 200


def test_resync_restores_adapters_exactly(cluster):
    """A replica that lost its adapters takes replica 0's (merged, with a strength) through
    export_state / import_state, as after a restart."""
    client, engine, ray = cluster.client, cluster.engine, cluster.ray
    import json

    cfg, tensors = adapter("default", seed=4)
    r = client.post(
        "/lora/load",
        content=save(tensors, metadata={"peft_config": json.dumps(cfg)}),
        params={"name": "default", "activate": "true", "mode": "merged", "strength": 0.7},
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 200, r.text
    outs = [generate(client, BODY)[0] for _ in range(2)]
    replica0, replica1 = (r.actor for r in engine.replicas)
    kwargs = {"target_module": "transformer", "name": None, "weight_version": engine.weight_version}
    ray.get(replica1.manager_call.remote("unload_lora", kwargs))
    ray.get(replica1.import_state.remote(replica0.export_state.remote([])))
    d0, d1 = ray.get([a.manager_call.remote("describe_lora", {}) for a in (replica0, replica1)])
    assert (
        d0 == d1
        and d0["transformer"]["merged"]
        and d0["transformer"]["adapters"]["default"]["strength"] == 0.7
    )
    checksum(client)  # 500 if the replicas' weights differ
    assert_versions_agree(client)
    for a, b in zip(outs, [generate(client, BODY)[0] for _ in range(2)], strict=True):
        assert_same_output(a, b)
    assert client.post("/lora/unload", json={"name": "default"}).status_code == 200


def test_min_weight_version_routes_to_the_replicas_holding_it(cluster):
    """Replicas at different versions: a request goes only where its min_weight_version is held,
    waits at the front while none holds it (until a fan-out lands) and is 409 when told not to."""
    client, engine, ray = cluster.client, cluster.engine, cluster.ray
    replica0, replica1 = (r.actor for r in engine.replicas)
    front = engine.weight_version
    # Replica 1 alone moves on (an update only it applied), then reports it through /server_info.
    kwargs = {"target_module": "transformer", "name": None, "weight_version": "only-1"}
    ray.get(replica1.manager_call.remote("unload_lora", kwargs))
    assert [r["weight_version"] for r in replicas(client)] == [front, "only-1"]

    newest = {**BODY, "min_weight_version": "only-1", "min_weight_version_wait": False}
    assert [generate(client, newest)[0]["weight_version"] for _ in range(4)] == ["only-1"] * 4
    older = {**BODY, "min_weight_version": front}  # both hold it: least outstanding work alternates
    assert {generate(client, older)[0]["weight_version"] for _ in range(4)} == {front, "only-1"}
    r = client.post(
        "/rollout/generate", json={**BODY, "min_weight_version": "nowhere", "min_weight_version_wait": False}
    )
    assert r.status_code == 409 and "replica 1: 'only-1'" in r.json()["error"]["message"], r.text

    ray.get(replica1.import_state.remote(replica0.export_state.remote([])))  # back in line
    assert [r["weight_version"] for r in replicas(client)] == [front, front]
    results: dict = {}
    waiting = threading.Thread(
        target=lambda: results.setdefault(
            "r", client.post("/rollout/generate", json={**BODY, "min_weight_version": "both-2"})
        )
    )
    waiting.start()
    time.sleep(0.5)
    assert "r" not in results
    assert client.post("/lora/unload", json={"name": None, "weight_version": "both-2"}).status_code == 200
    waiting.join(60)
    assert results["r"].status_code == 200, results["r"].text
    assert (
        wire.decode(results["r"].content, results["r"].headers["content-type"])[0]["weight_version"]
        == "both-2"
    )
    assert assert_versions_agree(client) == "both-2"


def test_gloo_update_group_reaches_both_replicas(cluster, served):
    """The project's WeightBroadcaster as trainer rank 0 (this process); each replica joins."""
    from diffusion_rollout.client import RolloutClient, WeightBroadcaster

    client = cluster.client
    reference = served("sd3").engine.pipe.transformer
    params = {n: p.detach().clone() for n, p in reference.named_parameters()}
    g = torch.Generator().manual_seed(21)
    new = {n: p + 0.01 * torch.randn(p.shape, generator=g) for n, p in params.items()}
    rc = RolloutClient("http://testserver", http_client=client)
    errors: list[BaseException] = []
    result = {}

    def trainer() -> None:
        try:
            with WeightBroadcaster(
                rc, master_address="127.0.0.1", master_port=free_port(), backend="gloo", timeout_s=60
            ) as b:
                assert b.world_size == 3 and b.rank_offsets == [1]
                result["out"] = b.broadcast(new, weight_version="bcast")
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    thread = threading.Thread(target=trainer)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "broadcast hung"
    if errors:
        raise errors[0]
    assert result["out"].weight_version == "bcast"
    assert assert_versions_agree(client) == "bcast"
    assert checksum(client) == trainer_weights_checksum(new.items(), torch.float32)
    # Restore for any later test.
    r = client.post(
        "/update_weights", content=save(params), headers={"Content-Type": "application/octet-stream"}
    )
    assert r.status_code == 200, r.text


def test_abort_and_set_lora_from_tensor_fan_out(cluster):
    # /abort_request reaches the replica holding the request; /set_lora_from_tensor every replica.
    import base64
    import io

    client, engine = cluster.client, cluster.engine
    assert client.post("/pause_generation", json={}).status_code == 200
    box: dict = {}
    try:
        t = threading.Thread(
            target=lambda: box.update(r=client.post("/rollout/generate", json={**BODY, "rid": "tail"}))
        )
        t.start()
        deadline = time.monotonic() + 30
        while True:  # until the front has dispatched it into a replica's queue
            r = client.post("/abort_request", json={"rid": "tail"})
            assert r.status_code == 200, r.text
            if r.json()["dropped"]:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert r.json()["dropped"] == 1 and engine.queue_stats().paused
        t.join(30)
        assert box["r"].status_code == 499 and box["r"].json()["error"]["type"] == "request_aborted"
    finally:
        client.post("/continue_generation")

    _, tensors = adapter("default", seed=4)
    buf = io.BytesIO()
    torch.save(tensors, buf)
    body = {"lora_name": "default", "serialized_tensors": base64.b64encode(buf.getvalue()).decode()}
    r = client.post("/set_lora_from_tensor", json={**body, "weight_version": "tensor-1"})
    assert r.status_code == 200 and r.json()["weight_version"] == "tensor-1", r.text
    assert assert_versions_agree(client) == "tensor-1"
    outs = [generate(client, BODY)[0] for _ in range(2)]  # one on each replica
    assert_same_output(outs[0], outs[1])
    assert client.post("/lora/unload", json={"name": "default"}).status_code == 200


def test_trainer_placed_actors_are_adopted_and_called_without_http(cluster, served, tiny_model_path):
    """A trainer on Ray creates the replica actor itself (its own options) and drives the front
    in-process; the front leaves the actor to its owner when it stops."""
    import asyncio

    from diffusion_rollout.cluster import ClusterEngine, replica_actor_class
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.request_params import to_params
    from diffusion_rollout.protocol.requests import GenerateRequest

    ray = cluster.ray
    config = ServerConfig(
        model=str(tiny_model_path("sd3")), device="cpu", dtype="float32", replicas=1, gpus_per_replica=0
    )
    # Zero CPUs: the module's Ray instance has its two given to the fixture's replicas.
    actor = replica_actor_class(num_gpus=0, num_cpus=0).remote(ClusterEngine(config).replica_config(), 0)
    front = ClusterEngine(config, actors=[actor])
    try:
        front.start()
        params = to_params(GenerateRequest(**BODY), "in-process")
        [out] = asyncio.run(front.generate(params))
        [reference] = served("sd3").generate(BODY)
        assert torch.equal(out.generated_output, reference["generated_output"])
        assert torch.equal(out.rollout_log_probs, reference["rollout_log_probs"])
        [direct] = ray.get(actor.generate.remote(params))
        assert torch.equal(direct.generated_output, reference["generated_output"])
        front.stop(grace_s=1)
        assert ray.get(actor.info.remote())["status"] == "ready"  # still the owner's, still serving
    finally:
        ray.kill(actor)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_a_sigkilled_replica_resyncs_lora_and_full_weights_before_it_serves(cluster, served):
    """Issue #42 item 3. After a LoRA push, then after a full-weight push, one replica's process is
    SIGKILLed while it is idle (the front learns of it only from the next call). Requests sent
    meanwhile, plain or with ``min_weight_version`` (an asynchronous trainer's rollouts in flight),
    are all answered at the front's version; a push made while it restarts reaches it too; it serves
    again only after it copied the peer's state: its outputs equal its peer's bit for bit, and differ
    from the disk weights it reloaded."""
    import json
    import signal

    from diffusion_rollout.entrypoints.request_params import to_params
    from diffusion_rollout.protocol.requests import GenerateRequest

    client, engine, ray = cluster.client, cluster.engine, cluster.ray
    params = to_params(GenerateRequest(**BODY), "in-process")
    [from_disk] = served("sd3").generate(BODY)
    reference = served("sd3").engine.pipe.transformer
    original = {n: p.detach().clone() for n, p in reference.named_parameters()}
    g = torch.Generator().manual_seed(43)
    new = {n: p + 0.01 * torch.randn(p.shape, generator=g) for n, p in original.items()}
    octet = {"Content-Type": "application/octet-stream"}

    def restarted_pid(victim) -> int | None:
        try:
            return ray.get(victim.actor.info.remote(), timeout=10)["pid"]
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None

    def kill_and_check(index: int, version: str, during: tuple[str, Callable[[], Any]]) -> None:
        """SIGKILL replica ``index`` at ``version``; ``during``: (version, push) applied while it restarts."""
        victim, peer = engine.replicas[index], engine.replicas[1 - index]
        assert assert_versions_agree(client) == version
        old_pid = next(r["pid"] for r in replicas(client) if r["replica_id"] == index)
        os.kill(old_pid, signal.SIGKILL)
        wait_for(lambda: not _alive(old_pid), 30, f"replica {index}'s process to die")
        # Ray brings the process back before the front hears of the death: the new process answers
        # calls before the front loaded the model on it or copied any state into it.
        wait_for(lambda: restarted_pid(victim) not in (None, old_pid), 120, f"replica {index}'s new process")
        bodies = [{**BODY, "seed": 700 + i} for i in range(6)]
        bodies = [b if i % 2 else {**b, "min_weight_version": version} for i, b in enumerate(bodies)]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda b: generate(client, b)[0], bodies))
        assert [a["seed"] for a in answers] == [b["seed"] for b in bodies]
        assert {a["weight_version"] for a in answers} == {version}, [a["weight_version"] for a in answers]
        # The front knows of the death now (the replica is restarting or syncing). An asynchronous
        # trainer's next rollouts already wait for the version it pushes meanwhile: they get it,
        # and so must the restarted replica, whichever of the push and its re-sync goes first.
        version, push = during
        ahead = [{**BODY, "seed": 800 + i, "min_weight_version": version} for i in range(3)]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            waiting = [pool.submit(generate, client, b) for b in ahead]
            r = push()
            assert r.status_code == 200 and r.json()["weight_version"] == version, r.text
            assert {f.result(timeout=180)[0]["weight_version"] for f in waiting} == {version}
        wait_for(
            lambda: victim.state == "serving" and victim.info.get("pid") != old_pid,
            180,
            f"replica {index} to be restarted and re-synced",
        )
        assert assert_versions_agree(client) == version
        # Each replica asked directly, one request at a time (same batch shape on both).
        [mine] = ray.get(victim.actor.generate.remote(params))
        [theirs] = ray.get(peer.actor.generate.remote(params))
        assert mine.weight_version == theirs.weight_version == version
        assert torch.equal(mine.generated_output, theirs.generated_output)
        assert torch.equal(mine.rollout_log_probs, theirs.rollout_log_probs)
        assert not torch.equal(mine.generated_output, from_disk["generated_output"])
        outs = [generate(client, BODY)[0] for _ in range(4)]
        assert {o["weight_version"] for o in outs} == {version}
        for o in outs[1:]:
            assert_same_output(outs[0], o)

    def push_lora(seed: int, version: str):
        cfg, tensors = adapter("default", seed=seed)
        return client.post(
            "/lora/load",
            content=save(tensors, metadata={"peft_config": json.dumps(cfg)}),
            params={"name": "default", "activate": "true", "weight_version": version},
            headers=octet,
        )

    def push_full(weights: dict[str, torch.Tensor], version: str):
        return client.post(
            "/update_weights", content=save(weights), params={"weight_version": version}, headers=octet
        )

    assert push_lora(9, "lora-kill").status_code == 200
    kill_and_check(0, "lora-kill", during=("lora-during", lambda: push_lora(10, "lora-during")))

    assert push_full(new, "full-kill").status_code == 200
    newer = {n: p + 0.01 for n, p in new.items()}
    kill_and_check(1, "full-kill", during=("full-during", lambda: push_full(newer, "full-during")))
    # Back to the original weights, without the adapter, for the other tests.
    assert client.post("/lora/unload", json={"name": "default"}).status_code == 200
    r = client.post("/update_weights", content=save(original), headers=octet)
    assert r.status_code == 200, r.text


def test_replica_killed_under_load_is_restarted_and_resynced(cluster, served):
    """Runs last: kills replica 1 while requests run; nothing is lost, nothing mixes versions."""
    client, engine, ray = cluster.client, cluster.engine, cluster.ray
    reference = served("sd3").engine.pipe.transformer
    params = {n: p.detach().clone() for n, p in reference.named_parameters()}
    g = torch.Generator().manual_seed(31)
    new = {n: p + 0.01 * torch.randn(p.shape, generator=g) for n, p in params.items()}
    # An update first, so the restarted replica (which loads the model from disk) must copy it.
    r = client.post(
        "/update_weights",
        content=save(new),
        params={"weight_version": "before-kill"},
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 200, r.text
    expected_sum = checksum(client)
    victim = engine.replicas[1]
    old_pid = victim.info["pid"]
    # An update group formed before the kill: replica 1's restarted process is no member of it.
    from diffusion_rollout.client import RolloutClient, WeightBroadcaster

    group = WeightBroadcaster(
        RolloutClient("http://testserver", http_client=client),
        master_address="127.0.0.1",
        master_port=free_port(),
        backend="gloo",
        timeout_s=60,
    ).init()

    # Replica 1 holds its share of the load in its queue (paused there alone), so the kill surely
    # lands while it has requests in flight; the rest of the load keeps running on replica 0.
    ray.get(victim.actor.manager_call.remote("pause_generation", {}))
    bodies = [{**BODY, "seed": 500 + i} for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(generate, client, b) for b in bodies]
        wait_for(lambda: victim.load.requests >= 2, 60, "requests queued on replica 1")
        ray.kill(victim.actor, no_restart=False)
        results = [f.result(timeout=180) for f in futures]  # none lost, none hung
    assert [r[0]["seed"] for r in results] == [500 + i for i in range(8)]
    assert {r[0]["weight_version"] for r in results} == {"before-kill"}

    wait_for(lambda: victim.state == "serving", 180, "replica 1 to be restarted and re-synced")
    info = replicas(client)
    assert info[1]["pid"] != old_pid and info[1]["state"] == "serving"
    assert assert_versions_agree(client) == "before-kill"
    assert checksum(client) == expected_sum  # replica 1 copied the update from replica 0
    before = [r["served_requests"] for r in info]
    outs = [generate(client, BODY)[0] for _ in range(2)]
    after = [r["served_requests"] for r in replicas(client)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]
    assert_same_output(outs[0], outs[1])

    # A broadcast into the group that lost replica 1 would wait for it until the group's timeout:
    # refused at once, nothing applied; the group can then be destroyed (replica 0 leaves it).
    t0 = time.monotonic()
    r = client.post(
        "/update_weights_from_distributed",
        json={"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": group.group_name},
    )
    assert r.status_code == 503, r.text
    assert "replica 1 restarted since the group was formed" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 10
    assert checksum(client) == expected_sum and assert_versions_agree(client) == "before-kill"
    group.destroy()
