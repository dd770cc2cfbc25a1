"""The benchmark scripts on the tiny zoo models, on the CPU: each one runs end to end, prints its
table and writes its JSON (device, commit, versions, settings); the ODE regression gate passes on
every served family and fails (exit 1) when the server differs from the stock pipeline."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from benchmarks import (
    family_gate,
    gpu_suite,
    ode_regression,
    rollout_overhead,
    speed_options,
    throughput,
    weight_sync,
    wire_codec,
)
from benchmarks.model_builders import default_models


def _doc(path, name, benchmark=None):
    doc = json.loads((path / f"{name}.json").read_text())
    assert doc["benchmark"] == (benchmark or name)
    assert doc["facts"]["device"] == "cpu" and doc["facts"]["commit"]
    assert doc["facts"]["versions"]["torch"] and doc["facts"]["versions"]["diffusers"]
    assert isinstance(doc["settings"], dict) and doc["results"]
    return doc


@pytest.mark.slow
def test_ode_regression_every_family_bit_exact(tmp_path, capsys):
    assert ode_regression.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    doc = _doc(tmp_path, "ode_regression")
    families = {r["family"] for r in doc["results"]}
    assert families == {m.removeprefix("tiny-") for m in default_models("cpu")}
    assert {"sd3", "flux"} <= families
    assert all(r["exact"] and r["max_abs_diff"] == 0.0 for r in doc["results"])
    assert {r["mode"] for r in doc["results"]} == set(ode_regression.MODES)
    assert "max |diff|" in capsys.readouterr().out


def test_ode_regression_gate_fails_on_a_difference(tmp_path, monkeypatch):
    monkeypatch.setitem(ode_regression.MODES, "sde", {"rollout_sde_type": "sde", "rollout_debug_mode": False})
    argv = ["--device", "cpu", "--models", "tiny-sd3", "--modes", "sde", "--out", str(tmp_path)]
    assert ode_regression.main(argv) == 1
    doc = json.loads((tmp_path / "ode_regression.json").read_text())
    assert not doc["ok"] and all(not r["exact"] and r["max_abs_diff"] > 0 for r in doc["results"])


def test_compare_counts_nan_positions_as_equal():
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert ode_regression.compare(a, a.clone())["exact"]
    b = torch.tensor([1.0, float("nan"), 3.5])
    r = ode_regression.compare(a, b)
    assert not r["exact"] and r["max_abs_diff"] == 0.5


def test_rollout_overhead(tmp_path):
    argv = ["--device", "cpu", "--models", "tiny-sd3", "--reps", "1", "--out", str(tmp_path)]
    assert rollout_overhead.main(argv) == 0
    doc = _doc(tmp_path, "rollout_overhead")
    assert {r["variant"] for r in doc["results"]} == {"stock", "server_plain", "server_rollout"}
    assert "tiny-sd3" in doc["targets"]
    assert next(r for r in doc["results"] if r["variant"] == "server_rollout")["response_mb"] > 0


def test_throughput(tmp_path):
    argv = [
        "--device", "cpu", "--models", "tiny-sd3,tiny-flux", "--group", "4", "--requests", "2",
        "--clients", "2", "--batch-sizes", "4,8", "--out", str(tmp_path),
    ]  # fmt: skip
    assert throughput.main(argv) == 0
    doc = _doc(tmp_path, "throughput")
    server = [r for r in doc["results"] if r.get("variant") == "server_sde_rollout"]
    assert [r["max_batch_size"] for r in server] == [4, 8]
    assert all(4 <= r["mean_batch"] <= 8 for r in server)  # groups batched across requests up to 8
    assert any(r.get("option") == "eager" for r in doc["results"])
    assert "grpo_vs_stock_batched" in doc["targets"]


@pytest.mark.slow
def test_weight_sync(tmp_path):
    argv = [
        "--device", "cpu", "--models", "tiny-flux", "--lora-rank", "4", "--lora-reps", "2",
        "--part-mb", "1", "--out", str(tmp_path),
    ]  # fmt: skip
    assert weight_sync.main(argv) == 0
    doc = _doc(tmp_path, "weight_sync")
    kinds = {r["transport"] for r in doc["results"]}
    assert {
        "tcp_raw",
        "http_legacy",
        "http_stream",
        "http_direct",
        "finite_check",
        "disk",
        "ipc",
        "lora_push_activate",
    } <= kinds
    assert doc["targets"]["http_stream"]["vs_legacy"] > 0, doc["targets"]
    assert doc["targets"]["http_direct"]["vs_http_stream"] > 0, doc["targets"]
    assert doc["ok"], doc["notes"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gpu_suite_dry_run_on_tiny_models(tmp_path):
    argv = ["--device", "cpu", "--tiny", "--no-compile", "--no-wan", "--out", str(tmp_path)]
    assert gpu_suite.main(argv) == 0
    summary = _doc(tmp_path, "summary", "gpu_suite")
    assert all(p["status"] == "ok" for p in summary["results"]), summary["results"]
    for name in ("ode_regression", "rollout_overhead", "throughput", "weight_sync"):
        _doc(tmp_path, name)
    assert summary["targets"]["ode_regression.exact"]["met"]


def test_family_gate_dry_run_on_tiny_models(tmp_path):
    """The one-command GPU check of FLUX.2 klein and Z-Image, on their tiny zoo models."""
    assert (
        family_gate.main(["--device", "cpu", "--tiny", "--reps", "1", "--steps", "2", "--out", str(tmp_path)])
        == 0
    )
    doc = _doc(tmp_path, "family_gate")
    assert doc["ok"] and not doc["failures"]
    gate = doc["ode_gate"]
    assert {r["family"] for r in gate} == {"flux2-klein", "zimage"}
    assert {(r["mode"], r["output"]) for r in gate} == {
        (m, o) for m in ("rollout_false", "ode_rollout") for o in ("latents", "images")
    }
    assert all(r["exact"] and r["max_abs_diff"] == 0.0 for r in gate)
    variants = {(r["model"], r["variant"]) for r in doc["speed"]}
    assert ("tiny-zimage", "server_rollout") in variants and ("tiny-flux2-klein", "stock") in variants
    assert all(r["ms_per_step"] > 0 for r in doc["speed"])
    assert [r["model"] for r in doc["memory"]] == ["tiny-flux2-klein", "tiny-zimage"]


def test_new_family_builders_have_the_public_sizes():
    """FLUX.2-klein-4B and Z-Image-Turbo transformers from their configs (on meta: no memory)."""
    from accelerate import init_empty_weights
    from diffusers import Flux2Transformer2DModel, ZImageTransformer2DModel

    from benchmarks.model_builders import FLUX2_KLEIN_4B_TRANSFORMER, ZIMAGE_TURBO_TRANSFORMER

    with init_empty_weights():
        klein = Flux2Transformer2DModel(**FLUX2_KLEIN_4B_TRANSFORMER)
        zimage = ZImageTransformer2DModel(**ZIMAGE_TURBO_TRANSFORMER)
    billions = [sum(p.numel() for p in m.parameters()) / 1e9 for m in (klein, zimage)]
    assert 3.8 < billions[0] < 4.0 and 6.1 < billions[1] < 6.2, billions


def test_speed_options_tiny(tmp_path):
    # The GPU script end to end on the CPU (no CUDA graphs, no compile; FLUX phases share the code).
    assert speed_options.main(["--tiny", "--device", "cpu", "--no-flux", "--out", str(tmp_path)]) == 0
    doc = _doc(tmp_path, "speed_options")
    grpo = {r["variant"]: r for r in doc["speed"] if r["phase"] == "grpo"}
    assert set(grpo) == {"stock", "server_plain_float32", "server_lean_float32", "server_lean_uint8"}
    assert grpo["server_lean_float32"]["response_mb"] < grpo["server_plain_float32"]["response_mb"]
    assert doc["gates"] and all(g["exact"] for g in doc["gates"])
    assert any("pipeline_lanes=2" in g["check"] for g in doc["gates"])
    drift = {r["option"]: r for r in doc["drift"]}
    eager = drift["eager"]
    assert eager["exact"] and eager["ode_gate_exact"] and eager["replay_ratio_max_dev"] == 0.0
    assert eager["replay_log_prob_mean_abs_diff"] == 0.0 and eager["first_step_ratio_std"] == 0.0
    cache = drift["feature_cache taylorseer"]
    assert cache["exact"] is False and cache["latent_max_abs_diff"] > 0 and not cache["ode_gate_exact"]
    assert 0 < cache["replay_log_prob_mean_abs_diff"] <= cache["replay_log_prob_max_abs_diff"]
    # SD3's attention processors call SDPA themselves: the backend is refused, with the reason.
    assert "would change nothing" in drift["attention _native_math"]["note"]
    lanes = drift["pipeline_lanes 2"]  # an exact option: no drift at all
    assert lanes["exact"] and lanes["ode_gate_exact"] and lanes["latent_max_abs_diff"] == 0.0
    assert lanes["log_prob_max_abs_diff"] == 0.0 and lanes["replay_ratio_max_dev"] == 0.0
    # Every server row splits its wait: the server's own pipeline seconds (from the responses) and
    # the rest, which together are the row's median time.
    for row in doc["speed"]:
        if "_lanes_" in row["variant"]:  # overlapping calls: their sum is no part of the wait
            assert row["server_pipeline_s"] > 0 and row["outside_pipeline_s"] is None
        elif row["variant"].startswith("server"):
            assert 0 < row["server_pipeline_s"] < row["median_s"]
            assert row["outside_pipeline_s"] == pytest.approx(row["median_s"] - row["server_pipeline_s"])
        else:
            assert row["server_pipeline_s"] is None


def test_speed_options_fast_tier_phases_say_why_they_cannot_run_on_a_cpu(tmp_path):
    argv = ["--tiny", "--device", "cpu", "--phases", "drift,grpo_fast,flux,flux_fast", "--fp8",
            "--backends", "_native_math,fa4", "--out", str(tmp_path)]  # fmt: skip
    assert speed_options.main(argv) == 0
    doc = _doc(tmp_path, "speed_options")
    drift = {r["option"]: r for r in doc["drift"] if r["model"] == "tiny-sd3"}
    for option in ("quantize fp8", "attention fa4"):
        assert "needs a CUDA GPU" in drift[option]["note"] and "ms_per_rollout" not in drift[option]
    # SD3's processors call SDPA themselves: a backend would change nothing, and is refused.
    assert "would change nothing" in drift["attention _native_math"]["note"]
    # FLUX's go through diffusers' dispatcher: with --fp8 its drift takes the backends and FP8 too.
    flux = {r["option"]: r for r in doc["drift"] if r["model"] == "tiny-flux"}
    assert (
        flux["attention _native_math"]["exact"] is False
        and "ms_per_rollout" in flux["attention _native_math"]
    )
    for option in ("quantize fp8", "attention fa4"):
        assert "needs a CUDA GPU" in flux[option]["note"]
    assert not [o for o in drift if "compile" in o]  # the tiny run does not compile
    for phase in ("grpo_fast", "flux_fast"):
        assert any(n.startswith(f"{phase}: quantize=fp8 needs a CUDA GPU") for n in doc["notes"])
    assert not [r for r in doc["speed"] if r["phase"].endswith("fast")]


def test_speed_options_drift_options_split_a_run(tmp_path):
    """``--drift-options``: eager (the reference) and the named options only, no FLUX batch-1 rows;
    a name the run does not have is an error naming the choices."""
    argv = ["--tiny", "--device", "cpu", "--phases", "flux", "--fp8", "--backends", "_native_math",
            "--drift-options", "attention _native_math", "--out", str(tmp_path)]  # fmt: skip
    assert speed_options.main(argv) == 0
    doc = _doc(tmp_path, "speed_options")
    assert [r["option"] for r in doc["drift"]] == ["eager", "attention _native_math"]
    assert doc["speed"] == [] and doc["drift"][1]["latent_max_abs_diff"] >= 0
    with pytest.raises(ValueError, match="not among"):
        speed_options.main([*argv[:-4], "--drift-options", "attention fa4", "--out", str(tmp_path)])


def test_speed_options_profile_phase_tiny(tmp_path):
    # On the CPU the profiler sees the operators of the calling thread: the stock pipeline's, not the
    # server worker's; the GPU run reads kernels of every stream. The shape of the rows is the check.
    assert (
        speed_options.main(["--tiny", "--device", "cpu", "--phases", "grpo_profile", "--out", str(tmp_path)])
        == 0
    )
    rows = {r["variant"]: r for r in _doc(tmp_path, "speed_options")["gpu_profile"]}
    assert set(rows) == {"stock", "server_lean_uint8_2_in_flight"}
    stock = rows["stock"]
    assert 0 < stock["gpu_busy_s"] <= stock["wall_s"] and stock["kernels_and_copies"] > 0
    assert stock["gpu_idle_within_s"] >= 0 and len(stock["largest_gaps_ms_at_ms"]) <= 12
    assert rows["server_lean_uint8_2_in_flight"]["wall_s"] > 0


def test_wire_codec_tiny(tmp_path):
    assert wire_codec.main(["--tiny", "--repeats", "1", "--out", str(tmp_path)]) == 0
    doc = _doc(tmp_path, "wire_codec")
    assert doc["ok"]  # the current codec's bytes and tensors equal the previous one's
    rows = {(r["phase"], r["variant"]) for r in doc["results"]}
    assert rows == {(p, v) for p in wire_codec.PHASES for v in ("previous", "current")} | {
        ("decode", "unpackb")
    }
    assert all(r["median_ms"] > 0 for r in doc["results"])


def test_flux_breakdown_tiny(tmp_path):
    from benchmarks.investigations import flux_breakdown

    argv = ["--tiny", "--device", "cpu", "--reps", "2", "--fp8", "--fp8-all", "--out", str(tmp_path)]
    assert flux_breakdown.main(argv) == 0
    doc = _doc(tmp_path, "flux_breakdown")
    variants = [r["variant"] for r in doc["forward"]]
    assert variants == [
        "eager, sdpa math", "compiled, default sdpa", "compiled + fp8", "compiled + fp8 (all by size)"
    ]  # fmt: skip
    assert all(r["ms"] > 0 for r in doc["forward"][:2])
    assert all(r["ms"] is None and "needs a CUDA GPU" in r["note"] for r in doc["forward"][2:])
    # The CPU's math attention is counted as its matmuls; CUDA's fused kernels as attention.
    assert doc["settings"]["tflop_per_forward"] > 0 and doc["settings"]["attention_tflop_per_forward"] >= 0
    kinds = {r["kind"]: r for r in doc["compiled_kernels"]}
    assert set(kinds) == {"attention", "matmul", "other"} and sum(r["share"] for r in kinds.values()) > 0.99


def test_speed_options_grpo_lanes_tiny(tmp_path):
    # The stock pipeline on two lanes (the server's twin recipe) vs back to back, with its gate.
    argv = ["--tiny", "--device", "cpu", "--phases", "grpo_lanes", "--out", str(tmp_path)]
    assert speed_options.main(argv) == 0
    doc = _doc(tmp_path, "speed_options")
    assert {r["variant"] for r in doc["speed"]} == {"stock", "stock_2_lanes"}
    [gate] = doc["gates"]
    assert gate["exact"] and gate["max_abs_diff"] == 0.0


@pytest.mark.slow
def test_train_recipes_tiny_runs(tmp_path):
    """The recipe runner on the tiny SD3 model: each recipe in its own process (the server layout
    starts ``diffusion-rollout serve`` as a subprocess), from a model folder saved under ``--work``."""
    from benchmarks import train_recipes

    out, work = tmp_path / "out", tmp_path / "work"
    argv = ["--out", str(out), "--work", str(work), "tiny-flow-grpo", "tiny-in-process"]
    assert train_recipes.main(argv) == 0
    model = work / "models" / "tiny-sd3"
    assert (model / "model_index.json").exists()
    for name, layout in (("tiny-flow-grpo", "server"), ("tiny-in-process", "in-process")):
        run = json.loads((out / f"{name}.json").read_text())
        assert run["recipe"] == "flow_grpo" and run["layout"] == layout
        assert run["args"]["model"] == str(model)
        assert len(run["history"]) == 2 and run["summary"]["first_ratio_max_dev"] == 0.0
        assert all(h["first_ratio_max_dev"] == 0.0 for h in run["history"])
        assert (work / "checkpoints" / name / "state.json").exists()
    served = json.loads((out / "tiny-flow-grpo.json").read_text())
    assert all(h["checksum_ok"] is True for h in served["history"])
    assert served["final_adapter_checksum"] == served["server_adapter_checksum"]


@pytest.mark.slow
def test_train_recipes_builds_the_judge_for_the_peer_run(tmp_path):
    """The Qwen-Image peer run's path at CPU size: the judge's folder built beside the model (and
    found again by its config.json, not rebuilt), ``{work}`` in the reward spec, two ranks."""
    from benchmarks import train_recipes

    out, work = tmp_path / "out", tmp_path / "work"
    argv = ["--out", str(out), "--work", str(work), "tiny-peer-qwen-image"]
    assert train_recipes.main(argv) == 0
    judge = work / "models" / "judge-tiny"
    assert (judge / "config.json").exists()
    assert train_recipes.model_folder("judge-tiny", work) == judge  # found, not rebuilt
    run = json.loads((out / "tiny-peer-qwen-image.json").read_text())
    assert run["ranks"] == 2 and run["args"]["reward"].startswith(f"vlm_ocr_judge?model={judge}&")
    h = run["history"][0]
    assert h["guidance"]["rule"] == "norm_rescale" and h["first_ratio_max_dev"] == 0.0
    assert all(0.0 <= r <= 1.0 for r in h["rewards"]) and h["optimizer_s"] >= 0.0


@pytest.mark.slow
def test_train_recipes_scores_on_the_server_with_a_clip_built_beside_the_model(tmp_path):
    """The reward-placement run at CPU size: a tiny CLIP folder built under ``--work`` and served by
    ``serve --reward pickscore=clip:...``, the recipe asking for it by name, no pixels travelling."""
    from benchmarks import train_recipes

    out, work = tmp_path / "out", tmp_path / "work"
    assert train_recipes.main(["--out", str(out), "--work", str(work), "tiny-reward-server"]) == 0
    assert (work / "models" / "clip-tiny" / "config.json").exists()
    run = json.loads((out / "tiny-reward-server.json").read_text())
    assert run["args"]["reward_on"] == "server" and run["server_reward"]["calls"] >= 2
    for h in run["history"]:
        assert h["first_ratio_max_dev"] == 0.0 and len(h["rewards"]) == 8


@pytest.mark.slow
def test_replica_push_dry_run_pushes_through_both_paths(tmp_path):
    """The GPU command of ``replica_push`` on CPU replicas: the CLI server with two Ray replicas,
    verified pushes through the replicas' own ports and through the object store."""
    from benchmarks import replica_push

    assert replica_push.main(
        ["--out", str(tmp_path), "--model", "tiny-sd3", "--cpu", "--rounds", "1", "--work", str(tmp_path / "w")]
    ) == 0  # fmt: skip
    doc = json.loads((tmp_path / "replica_push.json").read_text())
    assert [r["path"] for r in doc["results"]] == ["replica_ports", "object_store"]
    assert all(r["verified"] and r["gb"] > 0 for r in doc["results"])
    # Where each push's time went: the trainer's side, and every replica port's (only the first
    # path sends to the replicas' ports).
    ports, store = doc["results"]
    for row in (ports, store):
        assert set(row["trainer_seconds"]) == {"parts_s", "commit_s", "hash_wait_s", "check_s"}
        assert len(row["replica_port_seconds"]) == 2
    assert all(r["recv_s"] >= 0 and r["apply_s"] > 0 for r in ports["replica_port_seconds"])  # tiny bodies
    assert all(r["recv_s"] == 0 and r["apply_s"] == 0 for r in store["replica_port_seconds"])
    assert doc["environment"]["commit"] and doc["summary"]["replica_ports_gb_per_s"] > 0


def test_fast_tier_figure_waits_for_its_run_and_draws_both_axes(tmp_path):
    """The fast-vs-exact reward figure (issue #26): nothing until the fast run is committed; with a
    run (a committed exact-tier run standing in), one PNG, reward by iteration and by seconds."""
    from benchmarks import plots

    assert plots.fast_tier_curves(tmp_path, fast="no-such-run.json") == []
    [png] = plots.fast_tier_curves(tmp_path, fast="sd35-sync.json")
    data = png.read_bytes()
    assert png.name == "reward_fast_tier.png" and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.slow
def test_video_grpo_dry_run_on_tiny_video_families(tmp_path):
    """The one-GPU video-vs-stock command (issue #27) on a tiny video model with one video per
    request (HunyuanVideo 1.5's stock decode): every variant of both default phases against stock.
    Wan's (two videos per request) are in ``test_video_grpo_phases_and_profile``."""
    from benchmarks import video_grpo

    argv = [
        "--device",
        "cpu",
        "--models",
        "tiny-hunyuanvideo15",
        "--reps",
        "1",
        "--iteration-groups",
        "2",
        "--out",
        str(tmp_path),
    ]
    assert video_grpo.main(argv) == 0
    doc = _doc(tmp_path, "video_grpo")
    for model, group in (("tiny-hunyuanvideo15", 1),):
        rows = [r for r in doc["results"] if r["model"] == model]
        grpo = {r["variant"]: r for r in rows if r["phase"] == "grpo"}
        assert set(grpo) == {"stock", "server_plain_float32", "server_lean_float32", "server_lean_uint8"}
        assert all(r["outputs"] == group and r["ratio"] > 0 for r in grpo.values())
        iteration = [r for r in rows if r["phase"] == "grpo_iteration"]
        assert {r["outputs"] for r in iteration} == {4} and any("2_lanes" in r["variant"] for r in iteration)
        assert not any("equal_priority" in r["variant"] for r in iteration)  # an image-lane experiment


@pytest.mark.slow
def test_video_grpo_phases_and_profile(tmp_path):
    """``--phases grpo_iteration,grpo_fast,drift --profile --whole-messages --fresh-memory
    --socket-answers``: the iteration (with the unsliced answer's variant, and the trainers decoding
    into fresh memory and reading by the socket, one and two lanes each), its GPU-gap rows, and the
    fast tier's phases (on a CPU: the compiled server alone, saying why FP8 is left out, and its
    drift against eager)."""
    from benchmarks import video_grpo
    from diffusion_rollout.entrypoints import buffers_response

    argv = ["--device", "cpu", "--models", "tiny-wan", "--reps", "1", "--iteration-groups", "2",
            "--phases", "grpo,grpo_iteration,grpo_fast,drift", "--profile", "--frames", "9", "--whole-messages", "--fresh-memory",
            "--socket-answers", "--out", str(tmp_path)]  # fmt: skip
    assert video_grpo.main(argv) == 0
    assert buffers_response.SEND_CHUNK == 1 << 20  # the variant put the slice size back
    doc = _doc(tmp_path, "video_grpo")
    assert doc["settings"]["frames"] == 9
    assert doc["settings"]["phases"] == ["grpo", "grpo_iteration", "grpo_fast", "drift"]
    drift = [r for r in doc["results"] if "option" in r]
    rows = [r for r in doc["results"] if "option" not in r]
    assert {r["phase"] for r in rows} == {
        "grpo", "grpo_iteration", "grpo_profile", "grpo_compiled", "grpo_iteration_compiled"
    }  # fmt: skip
    grpo = {r["variant"]: r for r in rows if r["phase"] == "grpo"}  # two videos per request
    assert set(grpo) == {"stock", "server_plain_float32", "server_lean_float32", "server_lean_uint8"}
    assert all(r["outputs"] == 2 and r["ratio"] > 0 for r in grpo.values())
    fast = [r for r in rows if r["phase"].endswith("compiled")]
    assert {r["variant"] for r in fast} == {
        "stock", "server_lean_uint8_compiled", "server_lean_uint8_compiled_2_in_flight"
    }  # fmt: skip
    assert all("FP8 left out: quantize=fp8 needs a CUDA GPU" in r["note"] for r in fast)
    assert all(r["ratio"] > 0 for r in fast)
    assert [r["option"] for r in drift] == ["eager", "regional compile"]
    assert drift[0]["exact"] and drift[0]["latent_max_abs_diff"] == 0.0
    assert not drift[1]["exact"] and math.isfinite(drift[1]["latent_max_abs_diff"])  # says it is inexact
    assert "Drift against the eager server" in doc["table"]
    variants = {r["variant"] for r in rows if r["phase"] == "grpo_iteration"}
    assert {"server_lean_uint8_whole_messages_2_in_flight", "server_lean_uint8_fresh_memory_2_in_flight",
            "server_lean_uint8_2_lanes_fresh_memory_2_in_flight", "server_lean_uint8_socket_2_in_flight",
            "server_lean_uint8_2_lanes_socket_2_in_flight"} <= variants  # fmt: skip
    fresh = next(r for r in rows if r["variant"] == "server_lean_uint8_fresh_memory_2_in_flight")
    assert fresh["ratio"] > 0 and fresh["response_mb"] > 0  # a real answer, read by the other process
    profile = [r for r in rows if r["phase"] == "grpo_profile"]
    assert [r["variant"] for r in profile] == ["stock", "server_lean_uint8_2_in_flight"]
    assert profile[0]["kernels_and_copies"] > 0 and all(
        r["wall_s"] > 0 for r in profile
    )  # stock: operators on CPU
    assert profile[0]["after_last_kernel_s"] is not None and "seconds_by_kernel" not in profile[0]
    assert profile[1]["kernel_s_vs_stock"]  # stock's operators, none of which the server's thread shows
    with pytest.raises(SystemExit, match="unknown phase"):
        video_grpo.main(["--device", "cpu", "--models", "tiny-wan", "--phases", "grpo,nope"])


def test_video_grpo_default_models_are_all_buildable():
    # The H100 run at 33f829c lost its Wan 2.2 TI2V-5B row to an unregistered name. A fresh process:
    # in this one, another test may have registered the large models already.
    import subprocess

    code = (
        "from benchmarks import model_builders, video_grpo\n"
        "missing = set(video_grpo.DEFAULT) - set(model_builders.REAL_MODELS)\n"
        "assert not missing, missing\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_grpo_against_stock_times_each_option_and_names_the_one_that_failed():
    """The helper behind grpo_compiled and grpo_fast: an option that works gives both rows (one
    request, and the requests in flight), one that raises is left out and named in stock's note."""
    import contextlib

    from benchmarks.model_builders import build

    def refused():
        raise RuntimeError("not on this build")

    model = build("tiny-sd3", "cpu")

    @contextlib.contextmanager
    def nan_weights():  # an option whose rollouts come out NaN (as FP8 on a zero row once did)
        weight = model.pipe.transformer.proj_out.weight
        saved = weight.detach().clone()
        with torch.no_grad():
            weight.fill_(float("nan"))
        try:
            yield
        finally:
            with torch.no_grad():
                weight.copy_(saved)

    try:
        rows = speed_options._grpo_against_stock(
            model, {"plain": contextlib.nullcontext, "broken": refused, "nan": nan_weights}, phase="grpo_fast",
            note="stock first", group=2, groups=2, reps=1,
        )  # fmt: skip
        # the same variant name clean in a later run of the process (as the next model's would be)
        again = speed_options._grpo_against_stock(
            model, {"nan": contextlib.nullcontext}, phase="grpo_fast", note="", group=2, groups=2, reps=1
        )
    finally:
        model.close()
    # counted per run: the clean rerun is 0; stock's pipeline runs outside the server, so uncounted
    assert [(r["variant"], r["nonfinite_outputs"]) for r in again] == [
        ("stock", None), ("server_lean_uint8_nan", 0), ("stock", None), ("server_lean_uint8_nan_2_in_flight", 0)
    ]  # fmt: skip
    by = {(r["phase"], r["variant"]): r for r in rows}
    assert set(by) == {
        ("grpo_fast", "stock"), ("grpo_fast", "server_lean_uint8_plain"), ("grpo_fast", "server_lean_uint8_nan"),
        ("grpo_iteration_fast", "stock"), ("grpo_iteration_fast", "server_lean_uint8_plain_2_in_flight"),
        ("grpo_iteration_fast", "server_lean_uint8_nan_2_in_flight"),
    }  # fmt: skip
    assert by[("grpo_fast", "server_lean_uint8_plain")]["outputs"] == 2
    assert by[("grpo_iteration_fast", "server_lean_uint8_plain_2_in_flight")]["outputs"] == 4
    assert all(r["response_mb"] > 0 for r in rows if r["variant"] != "stock")
    note = by[("grpo_fast", "stock")]["note"]
    assert note.startswith("stock first; broken failed: RuntimeError: not on this build")
    # The NaN option is timed but flagged, in its rows and in stock's note; the others are clean.
    assert "nan: " in note and "non-finite" in note
    flagged = {v for (_, v), r in by.items() if r["nonfinite_outputs"]}
    assert flagged == {"server_lean_uint8_nan", "server_lean_uint8_nan_2_in_flight"}
    assert by[("grpo_fast", "server_lean_uint8_nan")]["nonfinite_outputs"] >= 2


def test_grpo_fast_every_linear_alone_leaves_out_the_family_rule(monkeypatch):
    """``--fp8-all-only``: the every-linear FP8 variant is the only option timed against stock (one
    compile fits a device call); by default the family rule's variant comes first."""
    from benchmarks import speed_options

    seen = []
    monkeypatch.setattr(speed_options, "_require_fp8", lambda model: None)
    monkeypatch.setattr(
        speed_options, "_grpo_against_stock", lambda model, options, **kw: seen.append(list(options))
    )
    speed_options.grpo_fast(None, group=2, groups=2, reps=1, fp8_all=True, family_rule=False)
    speed_options.grpo_fast(None, group=2, groups=2, reps=1, fp8_all=True)
    assert seen == [["fp8_all_compiled"], ["fp8_compiled", "fp8_all_compiled"]]


def test_video_grpo_fp8_all_times_and_drifts_every_linear_beside_the_family_rule(monkeypatch, tmp_path):
    """``video_grpo --fp8-all`` (how a video family's provisional FP8 threshold is settled): grpo_fast
    times every linear beside the family rule, and drift adds its compiled option after the family
    rule's. The CPU cannot run FP8, so the device check and both phases are stood in for."""
    from benchmarks import speed_options, video_grpo

    calls = {}
    monkeypatch.setattr(video_grpo, "fast_tier_gap", lambda model: None)
    monkeypatch.setattr(speed_options, "_has_graphs", lambda model: False)
    monkeypatch.setattr(
        speed_options, "grpo_fast", lambda model, **kw: calls.setdefault("grpo_fast", kw) and []
    )

    def drift(model, *, only, fp8, fp8_all, with_compile, **kw):
        names = [n for n, _, _ in speed_options._option_contexts(model, (), (), with_compile, fp8, fp8_all)]
        calls["drift"] = [n for n in names if n == "eager" or n in only]
        return []

    monkeypatch.setattr(speed_options, "drift", drift)
    argv = ["--tiny", "--device", "cpu", "--models", "tiny-wan", "--phases", "grpo_fast,drift",
            "--fp8-all", "--out", str(tmp_path)]  # fmt: skip
    assert video_grpo.main(argv) == 0
    assert calls["grpo_fast"]["fp8_all"] is True
    assert calls["drift"] == [
        "eager", "regional compile", "quantize fp8 + regional compile", speed_options.FP8_ALL_OPTION
    ]  # fmt: skip


def test_soak_runs_a_cli_server_and_reports_memory_slopes(tmp_path, tiny_model_path):
    """``benchmarks/soak.py`` with tiny counts: the CLI server on the tiny SD3 folder, rollouts
    between LoRA and full pushes, every answer at the version last pushed, and slopes of the server's
    RSS and open descriptors per 1000 rollouts and per update."""
    from benchmarks import soak

    args = ["--model", str(tiny_model_path("sd3")), "--work", str(tmp_path / "w"), "--out", str(tmp_path)]
    counts = [
        "--rollouts",
        "8",
        "--lora-updates",
        "2",
        "--full-updates",
        "1",
        "--samples",
        "4",
        "--warmup",
        "0",
    ]
    assert soak.main([*args, *counts]) == 0
    doc = json.loads((tmp_path / "soak_cpu.json").read_text())
    [run] = doc["results"]
    assert doc["ok"] and doc["facts"]["commit"] and doc["settings"]["rollouts"] == 8
    assert (run["rollouts"], run["lora"], run["full"], run["version_mismatches"]) == (8, 2, 1, 0)
    assert run["server_exit_code"] == 0 and len(run["samples"]) == 5  # the start, then every 2 rollouts
    assert [s["updates"] for s in run["samples"]] == [0, 0, 1, 1, 3]
    for series in ("rss_mib", "open_fds"):
        fitted = run["slopes"][series]
        assert isinstance(fitted["per_1000_rollouts"], float) and isinstance(fitted["per_update"], float)
        assert fitted["first"] > 0 and fitted["last"] > 0


def test_soak_reads_the_gpu_memory_the_metrics_report():
    """On a GPU the server's /metrics carries torch's allocated and reserved bytes; the soak reads them."""
    from benchmarks import soak
    from diffusion_rollout.server.core.metrics import Metrics

    state = {"queue_depth": 0, "busy": False, "paused": False, "status": "ready", "weight_version": 3}
    text = Metrics().render(**state, device_memory={"allocated": 3 * 2**20, "reserved": 5 * 2**21})
    assert soak.gpu_memory_mib(text) == {"gpu_allocated_mib": 3.0, "gpu_reserved_mib": 10.0}
    assert soak.gpu_memory_mib(Metrics().render(**state)) == {}  # on a CPU: no such series
    assert soak.slope([0, 1, 2, 3], [1.0, 3.0, 5.0, 7.0]) == 2.0 and soak.slope([1], [1.0]) is None


def test_group_rollouts_dry_run_times_every_variant(tmp_path):
    """The GPU command of ``group_rollouts`` at CPU size: one CLI server, every variant once, the
    screen-then-regenerate round, the JSON written."""
    from benchmarks import group_rollouts

    out = tmp_path / "out"
    argv = ["--cpu", "--screen", "6", "--out", str(out), "--work", str(tmp_path / "work")]
    assert group_rollouts.main(argv) == 0
    doc = json.loads((out / "group_rollouts.json").read_text())
    rows = {r["variant"]: r for r in doc["results"]}
    assert set(rows) == set(group_rollouts.VARIANTS)
    assert rows["plain"]["vs_plain"] == 1.0 and rows["plain"]["drift_max"] == 0.0
    assert rows["stride2"]["steps_run"] < rows["plain"]["steps_run"]  # fewer loop steps
    assert 0 < rows["share_prefix"]["formula_vs_plain"] < 1
    [screen] = doc["screen"]
    assert screen["seconds_per_kept"] > 0


def test_group_rollouts_dry_run_on_qwen_image_with_true_cfg(tmp_path):
    """The Qwen-Image row's command (verl-omni's true CFG with a negative prompt) at CPU size."""
    from benchmarks import group_rollouts

    out = tmp_path / "out"
    argv = ["--cpu", "--model", "tiny-qwenimage", "--guidance-scale", "1", "--true-cfg-scale", "4",
            "--negative-prompt", " ", "--max-sequence-length", "32", "--out", str(out), "--work", str(tmp_path / "w")]  # fmt: skip
    assert group_rollouts.main(argv) == 0
    doc = json.loads((out / "group_rollouts.json").read_text())
    assert doc["settings"]["true_cfg_scale"] == 4 and doc["settings"]["model"] == "tiny-qwenimage"
    rows = {r["variant"]: r for r in doc["results"]}
    assert set(rows) == set(group_rollouts.VARIANTS)
    assert rows["share_prefix"]["steps_run"] == rows["plain"]["steps_run"] == 6
    assert rows["stride2"]["steps_run"] < 6
