"""Replicas over a 2-node Ray cluster on one host: placement, a node lost under load, recovery.

Two Ray nodes (``ray.cluster_utils.Cluster``: a head and one worker raylet, each with its own CPUs)
behind the real HTTP app on the tiny SD3 model. With one CPU per node and one CPU per replica the
two replicas must go to different nodes; with two CPUs per node ``--placement`` decides. The last
test runs the documented multi-host commands (docs/scaling.md: ``ray start --head``, ``ray start --address=...``,
``diffusion-rollout serve ... --ray-address auto``) as real processes. Every Ray instance is shut
down by the test that started it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from diffusion_rollout.testing import free_port
from tests.cluster.test_cluster import BODY, assert_same_output, generate, replicas, wait_for

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# A node that dies is declared dead after ~1.5 s instead of Ray's default ~30 s.
FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}
NODE_ARGS = {"object_store_memory": 100 * 2**20}


@contextlib.contextmanager
def two_nodes(cpus_per_node: int):
    """A head and a worker node of ``cpus_per_node`` CPUs each; this process is its driver."""
    import ray
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized(), "another test left Ray running"
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": cpus_per_node,
            "include_dashboard": False,
            "_system_config": FAST_HEALTH_CHECKS,
            **NODE_ARGS,
        },
    )
    try:
        worker = cluster.add_node(num_cpus=cpus_per_node, **NODE_ARGS)
        ray.init(address=cluster.address, log_to_driver=False)
        yield SimpleNamespace(cluster=cluster, head=cluster.head_node, worker=worker, ray=ray)
    finally:
        ray.shutdown()
        cluster.shutdown()


@contextlib.contextmanager
def front(model: Path, **overrides):
    """``ClusterEngine`` over 2 CPU replicas of ``model`` behind the app, stopped on exit."""
    from fastapi.testclient import TestClient

    from diffusion_rollout.cluster import ClusterEngine
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.app import create_app

    config = ServerConfig(
        model=str(model), device="cpu", dtype="float32", replicas=2, gpus_per_replica=0, **overrides
    )
    engine = ClusterEngine(config)
    try:
        engine.start()
        with TestClient(create_app(config, engine=engine)) as client:
            yield engine, client
    finally:
        engine.stop(grace_s=5)


def node_ids(client) -> list[str]:
    return [r["node_id"] for r in replicas(client)]


def test_placement_option_is_validated_and_documented(capsys):
    from pydantic import ValidationError

    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.cli import build_parser, main

    assert ServerConfig().placement is None  # default: Ray's own scheduling, as before
    assert ServerConfig(replicas=2, placement="pack").placement == "pack"
    with pytest.raises(ValidationError, match="set replicas too"):
        ServerConfig(placement="spread")
    with pytest.raises(ValidationError, match="reserve a CPU or a GPU"):
        ServerConfig(replicas=2, placement="spread", cpus_per_replica=0, gpus_per_replica=0)
    with pytest.raises(ValidationError):
        ServerConfig(replicas=2, placement="strict")
    serve = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    text = " ".join(serve.format_help().split())
    assert "--placement {spread,pack}" in text and "'pack' onto as few" in text, text
    with pytest.raises(SystemExit):
        main(["serve", "--placement", "strict"])
    assert "invalid choice: 'strict'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="set replicas too"):
        main(["serve", "--placement", "pack"])


@pytest.mark.slow
def test_placement_spread_and_pack_on_two_nodes(tiny_model_path):
    """Two CPUs per node: both replicas fit on one node, so only --placement decides."""
    model = tiny_model_path("sd3")
    with two_nodes(cpus_per_node=2) as ray_nodes:
        nodes = {ray_nodes.head.node_id, ray_nodes.worker.node_id}
        for placement, spread in (("spread", True), ("pack", False)):
            with front(model, placement=placement) as (engine, client):
                ids = node_ids(client)
                assert set(ids) <= nodes and (ids[0] != ids[1]) == spread, (placement, ids)
                assert all(r["state"] == "serving" for r in replicas(client))
                outs = [generate(client, {**BODY, "seed": s})[0] for s in (1, 2)]
                assert [o["seed"] for o in outs] == [1, 2]
                pg = engine.placement.group
                assert pg is not None and pg.bundle_specs == [{"CPU": 1.0}] * 2
                assert client.get("/server_info").json()["placement"] == placement
            # stop() gave the group back: all 4 CPUs free for the next front.
            wait_for(lambda: ray_nodes.ray.available_resources().get("CPU") == 4.0, 30, "the group's CPUs")


# spread only (the suite's time): a replica Ray restarts without a placement group is what
# tests/cluster/test_cluster.py's replica kills cover; spread adds its bundle moving to a node added back.
@pytest.mark.slow
@pytest.mark.parametrize("placement", ["spread"])
def test_a_node_lost_under_load_loses_no_request_and_the_replica_comes_back(
    tiny_model_path, served, placement
):
    """One CPU per node: the replicas are on both nodes. The worker node is removed while requests
    wait on its replica; every request is answered (the surviving replica runs them again) and the
    replica returns, re-synced, on a node added back (with ``spread``, Ray moves its bundle there)."""
    model = tiny_model_path("sd3")
    # One request per pipeline call, as the single-process reference runs them: bit-identical.
    config = {"max_batch_size": 1, "placement": placement}
    with two_nodes(cpus_per_node=1) as ray_nodes, front(model, **config) as (engine, client):
        cluster, ray = ray_nodes.cluster, ray_nodes.ray
        # (a) placement: one replica per node.
        ids = node_ids(client)
        assert sorted(ids) == sorted([ray_nodes.head.node_id, ray_nodes.worker.node_id]), ids
        victim = engine.replicas[ids.index(ray_nodes.worker.node_id)]
        survivor = engine.replicas[1 - victim.replica_id]

        # (b) the worker node goes while its replica holds requests (paused there, so they surely
        # are in flight on it); the rest of the load runs on the head's replica meanwhile.
        bodies = [{**BODY, "seed": 700 + i} for i in range(8)]
        reference = {b["seed"]: served("sd3").generate(b)[0] for b in bodies}
        ray.get(victim.actor.manager_call.remote("pause_generation", {}))
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            futures = [pool.submit(generate, client, b) for b in bodies]  # each asserts a 200
            wait_for(lambda: victim.load.requests >= 2, 60, "requests queued on the worker node")
            cluster.remove_node(ray_nodes.worker, allow_graceful=False)
            results = [f.result(timeout=120) for f in futures]
        for body, result in zip(bodies, results, strict=True):
            assert len(result) == 1 and result[0]["seed"] == body["seed"]
            assert_same_output(result[0], reference[body["seed"]])
        wait_for(lambda: victim.state != "serving", 30, "the lost replica to leave service")
        assert victim.state in ("restarting", "syncing"), victim.state
        # One node, one CPU: the lost replica cannot come back yet; the survivor serves alone.
        before = survivor.load.served
        assert_same_output(generate(client, BODY)[0], served("sd3").generate(BODY)[0])
        assert survivor.load.served == before + 1
        assert client.get("/health_generate").status_code == 200

        # (c) capacity returns: the replica restarts on the new node and serves again.
        new = cluster.add_node(num_cpus=1, **NODE_ARGS)
        wait_for(lambda: victim.state == "serving", 120, "the replica to restart on the new node")
        info = replicas(client)
        assert [r["state"] for r in info] == ["serving", "serving"]
        assert sorted(r["node_id"] for r in info) == sorted([ray_nodes.head.node_id, new.node_id])
        before = [r["served_requests"] for r in info]
        outs = [generate(client, BODY)[0] for _ in range(2)]
        after = [r["served_requests"] for r in replicas(client)]
        assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]  # both replicas serve
        for out in outs:
            assert_same_output(out, served("sd3").generate(BODY)[0])


# ---------------------------------------------------------------------- the documented commands
DOCS_COMMANDS = [
    "ray get-auth-token --generate",
    "ray start --head --port 6379",
    "RAY_AUTH_MODE=token ray start --address=HEAD_IP:6379",
    "diffusion-rollout serve --model /shared/model --replicas 16 --ray-address auto",
]


def _docs_commands() -> list[str]:
    """The shell lines of the multi-host block of docs/scaling.md (section "Many GPUs and hosts (Ray)")."""
    text = (REPO / "docs" / "scaling.md").read_text()
    section = text.split("## Many GPUs and hosts (Ray)", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line and not line.startswith("#")]


def _command(line: str, env: dict[str, str], subs: dict[str, str], extra: list[str]):
    """``line`` as argv and env: leading ``VAR=value`` words go to the env, the program comes from
    this interpreter's folder (the venv's ``ray`` and ``diffusion-rollout``)."""
    for old, new in subs.items():
        line = line.replace(old, new)
    words = shlex.split(line)
    env = dict(env)
    while "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return [str(BIN / words[0]), *words[1:], *extra], env


def _restore(path: Path, content: bytes | None) -> None:
    if content is None:
        path.unlink(missing_ok=True)
    else:
        path.write_bytes(content)


@pytest.mark.slow
def test_documented_multi_host_commands_run_two_nodes(tiny_model_path, tmp_path):
    """The documented commands, run as they are on one host: the head and the joining node as real
    ``ray start`` processes (one CPU each, so the replicas land on both), then ``serve`` on them.
    Test-only additions: ports, ``--num-cpus 1``, ``--block`` (so the test can end them), the tiny
    model, 2 replicas and a fresh HOME for the token."""
    assert [c for c in _docs_commands() if c.startswith(("ray ", "RAY_", "diffusion-rollout serve"))][1:] == (
        DOCS_COMMANDS
    ), "docs/scaling.md's multi-host commands changed: update DOCS_COMMANDS and this test"
    home = tmp_path / "home"
    home.mkdir()
    gcs_port, http_port = free_port(), free_port()
    current_cluster = (
        Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    )
    current_before = current_cluster.read_bytes() if current_cluster.exists() else None
    env = {
        **os.environ,
        "HOME": str(home),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_DEDUP_LOGS": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    for key in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(key, None)
    subs = {
        "6379": str(gcs_port),
        "HEAD_IP": "127.0.0.1",
        "/shared/model": str(tiny_model_path("sd3")),
        "--replicas 16": "--replicas 2",
    }
    token, head, join, serve = DOCS_COMMANDS
    procs: list[subprocess.Popen] = []
    logs = {name: tmp_path / f"{name}.log" for name in ("head", "join", "serve")}

    def start(name: str, line: str, extra: list[str]) -> subprocess.Popen:
        argv, penv = _command(line, env, subs, extra)
        with open(logs[name], "wb") as log:
            proc = subprocess.Popen(argv, env=penv, stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    def log_tail() -> str:
        return "\n".join(
            f"--- {n}\n{p.read_text(errors='replace')[-3000:]}" for n, p in logs.items() if p.exists()
        )

    def up(name: str) -> bool:
        assert all(p.poll() is None for p in procs), log_tail()
        return "Ray runtime started" in logs[name].read_text(errors="replace")

    try:
        argv, penv = _command(token, env, subs, [])
        subprocess.run(argv, env=penv, check=True, capture_output=True, timeout=60)
        assert (home / ".ray" / "auth_token").stat().st_size > 0
        start("head", head, ["--num-cpus", "1", "--block"])
        wait_for(lambda: up("head"), 60, "ray start --head")
        start("join", join, ["--num-cpus", "1", "--block"])
        wait_for(lambda: up("join"), 60, "ray start --address")
        server = start("serve", serve, ["--port", str(http_port)])
        base = f"http://127.0.0.1:{http_port}"

        def ready() -> bool:
            assert server.poll() is None, log_tail()
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(base + "/health_generate", timeout=5).status_code == 200
            return False

        wait_for(ready, 150, "serve --ray-address auto to be ready")
        with httpx.Client(base_url=base, timeout=60) as client:
            info = client.get("/server_info").json()
            assert info["num_replicas"] == 2
            assert len({r["node_id"] for r in info["replicas"]}) == 2, info["replicas"]  # both nodes
            before = [r["served_requests"] for r in info["replicas"]]
            outs = [generate(client, {**BODY, "seed": s})[0] for s in (1, 2)]
            assert [o["seed"] for o in outs] == [1, 2]
            after = [r["served_requests"] for r in client.get("/server_info").json()["replicas"]]
            assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]  # both nodes serve
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0, log_tail()
    finally:
        for proc in reversed(procs):  # serve, then the joining node, then the head
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=45)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        # `ray start --head` leaves its address in the shared temp dir, and a later plain
        # `ray.init()` (other tests) would try to join that dead cluster: put the file back.
        _restore(current_cluster, current_before)
