"""Compiled before ready, a compile cache that survives restarts, and ``--speed`` (issue #43).

Two real ``diffusion-rollout serve --speed fast`` processes on the tiny SD3 (32x32) share one
``--compile-cache`` folder: the first compiles from nothing, the second, started after the first
stopped, reads what the first wrote. Each is watched from outside while it starts:

- it is not ready (``/health_generate`` 503, ``/health`` state ``warming`` with progress) until its
  warm-up shapes are compiled, then ready;
- requests of 1, 2 and 3 outputs compile nothing more (the blocks' own graph counter and the
  recompile count in ``/server_info`` and ``/metrics``);
- the second process's warm-up hits inductor's cache (counts, not times).

The speed presets themselves (which options each adds on which device, and that fine flags win) are
checked in process; the default choice is logged and reported by a plain CPU server.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from diffusion_rollout.config import ServerConfig
from diffusion_rollout.speed_presets import choose
from diffusion_rollout.testing import free_port

START_TIMEOUT_S = 300


class ServeProcess:
    """``serve`` in a child process; its states as seen by ``/health`` while it started."""

    def __init__(
        self, model: Path, cache: Path, log: Path, extra: tuple[str, ...] = (), warmup_shapes: str | None = "32x32"
    ) -> None:
        self.model = model
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        args = [
            sys.executable, "-m", "diffusion_rollout.entrypoints.cli", "serve",
            "--model", str(model), "--device", "cpu", "--dtype", "float32", "--port", str(self.port),
            "--speed", "fast", "--max-batch-size", "4", "--compile-cache", str(cache), *extra,
            *(("--warmup-shapes", warmup_shapes) if warmup_shapes is not None else ()),
        ]  # fmt: skip
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="2")
        self._out = log.open("w")
        self.proc = subprocess.Popen(args, env=env, stdout=self._out, stderr=subprocess.STDOUT)
        # Every /health answer while it warmed, and what /health_generate said at the same moment.
        self.warming: list[tuple[dict, int, str]] = []
        self.ready_after_warming = False
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        with httpx.Client(base_url=self.base, timeout=30) as c:
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    health = c.get("/health").json()
                except httpx.HTTPError:
                    time.sleep(0.2)
                    continue
                if health.get("state") == "warming":
                    r = c.get("/health_generate")
                    self.warming.append((health, r.status_code, r.text))
                elif health.get("state") == "ready":
                    self.ready_after_warming = bool(self.warming)
                    return
                time.sleep(0.1)
        self.stop()
        pytest.fail(f"server did not become ready:\n{self.log.read_text()[-4000:]}")

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.base + path, timeout=60)

    def info(self) -> dict:
        return self.get("/server_info").json()

    def generate(self, n: int) -> list[dict]:
        from diffusion_rollout.protocol import wire

        body = {"prompt": "a red square", "seed": n, "num_outputs_per_prompt": n, "width": 32, "height": 32}
        body.update(num_inference_steps=2, guidance_scale=4.5, return_generated_output=False)
        r = httpx.post(
            self.base + "/rollout/generate", json=body, headers={"Accept": "application/msgpack"}, timeout=300
        )
        assert r.status_code == 200, r.text[:2000]
        return wire.decode(r.content, r.headers["content-type"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


@pytest.fixture(scope="module")
def compiled_servers(tiny_model_path, tmp_path_factory):
    """``start(i)``: the i-th server process (0, 1, then 2), all on one compile cache; the earlier one
    is stopped before the next starts. The second runs without the precompiled blocks the first saved
    (``--no-precompile-blocks``: it traces, from inductor's cache) and profiles its warm-up
    (``--warmup-profile``, a stack sample every 1 s) into ``root/warmup-profile``; the third loads
    the precompiled blocks."""
    root = tmp_path_factory.mktemp("compile-warmup")
    model = tiny_model_path("sd3")
    started: dict[int, ServeProcess] = {}
    profile = ("--warmup-profile", str(root / "warmup-profile"), "--warmup-profile-interval-s", "1")

    def start(i: int) -> ServeProcess:
        if i not in started:
            for s in started.values():
                s.stop()
            extra = (*profile, "--no-precompile-blocks") if i == 1 else ()
            started[i] = ServeProcess(model, root / "compile-cache", root / f"serve-{i}.log", extra)
            started[i].root = root
        return started[i]

    yield start
    for s in started.values():
        s.stop()


@pytest.mark.slow
def test_a_compiled_server_is_ready_only_after_its_warmup(compiled_servers):
    server = compiled_servers(0)
    assert server.warming, "never saw the warming state"
    assert server.ready_after_warming
    for health, code, text in server.warming:
        assert code == 503 and "warming" not in health.get("status", "")
        assert "compiling for the expected request shapes" in text
        progress = health["warmup"]
        assert (
            progress["total"] == 2 and progress["shapes"] == ["32x32"] and progress["batch_sizes"] == [2, 1]
        )
        # Warming: calls still to make, or all made and the precompiled blocks being saved.
        assert progress["done"] < progress["total"] or progress["stage"].startswith("saving precompiled")
        assert progress["elapsed_s"] >= 0
    assert server.get("/health_generate").status_code == 200
    warmup = server.info()["speed"]["compile"]["warmup"]
    assert warmup["state"] == "done" and warmup["done"] == warmup["total"] == 2
    # One dynamic-batch graph set from the first call; batch 1 (2 rows with CFG) needs none of its own.
    first, second = warmup["calls"]
    assert first["graphs"] > 0 and second["graphs"] == 0, warmup["calls"]
    log = server.log.read_text()
    assert re.search(r"warm-up 1/2: 32x32 batch 2 in [\d.]+ s", log)
    assert "warm-up done in" in log
    # Inductor's compile workers were up before the first compile (else every kernel compiles
    # in-process, serially: server/speed/compile_workers.py).
    workers = server.info()["speed"]["compile"]["workers"]
    if workers["workers"] > 1:
        assert workers["ready"] and workers["wait_s"] >= 0 and "why_not" not in workers, workers
        assert "inductor compile workers ready" in log
        assert log.index("inductor compile workers ready") < log.index("warm-up 1/2")
    else:  # a one-CPU runner: inductor compiles in-process, and the report says why
        assert not workers["ready"] and "one compile thread" in workers["why_not"]


def test_batch_sizes_one_two_three_do_not_recompile(compiled_servers):
    server = compiled_servers(0)
    before = server.info()["speed"]["compile"]
    assert before["graphs_compiled"] > 0 and before["recompiles"] == 0
    for n in (1, 2, 3):
        out = server.generate(n)
        assert len(out) == n and all(o["exact"] is False for o in out)
        now = server.info()["speed"]["compile"]
        assert now["recompiles"] == 0 and now["graphs_compiled"] == before["graphs_compiled"], n
    metrics = server.get("/metrics").text
    assert re.search(r"^diffusion_rollout_compile_recompiles_total 0$", metrics, re.M)
    assert re.search(r"^diffusion_rollout_warmed_shapes 1$", metrics, re.M)
    graphs = re.search(r"^diffusion_rollout_compile_graphs_total (\d+)$", metrics, re.M)
    assert int(graphs.group(1)) == before["graphs_compiled"]


def test_the_fast_preset_is_logged_and_reported(compiled_servers):
    server = compiled_servers(0)
    choice = server.info()["speed"]["choice"]
    assert choice["preset"] == "fast" and choice["applied"] == {"compile": True}
    assert "FP8 left out: quantize=fp8 needs a CUDA GPU" in choice["why"]
    assert choice["results_rows"] == ["benchmarks/RESULTS.md#grpo-compiled"]
    assert "speed: --speed fast on cpu: compile=True." in server.log.read_text()


def test_without_warmup_profile_nothing_is_profiled_or_written(compiled_servers):
    server = compiled_servers(0)
    warmup = server.info()["speed"]["compile"]["warmup"]
    assert "profile" not in warmup, warmup
    assert "warm-up profile" not in server.log.read_text()
    written = [*server.root.rglob("warmup_stacks.txt"), *server.root.rglob("warmup_call_*")]
    written += [*Path.cwd().glob("warmup_stacks.txt"), *Path.cwd().glob("warmup_call_*")]
    assert written == [], written


@pytest.mark.slow
def test_a_restart_reads_the_compile_cache_the_last_process_wrote(compiled_servers):
    cold = compiled_servers(0).info()["speed"]["compile"]
    warm = compiled_servers(1).info()["speed"]["compile"]
    assert warm["cache"]["key"] == cold["cache"]["key"]
    assert cold["cache"]["artifacts_loaded"] == 0 and cold["cache"]["artifacts_saved_bytes"] > 0
    assert warm["cache"]["artifacts_loaded"] > 0

    # The first process compiled every graph (cache misses); the second found them all.
    def lookups(info: dict, what: str) -> int:
        return info["warmup"][f"fx_graph_cache_{what}"] + info["warmup"][f"aot_autograd_cache_{what}"]

    assert lookups(cold, "misses") > 0
    assert lookups(warm, "hits") > 0 and lookups(warm, "misses") == 0, warm["warmup"]
    assert warm["graphs_compiled"] == cold["graphs_compiled"]  # traced again, loaded from the cache
    # Dynamo's timers split each warm-up: the cache saves inductor's codegen, not Dynamo's tracing.
    for info in (cold, warm):
        ph = info["warmup"]["phases"]
        assert 0 < ph["dynamo_tracing_s"] < ph["dynamo_total_s"] <= info["warmup"]["elapsed_s"], ph
        assert ph["backend_s"] <= ph["dynamo_total_s"] and ph["outside_dynamo_s"] >= 0, ph
    assert warm["warmup"]["phases"]["inductor_codegen_s"] < cold["warmup"]["phases"]["inductor_codegen_s"]
    # The restart's warm-up did not wait for inductor's workers: its kernels came from the cache.
    if cold["workers"]["workers"] > 1:
        assert "wait_s" in cold["workers"] and "no_wait" not in cold["workers"], cold["workers"]
        assert "wait_s" not in warm["workers"], warm["workers"]
        assert warm["workers"]["no_wait"] == (
            f"the compile cache had {warm['cache']['artifacts_loaded']} artifacts for this key"
        )
    # /health had an estimate from the first warm-up while the second ran.
    server = compiled_servers(1)
    # (Only while the calls run: /health also says warming in the moments between the warm-up's
    # calls being done and the server being ready, with no estimate left.)
    calling = [h for h, _, _ in server.warming if h["warmup"]["state"] == "warming"]
    assert calling and all(h["warmup"]["estimate_remaining_s"] is not None for h in calling)
    assert warm["precompiled"] is None  # --no-precompile-blocks
    assert cold["precompiled"]["saved"] > 0 and cold["precompiled"]["not_saved"] == 0, cold["precompiled"]
    assert cold["precompiled"]["active"] is False


def test_the_cache_key_changes_with_dtype_options_and_model(tiny_model_path):
    import torch

    from diffusion_rollout.server.speed.compile_cache import cache_key

    base = {
        "model_path": str(tiny_model_path("sd3")), "device": "cpu", "dtype": torch.float32,
        "quantize": None, "attention_backend": None,
    }  # fmt: skip
    key, facts = cache_key(**base)
    assert facts["torch"] == torch.__version__ and facts["model"]["config_sha256"]
    assert cache_key(**base)[0] == key
    for change in (
        {"dtype": torch.bfloat16},
        {"quantize": "fp8"},
        {"attention_backend": "flash"},
        {"model_path": str(tiny_model_path("flux"))},
    ):
        assert cache_key(**{**base, **change})[0] != key, change


# --------------------------------------------------------------------------- speed presets
def test_speed_presets_by_device_and_fine_flags_win():
    exact_cuda = choose("exact", device="cuda", given={}, fp8_unavailable=None)
    assert exact_cuda.applied == {"pipeline_lanes": 2} and "grpo-lanes2" in exact_cuda.results_rows
    assert choose("exact", device="cpu", given={}, fp8_unavailable=None).applied == {}
    kept = choose("exact", device="cuda", given={"pipeline_lanes": 1}, fp8_unavailable=None)
    assert kept.applied == {} and kept.overridden == ("pipeline_lanes",)
    # Lanes are for the plain eager path: an inexact option given leaves them out.
    assert choose("exact", device="cuda", given={"compile": True}, fp8_unavailable=None).applied == {}
    fast = choose("fast", device="cuda", given={}, fp8_unavailable=None)
    assert fast.applied == {"compile": True, "quantize": "fp8"} and fast.results_rows[0] == "grpo-fast-all"
    no_fp8 = choose("fast", device="cuda", given={}, fp8_unavailable="no torchao")
    assert no_fp8.applied == {"compile": True} and "no torchao" in no_fp8.why

    assert ServerConfig(device="cpu", speed="fast").compile is True
    assert ServerConfig(device="cpu", speed="fast", compile=False).compile is False
    assert ServerConfig(device="cpu").pipeline_lanes == 1
    with pytest.raises(ValueError, match="warmup_shapes"):
        ServerConfig(warmup_shapes="512")


def test_the_default_speed_choice_is_logged_and_reported(fresh_server, caplog):
    with caplog.at_level(logging.INFO, logger="diffusion_rollout.server.core.engine"):
        server = fresh_server("sd3")
    assert "speed: --speed exact on cpu: nothing added. the plain eager path" in caplog.text
    speed = server.client.get("/server_info").json()["speed"]
    assert speed["choice"]["preset"] == "exact" and speed["choice"]["applied"] == {}
    assert speed["exact"] is True and speed["compile"] is False
    assert server.client.get("/health").json() == {"status": "ok", "state": "ready"}


# --------------------------------------------------------------------------- --warmup-profile
def test_a_profiled_warmup_writes_call_summaries_and_stack_samples(compiled_servers):
    server = compiled_servers(1)  # started with --warmup-profile DIR --warmup-profile-interval-s 1
    folder = server.root / "warmup-profile"
    profile = server.info()["speed"]["compile"]["warmup"]["profile"]
    assert (
        profile["dir"] == str(folder.resolve()) and profile["stack_interval_s"] == 1.0 and profile["cprofile"]
    )
    names = {Path(f).name for f in profile["files"]}
    assert names == {
        "warmup_stacks.txt", "warmup_call_1.txt", "warmup_call_1.pstats", "warmup_call_2.txt",
        "warmup_call_2.pstats",
    }, profile  # fmt: skip
    assert all(Path(f).is_file() and Path(f).stat().st_size > 0 for f in profile["files"])
    summary = (folder / "warmup_call_1.txt").read_text()
    assert "warm-up call 1 (warmup-32x32-b2)" in summary and "by cumulative time" in summary
    assert "by total (own) time" in summary
    # The pipeline call the warm-up made, with file:line, under the worker's batch.
    assert re.search(r"batch_runner\.py:\d+\(_run_call\)", summary), summary[:3000]
    assert re.search(r"pipeline_stable_diffusion_3\.py:\d+\(__call__\)", summary)
    stacks = (folder / "warmup_stacks.txt").read_text()
    assert profile["stack_samples"] >= 1 and stacks.count("\n=== ") >= 1, stacks[:2000]
    assert re.search(
        r"=== \S+ \+[\d.]+ s: warm-up call \d \(warmup-32x32-b\d\)\n--- thread rollout-worker", stacks
    )
    assert "warm-up ended after" in stacks and "(run_batch)" in stacks  # the closing tally
    log = server.log.read_text()
    assert "warm-up profile: cProfile of each warm-up call" in log and str(folder.resolve()) in log
    assert re.search(r"warm-up profile of call 2: \S+warmup_call_2\.txt", log)


def _stacks_of_a_stuck_worker(tmp_path: Path, stuck_in: str, samples: int) -> tuple[int, str]:
    """A worker thread stuck in a function named ``stuck_in``, sampled until ``samples`` samples are
    written; returns the count and the stacks file read *before* the profile stops (as a killed run
    leaves it)."""
    import threading

    from diffusion_rollout.server.speed.warmup_profile import WarmupProfile

    stop = threading.Event()
    namespace: dict = {"stop": stop}
    exec(f"def {stuck_in}():\n    stop.wait(30)\n", namespace)  # the frame's function name is the point
    worker = threading.Thread(target=namespace[stuck_in], name="rollout-worker", daemon=True)
    worker.start()
    profile = WarmupProfile(tmp_path / "p", 0.05, lambda: [worker.ident])
    profile.start()
    try:
        deadline = time.monotonic() + 10
        while profile.samples < samples and time.monotonic() < deadline:
            time.sleep(0.05)
        return profile.samples, (tmp_path / "p" / "warmup_stacks.txt").read_text()
    finally:
        stop.set()
        profile.stop()
        worker.join()


def test_stack_samples_show_a_call_that_never_ends(tmp_path):
    """What a run cut off by a timeout leaves: samples of the stuck call, written as they were taken."""
    count, stacks = _stacks_of_a_stuck_worker(tmp_path, "a_stuck_compile", 2)
    assert count >= 2
    assert "--- thread rollout-worker" in stacks and "in a_stuck_compile" in stacks


def test_a_cut_off_stacks_file_sums_up_by_phase(tmp_path):
    """``benchmarks/investigations/warmup_stacks.py`` on what a killed run leaves: each sample in the phase its frames
    show (here a worker stuck in the function inductor's CachingAutotuner compiles a config under)."""
    from benchmarks.investigations.warmup_stacks import summarize

    _, stacks = _stacks_of_a_stuck_worker(tmp_path, "_precompile_config", 3)
    summary = summarize(stacks)
    assert summary["samples"] >= 3
    assert summary["samples_by_phase"] == {"kernel_compile_at_first_run": summary["samples"]}
    assert summary["share_by_phase"]["kernel_compile_at_first_run"] == 1.0


def test_the_warmup_profile_option_is_a_writable_folder(tmp_path):
    made = tmp_path / "a" / "b"
    config = ServerConfig(warmup_profile=str(made))
    assert made.is_dir() and config.warmup_profile == str(made.resolve())
    assert ServerConfig().warmup_profile is None
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ValueError, match="warmup_profile"):
        ServerConfig(warmup_profile=str(a_file))
    with pytest.raises(ValueError, match="greater than 0"):
        ServerConfig(warmup_profile_interval_s=0)


def test_compile_workers_never_stop_the_load(monkeypatch):
    """``server/speed/compile_workers.py`` leans on inductor's private API: one compile thread, or a torch
    without that API, leaves the warm-up compiling in-process, reported, and nothing raised."""
    from torch._inductor import async_compile

    from diffusion_rollout.server.speed.compile_workers import CompileWorkers

    monkeypatch.setattr(async_compile, "get_compile_threads", lambda: 1)
    one = CompileWorkers()
    one.start()
    one.wait(timeout_s=1)
    assert one.report() == {"workers": 1, "ready": False, "why_not": one.why_not}
    assert "one compile thread" in one.why_not

    def missing() -> int:
        raise AttributeError("no get_compile_threads in this torch")

    monkeypatch.setattr(async_compile, "get_compile_threads", missing)
    gone = CompileWorkers()
    gone.start()
    gone.wait(timeout_s=1)
    assert not gone.started and not gone.ready and "not readable" in gone.why_not


def test_a_call_summary_waits_for_the_worker_to_leave_the_call(tmp_path):
    """The warm-up's future resolves inside the worker's batch, before the profiling hook has ended:
    write_pending, called right after the result, still writes that call's summary."""
    import threading
    from concurrent.futures import Future

    from diffusion_rollout.server.speed.warmup_profile import WarmupProfile

    profile = WarmupProfile(tmp_path / "p", 10.0, lambda: [])
    (tmp_path / "p").mkdir()
    result: Future = Future()

    def worker() -> None:
        with profile.around_call([]):
            result.set_result(None)  # the caller wakes here, the hook has not finished
            time.sleep(0.3)

    t = threading.Thread(target=worker)
    t.start()
    result.result(timeout=10)
    profile.write_pending()
    t.join()
    assert {Path(f).name for f in profile.files} == {"warmup_call_1.txt", "warmup_call_1.pstats"}


@pytest.mark.slow
def test_a_restart_runs_the_precompiled_blocks_equal_to_the_traced_ones_until_the_weights_change(
    compiled_servers,
):
    """The third start loads the blocks the first one saved: its warm-up traces nothing, and its
    rollouts equal, bit for bit, those of the ordinary compiled path the same process takes once the
    weights change (a full update from the same folder: identical weights)."""
    server = compiled_servers(2)
    warm = server.info()["speed"]["compile"]
    pre = warm["precompiled"]
    saved = sorted(Path(warm["cache"]["folder"], "blocks").glob("*.pt"))  # what the first start wrote
    assert pre["active"] and pre["loaded"] == len(saved) > 0, (pre, saved)
    assert warm["graphs_compiled"] == 0 and pre["calls"] > 0, warm
    assert warm["warmup"]["phases"].get("dynamo_tracing_s", 0.0) == 0.0, warm["warmup"]["phases"]
    precompiled = [server.generate(n) for n in (1, 3)]
    now = server.info()["speed"]["compile"]
    assert now["graphs_compiled"] == 0 and now["precompiled"]["calls"] > pre["calls"], now["precompiled"]
    r = httpx.post(
        server.base + "/update_weights_from_disk", json={"model_path": str(server.model)}, timeout=120
    )
    assert r.status_code == 200, r.text
    after = server.info()["speed"]["compile"]
    assert after["precompiled"]["active"] is False and "weights" in after["precompiled"]["off_because"]
    calls = after["precompiled"]["calls"]
    traced = [server.generate(n) for n in (1, 3)]
    now = server.info()["speed"]["compile"]
    assert now["graphs_compiled"] > 0 and now["precompiled"]["calls"] == calls  # the ordinary path served
    import torch

    for a, b in zip(precompiled, traced, strict=True):
        for x, y in zip(a, b, strict=True):
            tensors = [k for k, v in x.items() if isinstance(v, torch.Tensor)]
            assert tensors and all(torch.equal(x[k], y[k]) for k in tensors), tensors
