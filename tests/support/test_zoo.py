"""The tiny offline model zoo: every family loads with ``from_pretrained`` and runs the stock pipeline.

Also: builds are byte-for-byte reproducible, seeds change weights, the real scheduler configurations
survive the save/load round trip, tokenizers reload from the saved folder, and the demo model is
generated once, atomically, and reused.
"""

from __future__ import annotations

import filecmp
import logging
import os
import threading
from pathlib import Path

import pytest
import torch
from diffusers import (
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    FluxPipeline,
    HunyuanVideo15Pipeline,
    LTX2Pipeline,
    QwenImagePipeline,
    StableDiffusion3Pipeline,
    UniPCMultistepScheduler,
    WanPipeline,
    ZImagePipeline,
)

from diffusion_rollout.models import (
    FAMILIES,
    IMAGE_FAMILIES,
    REAL_SCHEDULER_CONFIGS,
    TINY_CALL_DEFAULTS,
    build_tiny_pipeline,
    ensure_demo_model,
    family_of,
    save_tiny_model,
)
from diffusion_rollout.models import demo as demo_module

PROMPT = "a photo of a cat riding a horse"

PIPELINE_CLASSES = {
    "sd3": StableDiffusion3Pipeline,
    "flux": FluxPipeline,
    "qwenimage": QwenImagePipeline,
    "wan": WanPipeline,
    "wan2.2": WanPipeline,
    "flux2-klein": Flux2KleinPipeline,
    "zimage": ZImagePipeline,
    "hunyuanvideo15": HunyuanVideo15Pipeline,
    "ltx2": LTX2Pipeline,
}

# Latents as the pipelines return them with output_type="latent" at the default call settings:
# SD3 (B, 16, H/4, W/4); FLUX and Qwen-Image pack 2x2 patches into (B, tokens, 64);
# Wan (B, 16, (F - 1) / 4 + 1, H/8, W/8).
LATENT_SHAPES = {
    "sd3": (1, 16, 8, 8),
    "flux": (1, 16, 64),
    "qwenimage": (1, 16, 64),
    "wan": (1, 16, 2, 4, 4),
    "wan2.2": (1, 16, 2, 4, 4),
    # FLUX.2 returns its latents un-packed, de-normalised and un-patchified; Z-Image's are plain.
    "flux2-klein": (1, 16, 8, 8),
    "zimage": (1, 16, 8, 8),
    "hunyuanvideo15": (1, 16, 2, 2, 2),  # (B, 16, (F - 1) / 4 + 1, H/16, W/16)
    "ltx2": (1, 4, 5, 16, 16),  # the video latent (the audio one is output.audio)
}
DECODED_SHAPES = {
    "sd3": (1, 3, 32, 32),
    "flux": (1, 3, 32, 32),
    "qwenimage": (1, 3, 32, 32),
    "wan": (1, 5, 3, 32, 32),
    "wan2.2": (1, 5, 3, 32, 32),
    "flux2-klein": (1, 3, 32, 32),
    "zimage": (1, 3, 32, 32),
    "hunyuanvideo15": (1, 5, 3, 32, 32),
    "ltx2": (1, 9, 3, 32, 32),
}


def _load(path: Path) -> DiffusionPipeline:
    pipe = DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate(pipe: DiffusionPipeline, family: str, seed: int, output_type: str) -> torch.Tensor:
    out = pipe(
        prompt=PROMPT,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type=output_type,
        **TINY_CALL_DEFAULTS[family],
    )
    return out.frames if hasattr(out, "frames") else out.images


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_families_and_call_defaults_cover_the_same_names():
    assert FAMILIES == (
        "sd3",
        "flux",
        "qwenimage",
        "wan",
        "wan2.2",
        "flux2-klein",
        "zimage",
        "hunyuanvideo15",
        "ltx2",
    )
    assert set(FAMILIES) == set(REAL_SCHEDULER_CONFIGS)
    assert set(TINY_CALL_DEFAULTS) == set(FAMILIES) | set(IMAGE_FAMILIES)
    with pytest.raises(TypeError):
        TINY_CALL_DEFAULTS["sd3"]["height"] = 64  # shared by every test: read-only


@pytest.mark.parametrize("family", FAMILIES)
def test_stock_pipeline_runs_end_to_end_and_repeats_bit_for_bit(family, tiny_model_path):
    pipe = _load(tiny_model_path(family))
    assert type(pipe) is PIPELINE_CLASSES[family]
    assert pipe.transformer.dtype == torch.float32
    assert pipe.device.type == "cpu"

    first = _generate(pipe, family, seed=0, output_type="latent")
    again = _generate(pipe, family, seed=0, output_type="latent")
    other = _generate(pipe, family, seed=1, output_type="latent")
    assert tuple(first.shape) == LATENT_SHAPES[family]
    assert torch.isfinite(first).all()
    assert torch.equal(first, again)
    assert not torch.equal(first, other)  # the equality above is not vacuous

    decoded = _generate(pipe, family, seed=0, output_type="pt")
    decoded_again = _generate(pipe, family, seed=0, output_type="pt")
    assert tuple(decoded.shape) == DECODED_SHAPES[family]
    assert decoded.dtype == torch.float32
    assert torch.isfinite(decoded).all()
    assert decoded.min() >= 0.0 and decoded.max() <= 1.0
    assert torch.equal(decoded, decoded_again)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_load_runs(family, tiny_model_path):
    pipe = DiffusionPipeline.from_pretrained(tiny_model_path(family), dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.transformer.dtype == torch.bfloat16
    latents = _generate(pipe, family, seed=0, output_type="latent")
    assert tuple(latents.shape) == LATENT_SHAPES[family]
    assert torch.isfinite(latents.float()).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_scheduler_carries_the_real_checkpoint_config(family, tiny_model_path):
    scheduler = _load(tiny_model_path(family)).scheduler
    scheduler_cls, real_config = REAL_SCHEDULER_CONFIGS[family]
    assert type(scheduler) is scheduler_cls
    for key, value in real_config.items():
        assert scheduler.config[key] == value, key


def test_sd3_scheduler_is_sd35_flow_match_euler(tiny_model_path):
    pipe = _load(tiny_model_path("sd3"))
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert pipe.scheduler.config.shift == 3.0
    assert not pipe.scheduler.config.use_dynamic_shifting
    assert pipe.transformer.config.qk_norm == "rms_norm"


def test_flux_is_dev_style_with_dynamic_shift_and_guidance_embedding(tiny_model_path):
    pipe = _load(tiny_model_path("flux"))
    config = pipe.scheduler.config
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert config.use_dynamic_shifting and config.shift == 3.0
    assert (config.base_shift, config.max_shift) == (0.5, 1.15)
    assert (config.base_image_seq_len, config.max_image_seq_len) == (256, 4096)
    assert pipe.transformer.config.guidance_embeds is True


def test_qwenimage_scheduler_uses_exponential_dynamic_shift_with_terminal(tiny_model_path):
    config = _load(tiny_model_path("qwenimage")).scheduler.config
    assert config.use_dynamic_shifting and config.time_shift_type == "exponential"
    assert (config.base_shift, config.max_shift, config.shift) == (0.5, 0.9, 1.0)
    assert (config.base_image_seq_len, config.max_image_seq_len) == (256, 8192)
    assert config.shift_terminal == 0.02


@pytest.mark.parametrize("family", ["wan", "wan2.2"])
def test_wan_scheduler_is_unipc_with_flow_sigmas(family, tiny_model_path):
    scheduler = _load(tiny_model_path(family)).scheduler
    assert isinstance(scheduler, UniPCMultistepScheduler)
    assert scheduler.config.use_flow_sigmas is True
    assert scheduler.config.prediction_type == "flow_prediction"
    assert scheduler.config.flow_shift == 3.0
    assert (scheduler.config.solver_type, scheduler.config.solver_order) == ("bh2", 2)


def test_wan21_has_one_transformer_and_no_boundary(tiny_model_path):
    pipe = _load(tiny_model_path("wan"))
    assert pipe.transformer_2 is None
    assert pipe.config.boundary_ratio is None


def test_wan22_has_two_distinct_experts_and_both_denoise(tiny_model_path):
    pipe = _load(tiny_model_path("wan2.2"))
    assert pipe.config.boundary_ratio == 0.875
    high, low = pipe.transformer, pipe.transformer_2
    assert high is not None and low is not None
    same_architecture = {k: v for k, v in high.config.items() if k != "_name_or_path"}
    assert same_architecture == {k: v for k, v in low.config.items() if k != "_name_or_path"}
    assert not torch.equal(high.patch_embedding.weight, low.patch_embedding.weight)

    timesteps: dict[str, list[float]] = {"transformer": [], "transformer_2": []}

    def record(name):
        def hook(module, args, kwargs):
            timesteps[name].append(float(kwargs["timestep"].flatten()[0]))

        return hook

    handles = [
        high.register_forward_pre_hook(record("transformer"), with_kwargs=True),
        low.register_forward_pre_hook(record("transformer_2"), with_kwargs=True),
    ]
    try:
        _generate(pipe, "wan2.2", seed=0, output_type="latent")
    finally:
        for handle in handles:
            handle.remove()
    boundary = 0.875 * pipe.scheduler.config.num_train_timesteps
    assert timesteps["transformer"] and all(t >= boundary for t in timesteps["transformer"])
    assert timesteps["transformer_2"] and all(t < boundary for t in timesteps["transformer_2"])


@pytest.mark.parametrize("family", FAMILIES)
def test_family_of_recognises_loaded_pipelines(family, tiny_model_path):
    assert family_of(_load(tiny_model_path(family))) == family


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_tokenizers_reload_and_encode_like_the_built_ones(family, tiny_model_path):
    folder = tiny_model_path(family)
    loaded = _load(folder)
    built = build_tiny_pipeline(family)
    names = [name for name in built.components if name.startswith("tokenizer")]
    assert names
    for name in names:
        # tokenizer.json only: no spiece.model, so no protobuf/sentencepiece is needed to load it
        ours, theirs = built.components[name], loaded.components[name]
        chat = ["chat_template.jinja"] if ours.chat_template else []
        # ByT5 (HunyuanVideo 1.5's glyph encoder) is byte-level: it has no vocabulary file at all.
        vocab = ["added_tokens.json"] if type(ours).__name__ == "ByT5Tokenizer" else ["tokenizer.json"]
        assert _files(folder / name) == sorted([*chat, *vocab, "tokenizer_config.json"])
        assert type(theirs) is type(ours)
        assert theirs(PROMPT).input_ids == ours(PROMPT).input_ids
        assert theirs.decode(theirs(PROMPT).input_ids, skip_special_tokens=True) == PROMPT  # nothing lost


@pytest.mark.parametrize("family", ["flux2-klein", "zimage"])
def test_qwen3_chat_template_renders_the_qwen3_layout_after_reload(family, tiny_model_path):
    tok = _load(tiny_model_path(family)).tokenizer
    msgs = [{"role": "user", "content": PROMPT}]
    head = f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"

    def render(thinking: bool) -> str:
        return tok.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )

    assert render(True) == head  # Z-Image's call
    assert render(False) == head + "<think>\n\n</think>\n\n"  # klein's call: an empty think block
    assert tok.convert_tokens_to_ids("</think>") == len(tok) - 1 and tok.pad_token == "<|endoftext|>"


def test_klein_text_encoder_has_the_layers_the_pipeline_stacks(tiny_model_path):
    pipe = _load(tiny_model_path("flux2-klein"))
    assert pipe.text_encoder.config.num_hidden_layers >= 27  # hidden states 9, 18 and 27 exist
    embeds, _ = pipe.encode_prompt(PROMPT, max_sequence_length=16)
    assert embeds.shape == (1, 16, pipe.transformer.config.joint_attention_dim)
    assert not torch.equal(pipe.vae.bn.running_mean, torch.zeros_like(pipe.vae.bn.running_mean))


def test_qwen_tokenizer_gives_the_template_prefix_the_length_the_pipeline_drops(tiny_model_path):
    pipe = _load(tiny_model_path("qwenimage"))
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    for special in ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>"):
        assert len(pipe.tokenizer(special).input_ids) == 1


def test_hunyuan_tokenizer_gives_the_chat_prefix_the_length_the_pipeline_crops(tiny_model_path):
    pipe = _load(tiny_model_path("hunyuanvideo15"))
    turns = [[{"role": "system", "content": pipe.system_message}, {"role": "user", "content": PROMPT}]]
    ids = pipe.tokenizer.apply_chat_template(
        turns, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"][0]
    kept = pipe.tokenizer.decode(ids[pipe.prompt_template_encode_start_idx :])
    assert pipe.prompt_template_encode_start_idx == 108
    assert kept == f"{PROMPT}<|im_end|>\n<|im_start|>assistant\n"  # exactly the system turn is cropped


@pytest.mark.parametrize("family", FAMILIES)
def test_same_family_and_seed_write_identical_files(family, tiny_model_path, tmp_path):
    first = tiny_model_path(family)
    second = save_tiny_model(family, tmp_path / family)
    assert _files(first) == _files(second)
    assert "model_index.json" in _files(first)
    for name in _files(first):
        assert filecmp.cmp(first / name, second / name, shallow=False), name


@pytest.mark.parametrize("family", FAMILIES)
def test_different_seed_changes_the_transformer_weights(family):
    base = build_tiny_pipeline(family, seed=0).transformer.state_dict()
    reseeded_pipe = build_tiny_pipeline(family, seed=1)
    reseeded = reseeded_pipe.transformer.state_dict()
    assert base.keys() == reseeded.keys()
    changed = [k for k in base if not torch.equal(base[k], reseeded[k])]
    # Norm weights start at 1 whatever the seed; every randomly initialised matrix must move.
    assert len(changed) >= len(base) // 2
    assert all(not torch.equal(base[k], reseeded[k]) for k in base if k.endswith("to_q.weight"))


def test_build_leaves_the_callers_global_rng_alone():
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    build_tiny_pipeline("flux", seed=7)
    assert torch.equal(torch.rand(4), expected)


def test_unknown_family_is_rejected_with_the_choices():
    with pytest.raises(
        ValueError,
        match=r"unknown model family 'sdxl'.*sd3, flux, qwenimage, wan, wan2\.2, flux2-klein, zimage, hunyuanvideo15, ltx2",
    ):
        build_tiny_pipeline("sdxl")


# --- demo model ------------------------------------------------------------------------------


def test_demo_model_is_built_once_then_reused(tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    with caplog.at_level(logging.WARNING, logger=demo_module.__name__):
        path = ensure_demo_model(cache)
    assert path == cache / "demo-sd3"
    assert "RANDOM demo model" in caplog.text
    assert os.listdir(cache) == ["demo-sd3"]  # no staging folder left behind
    stamp = (path / "model_index.json").stat()

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the demo model was rebuilt although it is cached")

    monkeypatch.setattr(demo_module, "save_tiny_model", no_rebuild)
    assert ensure_demo_model(str(cache)) == path
    again = (path / "model_index.json").stat()
    assert (again.st_ino, again.st_mtime_ns) == (stamp.st_ino, stamp.st_mtime_ns)

    pipe = _load(path)
    assert family_of(pipe) == "sd3"
    image = _generate(pipe, "sd3", seed=0, output_type="pt")
    assert tuple(image.shape) == (1, 3, 32, 32)


def test_demo_model_race_leaves_one_complete_copy(tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    both_built = threading.Barrier(2, timeout=60)
    real_save = demo_module.save_tiny_model

    def save_then_wait(*args, **kwargs):
        out = real_save(*args, **kwargs)
        both_built.wait()  # both racers hold a finished copy before either renames it into place
        return out

    monkeypatch.setattr(demo_module, "save_tiny_model", save_then_wait)
    results: list[Path] = []
    errors: list[BaseException] = []

    def racer():
        try:
            results.append(ensure_demo_model(cache))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=racer) for _ in range(2)]
    with caplog.at_level(logging.INFO, logger=demo_module.__name__):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert not errors, errors
    assert "created" in caplog.text and "first; using its copy" in caplog.text  # the loser's path ran
    assert results == [cache / "demo-sd3"] * 2
    assert os.listdir(cache) == ["demo-sd3"]
    assert _files(cache / "demo-sd3") == _files(save_tiny_model("sd3", tmp_path / "reference"))


def test_demo_model_replaces_an_incomplete_folder(tmp_path):
    broken = tmp_path / "demo-sd3"
    broken.mkdir()
    (broken / "leftover.txt").write_text("not a model")
    path = ensure_demo_model(tmp_path)
    assert (path / "model_index.json").is_file()
    assert not (path / "leftover.txt").exists()
    assert os.listdir(tmp_path) == ["demo-sd3"]
