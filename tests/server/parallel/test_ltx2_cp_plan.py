"""LTX-2 under diffusers' Ulysses context parallelism, checked on the CPU with two gloo ranks.

Issue #27 asks for ``--context-parallel k`` on LTX-2, whose transformer denoises a video and an
audio stream jointly. diffusers 0.42.1 ships ``LTX2VideoTransformer3DModel._cp_plan``
(transformer_ltx2.py:1125-1136): it splits ``hidden_states`` (video), ``encoder_hidden_states`` and
``encoder_attention_mask`` (text) on dim 1, splits the two outputs of the ``rope`` module (video
self-attention RoPE) on dim 1 *if they are 3-D*, and gathers ``proj_out``. Audio
(``audio_hidden_states``, ``audio_rope``, ``cross_attn_rope``, ``cross_attn_audio_rope``,
``audio_proj_out``) is not named, so it stays whole (replicated) on every rank.

Every one of the six attentions of a block (attn1, audio_attn1, attn2, audio_attn2,
audio_to_video_attn, video_to_audio_attn; transformer_ltx2.py:464-560) runs
``LTX2AudioVideoAttnProcessor`` (or the perturbed one), whose ``dispatch_attention_fn`` call passes
``parallel_config=self._parallel_config`` (:206-215, :301-310); ``enable_parallelism`` sets that on
every processor (modeling_utils.py:1816-1823), so all six go through Ulysses' all-to-all.

What these tests establish (two real ranks over gloo, diffusers' own hooks and Ulysses code, the
zoo's tiny LTX-2 transformer in float32):

1. diffusers' plan does not run on LTX-2 at all:
   - ``rope_type="split"`` (LTX-2's real config and the zoo's tiny): ``rope`` returns 4-D
     ``(B, heads, tokens, r)`` cos/sin (:1050-1078), the plan expects 3-D, so the split hook only warns
     and leaves them whole (hooks/context_parallel.py:206-212) while the video tokens are halved:
     ``apply_split_rotary_emb`` fails (:71).
   - ``rope_type="interleaved"``: ``rope`` is split, but ``cross_attn_rope`` (the video positions of
     the audio-to-video / video-to-audio attentions, :1450) is not, so the a2v query (half the video)
     meets a whole-video RoPE: ``apply_interleaved_rotary_emb`` fails (:42).
   - Any text mask (the pipeline always passes ``connector_attention_mask``): the processor repeats
     the mask over all ``heads`` (:175-176, attention.py:485-487) but Ulysses attends ``heads / k`` per
     rank (attention_dispatch.py:2559-2583): SDPA's output shape does not match.
2. Replicated audio is *not* silently wrong under Ulysses: the all-to-all does treat each rank's
   whole audio as a "shard", so the attention sees every audio token k times (recorded below: 2 x 6
   audio queries/keys at k = 2), but duplicated keys and values leave softmax attention unchanged and
   each rank gets back one copy of the duplicated query rows, so audio self-attention, audio-text,
   a2v and v2a all equal k = 1 (float32 ~1e-7), and both ranks hold the same audio.
   ``audio_proj_out`` is not gathered, and need not be: every rank computes the whole audio.
3. A corrected plan serves LTX-2 exactly (``cp_plans.ltx2_plan`` with ``localize_ltx2_attentions``; the server runs the
   same plan from ``server/parallel/cp_plans.py``, and the ``server_*`` cases call the server's own
   ``cp_calls.enable_layout`` on both ranks, since its CPU mirror mode does not shard): split only the video tokens (``hidden_states``), split both outputs of ``rope`` *and*
   ``cross_attn_rope`` on the token dim (dim 2 for 4-D split RoPE, dim 1 for 3-D interleaved),
   gather ``proj_out``; keep text and audio whole on every rank; and take the attentions whose keys
   and values are whole on every rank off Ulysses (``_parallel_config = None`` on attn2,
   audio_attn1, audio_attn2, audio_to_video_attn: local attention is then exact, and the text mask
   keeps its ``heads`` layout). Only attn1 (video self) and video_to_audio_attn (audio queries, video
   keys) go through the all-to-all. It matches k = 1 for both RoPE types with a padded text mask.

``tests/server/parallel/test_ltx2_cp_plan_gpu.py`` runs the same cases over NCCL in bfloat16 on two GPUs.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from diffusion_rollout.server.parallel.cp_plans import localize_ltx2_attentions, ltx2_plan
from diffusion_rollout.testing import free_port

WORLD = 2
# Tiny shapes: 2 x 4 x 4 = 32 video tokens, 6 audio tokens, 8 text tokens, CFG-like batch of 2.
SHAPES = {"batch": 2, "frames": 2, "height": 4, "width": 4, "audio_frames": 6, "text": 8}
# The Ulysses-routed attentions of the corrected plan; the other four run locally on each rank.
ULYSSES_ATTENTIONS = ("attn1", "video_to_audio_attn")

# name: (rope_type, text mask, plan, how the attentions are routed)
CASES: dict[str, tuple[str, str | None, str, str]] = {
    "diffusers_split_rope": ("split", "padded", "diffusers", "ulysses"),
    "diffusers_interleaved_no_mask": ("interleaved", None, "diffusers", "ulysses"),
    "diffusers_interleaved_mask": ("interleaved", "ones", "diffusers", "ulysses"),
    "replicated_audio_all_ulysses": ("split", None, "corrected", "ulysses"),
    "corrected_split": ("split", "padded", "corrected", "local"),
    "corrected_interleaved": ("interleaved", "padded", "corrected", "local"),
    # The server's own code path: server/parallel/cp_calls.py's enable_layout -> server/parallel/cp_plans.py.
    "server_split": ("split", "padded", "server", "server"),
    "server_interleaved": ("interleaved", "padded", "server", "server"),
}


def tiny_ltx2_transformer(rope_type: str = "split"):
    """The zoo's tiny LTX-2 transformer (seed 0), with ``rope_type`` swapped in if asked (RoPE has no weights)."""
    from diffusers import LTX2VideoTransformer3DModel

    from diffusion_rollout.models.tiny_video import ltx2_components

    model = ltx2_components(0)["transformer"]
    if model.config.rope_type != rope_type:
        other = LTX2VideoTransformer3DModel.from_config({**model.config, "rope_type": rope_type})
        other.load_state_dict(model.state_dict(), strict=True)
        model = other
    return model.eval()


def make_inputs(model, mask: str | None, device, dtype, shapes: dict[str, int] = SHAPES) -> dict[str, Any]:
    """One transformer call shaped like LTX2Pipeline's (pipeline_ltx2.py:1415-1437), tokens already packed."""
    g = torch.Generator().manual_seed(1)
    b, f, h, w = shapes["batch"], shapes["frames"], shapes["height"], shapes["width"]
    a, n = shapes["audio_frames"], shapes["text"]
    cfg = model.config

    def rnd(*s):
        return torch.randn(*s, generator=g).to(device=device, dtype=dtype)

    text_mask = None
    if mask is not None:
        text_mask = torch.ones(b, n, dtype=torch.int64)
        if mask == "padded":  # connectors without learnable registers (the zoo's tiny) keep padding
            text_mask[0, -3:] = 0
        text_mask = text_mask.to(device)
    return {
        "hidden_states": rnd(b, f * h * w, cfg.in_channels),
        "audio_hidden_states": rnd(b, a, cfg.audio_in_channels),
        "encoder_hidden_states": rnd(b, n, cfg.caption_channels),
        "audio_encoder_hidden_states": rnd(b, n, cfg.caption_channels),
        "timestep": torch.full((b,), 500.0, device=device, dtype=dtype),
        "sigma": torch.full((b,), 0.5, device=device, dtype=dtype),
        # Passed even when None: diffusers' plan names it, and its split hook needs the keyword.
        "encoder_attention_mask": text_mask,
        "audio_encoder_attention_mask": text_mask,
        "num_frames": f,
        "height": h,
        "width": w,
        "audio_num_frames": a,
        "return_dict": False,
    }


def _run_case(name: str, device, dtype, shapes: dict[str, int], seen: list) -> dict[str, Any]:
    from diffusers import ContextParallelConfig

    rope_type, mask, plan, routing = CASES[name]
    model = tiny_ltx2_transformer(rope_type).to(device=device, dtype=dtype)
    result: dict[str, Any] = {"blocks": len(model.transformer_blocks)}
    with torch.no_grad():
        ref = model(**make_inputs(model, mask, device, dtype, shapes))
    result["ref_video"], result["ref_audio"] = (t.float().cpu() for t in ref)
    try:
        if plan == "server":  # what a served engine runs on every rank (rank 0 and the followers)
            from diffusion_rollout.server.parallel.cp_calls import enable_layout

            enable_layout({"transformer": model}, 1, WORLD)  # ring degree 1: Ulysses over WORLD
        else:
            model.enable_parallelism(
                config=ContextParallelConfig(ulysses_degree=WORLD),
                cp_plan=None if plan == "diffusers" else ltx2_plan(model),
            )
        if routing == "local":
            localize_ltx2_attentions(model)
        seen.clear()
        with torch.no_grad():
            out = model(**make_inputs(model, mask, device, dtype, shapes))
        result["video"], result["audio"] = (t.float().cpu() for t in out)
        result["attention_lengths"] = list(seen)
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)
        result["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        result["where"] = [f.name for f in frames]
    return result


def _worker(
    rank: int,
    port: int,
    backend: str,
    dtype_name: str,
    cases: list[str],
    shapes: dict[str, int],
    out_dir: str,
) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    if backend == "gloo":
        # diffusers' _resolve_parallel_config picks ``rank % torch.accelerator.device_count()``: 0 on a CPU.
        torch.accelerator.device_count = lambda: 1
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, rank=rank, world_size=WORLD)

    import diffusers.models.attention_dispatch as dispatch

    # Record (query tokens, key tokens) as the attention op sees them, after Ulysses' all-to-all.
    seen: list[tuple[int, int]] = []
    original = dispatch._native_attention_forward_op

    def recording(ctx, query, key, value, *args, **kwargs):
        seen.append((int(query.shape[1]), int(key.shape[1])))
        return original(ctx, query, key, value, *args, **kwargs)

    dispatch._native_attention_forward_op = recording
    dtype = getattr(torch, dtype_name)
    results = {name: _run_case(name, device, dtype, shapes, seen) for name in cases}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def run_two_ranks(
    backend: str, dtype_name: str, cases: list[str], shapes: dict[str, int] = SHAPES
) -> list[dict[str, Any]]:
    """Each case on two ranks (gloo on the CPU, nccl on cuda:0/1); one result dict per rank."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(
            _worker, args=(free_port(), backend, dtype_name, cases, shapes, out_dir), nprocs=WORLD, join=True
        )
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.fixture(scope="module")
def ranks():
    return run_two_ranks("gloo", "float32", list(CASES))


def test_diffusers_plan_leaves_4d_split_rope_whole_and_fails(ranks):
    """LTX-2's own ``rope_type="split"``: the plan's 3-D RoPE split is skipped, the video RoPE no longer fits."""
    for r in ranks:
        res = r["diffusers_split_rope"]
        assert "error" in res, "diffusers' LTX-2 plan ran with split RoPE: re-examine the findings"
        assert "apply_split_rotary_emb" in res["where"], res


def test_diffusers_plan_does_not_shard_the_cross_modal_rope(ranks):
    """Interleaved RoPE, no mask: ``rope`` is split but ``cross_attn_rope`` is not; the a2v query does not fit."""
    for r in ranks:
        res = r["diffusers_interleaved_no_mask"]
        assert "error" in res
        assert "apply_interleaved_rotary_emb" in res["where"], res


def test_diffusers_plan_breaks_on_a_text_mask_under_ulysses(ranks):
    """The processor's mask has every head; Ulysses attends heads / k: SDPA refuses the shapes."""
    for r in ranks:
        res = r["diffusers_interleaved_mask"]
        assert "error" in res
        assert "_native_attention_forward_op" in res["where"] or "recording" in res["where"], res


def test_replicated_audio_through_ulysses_is_duplicated_yet_exact(ranks):
    """Whole audio on each rank is exchanged as if it were a shard: k copies, same attention values."""
    tokens = SHAPES["frames"] * SHAPES["height"] * SHAPES["width"]
    audio, text = SHAPES["audio_frames"], SHAPES["text"]
    for r in ranks:
        res = r["replicated_audio_all_ulysses"]
        assert "error" not in res, res.get("error")
        # Block 0: attn1, audio_attn1, attn2, audio_attn2, a2v, v2a (transformer_ltx2.py:623-790).
        assert res["attention_lengths"][:6] == [
            (tokens, tokens),  # video self: halves gathered back to every token
            (WORLD * audio, WORLD * audio),  # audio self: each rank's whole audio counted as a shard
            (tokens, WORLD * text),  # video-text: text whole on each rank, duplicated
            (WORLD * audio, WORLD * text),
            (tokens, WORLD * audio),  # a2v: duplicated audio keys
            (WORLD * audio, tokens),  # v2a: duplicated audio queries
        ]
        assert max_diff(res["video"], res["ref_video"]) < 1e-5
        assert max_diff(res["audio"], res["ref_audio"]) < 1e-5
    # Both ranks hold the same audio (audio_proj_out is not gathered, and need not be).
    assert torch.equal(
        ranks[0]["replicated_audio_all_ulysses"]["audio"], ranks[1]["replicated_audio_all_ulysses"]["audio"]
    )


@pytest.mark.parametrize(
    "case", ["corrected_split", "corrected_interleaved", "server_split", "server_interleaved"]
)
def test_corrected_plan_matches_one_rank_with_a_padded_text_mask(ranks, case):
    """The sketch here, and the server's own plan (``server/parallel/cp_plans.py`` through ``enable_layout``)."""
    tokens = SHAPES["frames"] * SHAPES["height"] * SHAPES["width"]
    for r in ranks:
        res = r[case]
        assert "error" not in res, res.get("error")
        assert res["video"].shape == res["ref_video"].shape
        assert res["audio"].shape == res["ref_audio"].shape
        assert max_diff(res["video"], res["ref_video"]) < 1e-5
        assert max_diff(res["audio"], res["ref_audio"]) < 1e-5
        # Only attn1 and v2a reach Ulysses' all-to-all (recorded per call); the four local ones call
        # SDPA directly with each rank's half of the video queries against whole text/audio.
        per_block = [(tokens, tokens), (WORLD * SHAPES["audio_frames"], tokens)]
        assert res["attention_lengths"] == per_block * res["blocks"]
    for stream in ("video", "audio"):
        assert torch.equal(ranks[0][case][stream], ranks[1][case][stream])
