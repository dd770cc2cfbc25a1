"""Tiny image-conditioned pipelines for the zoo: FLUX.1 Kontext and Wan image-to-video.

They reuse the text-to-image families' parts (``tiny``'s builders, seeds and tokenizers) and add what
the image path needs:

- **FLUX.1 Kontext**: FLUX's transformer, text encoders and scheduler, with a VAE that downsamples by
  16 instead of 4. The Kontext pipeline resizes every input image to its preferred resolutions
  (about 1024x1024), so a 4x VAE would hand the transformer 65k image tokens; at 16x the resized
  input is 1024 tokens and a 64x64 output 4 tokens, which a CPU runs in about a second.
- **Wan 2.1 image-to-video**: Wan's 3D VAE and text encoder, a transformer with Wan 2.1 I2V's input
  layout (``in_channels`` = 16 noise + 4 mask + 16 first-frame latent channels) and image
  cross-attention (``image_dim``, ``added_kv_proj_dim``), and a two-layer CLIP vision encoder with a
  32x32 CLIP image processor (the pipeline reads the second-to-last hidden state, so two layers is
  the fewest that exercise it).
"""

from __future__ import annotations

from typing import Any

from diffusers import AutoencoderKL, WanTransformer3DModel
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

_LATENT_CHANNELS = 16
_CLIP_VISION_WIDTH = 16


def flux_kontext_components(seed: int, flux_components, seeded) -> dict[str, Any]:
    components = flux_components(seed)
    components["vae"] = seeded(
        seed,
        "vae",
        lambda: AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 5,
            up_block_types=("UpDecoderBlock2D",) * 5,
            block_out_channels=(8, 8, 16, 16, 16),  # 2 ** (5 - 1) = 16x downsampling
            layers_per_block=1,
            latent_channels=_LATENT_CHANNELS,
            norm_num_groups=8,
            sample_size=64,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.1159,  # FLUX.1's VAE
            scaling_factor=0.3611,
        ),
    )
    return components


def _wan_i2v_transformer(text_dim: int) -> WanTransformer3DModel:
    heads, head_dim = 2, 16
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=_LATENT_CHANNELS + 4 + _LATENT_CHANNELS,  # noise, frame mask, first-frame latent
        out_channels=_LATENT_CHANNELS,
        text_dim=text_dim,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        image_dim=_CLIP_VISION_WIDTH,  # CLIP vision hidden size (1280 for Wan 2.1 I2V's ViT-H)
        added_kv_proj_dim=heads * head_dim,
        rope_max_seq_len=1024,  # Wan's own: the default 480x832x81 fits
    )


def wan_i2v_components(seed: int, wan_components, seeded, text_dim: int) -> dict[str, Any]:
    components = wan_components(seed, two_experts=False)
    components.pop("boundary_ratio", None)
    components.pop("transformer_2", None)
    components["transformer"] = seeded(seed, "transformer", lambda: _wan_i2v_transformer(text_dim))
    components["image_encoder"] = seeded(
        seed,
        "image_encoder",
        lambda: CLIPVisionModel(
            CLIPVisionConfig(
                hidden_size=_CLIP_VISION_WIDTH,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
                projection_dim=_CLIP_VISION_WIDTH,
            )
        ),
    )
    components["image_processor"] = CLIPImageProcessor(
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        do_resize=True,
        do_center_crop=True,
        do_normalize=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073],  # OpenAI CLIP's, as Wan 2.1 I2V ships
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    return components


def qwen2vl_image_processor(**kwargs):
    """Qwen2-VL's image processor: the PIL backend where transformers has one (5.x, which would
    otherwise warn that torchvision is missing), else the classic class (4.x)."""
    try:
        from transformers import Qwen2VLImageProcessorPil as cls
    except ImportError:
        from transformers import Qwen2VLImageProcessor as cls
    return cls(**kwargs)


def make_qwen2vl_processor(tokenizer, image_processor):
    """A ``Qwen2VLProcessor`` over ``tokenizer`` and ``image_processor``.

    transformers 5 requires a video processor in every Qwen2-VL processor, and video processors need
    torchvision; without it the constructor itself fails. QwenImageEditPipeline only ever calls the
    processor on text and images, so without torchvision the processor is assembled without one (the
    attributes its constructor would set, nothing else). Such a pipeline runs in memory; saving and
    loading its folder needs torchvision, as the real Qwen-Image-Edit checkpoint does.
    """
    from transformers import Qwen2VLProcessor

    try:
        return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)
    except (AttributeError, ImportError, TypeError, ValueError):
        processor = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
        processor.chat_template = None
        processor.image_token = "<|image_pad|>"
        processor.video_token = "<|video_pad|>"
        processor.image_token_id = tokenizer.convert_tokens_to_ids(processor.image_token)
        processor.video_token_id = tokenizer.convert_tokens_to_ids(processor.video_token)
        processor.tokenizer = tokenizer
        processor.image_processor = image_processor
        processor.video_processor = None
        return processor


def qwenimage_edit_components(seed: int, qwenimage_components, seeded) -> dict[str, Any]:
    """Qwen-Image's parts, a 32x downsampling VAE (the pipeline resizes every input image to about
    1024x1024: 256 image tokens here instead of 16k) and a Qwen2-VL processor whose image processor
    keeps the vision tower's input to a few patches."""
    from diffusers import AutoencoderKLQwenImage

    components = qwenimage_components(seed)
    components["vae"] = seeded(
        seed,
        "vae",
        lambda: AutoencoderKLQwenImage(
            base_dim=2,  # the encoder runs at ~1024x1024: the narrowest widths keep a CPU call short
            z_dim=_LATENT_CHANNELS,
            dim_mult=[1, 2, 4, 4, 8, 8],
            num_res_blocks=1,
            temperal_downsample=[False, True, True, True, True],  # 2 ** 5 = 32x
        ),
    )
    image_processor = qwen2vl_image_processor(
        min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    components["processor"] = make_qwen2vl_processor(components["tokenizer"], image_processor)
    return components


def wan_ti2v_i2v_components(seed: int, wan_components) -> dict[str, Any]:
    """Wan 2.2 TI2V-5B's image-to-video layout: the text-to-video parts (no image encoder, 16 input
    channels) in ``WanImageToVideoPipeline`` with per-token timesteps (``expand_timesteps``), which
    writes the image's latent over the first latent frame instead of concatenating it."""
    components = wan_components(seed, two_experts=False)
    components.pop("boundary_ratio", None)
    components.pop("transformer_2", None)
    components["expand_timesteps"] = True
    return components
