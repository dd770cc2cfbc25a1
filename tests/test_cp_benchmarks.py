"""CPU dry runs of the two-GPU context-parallel measurements (issue #27): the image-to-video rows of
``benchmarks/context_parallel.py`` and ``benchmarks/cp_tradeoff.py`` (2 replicas vs context parallel
2, both served by the CLI), on the tiny zoo models; and the Wan 2.1 I2V 14B builder's architecture."""

from __future__ import annotations

import json

import torch


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


def test_cp_tradeoff_dry_run_both_layouts(tmp_path):
    """The trade-off command on the CPU: the CLI server with two CPU Ray replicas, then with
    ``--context-parallel 2`` (mirror mode), each under the Flow-GRPO group load; both layouts answer
    with checked outputs and the JSON holds videos/s, latency and the ratios."""
    from benchmarks import cp_tradeoff

    argv = ["--model", "tiny-wan", "--cpu", "--requests", "2", "--out", str(tmp_path), "--work", str(tmp_path / "w")]  # fmt: skip
    assert cp_tradeoff.main(argv) == 0
    doc = json.loads((tmp_path / "cp_tradeoff_tiny-wan.json").read_text())
    assert doc["benchmark"] == "cp_tradeoff" and doc["ok"] and doc["facts"]["commit"]
    assert doc["facts"]["versions"]["torch"] and doc["facts"]["versions"]["diffusers"]
    rows = {r["layout"]: r for r in doc["results"]}
    assert set(rows) == {"replicas", "context_parallel"}
    for row in rows.values():
        assert "error" not in row and row["exit_code"] == 0, row
        assert row["outputs_ok"] and row["outputs"] == doc["settings"]["group"] == 4, row
        assert row["videos"] == 2 * 4 and row["videos_per_s"] > 0 and row["latency_s"] > 0
        assert row["video_shape"][1:] == [5, 32, 32]  # C, F, H, W of the tiny Wan's uint8 video
    assert rows["replicas"]["command"][-4:] == ["--replicas", "2", "--gpus-per-replica", "0"]
    assert sum(rows["replicas"]["served_requests_per_replica"]) > 0
    assert len(rows["replicas"]["served_requests_per_replica"]) == 2
    assert rows["context_parallel"]["command"][-2:] == ["--context-parallel", "2"]
    cp = rows["context_parallel"]["context_parallel"]
    assert cp["ranks"] == 2 and cp["mode"] == "mirror" and cp["follower_forwards"][0] > 0
    summary = doc["summary"]
    assert summary["cp_over_replicas_throughput"] > 0 and summary["cp_over_replicas_latency"] > 0
