"""The OCR judge reward (``diffusion_rollout.rewards`` ``vlm_ocr_judge``, re-exported by
examples/rewards.py) and its random-weight folder (benchmarks/judge_builders.py): the edit-distance
score on known strings, the prompt's target text, and a tiny Qwen3-VL judge built offline, loaded
through ``load_reward`` and run on the CPU."""

from __future__ import annotations

import importlib

import pytest
import torch


@pytest.fixture(scope="module")
def rewards():
    # What examples/rewards.py re-exports for the recipes.
    return importlib.import_module("diffusion_rollout.rewards")


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    from benchmarks.judge_builders import save_vlm_judge

    path = tmp_path_factory.mktemp("judge")
    info = save_vlm_judge(path, size="tiny", dtype=torch.float32, device="cpu", seed=0)
    return path, info


@pytest.fixture(scope="module")
def judge(rewards, judge_dir):
    path, _ = judge_dir
    return rewards.load_reward(f"vlm_ocr_judge?model={path}&device=cpu&max_new_tokens=4&batch_size=2")


def _images(n: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, 48, 64), generator=g, dtype=torch.uint8)


# ------------------------------------------------------------------------------------------- the score
@pytest.mark.parametrize(
    ("a", "b", "d"),
    [
        ("kitten", "sitting", 3),
        ("sitting", "kitten", 3),
        ("flaw", "lawn", 2),
        ("", "abc", 3),
        ("abc", "", 3),
        ("", "", 0),
        ("same", "same", 0),
        ("ab", "ba", 2),
    ],
)
def test_levenshtein_known_values(rewards, a, b, d):
    assert rewards.levenshtein(a, b) == d


def test_ocr_similarity(rewards):
    sim = rewards.ocr_similarity
    assert sim("OPEN 24 HOURS", "OPEN 24 HOURS") == 1.0
    assert sim("  open   24\nhours ", "OPEN 24 HOURS") == 1.0  # case and spacing do not count
    assert sim("", "OPEN") == 0.0
    assert sim("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    assert sim("a very long wrong reading", "ab") == 0.0  # clipped at 0
    assert sim("", "") == 1.0


def test_ocr_target_is_the_first_quoted_text(rewards):
    t = rewards.ocr_target
    assert t('A street sign that says "OPEN 24 HOURS"') == "OPEN 24 HOURS"
    assert t('a sign "ONE" next to a sign "TWO"') == "ONE"
    assert t("a mug that says \u201cLATTE\u201d") == "LATTE"
    assert t("a cat on a mat") == "a cat on a mat"  # no quotes: the whole prompt


def test_ocr_prompts_each_quote_a_text(rewards):
    assert len(rewards.OCR_PROMPTS) >= 30
    for p in rewards.OCR_PROMPTS:
        assert rewards.ocr_target(p) != p and rewards.ocr_target(p).strip()


# ------------------------------------------------------------------------------------------- the spec
def test_spec_without_a_model_is_a_clear_error(rewards, tmp_path):
    with pytest.raises(ValueError, match="model="):
        rewards.load_reward("vlm_ocr_judge")
    with pytest.raises(ValueError, match=r"config\.json"):
        rewards.load_reward(f"vlm_ocr_judge?model={tmp_path}")


# ------------------------------------------------------------------------------------ the tiny judge
def test_builder_writes_a_loadable_qwen3_vl_folder(judge_dir):
    from transformers import AutoModelForImageTextToText

    path, info = judge_dir
    assert info.architecture == "qwen3_vl" and info.model_class == "Qwen3VLForConditionalGeneration"
    assert info.vocab_size >= info.tokenizer_size
    for name in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"):
        assert (path / name).is_file(), name
    model = AutoModelForImageTextToText.from_pretrained(str(path))
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"


def test_judge_scores_images(judge):
    images, prompts = (
        _images(),
        [
            'A street sign that says "OPEN 24 HOURS"',
            "a cat",
            'A book titled "THE LAST LIGHTHOUSE"',
        ],
    )
    r = judge(images, prompts)
    assert r.shape == (3,) and r.dtype == torch.float32
    assert bool(((r >= 0) & (r <= 1)).all())
    assert torch.equal(r, judge(images, prompts))  # greedy: the same readings, the same scores
    # The fixed budget: every image decodes exactly max_new_tokens tokens.
    assert judge.tokens_generated == 3 * 4
    assert len(judge.last_readings) == 3 and judge.last_seconds > 0


def test_judge_runs_the_model_in_batches(judge, monkeypatch):
    calls = []
    generate = judge.model.generate

    def counting(**kwargs):
        calls.append((kwargs["input_ids"].shape[0], kwargs["min_new_tokens"], kwargs["max_new_tokens"]))
        return generate(**kwargs)

    monkeypatch.setattr(judge.model, "generate", counting)
    judge(_images(3), ["a"] * 3)
    # batch_size=2: left-padded batches of the same prompt, each held to the fixed budget of 4 tokens
    assert calls == [(2, 4, 4), (1, 4, 4)]


def test_without_the_fixed_budget_a_reading_ends_at_its_end_token(rewards, judge_dir):
    path, _ = judge_dir
    judge = rewards.load_reward(f"vlm_ocr_judge?model={path}&device=cpu&max_new_tokens=4&fixed_budget=0")
    eos = next(iter(judge.eos_ids))
    assert judge._until_eos([7, 8, eos, 9, eos]) == [7, 8, eos]
    assert judge._until_eos([7, 8]) == [7, 8]
    r = judge(_images(2), ["a", "b"])
    assert r.shape == (2,) and 2 <= judge.tokens_generated <= 2 * 4


def test_score_is_the_readings_match_to_the_prompt(judge, monkeypatch):
    # A judge that reads the target perfectly (up to case and spacing) scores 1; one that reads half of it, 0.5.
    readings = iter(["open  24 hours", "LIGHT"])
    monkeypatch.setattr(judge, "_decode", lambda ids: next(readings))
    r = judge(_images(2), ['A sign that says "OPEN 24 HOURS"', 'a word "LIGHTHOUSE"'])
    assert r.tolist() == [1.0, pytest.approx(1 - 5 / 10)]


def test_ids_past_the_tokenizer_decode_as_nothing(judge):
    tok = judge.tokenizer
    known = tok("big cat")["input_ids"]
    assert judge._decode([len(tok), 151935, *known, 10**6]) == tok.decode(known, skip_special_tokens=True)


def test_eight_b_config_has_qwen3_vl_8b_numbers():
    """The real-scale config, on the meta device (no weights): Qwen3-VL-8B-Instruct's 8.77B parameters."""
    from accelerate import init_empty_weights
    from transformers import Qwen3VLForConditionalGeneration

    from benchmarks.judge_builders import _qwen3_vl_config
    from diffusion_rollout.models.tokenizers import make_qwen2_tokenizer

    cfg = _qwen3_vl_config("qwen3-vl-8b", make_qwen2_tokenizer())
    t, v = cfg.text_config, cfg.vision_config
    assert (t.hidden_size, t.intermediate_size, t.num_hidden_layers) == (4096, 12288, 36)
    assert (t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.vocab_size) == (32, 8, 128, 151936)
    assert (v.depth, v.hidden_size, v.intermediate_size, v.num_heads, v.patch_size) == (
        27,
        1152,
        4304,
        16,
        16,
    )
    assert (v.out_hidden_size, v.deepstack_visual_indexes) == (4096, [8, 16, 24])
    assert not cfg.tie_word_embeddings
    with init_empty_weights():
        model = Qwen3VLForConditionalGeneration(cfg)
    assert sum(p.numel() for p in model.parameters()) == 8_767_123_696


def test_fallback_without_qwen3_vl_builds_qwen25_vl(rewards, tmp_path, monkeypatch):
    """A transformers without Qwen3-VL gets Qwen2.5-VL's architecture, and the folder says so."""
    import benchmarks.judge_builders as jb

    monkeypatch.setattr(jb, "_has_qwen3_vl", lambda: False)
    info = jb.save_vlm_judge(tmp_path, size="tiny", dtype=torch.float32, device="cpu")
    assert info.architecture == "qwen2_5_vl" and info.model_class == "Qwen2_5_VLForConditionalGeneration"
    judge = rewards.load_reward(f"vlm_ocr_judge?model={tmp_path}&device=cpu&max_new_tokens=2")
    r = judge(_images(1), ['a sign "HI"'])
    assert r.shape == (1,) and judge.tokens_generated == 2


def test_offloaded_judge_scores_alike_and_returns_its_weights_to_the_host_copies(rewards, judge_dir, judge):
    """``offload=1`` (the CUDA default): the weights move in for a call and point back at the one
    host copy afterwards (no new copy per call); the scores are the resident judge's."""
    path, _ = judge_dir
    off = rewards.load_reward(
        f"vlm_ocr_judge?model={path}&device=cpu&max_new_tokens=4&batch_size=2&offload=1"
    )
    assert off.offload and not judge.offload  # CPU default: resident
    images, prompts = _images(), ['a sign that says "OPEN"', 'a mug with "HI"', "plain words"]
    hosts = [host.data_ptr() for _, host in off._host]
    assert torch.equal(off(images, prompts), judge(images, prompts))
    assert [t.data_ptr() for t, _ in off._host] == hosts
