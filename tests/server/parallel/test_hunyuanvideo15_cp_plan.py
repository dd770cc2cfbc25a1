"""HunyuanVideo 1.5 under the server's Ulysses plan, checked on the CPU with two gloo ranks against k = 1.

diffusers 0.42.1 ships no ``_cp_plan`` for ``HunyuanVideo15Transformer3DModel``; the server runs its
own (``server/parallel/cp_plans.py``: :func:`hunyuanvideo15_plan` and ``HunyuanVideo15UlyssesProcessor``):
the video tokens are split after the patch embedding (``x_embedder``) with their RoPE (``rope``),
``proj_out`` is gathered, and the text (Qwen2.5-VL tokens through the token refiner, ByT5 tokens,
the SigLIP image tokens) stays whole on every rank. Each block's joint attention over ``[video;
text]`` exchanges only the video Q/K/V through Ulysses' all-to-all; the text Q/K/V are cut to the
rank's heads locally, and the text output is all-gathered over the heads.

What these tests establish (two real ranks over gloo, diffusers' own split/gather hooks, float32):

1. The plan with diffusers' stock processor does not run: the processor builds its ``(S, S)`` joint
   mask from the rank's local sequence (video shard + whole text), Ulysses all-gathers it on the key
   dim only, and SDPA's query length (the whole gathered sequence) no longer matches the mask's.
   (Had the mask fit, Ulysses would still have counted each rank's whole text k times as keys.)
2. The server's own code path (``cp_calls.enable_layout`` -> ``cp_plans.enable_plan``, as every
   served rank runs it) matches k = 1 within 1e-5 for text-to-video (zero image embeddings, masked)
   and for image embeddings that are attended (the I2V path), with a padded Qwen and a padded ByT5
   mask, on the zoo's tiny model (2 heads: one per rank) and a 4-head one (two per rank); both ranks
   return the same whole video.

``torch.accelerator.device_count`` is patched to 1 in the children (diffusers maps ranks to
accelerator devices). The CPU mirror mode of the server does not shard; its serving tests are
``tests/server/parallel/test_context_parallel_hunyuanvideo15.py``.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from diffusion_rollout.testing import free_port

WORLD = 2
# 2 latent frames x 4 x 4 = 32 video tokens; 12 Qwen tokens, 6 ByT5 tokens, 5 image tokens; CFG-like batch 2.
SHAPES = {"batch": 2, "frames": 2, "height": 4, "width": 4, "text": 12, "text_2": 6, "image": 5}

# name: (model, image embeddings, plan)
CASES: dict[str, tuple[str, str, str]] = {
    "stock_processor": ("zoo", "zeros", "plan_only"),
    "server_zoo_t2v": ("zoo", "zeros", "server"),
    "server_zoo_image": ("zoo", "image", "server"),
    "server_wide_t2v": ("wide", "zeros", "server"),
    "server_wide_image": ("wide", "image", "server"),
}


def tiny_transformer(kind: str):
    """``zoo``: the served tiny model's transformer (seed 0); ``wide``: 4 heads, so 2 per rank at k = 2."""
    from diffusers import HunyuanVideo15Transformer3DModel

    from diffusion_rollout.models.tiny_video import hunyuanvideo15_components

    if kind == "zoo":
        return hunyuanvideo15_components(0)["transformer"].eval()
    torch.manual_seed(0)
    return HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=2,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=32,
        text_embed_2_dim=16, image_embed_dim=16, rope_axes_dim=(4, 6, 6), target_size=32, task_type="t2v",
    ).eval()  # fmt: skip


def make_inputs(model, image: str, shapes: dict[str, int] = SHAPES) -> dict[str, Any]:
    """One call shaped like HunyuanVideo15Pipeline's: channel-concat input, padded masks, image tokens."""
    g = torch.Generator().manual_seed(1)
    cfg = model.config
    b, f, h, w = shapes["batch"], shapes["frames"], shapes["height"], shapes["width"]
    n, n2, m = shapes["text"], shapes["text_2"], shapes["image"]
    mask = torch.ones(b, n)
    mask[0, -4:] = 0  # padded Qwen tokens
    mask_2 = torch.zeros(b, n2)
    mask_2[1, :3] = 1  # ByT5: all padding but a quoted word in one sample
    embeds = (
        torch.randn(b, m, cfg.image_embed_dim, generator=g)
        if image == "image"
        else torch.zeros(b, m, cfg.image_embed_dim)
    )
    return {
        "hidden_states": torch.randn(b, cfg.in_channels, f, h, w, generator=g),
        "timestep": torch.full((b,), 500.0),
        "encoder_hidden_states": torch.randn(b, n, cfg.text_embed_dim, generator=g),
        "encoder_attention_mask": mask,
        "encoder_hidden_states_2": torch.randn(b, n2, cfg.text_embed_2_dim, generator=g),
        "encoder_attention_mask_2": mask_2,
        "image_embeds": embeds,
        "return_dict": False,
    }  # fmt: skip


def _run_case(name: str) -> dict[str, Any]:
    from diffusers import ContextParallelConfig

    from diffusion_rollout.server.parallel.cp_calls import enable_layout
    from diffusion_rollout.server.parallel.cp_plans import hunyuanvideo15_plan

    kind, image, plan = CASES[name]
    model = tiny_transformer(kind)
    with torch.no_grad():
        (ref,) = model(**make_inputs(model, image))
    result: dict[str, Any] = {"ref": ref, "heads": int(model.config.num_attention_heads)}
    try:
        if plan == "server":  # what a served engine runs on every rank (rank 0 and the followers)
            enable_layout({"transformer": model}, 1, WORLD)  # ring degree 1: Ulysses over WORLD
            result["processors"] = sorted({type(b.attn.processor).__name__ for b in model.transformer_blocks})
        else:
            model.enable_parallelism(
                config=ContextParallelConfig(ulysses_degree=WORLD), cp_plan=hunyuanvideo15_plan(model)
            )
        with torch.no_grad():
            (out,) = model(**make_inputs(model, image))
        result["out"] = out
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        result["where"] = [f.name for f in traceback.extract_tb(e.__traceback__)]
    return result


def _worker(rank: int, port: int, cases: list[str], out_dir: str) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    # diffusers' _resolve_parallel_config picks ``rank % torch.accelerator.device_count()``: 0 on a CPU.
    torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = {name: _run_case(name) for name in cases}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def run_two_ranks(cases: list[str]) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(free_port(), cases, out_dir), nprocs=WORLD, join=True)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def ranks():
    return run_two_ranks(list(CASES))


def test_the_plan_with_diffusers_stock_processor_fails_on_the_joint_mask(ranks):
    for r in ranks:
        res = r["stock_processor"]
        assert "error" in res, "the stock processor ran under Ulysses: re-examine the findings"
        assert "__call__" in res["where"] and "dispatch_attention_fn" in res["where"], res


@pytest.mark.parametrize(
    "case", ["server_zoo_t2v", "server_zoo_image", "server_wide_t2v", "server_wide_image"]
)
def test_the_servers_plan_matches_one_rank(ranks, case):
    for r in ranks:
        res = r[case]
        assert "error" not in res, (res.get("error"), res.get("where"))
        assert res["processors"] == ["HunyuanVideo15UlyssesProcessor"]
        assert res["out"].shape == res["ref"].shape
        assert float((res["out"] - res["ref"]).abs().max()) < 1e-5
    assert torch.equal(ranks[0][case]["out"], ranks[1][case]["out"])  # every rank holds the whole video
    assert ranks[0][case]["heads"] % WORLD == 0


def test_image_embeddings_matter_in_the_image_case(ranks):
    """The image case attends its image tokens (else it would not test them): its output differs from T2V's."""
    for model in ("zoo", "wide"):
        a, b = ranks[0][f"server_{model}_t2v"]["ref"], ranks[0][f"server_{model}_image"]["ref"]
        assert float((a - b).abs().max()) > 1e-4


def test_the_plan_shards_only_the_video():
    """What ``hunyuanvideo15_plan`` names, without ranks."""
    from diffusion_rollout.server.parallel.cp_plans import hunyuanvideo15_plan

    plan = hunyuanvideo15_plan(tiny_transformer("zoo"))
    assert set(plan) == {"x_embedder", "rope", "proj_out"}  # text, masks, image embeddings: whole
    assert (plan["x_embedder"][0].split_dim, plan["x_embedder"][0].split_output) == (1, True)
    assert {i: (s.split_dim, s.expected_dims) for i, s in plan["rope"].items()} == {0: (0, 2), 1: (0, 2)}
    assert plan["proj_out"].gather_dim == 1
