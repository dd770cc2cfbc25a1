"""CPU dry runs of the multi-GPU context-parallel measurements (issues #27, #44): the image-to-video
rows of ``benchmarks/context_parallel.py`` and ``benchmarks/cp_tradeoff.py`` (the layouts of two
GPUs, 2x1 and 1x2, served by the CLI), on the tiny zoo models; the four-GPU layouts' plan, their
check and the advice table without servers; and the Wan 2.1 I2V 14B builder's architecture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


@pytest.mark.slow
def test_context_parallel_image_to_video_harness_on_cpu(tmp_path):
    """Wan 2.1 I2V (CLIP image tokens) and TI2V-5B image-to-video (per-token timesteps) through the
    benchmark's k = 1 call and transformer call on two gloo ranks; CP itself is skipped on the CPU."""
    from benchmarks import context_parallel

    argv = ["--device", "cpu", "--gpus", "2", "--tiny", "--model", "tiny-wan-i2v,tiny-wan2.2-ti2v-i2v",
            "--modes", "ulysses", "--steps", "1", "--out", str(tmp_path)]  # fmt: skip
    assert context_parallel.main(argv) == 0
    doc = json.loads((tmp_path / "context_parallel.json").read_text())
    assert doc["facts"]["device"] == "cpu" and doc["facts"]["commit"] and doc["ok"]
    assert doc["settings"]["models"] == ["tiny-wan-i2v", "tiny-wan2.2-ti2v-i2v"]
    rows = {(r["model"], r["mode"]): r for r in doc["results"]}
    assert set(rows) == {(m, mode) for m in doc["settings"]["models"] for mode in ("single_gpu", "ulysses")}
    for model, family in (("tiny-wan-i2v", "wan-i2v"), ("tiny-wan2.2-ti2v-i2v", "wan2.2-ti2v-i2v")):
        single = rows[(model, "single_gpu")]
        assert single["family"] == family and single["image_to_video"] is True
        assert single["ms_per_step"] > 0 and single["ms_per_forward"] > 0
        assert rows[(model, "ulysses")]["cp"].startswith("skipped")


def test_wan21_i2v_14b_builder_architecture():
    """The Wan 2.1 I2V 14B 480P builder (public config; the transformer shrunk here for the CPU): the
    I2V layout, a 1280-wide CLIP ViT-H/14 giving 257 image tokens, the 480P scheduler shift."""
    from PIL import Image

    from benchmarks import model_builders_scale
    from benchmarks.model_builders import REAL_MODELS, build_real_pipeline

    assert "wan2.1-i2v-14b-480p" in model_builders_scale.BUILDERS and "wan2.1-i2v-14b-480p" in REAL_MODELS
    assert model_builders_scale.FAMILY["wan2.1-i2v-14b-480p"] == "wan-i2v"
    small = {"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 16, "added_kv_proj_dim": 32,
             "ffn_dim": 16}  # fmt: skip
    pipe = build_real_pipeline("wan2.1-i2v-14b-480p", "cpu", torch.float32, **small)
    cfg = pipe.transformer.config
    assert type(pipe).__name__ == "WanImageToVideoPipeline"
    assert (cfg.in_channels, cfg.out_channels, cfg.image_dim) == (36, 16, 1280)
    assert pipe.image_encoder.config.hidden_size == 1280 and pipe.scheduler.config.flow_shift == 3.0
    embeds = pipe.encode_image(Image.new("RGB", (832, 480), (90, 120, 30)), "cpu")
    assert tuple(embeds.shape) == (1, 257, 1280)


@pytest.mark.slow
def test_cp_tradeoff_dry_run_both_layouts(tmp_path, tiny_model_path):
    """The trade-off command on the CPU for two "GPUs": the CLI server with two CPU Ray replicas
    (``2x1``), then with ``--context-parallel 2`` (``1x2``, mirror mode), each under the same
    Flow-GRPO group load (N clients; 2 requests here, not 2N, to keep it short); both answer with checked outputs, and the JSON
    holds videos/s, latency, the ratios to ``2x1`` and the best layouts. (The session's tiny Wan is
    the model folder: ``model_folder`` finds it under ``--work`` and builds nothing.)"""
    from benchmarks import cp_tradeoff

    work = tmp_path / "w"
    (work / "models").mkdir(parents=True)
    (work / "models" / "tiny-wan").symlink_to(tiny_model_path("wan"), target_is_directory=True)
    argv = ["--model", "tiny-wan", "--cpu", "--requests", "2", "--out", str(tmp_path), "--work", str(work)]
    assert cp_tradeoff.main(argv) == 0
    doc = json.loads((tmp_path / "cp_tradeoff_tiny-wan_x2.json").read_text())
    assert doc["benchmark"] == "cp_tradeoff" and doc["ok"] and doc["facts"]["commit"]
    assert doc["facts"]["versions"]["torch"] and doc["facts"]["versions"]["diffusers"]
    settings = doc["settings"]
    assert (settings["gpus"], settings["requests"], settings["clients"], settings["group"]) == (2, 2, 2, 4)
    assert settings["layouts"] == ["2x1", "1x2"]
    rows = {r["layout"]: r for r in doc["results"]}
    assert list(rows) == ["2x1", "1x2"]
    for row in rows.values():
        assert "error" not in row and row["exit_code"] == 0, row
        assert row["outputs_ok"] and row["layout_ok"] and row["outputs"] == 4, row
        assert row["videos"] == 2 * 4 and row["videos_per_s"] > 0 and row["latency_s"] > 0
        assert row["ready_s"] > 0 and row["throughput_s"] > 0
        assert row["video_shape"][1:] == [5, 32, 32]  # C, F, H, W of the tiny Wan's uint8 video
    assert (rows["2x1"]["replicas"], rows["2x1"]["k"], rows["1x2"]["replicas"], rows["1x2"]["k"]) == (
        2,
        1,
        1,
        2,
    )
    assert rows["2x1"]["command"][-4:] == ["--replicas", "2", "--gpus-per-replica", "0"]
    served = rows["2x1"]["served_requests_per_replica"]
    # warm-up 2, latency 1, throughput 2 (ready is /model_info's, no probe generation): on both replicas
    assert len(served) == 2 and sum(served) == 5 and min(served) > 0, served
    assert "context_parallel" not in rows["2x1"]
    assert (
        rows["1x2"]["command"][-2:] == ["--context-parallel", "2"]
        and "--replicas" not in rows["1x2"]["command"]
    )
    cp = rows["1x2"]["context_parallel"]
    assert cp["ranks"] == 2 and cp["mode"] == "mirror" and cp["follower_forwards"][0] > 0
    summary = doc["summary"]
    assert summary["all_replicas"] == "2x1" and set(summary["layouts"]) == {"2x1", "1x2"}
    base, other = summary["layouts"]["2x1"], summary["layouts"]["1x2"]
    assert base["throughput_vs_all_replicas"] == 1.0 and base["latency_vs_all_replicas"] == 1.0
    assert other["throughput_vs_all_replicas"] == rows["1x2"]["videos_per_s"] / rows["2x1"]["videos_per_s"]
    assert other["latency_vs_all_replicas"] == rows["1x2"]["latency_s"] / rows["2x1"]["latency_s"]
    fastest = max(rows.values(), key=lambda r: r["videos_per_s"])["layout"]
    assert summary["best_throughput"] == fastest
    assert summary["best_latency"] == min(rows.values(), key=lambda r: r["latency_s"])["layout"]


def test_cp_tradeoff_layouts_of_four_gpus():
    """``--gpus 4`` plans 4x1, 2x2 and 1x4 (no server started): the commands a user runs, and what
    the CLI makes of ``--replicas 2 --context-parallel 2`` on a CUDA front: each Ray replica asks for
    two GPUs and runs an engine of two context-parallel ranks."""
    from benchmarks.cp_tradeoff import Layout, plan_layouts, serve_command
    from diffusion_rollout.cluster import ClusterEngine
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.cli import build_parser

    assert plan_layouts(2) == [Layout(2, 1), Layout(1, 2)]
    four = plan_layouts(4)
    assert [(lay.name, lay.replicas, lay.k, lay.gpus) for lay in four] == [
        ("4x1", 4, 1, 4), ("2x2", 2, 2, 4), ("1x4", 1, 4, 4)
    ]  # fmt: skip
    assert plan_layouts(4, "replicas, 1x4") == [Layout(4, 1), Layout(1, 4)]
    assert plan_layouts(4, "2x2,context_parallel,2x2") == [Layout(2, 2), Layout(1, 4)]
    assert plan_layouts(2, "context_parallel") == [Layout(1, 2)]
    for gpus, wanted in ((4, "2x1"), (2, "2x2"), (4, "4x4"), (4, " , ")):
        with pytest.raises(ValueError, match=f"--layouts for --gpus {gpus}"):
            plan_layouts(gpus, wanted)
    with pytest.raises(ValueError, match="--gpus: one of 2, 4"):
        plan_layouts(3)

    tails = {lay.name: serve_command(lay, Path("/m"), 8000, cpu=False)[4:] for lay in four}
    common = ["--model", "/m", "--port", "8000", "--host", "127.0.0.1", "--request-timeout-s", "3600",
              "--dtype", "bfloat16"]  # fmt: skip
    assert tails == {
        "4x1": [*common, "--replicas", "4", "--gpus-per-replica", "1"],
        "2x2": [*common, "--replicas", "2", "--context-parallel", "2"],
        "1x4": [*common, "--context-parallel", "4"],
    }
    assert serve_command(Layout(1, 2), Path("/m"), 8000, cpu=False, cp_mode="ring")[-4:] == [
        "--context-parallel",
        "2",
        "--context-parallel-mode",
        "ring",
    ]
    assert (
        serve_command(Layout(2, 1), Path("/m"), 8000, cpu=False, cp_mode="ring")[-1] == "1"
    )  # k = 1: no mode
    assert serve_command(Layout(2, 1), Path("/m"), 8000, cpu=True)[-4:] == [
        "--replicas",
        "2",
        "--gpus-per-replica",
        "0",
    ]
    for name, replicas, gpus_each, k in (("4x1", 4, 1, 1), ("2x2", 2, 2, 2), ("1x4", None, None, 4)):
        args = build_parser().parse_args(["serve", *tails[name]])
        values = {key: v for key, v in vars(args).items() if key != "command" and v is not None}
        config = ServerConfig(**{**values, "device": "cuda"})  # what the front on the GPU host resolves
        assert (config.replicas, config.context_parallel) == (replicas, k), name
        if replicas:
            assert config.resolved_gpus_per_replica() == gpus_each, name
            replica = ClusterEngine(config).replica_config()
            assert (replica.replicas, replica.device, replica.context_parallel) == (None, "cuda", k), name


def test_cp_tradeoff_layout_check():
    """``check_layout`` reads /server_info: a 2x2 whose replicas share a GPU, or whose follower ran
    nothing, is not the layout asked for."""
    from benchmarks.cp_tradeoff import Layout, check_layout

    cp = {"ranks": 2, "mode": "ulysses", "followers": [{"forwards": 12}]}
    info = {"replicas": [{"served_requests": 3, "gpu_uuids": ["a", "b"]},
                         {"served_requests": 4, "gpu_uuids": ["c", "d"]}],
            "speed": {"context_parallel": cp}}  # fmt: skip
    good = check_layout(Layout(2, 2), info, cuda=True)
    assert good["layout_ok"] and good["replica_gpus"] == [2, 2] and good["distinct_gpus"] == 4
    assert good["served_requests_per_replica"] == [3, 4]
    assert good["context_parallel"] == {"ranks": 2, "mode": "ulysses", "follower_forwards": [12]}
    shared = {**info, "replicas": [info["replicas"][0], {"served_requests": 4, "gpu_uuids": ["b", "c"]}]}
    bad = check_layout(Layout(2, 2), shared, cuda=True)
    assert not bad["layout_ok"] and "3 distinct" in bad["layout_problems"][0]
    idle = {**info, "speed": {"context_parallel": {**cp, "followers": [{"forwards": 0}]}}}
    assert not check_layout(Layout(2, 2), idle, cuda=True)["layout_ok"]
    assert not check_layout(Layout(4, 1), info, cuda=True)["layout_ok"]  # 2 replicas, ranks 2
    alone = {"speed": {"context_parallel": {**cp, "ranks": 4, "followers": [{"forwards": 5}] * 3}}}
    assert check_layout(Layout(1, 4), alone, cuda=True)["layout_ok"]


def test_cp_tradeoff_advice_table():
    """The README's advice table from hand-made rows: ratios over the all-replicas layout, a failed
    layout marked, and no ratios when the all-replicas layout itself failed."""
    from benchmarks.cp_tradeoff import advice_table, summary

    rows = [
        {"layout": "4x1", "replicas": 4, "k": 1, "videos_per_s": 0.8, "latency_s": 20.0},
        {"layout": "2x2", "replicas": 2, "k": 2, "videos_per_s": 0.6, "latency_s": 11.0},
        {"layout": "1x4", "replicas": 1, "k": 4, "error": "RuntimeError: out of memory"},
    ]
    assert advice_table(rows).splitlines() == [
        "| layout | videos/s | latency s | videos/s vs 4x1 | latency vs 4x1 |",
        "|---|---:|---:|---:|---:|",
        "| 4x1 (4 replicas x 1 GPU) | 0.8 | 20 | 1.00x | 1.00x |",
        "| 2x2 (2 replicas x 2 GPUs) | 0.6 | 11 | 0.75x | 0.55x |",
        "| 1x4 (1 replica x 4 GPUs) | failed | - | - | - |",
    ]
    s = summary(rows)
    assert (s["all_replicas"], s["best_throughput"], s["best_latency"]) == ("4x1", "4x1", "2x2")
    assert s["layouts"]["2x2"]["throughput_vs_all_replicas"] == 0.6 / 0.8
    no_base = [{**rows[0], "error": "TimeoutError"}, rows[1]]
    assert advice_table(no_base).splitlines()[2:] == [
        "| 4x1 (4 replicas x 1 GPU) | failed | - | - | - |",
        "| 2x2 (2 replicas x 2 GPUs) | 0.6 | 11 | - | - |",
    ]
    assert summary(no_base)["all_replicas"] is None and summary([])["best_latency"] is None


def test_cp_tradeoff_request_body_sizes_and_input_image():
    """The size and steps a run asks for; an image-to-video family's request carries an input image
    of the output size (a served rollout of it is refused without one)."""
    import argparse
    import base64
    import io

    from PIL import Image

    from benchmarks.cp_tradeoff import request_body

    args = argparse.Namespace(cpu=False, group=4, frames=121, steps=3, height=704, width=1280)
    t2v = request_body("wan2.2-ti2v-5b", args)
    assert (t2v["height"], t2v["width"], t2v["num_frames"], t2v["num_inference_steps"]) == (704, 1280, 121, 3)
    assert "image_data" not in t2v and t2v["num_outputs_per_prompt"] == 4
    i2v = request_body("wan2.2-ti2v-5b-i2v", args)
    (image,) = i2v["image_data"]
    assert Image.open(io.BytesIO(base64.b64decode(image))).size == (1280, 704)
    tiny = request_body("tiny-wan-i2v", argparse.Namespace(cpu=True, group=2, frames=None, steps=None))
    assert len(tiny["image_data"]) == 1 and tiny["generator_device"] == "cpu"


def test_tradeoff_output_check_names_what_a_trainer_would_miss():
    """``cp_tradeoff.check_outputs``: a group answer passes only with every output's uint8 video,
    finite log-probs, trajectory and env, and no output the server flagged non-finite."""
    from benchmarks.cp_tradeoff import check_outputs

    body = {"num_outputs_per_prompt": 2, "num_inference_steps": 3, "num_frames": 5, "height": 8, "width": 16}

    def output(**over):
        good = {
            "generated_output": torch.zeros(3, 5, 8, 16, dtype=torch.uint8),
            "rollout_log_probs": torch.zeros(3),
            "dit_trajectory": object(),
            "denoising_env": {},
            "nonfinite_output": False,
        }
        return {**good, **over}

    assert check_outputs([output(), output()], body)["outputs_ok"]
    bad = check_outputs([output(), output(nonfinite_output=True)], body)
    assert not bad["outputs_ok"] and bad["problems"] == ["output 1: nonfinite_output"]
    nan = check_outputs([output(rollout_log_probs=torch.tensor([0.0, float("nan"), 0.0])), output()], body)
    assert not nan["outputs_ok"] and nan["problems"][0].startswith("output 0: log-probs")
    assert not check_outputs([output()], body)["outputs_ok"]  # one output for a group of 2


def test_cp_served_runs_of_each_gpu_count():
    """``cp_served.phases``: k = 1, 2 (and 4) with their GPUs; side by side only where they fit on
    disjoint GPUs (k = 1 on GPU 0 beside k = 2 on GPUs 1-2), k = 4 alone on all four."""
    from benchmarks.cp_served import phases

    assert phases(4, overlap=True) == [[(1, [0]), (2, [1, 2])], [(4, [0, 1, 2, 3])]]
    assert phases(4, overlap=False) == [[(1, [0])], [(2, [0, 1])], [(4, [0, 1, 2, 3])]]
    assert phases(2, overlap=True) == [[(1, [0])], [(2, [0, 1])]]  # 1 + 2 GPUs do not fit on 2


def test_cp_served_servers_see_their_gpus_through_an_outer_setting():
    """A run under ``CUDA_VISIBLE_DEVICES=4,5,6,7`` puts k = 2's server (indices 1-2) on GPUs 5 and 6."""
    from benchmarks.cp_served import visible_devices

    assert visible_devices([1, 2], None) == "1,2"
    assert visible_devices([1, 2], "4,5,6,7") == "5,6"
    assert visible_devices([0], "GPU-aa, GPU-bb") == "GPU-aa"


def test_cp_served_comparison_names_the_field_that_differs():
    """``cp_served.compare``: equal answers are equal; one log-prob changed, one video pixel off by 3
    or a missing trajectory makes that field (and the whole) unequal with its |diff|."""
    import torch

    from benchmarks.cp_served import compare, kept

    def answer(video_px: int = 7, lp: float = -1.0, trajectory: bool = True) -> list[dict]:
        video = torch.full((3, 5, 4, 4), 9, dtype=torch.uint8)
        video[0, 0, 0, 0] = video_px
        out = {"generated_output": video, "rollout_log_probs": torch.tensor([lp, -2.0])}
        if trajectory:
            out["dit_trajectory"] = torch.ones(3, 2, 2)
        return [out]

    ref = kept(answer())
    same = compare(kept(answer()), ref)
    assert same["equal"] and same["generated_output"] == {"equal": True, "max_abs_diff": 0.0, "tensors": 1}
    off = compare(kept(answer(video_px=4, lp=-1.5)), ref)
    assert not off["equal"] and off["dit_trajectory"]["equal"]
    assert off["generated_output"]["max_abs_diff"] == 3.0  # uint8 compared as integers, not wrapped
    assert off["rollout_log_probs"] == {"equal": False, "max_abs_diff": 0.5, "tensors": 1}
    missing = compare(kept(answer(trajectory=False)), ref)
    assert not missing["equal"] and missing["dit_trajectory"]["max_abs_diff"] is None


def test_cp_served_runs_every_k_and_compares_it_with_k1(tmp_path, tiny_model_path, monkeypatch):
    """``cp_served.main`` over its runs, each server stood in by a fake ``serve_once`` (the CLI path it
    drives, ``serve_command``, ``timed_request`` and ``check_layout``, runs for real in the
    ``cp_tradeoff`` dry run above; ``cp_served`` itself ran on 4x H200, ``cp-served-video``): the rows
    carry k, what ran beside them, the speedup and efficiency over k = 1, and the comparison with
    k = 1's tensors; a k whose answer differs is not equal (the run stays ok: its outputs were well
    formed), and the JSON is written."""
    import torch

    from benchmarks import cp_served

    work = tmp_path / "w"
    (work / "models").mkdir(parents=True)
    (work / "models" / "tiny-wan").symlink_to(tiny_model_path("wan"), target_is_directory=True)
    seen = []

    def fake_serve_once(model, folder, k, gpu_ids, body, args):
        seen.append((k, gpu_ids, body["num_inference_steps"], body["num_outputs_per_prompt"]))
        lp = torch.tensor([-1.0, -2.0]) if k != 4 else torch.tensor([-1.0, -2.5])
        out = [{"generated_output": torch.zeros(3, 5, 32, 32, dtype=torch.uint8), "rollout_log_probs": lp,
                "dit_trajectory": torch.ones(3, 4)}]  # fmt: skip
        row = {"k": k, "gpu_ids": gpu_ids, "latency_s": 8.0 / k**0.5, "latency_inference_s": 6.0 / k**0.5,
               "outputs_ok": True, "layout_ok": True, "exit_code": 0}  # fmt: skip
        return row, cp_served.kept(out)

    monkeypatch.setattr(cp_served, "serve_once", fake_serve_once)
    argv = [
        "--cases",
        "tiny-wan",
        "--cpu",
        "--gpus",
        "4",
        "--out",
        str(tmp_path),
        "--work",
        str(work),
        "--tag",
        "t",
    ]
    assert cp_served.main(argv) == 0
    assert seen == [(1, [0], 4, 1), (2, [0, 1], 4, 1), (4, [0, 1, 2, 3], 4, 1)]  # defaults: 4 steps, 1 video
    doc = json.loads((tmp_path / "cp_served_t.json").read_text())
    assert doc["settings"]["overlap"] is False and len(doc["settings"]["runs"]) == 3  # one at a time on a CPU
    k1, k2, k4 = doc["results"]
    assert (k1["beside"], k2["beside"], k4["beside"], k4["model"], k4["steps"]) == ([], [], [], "tiny-wan", 4)
    assert k1["speedup_vs_k1"] == 1.0 and abs(k2["speedup_vs_k1"] - 2**0.5) < 1e-12
    assert abs(k4["efficiency"] - 0.5) < 1e-12 and abs(k4["inference_speedup_vs_k1"] - 2.0) < 1e-12
    assert k1["equal_to_k1"] and k2["equal_to_k1"] and not k4["equal_to_k1"]
    assert k4["vs_k1"]["rollout_log_probs"] == {"equal": False, "max_abs_diff": 0.5, "tensors": 1}
    assert k4["vs_k1"]["generated_output"]["equal"] and doc["ok"] is True
