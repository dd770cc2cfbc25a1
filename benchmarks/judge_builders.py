"""Random-weight VLM judge folders for the OCR reward (``examples/rewards.py``'s ``vlm_ocr_judge``).

``save_vlm_judge(path, size=...)`` writes an ordinary transformers folder (``config.json``,
safetensors weights, tokenizer, image processor, chat template) that
``AutoModelForImageTextToText.from_pretrained(path)`` and ``AutoProcessor.from_pretrained(path)``
read exactly as they read a downloaded Qwen3-VL-8B-Instruct. Nothing touches the hub. (transformers 5
builds a Qwen-VL ``AutoProcessor`` only with torchvision installed, for its video half, with this
folder as with the real one; the reward then reads the tokenizer and image processor on their own.)

Sizes:

- ``qwen3-vl-8b``: Qwen3-VL-8B-Instruct's architecture at its real widths, so the judge costs what
  the real one costs in time and memory (its scores are meaningless: random weights read nothing).
  Numbers checked against public copies of its files (found with the project's search tool; the
  official repository's own config page was not in the index): ``config.json`` of fine-tunes whose
  ``base_model`` is Qwen3-VL-8B-Instruct (huggingface.co Steinate/Cortex,
  Chhagan005/CSM-DocExtract-8N), Ollama's GGUF metadata of ``qwen3-vl:8b-instruct``, and
  ``preprocessor_config.json`` of cdreetz/Qwen3-VL-8B-Instruct (a re-upload of the original):

  * text: hidden 4096, intermediate 12288, 36 layers, 32 heads, 8 KV heads, head_dim 128, vocab
    151936, ``tie_word_embeddings`` false, rms_norm_eps 1e-6, rope_theta 5e6, interleaved mRoPE with
    sections [24, 20, 20], max_position_embeddings 262144: **verified** (config.json and GGUF agree);
  * vision: depth 27, hidden 1152, intermediate 4304, 16 heads, patch 16, temporal patch 2, spatial
    merge 2, deepstack indexes [8, 16, 24], ``gelu_pytorch_tanh``, ``num_position_embeddings`` 2304:
    **verified** (the last two from a 32B sibling's config.json, which shares the vision tower);
    ``out_hidden_size`` 4096: not seen in an 8B file's excerpt, but it must equal the text width (the
    merger projects into the text embeddings; the 32B's is its 5120), and Megatron-Bridge's
    Qwen3-VL config defaults to 4096;
  * image processor: patch 16, merge 2, temporal patch 2, mean/std 0.5, ``size`` shortest_edge
    65536 / longest_edge 16777216 pixels: **verified** (so a 512x512 image is 32x32 patches, 256
    image tokens after the 2x2 merge);
  * the whole: 8,767,123,696 parameters (576M in the vision tower), about the 8.8B that model listings give.

  If the installed transformers has no ``Qwen3VLForConditionalGeneration``, Qwen2.5-VL-7B-Instruct's
  config is used instead (text 3584 wide, 18944 intermediate, 28 layers, 28 heads, 4 KV heads, vocab
  152064, mRoPE [16, 24, 24]; vision 32 blocks of 1280, patch 14, window attention with full blocks
  7/15/23/31; from memory of its public config, **not verified** here). ``JudgeInfo.architecture``
  says which one was built.
- ``tiny``: the same class at toy widths (two text layers of 64, a two-block vision tower of 32,
  a vocabulary just above the offline tokenizer's) for CPU tests that take seconds.

The tokenizer is the project's offline byte-level Qwen2 BPE (``make_qwen2_tokenizer``) with Qwen's
chat and vision special tokens, and a chat template written here that renders image + text
messages in Qwen-VL's layout. The 8B keeps the real vocabulary of 151936 rows (its embedding and
lm_head cost what they really cost) though the tokenizer knows far fewer ids: the reward drops
generated ids the tokenizer does not know before decoding.

Weights are built as ``benchmarks.model_builders.build_module`` builds them: the module is made on
the meta device and each parameter gets random storage directly on ``device`` in ``dtype``, so the
8B costs one GPU allocation and the safetensors write (about 17 GB), not a CPU initialisation.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.model_builders import build_module

__all__ = ["JUDGE_CHAT_TEMPLATE", "JudgeInfo", "save_vlm_judge"]

SIZES = ("qwen3-vl-8b", "tiny")

# Qwen-VL's chat layout: each turn is ``<|im_start|>ROLE\n...<|im_end|>\n``; an image part becomes
# ``<|vision_start|><|image_pad|><|vision_end|>`` (the processor expands the single pad token to the
# image's token count); string content is rendered as is. Written here for the judge's one-turn
# prompt; a real Qwen3-VL folder brings its own, longer template, which the reward uses unchanged.
JUDGE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Words of the judge's instruction and the chat roles get BPE merges, so the prompt is a few dozen
# tokens as with the real tokenizer, not one token per byte.
_JUDGE_WORDS = "system user assistant Read all the text in this image. Answer with the text only."

# Qwen3-VL-8B-Instruct preprocessor_config.json / video_preprocessor_config.json (see module doc).
QWEN3_VL_IMAGE_PROCESSOR = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
}
QWEN3_VL_VIDEO_PROCESSOR = {
    **QWEN3_VL_IMAGE_PROCESSOR,
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
}
# Qwen2.5-VL-7B-Instruct's image processor (the fallback architecture).
QWEN25_VL_IMAGE_PROCESSOR = {
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "size": {"longest_edge": 12845056, "shortest_edge": 3136},
}


@dataclass(frozen=True)
class JudgeInfo:
    """What ``save_vlm_judge`` wrote."""

    path: str
    size: str
    architecture: str  # "qwen3_vl" or "qwen2_5_vl" (the fallback when transformers lacks Qwen3-VL)
    model_class: str
    parameters: int
    vocab_size: int
    tokenizer_size: int
    seconds: float


def _has_qwen3_vl() -> bool:
    try:
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration  # noqa: F401
    except ImportError:
        return False
    return True


def _special_ids(tokenizer) -> dict[str, int]:
    from diffusion_rollout.models.tokenizers import QWEN_SPECIAL_TOKENS

    ids = tokenizer.convert_tokens_to_ids(list(QWEN_SPECIAL_TOKENS))
    return dict(zip(QWEN_SPECIAL_TOKENS, ids, strict=True))


def _qwen3_vl_config(size: str, tokenizer):
    from transformers import Qwen3VLConfig

    ids = _special_ids(tokenizer)
    if size == "qwen3-vl-8b":
        text = {
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
        }
        vision = {
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "patch_size": 16,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "num_position_embeddings": 2304,
            "hidden_act": "gelu_pytorch_tanh",
            "out_hidden_size": 4096,
            "deepstack_visual_indexes": [8, 16, 24],
        }
    else:
        text = {
            "vocab_size": -(-len(tokenizer) // 64) * 64,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            # the sections split head_dim / 2 = 8 rotary frequencies over (t, h, w)
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
        }
        vision = {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "num_position_embeddings": 2304,
            "hidden_act": "gelu_pytorch_tanh",
            "out_hidden_size": 64,
            "deepstack_visual_indexes": [0],
        }
    text.update(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def _qwen25_vl_config(size: str, tokenizer):
    from transformers import Qwen2_5_VLConfig

    ids = _special_ids(tokenizer)
    if size == "qwen3-vl-8b":  # the fallback: Qwen2.5-VL-7B-Instruct
        text = {
            "vocab_size": 152064,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "max_position_embeddings": 128000,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [16, 24, 24],
            },
        }
        vision = {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "out_hidden_size": 3584,
        }
    else:
        text = {
            "vocab_size": -(-len(tokenizer) // 64) * 64,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        }
        vision = {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "fullatt_block_indexes": [1],
            "out_hidden_size": 64,
        }
    text.update(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def _save_processor(path: Path, tokenizer, image_settings: dict, video_settings: dict, processor_cls) -> None:
    """Write the processor's files: through ``processor.save_pretrained`` where the installed
    transformers can build the whole processor (it needs torchvision for the video processor), else
    file by file (tokenizer, image processor, video processor config, chat template), which is the
    same set of files a real checkpoint ships and which ``AutoProcessor`` reads wherever it can build
    a processor at all."""
    from diffusion_rollout.models.tiny_image_cond import qwen2vl_image_processor

    image_processor = qwen2vl_image_processor(**image_settings)
    try:
        from transformers import AutoVideoProcessor  # noqa: F401

        video_processor = _video_processor(processor_cls, video_settings)
        processor = processor_cls(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=video_processor,
            chat_template=JUDGE_CHAT_TEMPLATE,
        )
        processor.save_pretrained(str(path))
        return
    except Exception:  # whatever stops the whole processor, the parts below still make a folder
        pass  # typically no torchvision: no video processor, so no whole processor; write the parts
    tokenizer.save_pretrained(str(path))
    image_processor.save_pretrained(str(path))
    _patch_json(path / "preprocessor_config.json", {"processor_class": processor_cls.__name__})
    video = {
        **video_settings,
        "processor_class": processor_cls.__name__,
        "video_processor_type": processor_cls.__name__.replace("Processor", "VideoProcessor"),
    }
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    (path / "chat_template.jinja").write_text(JUDGE_CHAT_TEMPLATE)


def _video_processor(processor_cls, settings: dict):
    if processor_cls.__name__ == "Qwen3VLProcessor":
        from transformers import Qwen3VLVideoProcessor as cls
    else:
        from transformers import Qwen2VLVideoProcessor as cls
    return cls(**settings)


def _patch_json(file: Path, fields: dict) -> None:
    data = json.loads(file.read_text())
    data.update(fields)
    file.write_text(json.dumps(data, indent=2) + "\n")


def save_vlm_judge(
    path: str | Path,
    size: str = "qwen3-vl-8b",
    dtype: torch.dtype = torch.bfloat16,
    device: str | None = None,
    seed: int = 0,
) -> JudgeInfo:
    """Write a random-weight VLM judge folder at ``path`` (see the module docstring).

    ``device``: where the weights are made before they are written (default: CUDA when available,
    else the CPU); ``dtype``: the weights' dtype on disk (bf16 as the real checkpoint).
    """
    if size not in SIZES:
        raise ValueError(f"size {size!r}: expected one of {SIZES}")
    from diffusion_rollout.models.tokenizers import make_qwen2_tokenizer

    start = time.perf_counter()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_qwen2_tokenizer(template_prefix=_JUDGE_WORDS, chat_template=JUDGE_CHAT_TEMPLATE)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "<|endoftext|>"  # Qwen's pad token
    tokenizer.padding_side = "left"  # batched generation appends on the right
    if _has_qwen3_vl():
        from transformers import Qwen3VLForConditionalGeneration as model_cls
        from transformers import Qwen3VLProcessor as processor_cls

        config = _qwen3_vl_config(size, tokenizer)
        architecture, image_settings, video_settings = (
            "qwen3_vl",
            QWEN3_VL_IMAGE_PROCESSOR,
            QWEN3_VL_VIDEO_PROCESSOR,
        )
    else:
        from transformers import Qwen2_5_VLForConditionalGeneration as model_cls
        from transformers import Qwen2_5_VLProcessor as processor_cls

        config = _qwen25_vl_config(size, tokenizer)
        architecture, image_settings = "qwen2_5_vl", QWEN25_VL_IMAGE_PROCESSOR
        video_settings = QWEN25_VL_IMAGE_PROCESSOR
    model = build_module(lambda: model_cls(config), device, dtype, seed)
    # The Qwen-VL generation defaults sample; the judge decodes greedily, so the saved defaults do too.
    model.generation_config.do_sample = False
    model.save_pretrained(str(out), max_shard_size="5GB")
    parameters = sum(p.numel() for p in model.parameters())
    vocab = model.get_output_embeddings().weight.shape[0]
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # give the 17 GB back to whatever runs next in this process
    _save_processor(out, tokenizer, image_settings, video_settings, processor_cls)
    return JudgeInfo(
        path=str(out),
        size=size,
        architecture=architecture,
        model_class=model_cls.__name__,
        parameters=parameters,
        vocab_size=vocab,
        tokenizer_size=len(tokenizer),
        seconds=time.perf_counter() - start,
    )


# A CLIP scorer's architecture: "large" is PickScore's CLIP ViT-H/14 (vision 1280 wide, 32 layers,
# patch 14 at 224 px; text 1024 wide, 24 layers; projection 1024; about 986M parameters), "tiny" a
# few-layer one for CPU tests. Random weights: time and memory real, scores meaningless.
CLIP_SIZES = ("tiny", "large")


def clip_config(size: str, tokenizer):
    from transformers import CLIPConfig

    if size == "large":
        text = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                "vocab_size": 49408}  # fmt: skip
        vision = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 16,
                  "image_size": 224, "patch_size": 14}  # fmt: skip
        projection = 1024
    elif size == "tiny":
        text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                "vocab_size": len(tokenizer)}  # fmt: skip
        vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "image_size": 32, "patch_size": 8}  # fmt: skip
        projection = 16
    else:
        raise ValueError(f"size {size!r}: expected one of {CLIP_SIZES}")
    # The text model pools at the end-of-text token: the offline tokenizer's own ids.
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    text.update(max_position_embeddings=77, hidden_act="gelu", **ids)
    vision.update(hidden_act="gelu")
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection)


def save_clip_scorer(
    path: str | Path,
    size: str = "large",
    dtype: torch.dtype | None = None,
    device: str | None = None,
    seed: int = 0,
) -> str:
    """Write a random-weight CLIP scorer folder (model, tokenizer, image processor) at ``path``, in
    float32 for "tiny" and bfloat16 for "large" unless ``dtype`` says otherwise; returns the path."""
    from transformers import CLIPImageProcessor, CLIPModel

    from diffusion_rollout.models.tokenizers import make_clip_tokenizer

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_clip_tokenizer()
    config = clip_config(size, tokenizer)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.float32 if size == "tiny" else torch.bfloat16)
    model = build_module(lambda: CLIPModel(config), device, dtype, seed)
    model.save_pretrained(str(out))
    del model
    side = config.vision_config.image_size
    CLIPImageProcessor(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    ).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return str(out)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import dataclasses

    parser = argparse.ArgumentParser(description="Write a random-weight VLM judge folder (no hub).")
    parser.add_argument("path")
    parser.add_argument("--size", choices=SIZES, default="qwen3-vl-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    info = save_vlm_judge(args.path, args.size, getattr(torch, args.dtype), args.device, args.seed)
    print(json.dumps(dataclasses.asdict(info)))


if __name__ == "__main__":
    main()
