"""Real-scale builders for the large and the image-conditioned models (public configs, random weights).

Registered into ``model_builders`` on import (``REAL_MODELS``, builders, families, request defaults),
so ``model_builders.build(name)`` and every benchmark built on it serve them:

- ``qwen-image``: Qwen/Qwen-Image, the 20B MMDiT (``QwenImageTransformer2DModel``'s defaults are the
  checkpoint's config: 60 layers, 24 x 128 heads, text width 3584), its VAE (``AutoencoderKLQwenImage``
  defaults), a two-layer Qwen2.5-VL text encoder of the real width 3584. 1328x1328, true CFG 4.
- ``wan2.2-a14b``: Wan-AI/Wan2.2-T2V-A14B, two 14B experts (``WanTransformer3DModel``'s defaults are the
  14B config), the Wan 2.1 VAE, ``boundary_ratio`` 0.875, UniPC at shift 3; 480x832x81, guidance 4 / 3.
- ``wan2.2-ti2v-5b``: Wan-AI/Wan2.2-TI2V-5B text-to-video: the 5B transformer (3072 wide, 30 layers,
  48 latent channels), the Wan 2.2 VAE (16x spatial, 48 channels; its per-channel statistics are set
  to 0/1, which only rescale random latents), per-token timesteps (``expand_timesteps``), shift 5.
- ``wan2.2-ti2v-5b-i2v``: the same TI2V-5B in ``WanImageToVideoPipeline`` with a 1280x704 input image
  (its latent becomes the first latent frame, at timestep 0).
- ``flux.1-kontext-dev``: FLUX.1 Kontext [dev] (FLUX.1-dev's transformer and VAE) with a 1024x1024
  input image; 1024x1024 output, guidance 2.5.
- ``qwen-image-edit``: Qwen/Qwen-Image-Edit: Qwen-Image's 20B transformer and VAE, the Qwen2.5-VL
  text encoder above reading the prompt with the input image (Qwen2.5-VL's image processor
  settings), a 1024x1024 input image and output, true CFG 4.
- ``wan2.2-i2v-a14b``: Wan-AI/Wan2.2-I2V-A14B: two 14B experts with 36 input channels (16 noise + 4
  mask + 16 first-frame latent), no image encoder, ``boundary_ratio`` 0.9, shift 5, guidance 3.5 / 3.5
  (Wan2.2's ``wan_i2v_A14B.py``); 480x832x33 with a 480x832 input image.
- ``wan2.1-i2v-14b-480p``: Wan-AI/Wan2.1-I2V-14B-480P: one 14B transformer with 36 input channels and
  image cross-attention (``image_dim`` 1280, ``added_kv_proj_dim`` 5120), the Wan 2.1 VAE, its CLIP
  ViT-H/14 image encoder at the real width (1280 wide, 16 heads, 224 px, 257 tokens; two layers of
  the 32, as the text encoders: the pipeline reads the penultimate hidden state), OpenAI CLIP's image
  processor settings, UniPC at shift 3 (the 480P card's), guidance 5; 480x832x81 with an input image.

Text encoders are small (one or two layers) at the real output widths, as in ``model_builders``.
Step counts are small (2 to 4) so the whole set runs within one device call; ms/step is per step.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks import model_builders as mb
from benchmarks.model_builders import build_module

# Wan-AI/Wan2.2-TI2V-5B transformer/config.json.
WAN22_TI2V_5B_TRANSFORMER = {
    "added_kv_proj_dim": None,
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 14336,
    "freq_dim": 256,
    "image_dim": None,
    "in_channels": 48,
    "num_attention_heads": 24,
    "num_layers": 30,
    "out_channels": 48,
    "patch_size": (1, 2, 2),
    "pos_embed_seq_len": None,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
    "text_dim": 4096,
}
# Wan-AI/Wan2.2-TI2V-5B vae/config.json, except latents_mean / latents_std (48 values each; 0 and 1
# here: with random weights they only shift and scale random latents).
WAN22_VAE = {
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
    "is_residual": True,
    "latents_mean": [0.0] * 48,
    "latents_std": [1.0] * 48,
}
# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers transformer/config.json (the rest: WanTransformer3DModel's
# defaults, the 14B sizes: 40 layers, 40 x 128 heads, ffn 13824).
WAN21_I2V_14B_TRANSFORMER = {"in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}
# Its image_encoder/config.json (CLIPVisionModel, open-clip xlm-roberta-large-vit-huge-14's vision
# tower), except num_hidden_layers: 2 of 32.
WAN21_I2V_CLIP_VISION = {
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_attention_heads": 16,
    "num_hidden_layers": 2,
    "image_size": 224,
    "patch_size": 14,
    "projection_dim": 1024,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
}
WAN22_T2V_BOUNDARY = 0.875  # wan_t2v_A14B.py
WAN22_I2V_BOUNDARY = 0.9  # wan_i2v_A14B.py
QWEN25_VL_7B_HIDDEN = 3584

DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen-image": {
        "height": 1328,
        "width": 1328,
        "num_inference_steps": 4,
        "true_cfg_scale": 4.0,
        "negative_prompt": " ",
    },
    # Wan 2.1 T2V 14B (WanTransformer3DModel's defaults: 40 layers, dim 5120, 40 heads), 480p.
    "wan2.1-14b": {
        "height": 480,
        "width": 832,
        "num_frames": 81,
        "num_inference_steps": 2,
        "guidance_scale": 5.0,
    },
    "wan2.2-a14b": {
        "height": 480,
        "width": 832,
        "num_frames": 81,
        "num_inference_steps": 2,
        "guidance_scale": 4.0,
        "guidance_scale_2": 3.0,
    },
    "wan2.2-ti2v-5b": {
        "height": 704,
        "width": 1280,
        "num_frames": 81,
        "num_inference_steps": 3,
        "guidance_scale": 5.0,
    },
    # TI2V-5B's image-to-video call: the first latent frame is the input image's.
    "wan2.2-ti2v-5b-i2v": {
        "height": 704,
        "width": 1280,
        "num_frames": 81,
        "num_inference_steps": 3,
        "guidance_scale": 5.0,
    },
    "flux.1-kontext-dev": {"height": 1024, "width": 1024, "num_inference_steps": 4, "guidance_scale": 2.5},
    # The input image is 1024x1024, so the default output is too; true CFG 4 as Qwen-Image-Edit's card.
    "qwen-image-edit": {
        "height": 1024,
        "width": 1024,
        "num_inference_steps": 4,
        "true_cfg_scale": 4.0,
        "negative_prompt": " ",
    },
    "wan2.1-i2v-14b-480p": {
        "height": 480,
        "width": 832,
        "num_frames": 81,
        "num_inference_steps": 2,
        "guidance_scale": 5.0,
    },
    # 33 frames (not 81) keeps the image-to-video row within the device call; 81 is wan2.2-a14b's.
    "wan2.2-i2v-a14b": {
        "height": 480,
        "width": 832,
        "num_frames": 33,
        "num_inference_steps": 2,
        "guidance_scale": 3.5,
        "guidance_scale_2": 3.5,
    },
}
FAMILY = {
    "qwen-image": "qwenimage",
    "wan2.1-14b": "wan",
    "wan2.2-a14b": "wan2.2",
    "wan2.2-ti2v-5b": "wan",
    "wan2.2-ti2v-5b-i2v": "wan2.2-ti2v-i2v",
    "flux.1-kontext-dev": "flux-kontext",
    "qwen-image-edit": "qwenimage-edit",
    "wan2.2-i2v-a14b": "wan-i2v",
    "wan2.1-i2v-14b-480p": "wan-i2v",
}


def _qwen25_vl(tokenizer, *, seed: int, device: str, dtype) -> torch.nn.Module:
    """Qwen2.5-VL at Qwen2.5-VL-7B's text width (3584, 28 heads, mRoPE 16/24/24), two small layers,
    and a one-block vision tower projecting to that width."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from diffusion_rollout.models.tokenizers import QWEN_SPECIAL_TOKENS

    ids = dict(
        zip(QWEN_SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(QWEN_SPECIAL_TOKENS)), strict=True)
    )
    cfg = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": -(-len(tokenizer) // 64) * 64,
            "hidden_size": QWEN25_VL_7B_HIDDEN,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [16, 24, 24],
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": QWEN25_VL_7B_HIDDEN,
            "fullatt_block_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return build_module(lambda: Qwen2_5_VLForConditionalGeneration(cfg), device, dtype, seed)


def _qwen_image(device: str, dtype, seed: int, overrides: dict[str, Any]) -> Any:
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel

    from diffusion_rollout.models import make_real_scheduler
    from diffusion_rollout.models.tokenizers import make_qwen2_tokenizer

    tok = make_qwen2_tokenizer()
    return QwenImagePipeline(
        transformer=build_module(lambda: QwenImageTransformer2DModel(**overrides), device, dtype, seed),
        vae=build_module(lambda: AutoencoderKLQwenImage(), device, dtype, seed + 1),
        text_encoder=_qwen25_vl(tok, seed=seed + 2, device=device, dtype=dtype),
        tokenizer=tok,
        scheduler=make_real_scheduler("qwenimage"),
    )


def _qwen_image_edit(device: str, dtype, seed: int, overrides: dict[str, Any]) -> Any:
    from diffusers import AutoencoderKLQwenImage, QwenImageEditPipeline, QwenImageTransformer2DModel

    from diffusion_rollout.models import make_real_scheduler
    from diffusion_rollout.models.tiny_image_cond import make_qwen2vl_processor, qwen2vl_image_processor
    from diffusion_rollout.models.tokenizers import make_qwen2_tokenizer

    tok = make_qwen2_tokenizer()
    # Qwen2.5-VL's image processor settings (14 px patches, 2x2 merge, up to 12845056 pixels).
    image_processor = qwen2vl_image_processor(
        min_pixels=3136, max_pixels=12845056, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    return QwenImageEditPipeline(
        transformer=build_module(lambda: QwenImageTransformer2DModel(**overrides), device, dtype, seed),
        vae=build_module(lambda: AutoencoderKLQwenImage(), device, dtype, seed + 1),
        text_encoder=_qwen25_vl(tok, seed=seed + 2, device=device, dtype=dtype),
        tokenizer=tok,
        processor=make_qwen2vl_processor(tok, image_processor),
        scheduler=make_real_scheduler("qwenimage"),
    )


def _wan_scheduler(shift: float) -> Any:
    from diffusion_rollout.models import make_real_scheduler

    base = make_real_scheduler("wan")  # Wan's UniPC (flow sigmas), at the checkpoint's shift
    return type(base).from_config(base.config, flow_shift=shift)


def _wan_experts(
    pipeline_cls,
    device: str,
    dtype,
    seed: int,
    overrides: dict[str, Any],
    *,
    in_channels: int,
    boundary: float,
) -> Any:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from diffusion_rollout.models.tokenizers import make_t5_tokenizer

    tok = make_t5_tokenizer()
    tcfg = {"in_channels": in_channels, **overrides}  # the rest: WanTransformer3DModel's 14B defaults
    kwargs = {
        "transformer": build_module(lambda: WanTransformer3DModel(**tcfg), device, dtype, seed),
        "transformer_2": build_module(lambda: WanTransformer3DModel(**tcfg), device, dtype, seed + 10),
        "vae": build_module(lambda: AutoencoderKLWan(), device, dtype, seed + 1),
        "text_encoder": mb._t5(tok, umt5=True, seed=seed + 2, device=device, dtype=dtype),
        "tokenizer": tok,
        "scheduler": _wan_scheduler(3.0 if boundary == WAN22_T2V_BOUNDARY else 5.0),
        "boundary_ratio": boundary,
    }
    return pipeline_cls(**kwargs)


def _wan21_14b(device: str, dtype, seed: int, overrides: dict[str, Any]) -> Any:
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    from diffusion_rollout.models.tokenizers import make_t5_tokenizer

    tok = make_t5_tokenizer()
    tcfg = {"in_channels": 16, **overrides}  # the rest: WanTransformer3DModel's 14B defaults
    return WanPipeline(
        transformer=build_module(lambda: WanTransformer3DModel(**tcfg), device, dtype, seed),
        vae=build_module(lambda: AutoencoderKLWan(), device, dtype, seed + 1),
        text_encoder=mb._t5(tok, umt5=True, seed=seed + 2, device=device, dtype=dtype),
        tokenizer=tok,
        scheduler=_wan_scheduler(5.0),  # Wan 2.1 T2V 14B's sample_shift
    )


def _wan22_a14b(device: str, dtype, seed: int, overrides: dict[str, Any]) -> Any:
    from diffusers import WanPipeline

    return _wan_experts(
        WanPipeline, device, dtype, seed, overrides, in_channels=16, boundary=WAN22_T2V_BOUNDARY
    )


def _wan22_i2v_a14b(device: str, dtype, seed: int, overrides: dict[str, Any]) -> Any:
    from diffusers import WanImageToVideoPipeline

    return _wan_experts(
        WanImageToVideoPipeline, device, dtype, seed, overrides, in_channels=36, boundary=WAN22_I2V_BOUNDARY
    )


def _wan22_ti2v_5b(device: str, dtype, seed: int, overrides: dict[str, Any]) -> Any:
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    from diffusion_rollout.models.tokenizers import make_t5_tokenizer

    tok = make_t5_tokenizer()
    tcfg = {**WAN22_TI2V_5B_TRANSFORMER, **overrides}
    return WanPipeline(
        transformer=build_module(lambda: WanTransformer3DModel(**tcfg), device, dtype, seed),
        vae=build_module(lambda: AutoencoderKLWan(**WAN22_VAE), device, dtype, seed + 1),
        text_encoder=mb._t5(tok, umt5=True, seed=seed + 2, device=device, dtype=dtype),
        tokenizer=tok,
        scheduler=_wan_scheduler(5.0),
        expand_timesteps=True,
    )


def _wan22_ti2v_5b_i2v(device: str, dtype, seed: int, overrides: dict[str, Any]) -> Any:
    from diffusers import WanImageToVideoPipeline

    t2v = _wan22_ti2v_5b(device, dtype, seed, overrides)  # the same model; the image-to-video call
    parts = {
        k: v for k, v in t2v.components.items() if k in ("transformer", "vae", "text_encoder", "tokenizer")
    }
    return WanImageToVideoPipeline(**parts, scheduler=t2v.scheduler, expand_timesteps=True)


def _wan21_i2v_14b_480p(device: str, dtype, seed: int, overrides: dict[str, Any]) -> Any:
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    from diffusion_rollout.models.tokenizers import make_t5_tokenizer

    tok = make_t5_tokenizer()
    tcfg = {**WAN21_I2V_14B_TRANSFORMER, **overrides}
    vision = CLIPVisionConfig(**WAN21_I2V_CLIP_VISION)
    processor = CLIPImageProcessor(  # image_processor/preprocessor_config.json: OpenAI CLIP's
        size={"shortest_edge": 224},
        crop_size={"height": 224, "width": 224},
        do_resize=True,
        do_center_crop=True,
        do_normalize=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    return WanImageToVideoPipeline(
        transformer=build_module(lambda: WanTransformer3DModel(**tcfg), device, dtype, seed),
        vae=build_module(lambda: AutoencoderKLWan(), device, dtype, seed + 1),
        text_encoder=mb._t5(tok, umt5=True, seed=seed + 2, device=device, dtype=dtype),
        tokenizer=tok,
        image_encoder=build_module(lambda: CLIPVisionModel(vision), device, dtype, seed + 3),
        image_processor=processor,
        scheduler=_wan_scheduler(3.0),
    )


def _flux1_kontext_dev(device: str, dtype, seed: int, overrides: dict[str, Any]) -> Any:
    from diffusers import FluxKontextPipeline

    flux = mb._flux1_dev(device, dtype, seed, overrides)  # same transformer, VAE and encoders
    return FluxKontextPipeline(**{k: v for k, v in flux.components.items()})


BUILDERS = {
    "qwen-image": _qwen_image,
    "wan2.1-14b": _wan21_14b,
    "wan2.2-a14b": _wan22_a14b,
    "wan2.2-ti2v-5b": _wan22_ti2v_5b,
    "wan2.2-ti2v-5b-i2v": _wan22_ti2v_5b_i2v,
    "flux.1-kontext-dev": _flux1_kontext_dev,
    "qwen-image-edit": _qwen_image_edit,
    "wan2.2-i2v-a14b": _wan22_i2v_a14b,
    "wan2.1-i2v-14b-480p": _wan21_i2v_14b_480p,
}


def register() -> None:
    """Make ``model_builders.build`` know these models (idempotent)."""
    mb._REAL_BUILDERS.update(BUILDERS)
    mb._REAL_FAMILY.update(FAMILY)
    mb.REAL_DEFAULTS.update({k: dict(v) for k, v in DEFAULTS.items()})
    mb.REAL_MODELS = tuple(dict.fromkeys((*mb.REAL_MODELS, *BUILDERS)))


register()
