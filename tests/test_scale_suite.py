"""The real-scale / image-conditioned GPU suite (benchmarks/scale_suite.py), dry-run on tiny models.

The real builders are checked for their public sizes on the meta device (no memory); the suite itself
runs on the tiny zoo: the ODE gate must be exact for image-conditioned models too (the stock pipeline
gets the same image), the SDE rollout of a two-expert model has one window per expert, and the
response of an image model carries the image latents.
"""

from __future__ import annotations

import json

from benchmarks import scale_suite


def test_scale_builders_have_the_public_sizes():
    from accelerate import init_empty_weights
    from diffusers import QwenImageTransformer2DModel, WanTransformer3DModel

    from benchmarks.model_builders_scale import WAN22_TI2V_5B_TRANSFORMER

    with init_empty_weights():
        models = {
            "qwen-image": QwenImageTransformer2DModel(),  # its defaults are Qwen-Image's config
            "wan-14b": WanTransformer3DModel(),  # the 14B config (each Wan 2.2 A14B expert)
            "ti2v-5b": WanTransformer3DModel(**WAN22_TI2V_5B_TRANSFORMER),
        }
    billions = {k: sum(p.numel() for p in m.parameters()) / 1e9 for k, m in models.items()}
    assert 20.0 < billions["qwen-image"] < 20.6, billions
    assert 14.0 < billions["wan-14b"] < 14.5, billions
    assert 4.9 < billions["ti2v-5b"] < 5.1, billions


def test_scale_suite_dry_run_on_tiny_models(tmp_path):
    models = "tiny-wan2.2,tiny-wan-i2v"  # Kontext's gate is in test_image_cond
    argv = ["--device", "cpu", "--models", models, "--steps", "2", "--out", str(tmp_path)]
    assert scale_suite.main(argv) == 0
    doc = json.loads((tmp_path / "scale_suite.json").read_text())
    assert doc["ok"] and not doc["failures"]
    gate = doc["ode_gate"]
    assert {r["model"] for r in gate} == set(models.split(","))
    assert len(gate) == 2 * 4 and all(r["exact"] and r["max_abs_diff"] == 0.0 for r in gate)
    sde = {r["model"]: r for r in doc["timed"] if r["variant"] == "server_sde"}
    assert sde["tiny-wan2.2"]["one_window_per_expert"] is True
    assert sde["tiny-wan2.2"]["sde_experts"] == "transformer,transformer_2"
    assert all(r["log_probs_nonzero_exactly_at_sde_steps"] and r["log_probs_finite"] for r in sde.values())
    assert sde["tiny-wan-i2v"]["latent_condition_shape"] == [1, 20, 2, 4, 4]  # 4 mask + 16 latent channels
    assert all(r["ms_per_step"] > 0 and r["response_mb"] > 0 for r in sde.values())


def test_context_parallel_harness_on_cpu(tmp_path):
    """Two gloo ranks build the same tiny Wan (rank 0's weights broadcast) and run the k = 1 call;
    diffusers' context parallelism itself needs an accelerator, so the CPU run reports it skipped."""
    from benchmarks import context_parallel

    argv = ["--device", "cpu", "--gpus", "2", "--tiny", "--steps", "1", "--out", str(tmp_path)]
    assert context_parallel.main(argv) == 0
    doc = json.loads((tmp_path / "context_parallel.json").read_text())
    rows = {r["mode"]: r for r in doc["results"]}
    assert rows["single_gpu"]["k"] == 1 and rows["single_gpu"]["ms_per_step"] > 0
    assert rows["ulysses"]["cp"].startswith("skipped") and rows["ring"]["cp"].startswith("skipped")
