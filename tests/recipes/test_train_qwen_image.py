"""Qwen-Image through the Flow-GRPO recipe at verl-omni's recipe shape, on the CPU (tiny Qwen-Image).

The settings of verl-omni's Qwen-Image OCR recipe, scaled down: LoRA on both streams' attention
and MLP projections (``--lora-targets qwen-image``) with alpha twice the rank, true CFG with a
negative prompt, a fixed text length, an SDE window of 2 within the first steps at noise level 1.2,
a reward callable scoring the prompts' quoted text. One rank and two ``torchrun`` ranks must make the
same batch and the same update, and the first-step ratio must be exactly 1 on every rank.
"""

from __future__ import annotations

import importlib

import pytest

from tests.recipes.test_train_ranks import EXAMPLES, adapter, torchrun

QWEN = [
    "--iterations", "1", "--prompts", "2", "--group-size", "4", "--steps", "6", "--size", "32",
    "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "qwen-image", "--lr", "1e-2",
    "--true-cfg-scale", "4", "--negative-prompt", " ", "--max-sequence-length", "32",
    "--sde-window", "2", "--sde-window-range", "6", "--noise-level", "1.2", "--prompt-set", "ocr",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    from diffusion_rollout.models import save_tiny_model

    return save_tiny_model("qwenimage", tmp_path_factory.mktemp("qwen") / "tiny-qwenimage")


@pytest.fixture(scope="module")
def tiny_judge(tmp_path_factory):
    from benchmarks.judge_builders import save_vlm_judge

    return save_vlm_judge(tmp_path_factory.mktemp("judge") / "judge-tiny", size="tiny", device="cpu").path


@pytest.fixture
def flow_grpo(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module("flow_grpo")


@pytest.mark.slow
def test_qwen_image_recipe_two_ranks_make_the_one_rank_batch_and_update(tiny_qwen, tmp_path):
    # A reward callable that varies within a group. (The OCR judge runs through the same path in
    # test_qwen_image_recipe_scores_with_the_ocr_judge; a tiny random judge reads the same nothing in
    # every image of a group, so its advantages are 0 and no update could be compared.)
    reward = "brightness"
    args = [*QWEN, "--model", str(tiny_qwen), "--server", "thread", "--reward", reward]
    # Both under torchrun, so both runs' server and trainer use one thread each: a CPU matmul's low
    # bits depend on the thread count, and the brightness of a tiny model's images varies within a
    # group by about the advantage's epsilon, which would magnify those bits.
    one = torchrun("flow_grpo", 1, [*args, "--checkpoint", str(tmp_path / "c1")], tmp_path / "one.json")
    two = torchrun("flow_grpo", 2, [*args, "--checkpoint", str(tmp_path / "c2")], tmp_path / "two.json")
    h1, h2 = one["history"][0], two["history"][0]
    # True CFG as Qwen-Image runs it: the replay applied the pipeline's norm-rescaled true CFG.
    assert h1["guidance"] == h2["guidance"]
    assert h1["guidance"]["rule"] == "norm_rescale" and h1["guidance"]["true_cfg_scale"] == 4.0
    # The window lies within steps 0..5 and is 2 steps long.
    assert len(h1["sde_steps"]) == 2 and max(h1["sde_steps"]) <= 5
    assert h2["rewards"] == h1["rewards"] and len(h1["rewards"]) == 8
    assert h2["advantages"] == h1["advantages"]
    assert one["ranks"] == 1 and two["ranks"] == 2
    assert h1["first_ratio_max_dev"] == 0.0 and h2["first_ratio_max_dev_per_rank"] == [0.0, 0.0]
    assert h2["checksum_ok"] is True and two["final_adapter_checksum"] == two["server_adapter_checksum"]
    a1, a2 = adapter(tmp_path / "c1"), adapter(tmp_path / "c2")
    assert a1.keys() == a2.keys()
    # Every listed target of both streams carries the adapter (12 kinds of module).
    for target in ("attn.to_q", "attn.add_k_proj", "attn.to_add_out", "img_mlp.net.0.proj", "txt_mlp.net.2"):
        assert any(target in k for k in a1), target
    lr = 1e-2
    moved = max(float(v.abs().max()) for k, v in a1.items() if "lora_B" in k)
    assert moved > 0.5 * lr  # Adam's first step moves lora_B by about lr: the comparison can fail
    # Same bound as the SD3 test (tests/recipes/test_train_ranks.py): the ranks sum the same gradient terms
    # in another order, so the updates agree to a few float32 ulps of the gradient.
    worst = max(float((a1[k] - a2[k]).abs().max()) for k in a1)
    assert worst <= 1e-4 * lr, worst


@pytest.mark.slow
def test_qwen_image_recipe_scores_with_the_ocr_judge(tiny_qwen, tiny_judge, tmp_path):
    """verl-omni's reward kind in the recipe: a generative VLM judge (tiny Qwen3-VL) reads every
    image within a fixed token budget, scored by edit distance to the prompt's quoted text."""
    reward = f"vlm_ocr_judge?model={tiny_judge}&max_new_tokens=4&device=cpu"
    args = [*QWEN, "--model", str(tiny_qwen), "--server", "thread", "--reward", reward]
    run = torchrun("flow_grpo", 1, args, tmp_path / "judge.json")
    h = run["history"][0]
    assert len(h["rewards"]) == 8 and all(0.0 <= r <= 1.0 for r in h["rewards"])
    assert h["reward_s"] > 0 and h["first_ratio_max_dev"] == 0.0 and h["checksum_ok"] is True


@pytest.mark.slow
def test_qwen_image_in_process_layout_samples_what_the_server_samples(flow_grpo, tiny_qwen, tmp_path):
    """``--layout in-process`` for Qwen-Image (verl-omni's layout: each rank samples its own groups)
    runs this project's engine in the trainer's process on the trainer's own transformer: the same
    seeds give the server layout's rewards bit for bit in both iterations (the second after an
    update, so the adapter the trainer stepped is the one sampled), the ratio exactly 1."""
    args = [*QWEN, "--iterations", "2", "--model", str(tiny_qwen), "--reward", "brightness"]
    served = flow_grpo.main([*args, "--server", "thread", "--out", str(tmp_path / "served.json")])
    local = flow_grpo.main([*args, "--layout", "in-process", "--out", str(tmp_path / "local.json")])
    assert local["layout"] == "in-process" and served["layout"] == "server"
    for a, b in zip(local["history"], served["history"], strict=True):
        assert a["rewards"] == b["rewards"] and a["advantages"] == b["advantages"]
        assert a["first_ratio_max_dev"] == 0.0 and a["guidance"]["rule"] == "norm_rescale"
    # The update moves the second iteration's rewards, so the equality above can fail: a sampler on
    # a stale copy of the transformer would have sampled what a run without the update samples.
    frozen = flow_grpo.main(
        [*args, "--layout", "in-process", "--lr", "0", "--out", str(tmp_path / "lr0.json")]
    )
    assert frozen["history"][1]["rewards"] != local["history"][1]["rewards"]


def test_lora_target_presets_and_lists(flow_grpo):
    common = importlib.import_module("diffusion_rollout.recipes.options")
    assert common.lora_targets("qwen-image")[-1] == "txt_mlp.net.2"
    assert len(common.lora_targets("qwen-image")) == 12
    assert common.lora_targets("to_q, to_k") == ["to_q", "to_k"]
    args = flow_grpo.parse_args(
        ["--lora-targets", "qwen-image", "--lora-alpha", "128", "--prompt-set", "ocr"]
    )
    assert args.lora_alpha == 128.0 and "img_mlp.net.2" in args.lora_targets
    prompts = importlib.import_module("diffusion_rollout.recipes.flow_grpo_rollouts").prompt_set("ocr")
    assert all('"' in p for p in prompts)
