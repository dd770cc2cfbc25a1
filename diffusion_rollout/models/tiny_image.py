"""Tiny offline text-to-image families: SD3(.5), FLUX.1, Qwen-Image, FLUX.2 [klein] and Z-Image.

Real component classes at one or two layers and widths of 8 to 32, the real checkpoints' scheduler
configs; the seeded construction and the shared text encoders and VAE come from ``tiny_parts``. The
family table that names them is ``tiny.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    AutoencoderKLFlux2,
    AutoencoderKLQwenImage,
    Flux2Transformer2DModel,
    FluxTransformer2DModel,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    ZImageTransformer2DModel,
)
from transformers import (
    CLIPTextModel,
    CLIPTextModelWithProjection,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    T5Config,
    T5EncoderModel,
)

from .scheduler_configs import make_real_scheduler
from .tiny_parts import (
    LATENT_CHANNELS,
    TEXT_DIM,
    clip_config,
    image_vae,
    padded_vocab,
    qwen25_text_config,
    qwen_ids,
    seeded,
    t5_kwargs,
)
from .tokenizers import (
    make_clip_tokenizer,
    make_qwen2_tokenizer,
    make_qwen3_tokenizer,
    make_t5_tokenizer,
)


def sd3_components(seed: int) -> dict[str, Any]:
    tokenizer = make_clip_tokenizer()
    tokenizer_2 = make_clip_tokenizer(pad_token="!")  # CLIP-G's tokenizer pads with "!"
    tokenizer_3 = make_t5_tokenizer()
    clip_l_width, clip_g_width = 8, 16  # concatenated (24) and zero-padded to the T5 width (32)
    return {
        "transformer": seeded(
            seed,
            "transformer",
            lambda: SD3Transformer2DModel(
                sample_size=8,  # latent size of the default 32x32 image
                patch_size=2,
                in_channels=LATENT_CHANNELS,
                out_channels=LATENT_CHANNELS,
                num_layers=2,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=TEXT_DIM,
                caption_projection_dim=32,
                pooled_projection_dim=clip_l_width + clip_g_width,
                pos_embed_max_size=32,
                dual_attention_layers=(0,),  # SD3.5-medium's MMDiT-X blocks
                qk_norm="rms_norm",  # SD3.5
            ),
        ),
        "text_encoder": seeded(
            seed,
            "text_encoder",
            lambda: CLIPTextModelWithProjection(
                clip_config(tokenizer, clip_l_width, clip_l_width, "quick_gelu")
            ),
        ),
        "text_encoder_2": seeded(
            seed,
            "text_encoder_2",
            lambda: CLIPTextModelWithProjection(clip_config(tokenizer_2, clip_g_width, clip_g_width, "gelu")),
        ),
        "text_encoder_3": seeded(
            seed, "text_encoder_3", lambda: T5EncoderModel(T5Config(**t5_kwargs(tokenizer_3)))
        ),
        "vae": seeded(seed, "vae", lambda: image_vae(shift_factor=0.0609, scaling_factor=1.5305)),
        "scheduler": make_real_scheduler("sd3"),
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer_2,
        "tokenizer_3": tokenizer_3,
    }


def flux_components(seed: int) -> dict[str, Any]:
    tokenizer = make_clip_tokenizer()
    tokenizer_2 = make_t5_tokenizer()
    clip_width = 16
    return {
        "transformer": seeded(
            seed,
            "transformer",
            lambda: FluxTransformer2DModel(
                patch_size=1,
                in_channels=4 * LATENT_CHANNELS,  # 2x2 packed latent patches
                num_layers=1,
                num_single_layers=1,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=TEXT_DIM,
                pooled_projection_dim=clip_width,
                guidance_embeds=True,  # FLUX.1-dev's distilled guidance embedding
                axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
            ),
        ),
        "text_encoder": seeded(
            seed,
            "text_encoder",
            lambda: CLIPTextModel(clip_config(tokenizer, clip_width, clip_width, "quick_gelu")),
        ),
        "text_encoder_2": seeded(
            seed, "text_encoder_2", lambda: T5EncoderModel(T5Config(**t5_kwargs(tokenizer_2)))
        ),
        "vae": seeded(seed, "vae", lambda: image_vae(shift_factor=0.1159, scaling_factor=0.3611)),
        "scheduler": make_real_scheduler("flux"),
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer_2,
        "image_encoder": None,
        "feature_extractor": None,
    }


def _qwen25_vl_config(tokenizer: PreTrainedTokenizerBase) -> Qwen2_5_VLConfig:
    ids = qwen_ids(tokenizer)
    return Qwen2_5_VLConfig(
        text_config=qwen25_text_config(tokenizer),
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": TEXT_DIM,
            "fullatt_block_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def qwenimage_components(seed: int) -> dict[str, Any]:
    tokenizer = make_qwen2_tokenizer()
    return {
        "transformer": seeded(
            seed,
            "transformer",
            lambda: QwenImageTransformer2DModel(
                patch_size=2,
                in_channels=4 * LATENT_CHANNELS,  # 2x2 packed latent patches
                out_channels=LATENT_CHANNELS,
                num_layers=2,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=TEXT_DIM,
                guidance_embeds=False,
                axes_dims_rope=(4, 6, 6),
            ),
        ),
        "text_encoder": seeded(
            seed, "text_encoder", lambda: Qwen2_5_VLForConditionalGeneration(_qwen25_vl_config(tokenizer))
        ),
        # Qwen-Image's VAE is Wan's causal 3D VAE; latents_mean/std keep the real per-channel values.
        "vae": seeded(
            seed,
            "vae",
            lambda: AutoencoderKLQwenImage(
                base_dim=8,
                z_dim=LATENT_CHANNELS,
                dim_mult=[1, 2, 2],
                num_res_blocks=1,
                temperal_downsample=[False, True],  # pipeline's vae_scale_factor = 2 ** len(...) = 4
            ),
        ),
        "scheduler": make_real_scheduler("qwenimage"),
        "tokenizer": tokenizer,
    }


def _qwen3_config(tokenizer: PreTrainedTokenizerBase, num_layers: int) -> Qwen3Config:
    head_dim = 16
    return Qwen3Config(
        vocab_size=padded_vocab(tokenizer),
        hidden_size=TEXT_DIM,
        intermediate_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=TEXT_DIM // head_dim,
        num_key_value_heads=1,  # grouped-query attention, as in Qwen3
        head_dim=head_dim,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


# FLUX.2 [klein] stacks the text encoder's hidden states after layers 9, 18 and 27 (the pipeline's
# default ``text_encoder_out_layers``): the tiny Qwen3 needs 27 layers so the real indices exist.
_KLEIN_TEXT_LAYERS = 27
_KLEIN_OUT_LAYERS = 3


def _flux2_vae() -> AutoencoderKLFlux2:
    vae = AutoencoderKLFlux2(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=32,
    )
    # The pipeline de-normalises latents with the VAE's batch-norm statistics; give them real values
    # (the defaults 0 and 1 would make that step an identity no test could catch).
    with torch.no_grad():
        vae.bn.running_mean.normal_(0.0, 0.1)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def flux2_klein_components(seed: int) -> dict[str, Any]:
    tokenizer = make_qwen3_tokenizer()
    return {
        "transformer": seeded(
            seed,
            "transformer",
            lambda: Flux2Transformer2DModel(
                patch_size=1,
                in_channels=4 * LATENT_CHANNELS,  # 2x2 patchified latents
                num_layers=1,
                num_single_layers=1,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=_KLEIN_OUT_LAYERS * TEXT_DIM,
                timestep_guidance_channels=32,
                axes_dims_rope=(4, 4, 4, 4),  # (t, h, w, l); sums to attention_head_dim
                guidance_embeds=False,  # klein has no distilled guidance embedding
            ),
        ),
        "text_encoder": seeded(
            seed, "text_encoder", lambda: Qwen3ForCausalLM(_qwen3_config(tokenizer, _KLEIN_TEXT_LAYERS))
        ),
        "vae": seeded(seed, "vae", _flux2_vae),
        "scheduler": make_real_scheduler("flux2-klein"),
        "tokenizer": tokenizer,
        # The base (undistilled) variant, so true CFG runs; the distilled 4B sets is_distilled=True.
        "is_distilled": False,
    }


def zimage_components(seed: int) -> dict[str, Any]:
    tokenizer = make_qwen3_tokenizer()
    return {
        "transformer": seeded(
            seed,
            "transformer",
            lambda: ZImageTransformer2DModel(
                all_patch_size=(2,),
                all_f_patch_size=(1,),
                in_channels=LATENT_CHANNELS,
                dim=32,
                n_layers=2,
                n_refiner_layers=1,
                n_heads=2,
                n_kv_heads=2,
                qk_norm=True,
                cap_feat_dim=TEXT_DIM,
                axes_dims=[4, 6, 6],  # (t, h, w); sums to dim / n_heads
                axes_lens=[
                    1536,
                    256,
                    256,
                ],  # 512 text tokens (Z-Image's 1536) and 1024x1024 (128 rows of 8 px) fit
            ),
        ),
        # Z-Image reads the text encoder's second-to-last hidden state.
        "text_encoder": seeded(seed, "text_encoder", lambda: Qwen3Model(_qwen3_config(tokenizer, 2))),
        # Z-Image decodes with the FLUX.1 VAE (16 channels, its shift and scale).
        "vae": seeded(seed, "vae", lambda: image_vae(shift_factor=0.1159, scaling_factor=0.3611)),
        "scheduler": make_real_scheduler("zimage"),
        "tokenizer": tokenizer,
    }
