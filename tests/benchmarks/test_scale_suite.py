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
    """Parameter counts from one- and two-layer builds on the meta device (no memory), extrapolated
    to the configs' layer counts: Qwen-Image ~20.4B, each Wan 2.2 A14B expert ~14.3B, TI2V-5B ~5.0B."""
    from accelerate import init_empty_weights
    from diffusers import QwenImageTransformer2DModel, WanTransformer3DModel

    from benchmarks.model_builders_scale import WAN22_TI2V_5B_TRANSFORMER

    def billions(cls, layers: int, **config) -> float:
        counts = []
        for n in (1, 2):
            with init_empty_weights():
                model = cls(**{**config, "num_layers": n})
            counts.append(sum(p.numel() for p in model.parameters()))
        return (counts[0] + (layers - 1) * (counts[1] - counts[0])) / 1e9

    assert 20.0 < billions(QwenImageTransformer2DModel, 60) < 20.6  # its defaults are Qwen-Image's config
    assert 14.0 < billions(WanTransformer3DModel, 40) < 14.5  # its defaults are the 14B config
    assert 4.9 < billions(WanTransformer3DModel, 30, **WAN22_TI2V_5B_TRANSFORMER) < 5.1


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
    assert rows["single_gpu"]["ms_per_forward"] > 0
    assert rows["ulysses"]["cp"].startswith("skipped") and rows["ring"]["cp"].startswith("skipped")
