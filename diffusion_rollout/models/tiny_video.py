"""Tiny offline video families: Wan 2.1/2.2 text-to-video, and HunyuanVideo 1.5 and LTX-2 with their
own text stacks.

Real scheduler configs, real tokenizer layouts (``tokenizers.py``), every width cut down so a CPU
builds and runs them in seconds; the shared pieces come from ``tiny_parts``.
"""

from __future__ import annotations

import inspect
from typing import Any

from diffusers import (
    AutoencoderKLHunyuanVideo15,
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    AutoencoderKLWan,
    ClassifierFreeGuidance,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
    LTX2VideoTransformer3DModel,
    WanTransformer3DModel,
)
from transformers import (
    ByT5Tokenizer,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    PreTrainedTokenizerBase,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

from .scheduler_configs import HUNYUANVIDEO15_480P_GUIDANCE, WAN22_A14B_BOUNDARY_RATIO, make_real_scheduler
from .tiny_parts import (
    LATENT_CHANNELS,
    TEXT_DIM,
    padded_vocab,
    qwen25_text_config,
    seeded,
    t5_kwargs,
)
from .tokenizers import (
    QWEN_CHAT_TEMPLATE,
    make_gemma_tokenizer,
    make_qwen2_tokenizer,
    make_t5_tokenizer,
)


def _wan_transformer() -> WanTransformer3DModel:
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,  # RoPE splits it 8 (t) / 4 (h) / 4 (w)
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024,  # Wan's own: the default 480x832x81 fits
    )


def _wan_vae() -> AutoencoderKLWan:
    # Four levels: 8x spatial and (two temporal downsamples) 4x temporal, the real Wan 2.1 factors.
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )


def wan_components(seed: int, *, two_experts: bool) -> dict[str, Any]:
    tokenizer = make_t5_tokenizer()
    return {
        # Wan2.2 A14B: `transformer` is the high-noise expert, `transformer_2` the low-noise one.
        "transformer": seeded(seed, "transformer", _wan_transformer),
        "transformer_2": seeded(seed, "transformer_2", _wan_transformer) if two_experts else None,
        "boundary_ratio": WAN22_A14B_BOUNDARY_RATIO if two_experts else None,
        "text_encoder": seeded(
            seed, "text_encoder", lambda: UMT5EncoderModel(UMT5Config(**t5_kwargs(tokenizer)))
        ),
        "vae": seeded(seed, "vae", _wan_vae),
        "scheduler": make_real_scheduler("wan2.2" if two_experts else "wan"),
        "tokenizer": tokenizer,
    }


def _hunyuanvideo15_system_prefix() -> str:
    """The chat-formatted system turn ``HunyuanVideo15Pipeline`` crops after encoding.

    Read from the pipeline itself (its ``system_message`` default), so the tiny tokenizer's merges
    follow whatever text the installed diffusers sends.
    """
    system = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"]
    return f"<|im_start|>system\n{system.default}<|im_end|>\n<|im_start|>user\n"


def hunyuanvideo15_tokenizers() -> tuple[PreTrainedTokenizerBase, PreTrainedTokenizerBase]:
    """HunyuanVideo 1.5's two tokenizers, offline: Qwen2 (ChatML, the 108-token system prefix) and ByT5."""
    tokenizer = make_qwen2_tokenizer(
        template_prefix=_hunyuanvideo15_system_prefix(), chat_template=QWEN_CHAT_TEMPLATE
    )
    return tokenizer, ByT5Tokenizer()  # ByT5 is byte-level: no vocabulary file exists to download


def hunyuanvideo15_components(seed: int) -> dict[str, Any]:
    tokenizer, tokenizer_2 = hunyuanvideo15_tokenizers()
    glyph_dim = 16  # the ByT5 encoder width (text_embed_2_dim; 1472 for the real Glyph-SDXL-v2 ByT5)
    latent_channels = LATENT_CHANNELS  # 32 in the real model
    return {
        "transformer": seeded(
            seed,
            "transformer",
            lambda: HunyuanVideo15Transformer3DModel(
                # The model input is [latent, image-condition latent, mask] on channels: 2C + 1.
                in_channels=2 * latent_channels + 1,
                out_channels=latent_channels,
                num_attention_heads=2,
                attention_head_dim=16,
                num_layers=2,
                num_refiner_layers=1,
                mlp_ratio=2.0,
                patch_size=1,
                patch_size_t=1,
                text_embed_dim=TEXT_DIM,
                text_embed_2_dim=glyph_dim,
                image_embed_dim=16,
                rope_axes_dim=(4, 6, 6),  # sums to attention_head_dim, like (16, 56, 56) to 128
                target_size=32,  # pixels: the default size the pipeline derives (640 for 480p)
                task_type="t2v",
            ),
        ),
        # Qwen2.5-VL's language model alone, as the pipeline loads it; three layers because the
        # pipeline reads the hidden states two layers below the top.
        "text_encoder": seeded(
            seed,
            "text_encoder",
            lambda: Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**qwen25_text_config(tokenizer, num_layers=3))),
        ),
        "text_encoder_2": seeded(
            seed,
            "text_encoder_2",
            lambda: T5EncoderModel(
                T5Config(**{**t5_kwargs(tokenizer_2), "vocab_size": len(tokenizer_2), "d_model": glyph_dim})
            ),
        ),
        # 16x spatial and 4x temporal compression, the real factors (the pipeline reads them).
        "vae": seeded(
            seed,
            "vae",
            lambda: AutoencoderKLHunyuanVideo15(
                latent_channels=latent_channels,
                block_out_channels=(8, 16, 16, 32, 32),
                layers_per_block=1,
                spatial_compression_ratio=16,
                temporal_compression_ratio=4,
            ),
        ),
        "scheduler": make_real_scheduler("hunyuanvideo15"),
        "guider": ClassifierFreeGuidance(guidance_scale=HUNYUANVIDEO15_480P_GUIDANCE),
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer_2,
    }


def ltx2_components(seed: int) -> dict[str, Any]:
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    tokenizer = make_gemma_tokenizer()
    text_layers = 2
    return {
        # Video (4 latent channels) and audio (2 channels x 2 latent mel bins, packed to 4) streams,
        # denoised jointly; the real LTX-2 has 128 and 8 x 16.
        "transformer": seeded(
            seed,
            "transformer",
            lambda: LTX2VideoTransformer3DModel(
                in_channels=4,
                out_channels=4,
                patch_size=1,
                patch_size_t=1,
                num_attention_heads=2,
                attention_head_dim=8,
                cross_attention_dim=16,
                audio_in_channels=4,
                audio_out_channels=4,
                audio_num_attention_heads=2,
                audio_attention_head_dim=4,
                audio_cross_attention_dim=8,
                num_layers=2,
                qk_norm="rms_norm_across_heads",
                caption_channels=TEXT_DIM,
                rope_double_precision=False,
                rope_type="split",
            ),
        ),
        # Gemma 3 (the pipeline stacks every hidden state, embeddings included, on the last dim).
        "text_encoder": seeded(
            seed,
            "text_encoder",
            lambda: Gemma3ForConditionalGeneration(
                Gemma3Config(
                    text_config={
                        "vocab_size": padded_vocab(tokenizer),
                        "hidden_size": TEXT_DIM,
                        "intermediate_size": 32,
                        "num_hidden_layers": text_layers,
                        "num_attention_heads": 2,
                        "num_key_value_heads": 1,
                        "head_dim": 16,
                        "max_position_embeddings": 1024,
                        "sliding_window": 64,
                        "pad_token_id": tokenizer.pad_token_id,
                        "eos_token_id": tokenizer.eos_token_id,
                        "bos_token_id": tokenizer.bos_token_id,
                    },
                    vision_config={
                        "hidden_size": 16,
                        "intermediate_size": 16,
                        "num_hidden_layers": 1,
                        "num_attention_heads": 2,
                        "image_size": 28,
                        "patch_size": 14,
                    },
                    mm_tokens_per_image=4,
                )
            ),
        ),
        "connectors": seeded(
            seed,
            "connectors",
            lambda: LTX2TextConnectors(
                caption_channels=TEXT_DIM,
                text_proj_in_factor=text_layers + 1,
                video_connector_num_attention_heads=4,
                video_connector_attention_head_dim=8,
                video_connector_num_layers=1,
                video_connector_num_learnable_registers=None,
                audio_connector_num_attention_heads=4,
                audio_connector_attention_head_dim=8,
                audio_connector_num_layers=1,
                audio_connector_num_learnable_registers=None,
                connector_rope_base_seq_len=32,
                rope_theta=10000.0,
                rope_double_precision=False,
                causal_temporal_positioning=False,
                rope_type="split",
            ),
        ),
        # 2x spatial and 2x temporal compression (the real video VAE: 32x and 8x).
        "vae": seeded(
            seed,
            "vae",
            lambda: AutoencoderKLLTX2Video(
                in_channels=3,
                out_channels=3,
                latent_channels=4,
                block_out_channels=(8,),
                decoder_block_out_channels=(8,),
                layers_per_block=(1,),
                decoder_layers_per_block=(1, 1),
                spatio_temporal_scaling=(True,),
                decoder_spatio_temporal_scaling=(True,),
                decoder_inject_noise=(False, False),
                downsample_type=("spatial",),
                upsample_residual=(False,),
                upsample_factor=(1,),
                timestep_conditioning=False,
                patch_size=1,
                patch_size_t=1,
                encoder_causal=True,
                decoder_causal=False,
            ),
        ),
        "audio_vae": seeded(
            seed,
            "audio_vae",
            lambda: AutoencoderKLLTX2Audio(
                base_channels=4,
                output_channels=2,
                ch_mult=(1,),
                num_res_blocks=1,
                attn_resolutions=None,
                in_channels=2,
                resolution=32,
                latent_channels=2,
                norm_type="pixel",
                causality_axis="height",
                dropout=0.0,
                mid_block_add_attention=False,
                sample_rate=16000,
                mel_hop_length=160,
                is_causal=True,
                mel_bins=8,
            ),
        ),
        "vocoder": seeded(
            seed,
            "vocoder",
            lambda: LTX2Vocoder(
                in_channels=16,  # the audio VAE's output channels x mel bins
                hidden_channels=32,
                out_channels=2,
                upsample_kernel_sizes=[4, 4],
                upsample_factors=[2, 2],
                resnet_kernel_sizes=[3],
                resnet_dilations=[[1, 3, 5]],
                leaky_relu_negative_slope=0.1,
                output_sampling_rate=16000,
            ),
        ),
        "scheduler": make_real_scheduler("ltx2"),
        "tokenizer": tokenizer,
        "processor": None,
        "prompt_enhancer": None,
        "duration_head": None,
    }
