"""Context parallelism's serving mechanics on the CPU: ``context_parallel=2`` in mirror mode over gloo.

On the CPU diffusers' context parallelism is unavailable, so the follower runs the whole transformer
on every call rank 0 hands it (server/context_parallel.py). That makes the lockstep observable: the
follower must run exactly rank 0's calls, get exactly its outputs (checksums) and hold exactly its
weights after every update, and rank 0's rollouts must equal a one-process server's bit for bit.
The tiny Wan 2.2 model has two experts, so both denoisers are mirrored.
"""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import save

from diffusion_rollout import wire
from diffusion_rollout.config import ServerConfig
from diffusion_rollout.errors import ContextParallelError
from tests.conftest import ServedModel

T = 3
BODY = {
    "prompt": "a red cat",
    "seed": 7,
    "width": 32,
    "height": 32,
    "num_frames": 5,
    "num_inference_steps": T,
    "guidance_scale": 4.0,
    "guidance_scale_2": 3.0,
    "max_sequence_length": 16,
    "rollout_sde_step_indices": [0, 2],
    "rollout_debug_mode": False,
}
# Classifier-free guidance: two transformer calls per step, one request of one output.
CALLS_PER_ROLLOUT = 2 * T


class Servers:
    def __init__(self, path) -> None:
        self.ref = ServedModel(path)
        self.cp = ServedModel(path, context_parallel=2)
        self.closed = False

    def close(self) -> None:
        self.ref.close()
        if not self.closed:
            self.closed = True
            self.cp.close()


@pytest.fixture(scope="module")
def servers(tiny_model_path):
    s = Servers(tiny_model_path("wan2.2"))
    yield s
    s.close()


def group(server):
    return server.engine.context_parallel


def settled_stats(server, timeout_s: float = 30.0) -> dict:
    """The stats once the follower has run every call rank 0 handed it (it runs behind rank 0)."""
    return settled(lambda: server.client.get("/server_info").json()["speed"]["context_parallel"], timeout_s)


def settled(read, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = read()
        (follower,) = stats["followers"]
        if follower["forwards"] == stats["forwards"] or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def both(servers, body=BODY):
    (ref,) = servers.ref.generate(body)
    (cp,) = servers.cp.generate(body)
    return ref, cp


def assert_follower_ran_every_call(server, forwards: int) -> None:
    """Mirror mode after a rollout: the follower ran each of the ``forwards`` calls rank 0 ran, and
    the last one bit for bit (same output checksum, same weights): it got rank 0's inputs and
    weights, not just a call."""
    stats = settled_stats(server)
    (follower,) = stats["followers"]
    assert stats["ranks"] == 2 and stats["mode"] == "mirror" and stats["error"] is None
    assert stats["forwards"] == forwards
    assert follower["forwards"] == stats["forwards"] and follower["alive"]
    assert follower["last_output_checksum"] == stats["last_output_checksum"] != 0.0
    assert follower["weights_digest"] == group(server).weights_digest()


def update_both(servers, body=BODY, seed: int = 3) -> tuple[dict, dict, dict]:
    """The same perturbed transformer pushed to the one-process and the context-parallel server;
    checks that the follower took it (one more sync, rank 0's digest) and that the outputs changed.
    Returns the context-parallel output before the update, and both outputs after it."""
    g = torch.Generator().manual_seed(seed)
    new = {
        n: p.detach() + 0.05 * torch.randn(p.shape, generator=g)
        for n, p in servers.cp.engine.pipe.transformer.named_parameters()
    }
    (old,) = servers.cp.generate(body)
    digest_before = group(servers.cp).weights_digest()
    syncs_before = settled_stats(servers.cp)["followers"][0]["weight_syncs"]
    for srv in (servers.ref, servers.cp):
        r = srv.client.post(
            "/update_weights", content=save(new), headers={"Content-Type": "application/octet-stream"}
        )
        assert r.status_code == 200, r.text
    digest_after = group(servers.cp).weights_digest()
    assert digest_after != digest_before
    ref, cp = both(servers, body)
    assert not torch.equal(cp["generated_output"], old["generated_output"])  # the update mattered
    stats = settled_stats(servers.cp)
    (follower,) = stats["followers"]
    assert follower["weight_syncs"] == syncs_before + 1
    assert follower["weights_digest"] == digest_after
    assert follower["last_output_checksum"] == stats["last_output_checksum"]
    return old, ref, cp


def assert_dead_follower_fails_with_503(server, body=BODY) -> None:
    """Kill the follower: the next rollout is a 503 naming it, and the engine is marked failed."""
    (proc,) = group(server).processes
    proc.kill()
    proc.join(10)
    r = server.client.post("/rollout/generate", json=body)
    assert r.status_code == 503, r.text
    assert "follower" in r.json()["error"]["message"]
    assert server.engine.status == "failed"
    assert server.client.get("/server_info").json()["speed"]["context_parallel"]["error"]


def test_rollouts_equal_one_process_and_the_follower_runs_every_call(servers):
    before = settled_stats(servers.cp)["forwards"]
    ref, cp = both(servers)
    for key in ("generated_output", "rollout_log_probs"):
        assert torch.equal(ref[key], cp[key]), key
    assert cp["exact"] is True  # mirror mode: rank 0 computes alone
    assert_follower_ran_every_call(servers.cp, before + CALLS_PER_ROLLOUT)


def test_a_full_update_reaches_the_follower_before_the_next_rollout(servers):
    _, ref, cp = update_both(servers)
    for key in ("generated_output", "rollout_log_probs"):
        assert torch.equal(ref[key], cp[key]), key


def test_dynamic_lora_and_feature_caches_are_refused_naming_the_field(servers):
    r = servers.cp.client.post("/lora/activate", json={"name": "default"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "context_parallel" in err["message"] and "merged" in err["message"]
    # Merged mode passes that check (and fails only because no such adapter is loaded).
    r = servers.cp.client.post("/lora/activate", json={"name": "default", "mode": "merged"})
    assert r.status_code == 404, r.text
    cache = {"kind": "first_block", "threshold": 0.05}
    r = servers.cp.generate({**BODY, "feature_cache": cache}, expect=400)
    assert "feature_cache" in r.json()["error"]["message"]


def test_memory_release_reaches_the_follower_and_rollouts_match_after_resume(servers):
    """A colocated trainer frees every rank's GPU: the follower moves its denoisers off and back."""
    cp = servers.cp
    r = cp.client.post("/release_memory_occupation", json={})
    assert r.status_code == 200, r.text
    # Answered after the follower met rank 0 past its release: no settling needed.
    (follower,) = cp.client.get("/server_info").json()["speed"]["context_parallel"]["followers"]
    assert follower["released"] is True and follower["alive"]
    r = cp.client.post("/resume_memory_occupation", json={})
    assert r.status_code == 200, r.text
    (follower,) = cp.client.get("/server_info").json()["speed"]["context_parallel"]["followers"]
    assert follower["released"] is False
    ref, out = both(servers)
    for key in ("generated_output", "rollout_log_probs"):
        assert torch.equal(ref[key], out[key]), key
    stats = settled_stats(cp)
    assert stats["followers"][0]["last_output_checksum"] == stats["last_output_checksum"]


def test_stop_ends_the_follower(servers):
    procs = group(servers.cp).processes
    assert all(p.is_alive() for p in procs)
    servers.closed = True
    servers.cp.close()
    assert all(not p.is_alive() and p.exitcode == 0 for p in procs)  # it left on "stop", not terminate()


def test_an_in_memory_pipeline_gets_its_weights_by_sync_and_a_dead_follower_fails_the_engine(servers):
    from fastapi.testclient import TestClient

    servers.close()  # one context-parallel engine per process (it owns the default process group)

    from diffusion_rollout.entrypoints.app import create_app
    from diffusion_rollout.models import build_tiny_pipeline
    from diffusion_rollout.server.engine import Engine
    from diffusion_rollout.server.loader import prepare_pipeline

    # No folder: the follower builds the transformer from its config, with its own random weights,
    # and holds rank 0's only through the start-up sync.
    config = ServerConfig(device="cpu", dtype="float32", context_parallel=2)
    engine = Engine(config, loaded=prepare_pipeline(build_tiny_pipeline("wan", seed=5), device="cpu"))
    engine.start()
    body = {k: v for k, v in BODY.items() if k != "guidance_scale_2"}
    try:
        with TestClient(create_app(config, engine=engine)) as client:
            r = client.post("/rollout/generate", json=body, headers={"Accept": "application/msgpack"})
            assert r.status_code == 200, r.text[:500]
            wire.decode(r.content, r.headers["content-type"])
            (follower,) = settled(engine.context_parallel.stats)["followers"]
            assert follower["weights_digest"] == engine.context_parallel.weights_digest()

            (proc,) = engine.context_parallel.processes
            proc.kill()
            proc.join(10)
            r = client.post("/rollout/generate", json=body)
            assert r.status_code == 503, r.text
            assert "follower" in r.json()["error"]["message"]
            assert engine.status == "failed"
            assert client.get("/server_info").json()["speed"]["context_parallel"]["error"]
    finally:
        engine.stop(grace_s=5)


def test_unsupported_families_and_options_are_refused_naming_the_field(tiny_model_path):
    from diffusion_rollout.server.engine import Engine

    engine = Engine(ServerConfig(model=str(tiny_model_path("sd3")), device="cpu", context_parallel=2))
    with pytest.raises(ContextParallelError, match="context_parallel=2 is not supported for family 'sd3'"):
        engine.load()
    assert engine.context_parallel is None  # refused before any follower was spawned
    # Ring attention is refused before any follower starts (its served rollouts were NaN on 2 GPUs).
    engine = Engine(
        ServerConfig(
            model=str(tiny_model_path("wan")), device="cpu", context_parallel=2, context_parallel_mode="ring"
        )
    )
    with pytest.raises(ContextParallelError, match="context_parallel_mode='ring' is not served"):
        engine.load()
    assert engine.context_parallel is None
    with pytest.raises(ValueError, match="context_parallel=2 cannot be combined with compile"):
        ServerConfig(context_parallel=2, compile=True)
    with pytest.raises(ValueError, match="context_parallel=2 needs gpus_per_replica >= 2"):
        ServerConfig(context_parallel=2, replicas=2, gpus_per_replica=1)


def test_a_ray_replica_runs_its_own_follower(tiny_model_path, served):
    """``--replicas 1 --context-parallel 2``: the replica actor spawns the follower and serves as k = 1."""
    import ray
    from fastapi.testclient import TestClient

    from diffusion_rollout.cluster import ClusterEngine
    from diffusion_rollout.entrypoints.app import create_app

    path = str(tiny_model_path("wan"))
    body = {k: v for k, v in BODY.items() if k != "guidance_scale_2"}
    (ref,) = served("wan").generate(body)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False)
    engine = None
    try:
        config = ServerConfig(
            model=path, device="cpu", dtype="float32", replicas=1, gpus_per_replica=0, context_parallel=2
        )
        engine = ClusterEngine(config)
        engine.start()
        with TestClient(create_app(config, engine=engine)) as client:
            stats = client.get("/server_info").json()["speed"]["context_parallel"]
            assert stats["ranks"] == 2 and stats["mode"] == "mirror"
            assert stats["followers"][0]["alive"]
            r = client.post("/rollout/generate", json=body, headers={"Accept": "application/msgpack"})
            assert r.status_code == 200, r.text[:500]
            (out,) = wire.decode(r.content, r.headers["content-type"])
            for key in ("generated_output", "rollout_log_probs"):
                assert torch.equal(out[key], ref[key]), key
    finally:
        if engine is not None:
            engine.stop(grace_s=5)
        ray.shutdown()
