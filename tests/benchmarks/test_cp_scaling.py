"""benchmarks/cp_scaling.py on the CPU: the weight-sharing twin, the layout plan, and a 2-rank dry run."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import cp_scaling
from benchmarks.cp_scaling import Case, compare, decode_share, layout_plan, output_tensors, twin


@pytest.mark.parametrize("family", ["ltx2"])  # two outputs; Wan's twin: the dry run checks it
def test_twin_shares_every_tensor_and_computes_the_same_bits(family):
    from diffusion_rollout.models import build_tiny_pipeline

    pipe = build_tiny_pipeline(family)
    pipe.set_progress_bar_config(disable=True)
    call, calls_per_step, decode_s, _ = cp_scaling._capture(pipe, Case.parse(f"tiny-{family}"), "cpu")
    module = pipe.transformer
    copy = twin(module)
    ours = {n: t.data_ptr() for n, t in [*module.named_parameters(), *module.named_buffers()]}
    theirs = {n: t.data_ptr() for n, t in [*copy.named_parameters(), *copy.named_buffers()]}
    assert theirs == ours  # the same storage, not a copy
    with torch.inference_mode():
        ref = module(*call[0], **call[1])
        out = copy(*call[0], **call[1])
    assert compare(out, ref) == {"bit_identical_to_k1": True, "max_abs_diff_vs_k1": 0.0, "finite": True}
    assert len(output_tensors(ref)) == (2 if family == "ltx2" else 1)  # LTX-2: video and audio
    assert calls_per_step == (1 if family == "ltx2" else 2)  # LTX-2 batches CFG; Wan and HV call twice
    assert decode_s > 0


def test_compare_reports_a_difference():
    a = torch.zeros(3)
    b = torch.tensor([0.0, 0.5, 0.0])
    assert compare((a,), (b,)) == {"bit_identical_to_k1": False, "max_abs_diff_vs_k1": 0.5, "finite": True}


def test_layout_plan_says_why_a_layout_is_not_run():
    plan = {
        name: why
        for name, _, _, why in layout_plan(list(cp_scaling.LAYOUTS), 4, "WanTransformer3DModel", 12, True)
    }
    assert plan == {"ulysses2": None, "ring2": None, "ulysses4": None, "ring4": None, "usp2x2": None}
    plan = {
        n: w for n, _, _, w in layout_plan(["ulysses4", "ring2"], 4, "LTX2VideoTransformer3DModel", 30, True)
    }
    assert plan["ulysses4"] == "30 heads do not divide by the Ulysses degree 4"
    assert "Ulysses-only" in plan["ring2"]
    plan = {
        n: w for n, _, _, w in layout_plan(["ulysses4", "ulysses2"], 2, "WanTransformer3DModel", 12, False)
    }
    assert plan == {"ulysses4": "needs 4 ranks dividing 2", "ulysses2": "skipped (no accelerator)"}


def test_kernel_kinds():
    assert cp_scaling.kernel_kind("ncclDevKernel_AllToAll_RING_LL") == "communication"
    assert cp_scaling.kernel_kind("pytorch_flash::flash_fwd_kernel") == "attention"
    assert cp_scaling.kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert cp_scaling.kernel_kind("aten::addmm") == "matmul"
    assert cp_scaling.kernel_kind("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT") == "matmul"
    assert cp_scaling.kernel_kind("vectorized_elementwise_kernel") == "other"


def test_decode_share_and_case_parsing():
    assert decode_share(10.0, 4500.0, 20) == pytest.approx(10.0 / 100.0)
    assert Case.parse("wan2.1-14b@1280x720x81") == Case("wan2.1-14b", 1280, 720, 81)
    assert Case.parse("tiny-wan").size == "32x32x5"
    with pytest.raises(ValueError, match="model@WIDTHxHEIGHTxFRAMES"):
        Case.parse("wan2.1-14b")


def test_dry_run_two_gloo_ranks(tmp_path):
    """Every rank gets rank 0's captured call and runs k = 1; the parallel layouts are skipped with
    the reason (no accelerator); the VAE's split decode equals its tiled decode; the JSON is written."""
    rc = cp_scaling.main(
        ["--device", "cpu", "--gpus", "2", "--cases", "tiny-wan", "--repeats", "1", "--layouts",
         "ulysses2,ulysses4", "--profile", "--vae-split", "--out", str(tmp_path)]
    )  # fmt: skip
    assert rc == 0
    (path,) = tmp_path.glob("cp_scaling*.json")
    doc = json.loads(path.read_text())
    assert doc["ok"] is True
    k1, u2, u4, rank0, split2 = doc["results"]
    assert (k1["layout"], k1["k"], k1["groups"], k1["calls_per_step"]) == ("k1", 1, 2, 2)
    assert k1["twin_bit_identical"] is True and k1["ms_per_forward"] > 0
    assert k1["hidden_states_shape"] == [1, 16, 2, 4, 4]
    assert k1["vae_decode_share"]["20"] == decode_share(k1["vae_decode_s"], k1["ms_per_step"], 20) > 0
    assert u2["skipped"] == "skipped (no accelerator)" and u4["skipped"] == "needs 4 ranks dividing 2"
    # The VAE: tiled and split over the two ranks (tiny tiles: several per frame), equal bit for bit.
    assert (rank0["layout"], split2["layout"], split2["k"]) == ("vae_rank0", "vae_split2", 2)
    assert rank0["vae_untiled_s"] > 0 and rank0["vae_tiled_s"] > 0 and split2["vae_split_s"] > 0
    assert split2["split_bit_identical_to_tiled"] is True
    prof = k1["profile"]  # on a CPU: the ops' own CPU time by family
    assert prof["matmul_ms"] > 0 and prof["attention_ms"] > 0
    parts = prof["communication_ms"] + prof["attention_ms"] + prof["matmul_ms"] + prof["other_ms"]
    assert prof["device_total_ms"] == pytest.approx(parts)
