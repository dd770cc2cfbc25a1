"""Context parallelism's serving mechanics on the CPU: ``context_parallel=4`` (hybrid, 2 Ulysses x
2 ring) in mirror mode over gloo, ``context_parallel=2`` for the in-memory and Ray engines.

On the CPU diffusers' context parallelism is unavailable, so each follower runs the whole transformer
on every call rank 0 hands it (server/parallel/context_parallel.py). That makes the lockstep observable: every
follower must run exactly rank 0's calls, get exactly its outputs (checksums) and hold exactly its
weights after every update, and rank 0's rollouts must equal a one-process server's bit for bit.
The tiny Wan 2.2 model has two experts, so both denoisers are mirrored. The layout rules (which
modes, degrees, dtypes and families are served) are checked without followers at the end.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from safetensors.torch import save

from diffusion_rollout.config import ServerConfig
from diffusion_rollout.errors import ContextParallelError
from diffusion_rollout.protocol import wire
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
    """A one-process server and a context-parallel one (k = 2 Ulysses unless ``layout`` says) on ``path``."""

    def __init__(self, path, **layout) -> None:
        self.ref = ServedModel(path)
        self.cp = ServedModel(path, **(layout or {"context_parallel": 2}))
        self.closed = False

    def close(self) -> None:
        self.ref.close()
        if not self.closed:
            self.closed = True
            self.cp.close()


@pytest.fixture(scope="module")
def servers(tiny_model_path):
    # Four ranks, 2 Ulysses x 2 ring (the tiny Wan's 2 heads allow no more Ulysses ranks): mirror
    # mode runs every layout alike, and three followers show the lockstep is not a pair's. The VAE
    # decode is split: with the VAE's default tiles (256 pixels) the tiny video fits one tile, which
    # is decoded untiled on rank 0, so the rollouts still equal the one-process server's.
    s = Servers(
        tiny_model_path("wan2.2"),
        context_parallel=4,
        context_parallel_mode="hybrid",
        context_parallel_vae="split",
    )
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
        caught_up = all(
            f["forwards"] == stats["forwards"] and f.get("decodes") == stats.get("decodes")
            for f in stats["followers"]
        )
        if caught_up or time.monotonic() > deadline:
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
    ranks = server.config.context_parallel
    assert stats["ranks"] == ranks == len(stats["followers"]) + 1
    assert stats["mode"] == "mirror" and stats["error"] is None
    assert stats["forwards"] == forwards
    for follower in stats["followers"]:
        assert follower["forwards"] == stats["forwards"] and follower["alive"], follower
        assert follower["last_output_checksum"] == stats["last_output_checksum"] != 0.0, follower
        assert follower["weights_digest"] == group(server).weights_digest(), follower


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
    syncs_before = [f["weight_syncs"] for f in settled_stats(servers.cp)["followers"]]
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
    for follower, syncs in zip(stats["followers"], syncs_before, strict=True):
        assert follower["weight_syncs"] == syncs + 1, follower
        assert follower["weights_digest"] == digest_after, follower
        assert follower["last_output_checksum"] == stats["last_output_checksum"], follower
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
    stats = settled_stats(servers.cp)
    layout = (stats["configured_mode"], stats["ring_degree"], stats["ulysses_degree"])
    assert layout == ("hybrid", 2, 2) and len(stats["followers"]) == 3
    assert stats["attention_backend"] is None  # mirror mode shards nothing, so it sets no backend
    before = stats["forwards"]
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
    # Answered after the followers met rank 0 past their release: no settling needed.
    followers = cp.client.get("/server_info").json()["speed"]["context_parallel"]["followers"]
    assert all(f["released"] is True and f["alive"] for f in followers), followers
    r = cp.client.post("/resume_memory_occupation", json={})
    assert r.status_code == 200, r.text
    followers = cp.client.get("/server_info").json()["speed"]["context_parallel"]["followers"]
    assert all(f["released"] is False for f in followers), followers
    ref, out = both(servers)
    for key in ("generated_output", "rollout_log_probs"):
        assert torch.equal(ref[key], out[key]), key
    stats = settled_stats(cp)
    assert all(f["last_output_checksum"] == stats["last_output_checksum"] for f in stats["followers"])


def test_a_split_vae_decode_equals_one_process_tiled_decode_and_each_follower_decodes_a_tile(servers):
    """``context_parallel_vae=split`` with tiles of 24 pixels at a stride of 16: the 32x32 video's 4x4
    latent has 2x2 tiles, one per rank; the served video equals a one-process server whose VAE tiles
    the same way, bit for bit (and not its untiled decode)."""
    from diffusion_rollout.server.parallel.vae_split import TileSettings

    tiles = {"tile_sample_min_height": 24, "tile_sample_min_width": 24,
             "tile_sample_stride_height": 16, "tile_sample_stride_width": 16}  # fmt: skip
    cp_vae, ref_vae = servers.cp.engine.pipe.vae, servers.ref.engine.pipe.vae
    defaults = TileSettings.of(cp_vae)
    (untiled,) = servers.ref.generate(BODY)
    before = settled_stats(servers.cp)
    for name, value in tiles.items():  # rank 0's VAE has tiling off: the split reads the grid only
        setattr(cp_vae, name, value)
    ref_vae.enable_tiling(**tiles)
    try:
        ref, cp = both(servers)
    finally:
        ref_vae.use_tiling = False
        for vae in (cp_vae, ref_vae):
            vae.enable_tiling(
                defaults.min_height, defaults.min_width, defaults.stride_height, defaults.stride_width
            )
            vae.use_tiling = False
    assert torch.equal(ref["generated_output"], cp["generated_output"])
    assert not torch.equal(untiled["generated_output"], cp["generated_output"])  # the tiles mattered
    assert torch.equal(ref["rollout_log_probs"], cp["rollout_log_probs"])
    stats = settled_stats(servers.cp)
    assert stats["vae"] == "split" and stats["decodes"] == before["decodes"] + 1
    for follower, earlier in zip(stats["followers"], before["followers"], strict=True):
        # Followers run behind rank 0 only until the decode's collective, which rank 0 waits for.
        assert follower["decodes"] == earlier["decodes"] + 1, follower
        assert follower["tiles_decoded"] == earlier["tiles_decoded"] + 1, follower


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
    from diffusion_rollout.server.core.engine import Engine
    from diffusion_rollout.server.core.loader import prepare_pipeline

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
    from diffusion_rollout.server.core.engine import Engine

    engine = Engine(ServerConfig(model=str(tiny_model_path("sd3")), device="cpu", context_parallel=2))
    with pytest.raises(ContextParallelError, match="context_parallel=2 is not supported for family 'sd3'"):
        engine.load()
    assert engine.context_parallel is None  # refused before any follower was spawned
    # A layout the model cannot take is refused the same way: Ulysses k = 4 over the tiny Wan's 2 heads.
    engine = Engine(ServerConfig(model=str(tiny_model_path("wan")), device="cpu", context_parallel=4))
    with pytest.raises(ContextParallelError, match=r"num_attention_heads=2; .* divisible by 4"):
        engine.load()
    assert engine.context_parallel is None
    with pytest.raises(ValueError, match="context_parallel=2 cannot be combined with compile"):
        ServerConfig(context_parallel=2, compile=True)
    with pytest.raises(ValueError, match="context_parallel=2 needs gpus_per_replica >= 2"):
        ServerConfig(context_parallel=2, replicas=2, gpus_per_replica=1)


def test_a_split_vae_needs_ranks_and_a_wan_vae_naming_the_field():
    from types import SimpleNamespace

    from diffusers import AutoencoderKL

    from diffusion_rollout.entrypoints.cli import build_parser
    from diffusion_rollout.server.parallel.context_parallel import start_for

    assert ServerConfig().context_parallel_vae == "rank0"
    with pytest.raises(ValueError, match=r"context_parallel_vae=split .* needs context_parallel > 1"):
        ServerConfig(context_parallel_vae="split")
    args = build_parser().parse_args(["serve", "--context-parallel", "2", "--context-parallel-vae", "split"])
    assert args.context_parallel_vae == "split"
    # A family served with context parallelism whose VAE is not Wan's: refused before any follower.
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4)
    engine = SimpleNamespace(
        config=ServerConfig(device="cpu", context_parallel=2, context_parallel_vae="split"),
        adapter=SimpleNamespace(name="ltx2"),
        pipe=SimpleNamespace(vae=vae),
    )
    with pytest.raises(
        ContextParallelError, match=r"context_parallel_vae=split .* family 'ltx2' has AutoencoderKL"
    ):
        start_for(engine)


@pytest.mark.slow
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


def test_the_three_layouts_resolve_their_degrees_and_bad_combinations_name_the_field():
    from diffusion_rollout.entrypoints.cli import build_parser, main

    def degrees(**kw):
        return ServerConfig(device="cpu", **kw).context_parallel_degrees()

    assert degrees(context_parallel=4) == (1, 4)  # ulysses, the default
    assert degrees(context_parallel=4, context_parallel_mode="ring") == (4, 1)
    assert degrees(context_parallel=4, context_parallel_mode="hybrid") == (2, 2)  # ring degree unset = 2
    assert degrees(context_parallel=8, context_parallel_mode="hybrid", context_parallel_ring_degree=4) == (
        4,
        2,
    )
    refused = {
        # hybrid needs 1 < ring degree < k, k a multiple of it
        (2, "hybrid", None): "1 < context_parallel_ring_degree < context_parallel",
        (8, "hybrid", 8): "got context_parallel_ring_degree=8, context_parallel=8",
        (6, "hybrid", 4): "got context_parallel_ring_degree=4, context_parallel=6",
        (4, "hybrid", 1): "got context_parallel_ring_degree=1",
        # the ring degree belongs to hybrid only
        (4, "ring", 2): "context_parallel_ring_degree=2 applies to context_parallel_mode=hybrid only",
        (4, "ulysses", 2): "got context_parallel_mode=ulysses",
    }
    for (k, mode, ring), message in refused.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            ServerConfig(context_parallel=k, context_parallel_mode=mode, context_parallel_ring_degree=ring)

    args = build_parser().parse_args(
        [
            "serve",
            "--context-parallel",
            "4",
            "--context-parallel-mode",
            "hybrid",
            "--context-parallel-ring-degree",
            "2",
        ]
    )
    assert (args.context_parallel_mode, args.context_parallel_ring_degree) == ("hybrid", 2)
    with pytest.raises(SystemExit) as exc:  # a one-line start-up error, before anything loads
        main(["serve", "--context-parallel", "3", "--context-parallel-mode", "hybrid"])
    assert "context_parallel_mode=hybrid needs 1 < context_parallel_ring_degree" in str(exc.value.code)


def test_start_up_checks_refuse_layouts_the_model_or_dtype_cannot_serve():
    """``check_start`` on real tiny transformers, without followers: the heads the Ulysses degree
    splits, the half-precision backend of a ring on CUDA, and the server's own plans (Ulysses only)."""
    from diffusion_rollout.models.tiny_video import (
        _wan_transformer,
        hunyuanvideo15_components,
        ltx2_components,
    )
    from diffusion_rollout.server.parallel.cp_plans import RING_BACKEND, check_start, ring_backend

    wan = {"transformer": _wan_transformer()}  # 2 heads

    def check(modules, *, cuda=False, dtype=torch.float32, **kw):
        check_start(modules, ServerConfig(device="cpu", **kw), cuda=cuda, dtype=dtype)

    check(wan, context_parallel=2)
    check(wan, context_parallel=4, context_parallel_mode="ring")  # a ring splits no heads
    check(wan, context_parallel=4, context_parallel_mode="hybrid")  # Ulysses degree 2
    with pytest.raises(
        ContextParallelError,
        match=r"context_parallel_mode=hybrid: .*over its 4 ranks, so they must be divisible by 4",
    ):
        check(wan, context_parallel=8, context_parallel_mode="hybrid", context_parallel_ring_degree=2)
    check(wan, context_parallel=8, context_parallel_mode="hybrid", context_parallel_ring_degree=4)

    # On CUDA a ring runs _native_flash unless a backend is set; it takes half precision only.
    assert ring_backend(None, 2, cuda=True) == RING_BACKEND == "_native_flash"
    assert ring_backend(None, 1, cuda=True) is None and ring_backend(None, 2, cuda=False) is None
    assert ring_backend("flash", 2, cuda=True) == "flash"
    for mode in ("ring", "hybrid"):
        with pytest.raises(
            ContextParallelError,
            match=f"context_parallel_mode={mode} runs attention_backend=_native_flash.*dtype=bfloat16",
        ):
            check(wan, cuda=True, context_parallel=4, context_parallel_mode=mode)
        check(wan, cuda=True, dtype=torch.bfloat16, context_parallel=4, context_parallel_mode=mode)
        check(wan, context_parallel=4, context_parallel_mode=mode)  # float32 mirror mode: no backend
        # A configured backend is left to diffusers (enable_parallelism refuses one without CP).
        check(wan, cuda=True, context_parallel=4, context_parallel_mode=mode, attention_backend="flash")
    check(wan, cuda=True, context_parallel=2)  # Ulysses in float32 on CUDA: no rule

    for name, modules in (
        ("LTX2VideoTransformer3DModel", {"transformer": ltx2_components(0)["transformer"]}),
        ("HunyuanVideo15Transformer3DModel", {"transformer": hunyuanvideo15_components(0)["transformer"]}),
    ):
        check(modules, context_parallel=2)
        for mode in ("ring", "hybrid"):
            with pytest.raises(
                ContextParallelError, match=f"{mode}: transformer \\({name}\\) runs the server's own"
            ):
                check(modules, context_parallel=4, context_parallel_mode=mode)


def test_the_video_token_count_must_divide_by_k_for_wan_too():
    """diffusers' Wan plan asserts an even split inside the call (a dead follower on CUDA): a 400 first."""
    from types import SimpleNamespace

    from diffusion_rollout.errors import RequestError
    from diffusion_rollout.server.families.base import CallSettings
    from diffusion_rollout.server.parallel.cp_plans import check_call, wan_video_tokens

    patch = SimpleNamespace(config=SimpleNamespace(patch_size=(1, 2, 2)))
    adapter = SimpleNamespace(
        name="wan",
        transformers=lambda: {"transformer": patch},
        noise_shape=lambda c: (16, (c.num_frames - 1) // 4 + 1, c.height // 8, c.width // 8),
    )  # the real Wan 2.1's compression (8x, 4x in time)

    def engine(k):
        return SimpleNamespace(config=SimpleNamespace(context_parallel=k), adapter=adapter)

    def call(h, w, f):
        return CallSettings(
            height=h, width=w, num_inference_steps=1, guidance_scale=5.0, true_cfg_scale=None,
            guidance_scale_2=None, num_frames=f, max_sequence_length=None, has_negative_prompt=False,
        )  # fmt: skip

    assert wan_video_tokens(adapter, call(480, 832, 81)) == 21 * 30 * 52
    for k in (2, 4, 8):
        check_call(engine(k), call(480, 832, 81))
    with pytest.raises(RequestError, match="75 video tokens, not divisible by context_parallel=2") as exc:
        check_call(engine(2), call(80, 48, 17))  # 5 x 5 x 3
    assert exc.value.field == "num_frames"


class _FollowerLeavingAfterRankZero:
    """A follower process as NCCL makes it at stop: it leaves destroy_process_group (and so ends)
    only once rank 0 has destroyed the group too."""

    def __init__(self, closed) -> None:
        self.pid, self.name, self.closed, self.terminated = 1, "context-parallel-rank1", closed, False

    def join(self, timeout: float | None = None) -> None:
        self.closed.wait(timeout)

    def is_alive(self) -> bool:
        return not self.closed.is_set() and not self.terminated

    def terminate(self) -> None:
        self.terminated = True


def test_stop_closes_rank_zeros_group_while_it_waits_for_the_followers(monkeypatch, caplog):
    """Every CUDA shutdown waited 10 s and terminated rank 1 (2x H200 logs): the follower's
    destroy_process_group waited for rank 0's, which came only after the join."""
    import threading

    import torch.distributed as dist

    from diffusion_rollout.server.parallel.context_parallel import ContextParallelGroup

    closed = threading.Event()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", closed.set)
    group = object.__new__(ContextParallelGroup)
    follower = _FollowerLeavingAfterRankZero(closed)
    sent: list[tuple] = []
    group._hooks, group.vae, group._procs = [], None, [follower]
    group._ops = [type("Ops", (), {"put": staticmethod(sent.append)})()]
    with caplog.at_level("WARNING", logger="diffusion_rollout.server.parallel.context_parallel"):
        group.stop(timeout_s=5.0)
    assert sent == [("stop",)] and closed.is_set()
    assert not follower.terminated, "the follower was terminated: rank 0 closed its group too late"
    assert "did not stop" not in caplog.text
