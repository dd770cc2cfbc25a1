"""Models for the benchmarks: the real architectures with random weights, and the tiny zoo.

Design decisions:

- **Real architectures from their public configs.** ``sd3.5-medium``, ``flux.1-dev`` and
  ``wan2.1-1.3b`` use the transformer and VAE configurations the checkpoints ship, and the real
  scheduler configurations (``REAL_SCHEDULER_CONFIGS``). No weights can be downloaded on the device
  machine, so weights are random. Speed depends on shapes, not values.
- **Built on the GPU, in the serving dtype.** Modules are constructed on the meta device
  (``accelerate.init_empty_weights``: parameters only, buffers such as SD3's positional table are
  computed normally), then every parameter is materialised directly on the device in bf16 and filled
  there: ``N(0, 1/fan_in)`` for matrices and convolutions (so activations keep their scale through
  57 FLUX blocks and stay finite), ones for norm weights, zeros for biases. FLUX's 12B parameters take
  seconds instead of minutes of CPU initialisation, with no float32 copy (48 GB) on the way. Floating
  buffers are cast to the serving dtype as ``from_pretrained(dtype=...)`` does, except in the model's
  ``_keep_in_fp32_modules`` (Wan keeps its time embedder, norms and RoPE tables in float32).
- **Small text encoders of the real widths.** CLIP-L/CLIP-G/T5-XXL and UMT5-XXL are replaced by one-
  or two-layer encoders with the real *output* widths (768, 1280, 4096), the zoo's offline
  tokenizers and the pipelines' default sequence lengths (SD3: 77 + 256 tokens, FLUX and Wan: 512),
  so the transformer sees real sequence lengths. Text encoding is not what these benchmarks measure:
  the server caches encodings and the stock pipeline is handed precomputed embeddings when timed.
- **One set of weights, two pipelines.** ``BenchModel.pipe`` is the pipeline the server serves (the
  loader swaps in the rollout scheduler); ``BenchModel.stock`` is a stock pipeline object over the
  *same* modules with a fresh stock scheduler, so "same weights, same inputs" holds by construction.
  ``BenchModel.stock_ode`` is the stock pipeline an all-ODE rollout must equal: the stock one, except
  for Wan, whose rollouts run flow-match Euler at the checkpoint's shift instead of UniPC.
- **Tiny models** (``tiny-<family>``) are the offline zoo's pipelines, float32 on the CPU, for the
  smoke test and the CPU regression gate.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

REAL_MODELS = (
    "sd3.5-medium",
    "flux.1-dev",
    "wan2.1-1.3b",
    "flux.2-klein-4b",
    "z-image-turbo",
    "hunyuanvideo-1.5-480p",
    "ltx-2",
)

# Transformer configs, as in each checkpoint's transformer/config.json.
SD35_MEDIUM_TRANSFORMER = {
    "attention_head_dim": 64,
    "caption_projection_dim": 1536,
    "dual_attention_layers": tuple(range(13)),
    "in_channels": 16,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 24,
    "out_channels": 16,
    "patch_size": 2,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 384,
    "qk_norm": "rms_norm",
    "sample_size": 128,
}
FLUX1_DEV_TRANSFORMER = {
    "attention_head_dim": 128,
    "axes_dims_rope": (16, 56, 56),
    "guidance_embeds": True,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 19,
    "num_single_layers": 38,
    "patch_size": 1,
    "pooled_projection_dim": 768,
}
WAN21_1_3B_TRANSFORMER = {
    "added_kv_proj_dim": None,
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 8960,
    "freq_dim": 256,
    "image_dim": None,
    "in_channels": 16,
    "num_attention_heads": 12,
    "num_layers": 30,
    "out_channels": 16,
    "patch_size": (1, 2, 2),
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
    "text_dim": 4096,
}
# black-forest-labs/FLUX.2-klein-4B transformer/config.json (5 double + 20 single blocks, 24 x 128
# heads, no guidance embedding; the text width is three stacked Qwen3-4B layers, 3 x 2560).
FLUX2_KLEIN_4B_TRANSFORMER = {
    "attention_head_dim": 128,
    "axes_dims_rope": (32, 32, 32, 32),
    "eps": 1e-6,
    "guidance_embeds": False,
    "in_channels": 128,
    "joint_attention_dim": 7680,
    "mlp_ratio": 3.0,
    "num_attention_heads": 24,
    "num_layers": 5,
    "num_single_layers": 20,
    "patch_size": 1,
    "rope_theta": 2000,
    "timestep_guidance_channels": 256,
}
# Tongyi-MAI/Z-Image-Turbo transformer/config.json (30 layers of width 3840, 30 heads, 2 refiner
# layers, Qwen3-4B caption features of width 2560, 3-axis RoPE 32/48/48 at theta 256).
ZIMAGE_TURBO_TRANSFORMER = {
    "all_f_patch_size": (1,),
    "all_patch_size": (2,),
    "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
    "cap_feat_dim": 2560,
    "dim": 3840,
    "in_channels": 16,
    "n_heads": 30,
    "n_kv_heads": 30,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "norm_eps": 1e-5,
    "qk_norm": True,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
}
# Qwen3-4B's hidden width (the text encoder of both); klein stacks hidden layers 9, 18 and 27.
QWEN3_4B_HIDDEN = 2560
KLEIN_TEXT_LAYERS = 27

# SD3.5 and FLUX.1 share the 16-channel KL VAE architecture; shift and scale differ.
_KL_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "act_fn": "silu",
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "force_upcast": True,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": True,
}
SD35_VAE = {**_KL_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609}
FLUX1_VAE = {**_KL_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}
# AutoencoderKLFlux2's defaults are FLUX.2's VAE (32 channels, batch-norm latent statistics).
FLUX2_VAE: dict[str, Any] = {}
# AutoencoderKLWan's defaults are the Wan 2.1 VAE (base_dim 96, dim_mult 1/2/4/4, 4x temporal).
WAN21_VAE: dict[str, Any] = {}

# Default request settings per benchmark model (API field names).
# HunyuanVideo-1.5 480p text-to-video, 8.3B: the transformer config of diffusers'
# scripts/convert_hunyuan_video1_5_to_diffusers.py ("480p_t2v"); its VAE is AutoencoderKLHunyuanVideo15's
# defaults (32 latent channels, 16x spatial, 4x temporal); text: Qwen2.5-VL-7B (3584 wide) + ByT5
# (Glyph-SDXL-v2, 1472 wide).
HUNYUANVIDEO15_480P_TRANSFORMER = {
    "in_channels": 65,
    "out_channels": 32,
    "num_attention_heads": 16,
    "attention_head_dim": 128,
    "num_layers": 54,
    "num_refiner_layers": 2,
    "mlp_ratio": 4.0,
    "patch_size": 1,
    "patch_size_t": 1,
    "qk_norm": "rms_norm",
    "text_embed_dim": 3584,
    "text_embed_2_dim": 1472,
    "image_embed_dim": 1152,
    "rope_theta": 256.0,
    "rope_axes_dim": (16, 56, 56),
    "use_meanflow": False,
    "target_size": 640,
    "task_type": "t2v",
}

# Lightricks/LTX-2 (2.0), from diffusers' scripts/convert_ltx2_to_diffusers.py: the audio-video
# transformer (48 layers; video 32 x 128 wide, audio 32 x 64), the text connectors (Gemma 3 12B's
# 49 stacked hidden states of width 3840), the video VAE (32x spatial, 8x temporal, 128 channels),
# the audio VAE (8 channels x 16 latent mel bins) and the vocoder.
LTX2_TRANSFORMER = {
    "in_channels": 128,
    "out_channels": 128,
    "patch_size": 1,
    "patch_size_t": 1,
    "num_attention_heads": 32,
    "attention_head_dim": 128,
    "cross_attention_dim": 4096,
    "vae_scale_factors": (8, 32, 32),
    "pos_embed_max_pos": 20,
    "base_height": 2048,
    "base_width": 2048,
    "gated_attn": False,
    "cross_attn_mod": False,
    "audio_in_channels": 128,
    "audio_out_channels": 128,
    "audio_patch_size": 1,
    "audio_patch_size_t": 1,
    "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64,
    "audio_cross_attention_dim": 2048,
    "audio_scale_factor": 4,
    "audio_pos_embed_max_pos": 20,
    "audio_sampling_rate": 16000,
    "audio_hop_length": 160,
    "audio_gated_attn": False,
    "audio_cross_attn_mod": False,
    "num_layers": 48,
    "activation_fn": "gelu-approximate",
    "qk_norm": "rms_norm_across_heads",
    "norm_elementwise_affine": False,
    "norm_eps": 1e-6,
    "caption_channels": 3840,
    "attention_bias": True,
    "attention_out_bias": True,
    "rope_theta": 10000.0,
    "rope_double_precision": True,
    "causal_offset": 1,
    "timestep_scale_multiplier": 1000,
    "cross_attn_timestep_scale_multiplier": 1000,
    "rope_type": "split",
    "use_prompt_embeddings": True,
    "perturbed_attn": False,
}
LTX2_CONNECTORS = {
    "caption_channels": 3840,
    "text_proj_in_factor": 49,
    "video_connector_num_attention_heads": 30,
    "video_connector_attention_head_dim": 128,
    "video_connector_num_layers": 2,
    "video_connector_num_learnable_registers": 128,
    "video_gated_attn": False,
    "audio_connector_num_attention_heads": 30,
    "audio_connector_attention_head_dim": 128,
    "audio_connector_num_layers": 2,
    "audio_connector_num_learnable_registers": 128,
    "audio_gated_attn": False,
    "connector_rope_base_seq_len": 4096,
    "rope_theta": 10000.0,
    "rope_double_precision": True,
    "causal_temporal_positioning": False,
    "rope_type": "split",
    "per_modality_projections": False,
    "proj_bias": False,
}
LTX2_VIDEO_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 128,
    "block_out_channels": (256, 512, 1024, 2048),
    "down_block_types": ("LTX2VideoDownBlock3D",) * 4,
    "decoder_block_out_channels": (256, 512, 1024),
    "layers_per_block": (4, 6, 6, 2, 2),
    "decoder_layers_per_block": (5, 5, 5, 5),
    "spatio_temporal_scaling": (True, True, True, True),
    "decoder_spatio_temporal_scaling": (True, True, True),
    "decoder_inject_noise": (False, False, False, False),
    "downsample_type": ("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    "upsample_type": ("spatiotemporal", "spatiotemporal", "spatiotemporal"),
    "upsample_residual": (True, True, True),
    "upsample_factor": (2, 2, 2),
    "timestep_conditioning": False,
    "patch_size": 4,
    "patch_size_t": 1,
    "resnet_norm_eps": 1e-6,
    "encoder_causal": True,
    "decoder_causal": False,
    "encoder_spatial_padding_mode": "zeros",
    "decoder_spatial_padding_mode": "reflect",
    "spatial_compression_ratio": 32,
    "temporal_compression_ratio": 8,
}
LTX2_AUDIO_VAE = {
    "base_channels": 128,
    "output_channels": 2,
    "ch_mult": (1, 2, 4),
    "num_res_blocks": 2,
    "attn_resolutions": None,
    "in_channels": 2,
    "resolution": 256,
    "latent_channels": 8,
    "norm_type": "pixel",
    "causality_axis": "height",
    "dropout": 0.0,
    "mid_block_add_attention": False,
    "sample_rate": 16000,
    "mel_hop_length": 160,
    "is_causal": True,
    "mel_bins": 64,
    "double_z": True,
}
LTX2_VOCODER = {
    "in_channels": 128,
    "hidden_channels": 1024,
    "out_channels": 2,
    "upsample_kernel_sizes": [16, 15, 8, 4, 4],
    "upsample_factors": [6, 5, 2, 2, 2],
    "resnet_kernel_sizes": [3, 7, 11],
    "resnet_dilations": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    "act_fn": "leaky_relu",
    "leaky_relu_negative_slope": 0.1,
    "antialias": False,
    "final_act_fn": "tanh",
    "final_bias": True,
    "output_sampling_rate": 24000,
}

REAL_DEFAULTS: dict[str, dict[str, Any]] = {
    "sd3.5-medium": {"height": 512, "width": 512, "num_inference_steps": 10, "guidance_scale": 4.5},
    "flux.1-dev": {"height": 1024, "width": 1024, "num_inference_steps": 28, "guidance_scale": 3.5},
    "wan2.1-1.3b": {
        "height": 480,
        "width": 832,
        "num_frames": 17,
        "num_inference_steps": 4,
        "guidance_scale": 5.0,
    },
    # The distilled klein and Z-Image-Turbo as their model cards run them: 4 steps without CFG, and
    # 9 steps with guidance 0.
    "flux.2-klein-4b": {"height": 1024, "width": 1024, "num_inference_steps": 4, "guidance_scale": 1.0},
    "z-image-turbo": {"height": 1024, "width": 1024, "num_inference_steps": 9, "guidance_scale": 0.0},
    # A modest 480p clip: 33 frames (9 latent frames of 30x53 tokens), the checkpoint's guider (6.0).
    "hunyuanvideo-1.5-480p": {"height": 480, "width": 848, "num_frames": 33, "num_inference_steps": 4},
    # 41 frames at 512x768 (6 latent frames of 16x24 tokens, ~43 audio tokens); plain CFG at 3.0.
    "ltx-2": {"height": 512, "width": 768, "num_frames": 41, "num_inference_steps": 4, "guidance_scale": 3.0},
}


# ---------------------------------------------------------------------------------------------
# Random weights directly on the device
# ---------------------------------------------------------------------------------------------
def _keep_fp32(name: str, keep: tuple[str, ...]) -> bool:
    parts = name.split(".")
    return any(k in parts for k in keep)


@torch.no_grad()
def materialize(model: nn.Module, device: str, dtype: torch.dtype, seed: int) -> nn.Module:
    """Give every meta parameter real storage on ``device`` with random values (see module doc)."""
    gen = torch.Generator(device).manual_seed(seed)
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    made: dict[int, nn.Parameter] = {}  # tied parameters stay tied
    for mod_name, module in model.named_modules():
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) in made:
                module._parameters[pname] = made[id(p)]
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            t = torch.empty(p.shape, device=device, dtype=torch.float32 if _keep_fp32(full, keep) else dtype)
            if p.ndim >= 2:
                std = 1.0 if isinstance(module, nn.Embedding) else 1.0 / math.sqrt(max(1, p[0].numel()))
                t.normal_(0.0, std, generator=gen)
            elif pname == "weight" or "scale" in pname:
                t.fill_(1.0)
            else:
                t.zero_()
            new = nn.Parameter(t, requires_grad=False)
            made[id(p)] = new
            module._parameters[pname] = new
    for mod_name, module in model.named_modules():
        for bname, b in list(module._buffers.items()):
            if b is None:
                continue
            full = f"{mod_name}.{bname}" if mod_name else bname
            target = torch.float32 if _keep_fp32(full, keep) else dtype
            module._buffers[bname] = b.to(device=device, dtype=target if b.is_floating_point() else b.dtype)
    return model.eval()


def build_module(factory: Callable[[], nn.Module], device: str, dtype: torch.dtype, seed: int) -> nn.Module:
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = factory()
    return materialize(model, device, dtype, seed)


# ---------------------------------------------------------------------------------------------
# Text encoders of the real output widths
# ---------------------------------------------------------------------------------------------
def _clip(tokenizer, hidden: int, *, projection: bool, seed: int, device: str, dtype) -> nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=256,
        num_hidden_layers=2,  # SD3 reads the penultimate hidden state
        num_attention_heads=hidden // 64,
        max_position_embeddings=tokenizer.model_max_length,
        projection_dim=hidden,
        hidden_act="gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return build_module(lambda: cls(cfg), device, dtype, seed)


def _t5(tokenizer, *, umt5: bool, seed: int, device: str, dtype) -> nn.Module:
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    kw = {
        "vocab_size": -(-len(tokenizer) // 64) * 64,
        "d_model": 4096,
        "d_kv": 64,
        "d_ff": 256,
        "num_layers": 1,
        "num_heads": 4,
        "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128,
        "dropout_rate": 0.0,
        "feed_forward_proj": "gated-gelu",
        "is_encoder_decoder": False,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "decoder_start_token_id": tokenizer.pad_token_id,
    }
    if umt5:
        return build_module(lambda: UMT5EncoderModel(UMT5Config(**kw)), device, dtype, seed)
    return build_module(lambda: T5EncoderModel(T5Config(**kw)), device, dtype, seed)


def _qwen3(tokenizer, *, layers: int, causal_lm: bool, seed: int, device: str, dtype) -> nn.Module:
    """Qwen3 of Qwen3-4B's width with a small MLP and few heads (the output width is what matters)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    cfg = Qwen3Config(
        vocab_size=-(-len(tokenizer) // 64) * 64,
        hidden_size=QWEN3_4B_HIDDEN,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    cls = Qwen3ForCausalLM if causal_lm else Qwen3Model
    return build_module(lambda: cls(cfg), device, dtype, seed)


# ---------------------------------------------------------------------------------------------
# Real pipelines
# ---------------------------------------------------------------------------------------------
def _sd35_medium(device: str, dtype, seed: int, overrides: dict[str, Any]) -> Any:
    from diffusers import AutoencoderKL, SD3Transformer2DModel, StableDiffusion3Pipeline

    from diffusion_rollout.models import make_real_scheduler
    from diffusion_rollout.models.tokenizers import make_clip_tokenizer, make_t5_tokenizer

    tok, tok2, tok3 = make_clip_tokenizer(), make_clip_tokenizer(pad_token="!"), make_t5_tokenizer()
    tcfg = {**SD35_MEDIUM_TRANSFORMER, **overrides}
    return StableDiffusion3Pipeline(
        transformer=build_module(lambda: SD3Transformer2DModel(**tcfg), device, dtype, seed),
        vae=build_module(lambda: AutoencoderKL(**SD35_VAE), device, dtype, seed + 1),
        text_encoder=_clip(tok, 768, projection=True, seed=seed + 2, device=device, dtype=dtype),
        text_encoder_2=_clip(tok2, 1280, projection=True, seed=seed + 3, device=device, dtype=dtype),
        text_encoder_3=_t5(tok3, umt5=False, seed=seed + 4, device=device, dtype=dtype),
        tokenizer=tok,
        tokenizer_2=tok2,
        tokenizer_3=tok3,
        scheduler=make_real_scheduler("sd3"),
    )


def _flux1_dev(device: str, dtype, seed: int, overrides: dict[str, Any]) -> Any:
    from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel

    from diffusion_rollout.models import make_real_scheduler
    from diffusion_rollout.models.tokenizers import make_clip_tokenizer, make_t5_tokenizer

    tok, tok2 = make_clip_tokenizer(), make_t5_tokenizer()
    tcfg = {**FLUX1_DEV_TRANSFORMER, **overrides}
    return FluxPipeline(
        transformer=build_module(lambda: FluxTransformer2DModel(**tcfg), device, dtype, seed),
        vae=build_module(lambda: AutoencoderKL(**FLUX1_VAE), device, dtype, seed + 1),
        text_encoder=_clip(tok, 768, projection=False, seed=seed + 2, device=device, dtype=dtype),
        text_encoder_2=_t5(tok2, umt5=False, seed=seed + 3, device=device, dtype=dtype),
        tokenizer=tok,
        tokenizer_2=tok2,
        scheduler=make_real_scheduler("flux"),
        image_encoder=None,
        feature_extractor=None,
    )


def _wan21_1_3b(device: str, dtype, seed: int, overrides: dict[str, Any]) -> Any:
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    from diffusion_rollout.models import make_real_scheduler
    from diffusion_rollout.models.tokenizers import make_t5_tokenizer

    tok = make_t5_tokenizer()
    tcfg = {**WAN21_1_3B_TRANSFORMER, **overrides}
    return WanPipeline(
        transformer=build_module(lambda: WanTransformer3DModel(**tcfg), device, dtype, seed),
        # The Wan VAE runs in float32 in the diffusers examples; bf16 here, like the rest.
        vae=build_module(lambda: AutoencoderKLWan(**WAN21_VAE), device, dtype, seed + 1),
        text_encoder=_t5(tok, umt5=True, seed=seed + 2, device=device, dtype=dtype),
        tokenizer=tok,
        scheduler=make_real_scheduler("wan"),
    )


def _flux2_klein_4b(device: str, dtype, seed: int, overrides: dict[str, Any]) -> Any:
    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel

    from diffusion_rollout.models import make_real_scheduler
    from diffusion_rollout.models.tokenizers import make_qwen3_tokenizer

    tok = make_qwen3_tokenizer()
    tcfg = {**FLUX2_KLEIN_4B_TRANSFORMER, **overrides}
    vae = build_module(lambda: AutoencoderKLFlux2(**FLUX2_VAE), device, dtype, seed + 1)
    with torch.no_grad():  # materialize leaves buffers at their defaults: real-looking statistics
        vae.bn.running_var.fill_(2.0)
    return Flux2KleinPipeline(
        transformer=build_module(lambda: Flux2Transformer2DModel(**tcfg), device, dtype, seed),
        vae=vae,
        text_encoder=_qwen3(
            tok, layers=KLEIN_TEXT_LAYERS, causal_lm=True, seed=seed + 2, device=device, dtype=dtype
        ),
        tokenizer=tok,
        scheduler=make_real_scheduler("flux2-klein"),
        is_distilled=True,  # FLUX.2-klein-4B is the step-distilled checkpoint
    )


def _zimage_turbo(device: str, dtype, seed: int, overrides: dict[str, Any]) -> Any:
    from diffusers import AutoencoderKL, ZImagePipeline, ZImageTransformer2DModel

    from diffusion_rollout.models import make_real_scheduler
    from diffusion_rollout.models.tokenizers import make_qwen3_tokenizer

    tok = make_qwen3_tokenizer()
    tcfg = {**ZIMAGE_TURBO_TRANSFORMER, **overrides}
    return ZImagePipeline(
        transformer=build_module(lambda: ZImageTransformer2DModel(**tcfg), device, dtype, seed),
        vae=build_module(lambda: AutoencoderKL(**FLUX1_VAE), device, dtype, seed + 1),  # FLUX.1's VAE
        # Z-Image reads the second-to-last hidden state: two layers are enough for the real width.
        text_encoder=_qwen3(tok, layers=2, causal_lm=False, seed=seed + 2, device=device, dtype=dtype),
        tokenizer=tok,
        scheduler=make_real_scheduler("zimage"),
    )


def _hunyuanvideo15_480p(device: str, dtype, seed: int, overrides: dict[str, Any]) -> Any:
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    from diffusion_rollout.models import make_real_scheduler
    from diffusion_rollout.models.scheduler_configs import HUNYUANVIDEO15_480P_GUIDANCE
    from diffusion_rollout.models.tiny_video import hunyuanvideo15_tokenizers

    tok, tok2 = hunyuanvideo15_tokenizers()
    tcfg = {**HUNYUANVIDEO15_480P_TRANSFORMER, **overrides}
    # Qwen2.5-VL-7B's width (3584, 28 heads of 128, multimodal RoPE sections 16/24/24) with two small
    # layers: the pipeline reads the hidden state two layers below the top, here the embeddings.
    qwen = Qwen2_5_VLTextConfig(
        vocab_size=-(-len(tok) // 64) * 64,
        hidden_size=3584,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        bos_token_id=None,  # the real ids lie beyond the offline tokenizer's vocabulary
        eos_token_id=None,
        pad_token_id=tok.pad_token_id,
    )
    byt5 = T5Config(
        vocab_size=len(tok2),
        d_model=1472,
        d_kv=64,
        d_ff=256,
        num_layers=1,
        num_heads=4,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        pad_token_id=tok2.pad_token_id,
        eos_token_id=tok2.eos_token_id,
        decoder_start_token_id=tok2.pad_token_id,
    )
    return HunyuanVideo15Pipeline(
        transformer=build_module(lambda: HunyuanVideo15Transformer3DModel(**tcfg), device, dtype, seed),
        vae=build_module(lambda: AutoencoderKLHunyuanVideo15(), device, dtype, seed + 1),
        text_encoder=build_module(lambda: Qwen2_5_VLTextModel(qwen), device, dtype, seed + 2),
        text_encoder_2=build_module(lambda: T5EncoderModel(byt5), device, dtype, seed + 3),
        tokenizer=tok,
        tokenizer_2=tok2,
        scheduler=make_real_scheduler("hunyuanvideo15"),
        guider=ClassifierFreeGuidance(guidance_scale=HUNYUANVIDEO15_480P_GUIDANCE),
    )


def _accepted(cls: type, config: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``config`` that ``cls.__init__`` takes (configs of newer diffusers carry more)."""
    params = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in config.items() if k in params}


def _ltx2(device: str, dtype, seed: int, overrides: dict[str, Any]) -> Any:
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from diffusion_rollout.models import make_real_scheduler
    from diffusion_rollout.models.tokenizers import make_gemma_tokenizer

    tok = make_gemma_tokenizer()
    tcfg = _accepted(LTX2VideoTransformer3DModel, {**LTX2_TRANSFORMER, **overrides})
    ccfg = _accepted(LTX2TextConnectors, LTX2_CONNECTORS)
    # Gemma 3 12B's width (3840) and depth (48 layers: 49 stacked hidden states, what the connectors
    # project), with a small MLP and few heads: the text encoder runs once per prompt (cached).
    layers = ccfg["text_proj_in_factor"] - 1
    gemma = Gemma3Config(
        text_config={
            "vocab_size": -(-len(tok) // 64) * 64,
            "hidden_size": ccfg["caption_channels"],
            "intermediate_size": 256,
            "num_hidden_layers": layers,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "max_position_embeddings": 2048,
            "pad_token_id": tok.pad_token_id,
            "eos_token_id": tok.eos_token_id,
            "bos_token_id": tok.bos_token_id,
        },
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        },
    )
    return LTX2Pipeline(
        transformer=build_module(lambda: LTX2VideoTransformer3DModel(**tcfg), device, dtype, seed),
        vae=build_module(
            lambda: AutoencoderKLLTX2Video(**_accepted(AutoencoderKLLTX2Video, LTX2_VIDEO_VAE)),
            device,
            dtype,
            seed + 1,
        ),
        audio_vae=build_module(
            lambda: AutoencoderKLLTX2Audio(**_accepted(AutoencoderKLLTX2Audio, LTX2_AUDIO_VAE)),
            device,
            dtype,
            seed + 2,
        ),
        text_encoder=build_module(lambda: Gemma3ForConditionalGeneration(gemma), device, dtype, seed + 3),
        tokenizer=tok,
        connectors=build_module(lambda: LTX2TextConnectors(**ccfg), device, dtype, seed + 4),
        vocoder=build_module(
            lambda: LTX2Vocoder(**_accepted(LTX2Vocoder, LTX2_VOCODER)), device, dtype, seed + 5
        ),
        scheduler=make_real_scheduler("ltx2"),
    )


_TINY_PIPELINE_CLASS = {
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
    "qwenimage": "QwenImagePipeline",
    "wan": "WanPipeline",
    "wan2.2": "WanPipeline",
    "flux2-klein": "Flux2KleinPipeline",
    "zimage": "ZImagePipeline",
    "hunyuanvideo15": "HunyuanVideo15Pipeline",
    "ltx2": "LTX2Pipeline",
}
_REAL_BUILDERS = {
    "sd3.5-medium": _sd35_medium,
    "flux.1-dev": _flux1_dev,
    "wan2.1-1.3b": _wan21_1_3b,
    "flux.2-klein-4b": _flux2_klein_4b,
    "z-image-turbo": _zimage_turbo,
    "hunyuanvideo-1.5-480p": _hunyuanvideo15_480p,
    "ltx-2": _ltx2,
}
_REAL_FAMILY = {
    "sd3.5-medium": "sd3",
    "flux.1-dev": "flux",
    "wan2.1-1.3b": "wan",
    "flux.2-klein-4b": "flux2-klein",
    "z-image-turbo": "zimage",
    "hunyuanvideo-1.5-480p": "hunyuanvideo15",
    "ltx-2": "ltx2",
}


def build_real_pipeline(
    name: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0, **overrides: Any
) -> Any:
    """The ``name`` architecture with random weights on ``device`` (``overrides`` change the
    transformer config, e.g. fewer layers for a CPU check of the builder itself)."""
    try:
        builder = _REAL_BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(REAL_MODELS)}") from None
    pipe = builder(device, dtype, seed, overrides)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---------------------------------------------------------------------------------------------
# Benchmark models: served pipeline + stock twin
# ---------------------------------------------------------------------------------------------
def stock_twin(pipe: Any, scheduler: Any | None = None) -> Any:
    """A stock pipeline object over the same modules, with a fresh copy of the stock scheduler."""
    params = inspect.signature(type(pipe).__init__).parameters
    components = dict(pipe.components)
    stock = scheduler if scheduler is not None else type(pipe.scheduler).from_config(pipe.scheduler.config)
    components["scheduler"] = stock
    kwargs = {k: v for k, v in components.items() if k in params}
    for k in params:
        if k not in kwargs and k != "self" and k in pipe.config:
            kwargs[k] = pipe.config[k]
    twin = type(pipe)(**kwargs)
    twin.set_progress_bar_config(disable=True)
    return twin


def _ode_reference(pipe: Any, stock: Any) -> Any:
    """The stock pipeline an all-ODE rollout equals (Wan: flow-match Euler at its flow_shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if isinstance(stock.scheduler, FlowMatchEulerDiscreteScheduler):
        return stock
    cfg = stock.scheduler.config
    shift = cfg.get("flow_shift") if "flow_shift" in cfg else cfg.get("shift", 1.0)
    euler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=cfg.num_train_timesteps, shift=shift)
    return stock_twin(pipe, euler)


@dataclass
class BenchModel:
    name: str
    family: str
    device: str
    dtype: torch.dtype
    pipe: Any
    stock: Any
    stock_ode: Any
    defaults: dict[str, Any]
    build_s: float
    server_overrides: dict[str, Any] = field(default_factory=dict)
    _server: Any = None
    _lanes_server: Any = None

    @property
    def generator_device(self) -> str:
        return "cuda" if self.device.startswith("cuda") else "cpu"

    @property
    def is_video(self) -> bool:
        return self.family.startswith("wan") or self.family in _PROMPT_PER_OUTPUT or self.family == "ltx2"

    @property
    def decodes_one_video_per_call(self) -> bool:
        """The stock pipeline cannot decode a batch (HunyuanVideo 1.5's VAE attention mask)."""
        return self.family in _PROMPT_PER_OUTPUT

    def server(self, **config_overrides: Any):
        """The model's loopback server (started on first use, then shared)."""
        if self._server is None:
            from benchmarks.loopback import LoopbackServer
            from diffusion_rollout.config import ServerConfig
            from diffusion_rollout.server.core.engine import Engine
            from diffusion_rollout.server.core.loader import prepare_pipeline

            cfg = {
                "model": None,
                "device": self.device,
                "dtype": str(self.dtype).replace("torch.", ""),
                "max_outputs_per_request": 64,
                "max_batch_size": 16,
                # The rows measured before --speed existed ran one lane: keep that the baseline here
                # (--speed exact would add a second lane on CUDA); variants ask for lanes explicitly.
                "pipeline_lanes": 1,
                # The phases time their own first (compiling) calls at their own sizes, on torch's
                # default cache: no warm-up at the model's default size, no keyed compile cache.
                "warmup_shapes": "none",
                "compile_cache": "none",
                **self.server_overrides,
                **config_overrides,
            }
            config = ServerConfig(**cfg)
            loaded = prepare_pipeline(
                self.pipe,
                device=self.device,
                compile=config.compile,
                attention_backend=config.attention_backend,
                cuda_graphs=config.cuda_graphs,
                cuda_graph_max_buckets=config.cuda_graph_max_buckets,
            )
            engine = Engine(config, loaded=loaded)
            engine.model_path = self.name
            engine.start()
            self._server = LoopbackServer(engine, config)
        return self._server

    def lanes_server(self, lanes: int):
        """A second loopback server on the same loaded pipeline with ``pipeline_lanes=lanes`` (started on
        first use). It runs the eager denoiser: time it with the first server's CUDA graphs off."""
        if self._lanes_server is None:
            from benchmarks.loopback import LoopbackServer
            from diffusion_rollout.server.core.engine import Engine

            base = self.server()
            config = base.engine.config.model_copy(update={"pipeline_lanes": lanes, "cuda_graphs": False})
            engine = Engine(config, loaded=base.engine.loaded)
            engine.model_path = self.name
            engine.start()
            self._lanes_server = LoopbackServer(engine, config)
        return self._lanes_server

    def close(self) -> None:
        if self._lanes_server is not None:
            self._lanes_server.close()
            self._lanes_server.engine.stop(grace_s=5)
            self._lanes_server = None
        if self._server is not None:
            self._server.close()
            self._server.engine.stop(grace_s=5)
            self._server = None
        self.pipe = self.stock = self.stock_ode = None
        if self.device.startswith("cuda"):
            import gc

            gc.collect()
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ stock calls
    def stock_kwargs(self, pipe: Any, body: dict[str, Any]) -> dict[str, Any]:
        """The stock ``__call__`` arguments equivalent to a request ``body`` (API field names)."""
        params = inspect.signature(type(pipe).__call__).parameters
        n = body.get("num_outputs_per_prompt", 1)
        kw: dict[str, Any] = {"num_videos_per_prompt" if self.is_video else "num_images_per_prompt": n}
        for key in (
            "prompt", "negative_prompt", "height", "width", "num_inference_steps", "guidance_scale",
            "true_cfg_scale", "guidance_scale_2", "num_frames", "max_sequence_length",
        ):  # fmt: skip
            if body.get(key) is not None and key in params:
                kw[key] = body[key]
        if self.family in _PROMPT_PER_OUTPUT:
            kw["num_videos_per_prompt"] = 1
            for key in ("prompt", "negative_prompt"):
                if kw.get(key) is not None:
                    kw[key] = [kw[key]] * n
        if body.get("image_data"):
            kw.update(self._stock_image_kwargs(pipe, body, kw, n))
        if self.family == "ltx2":
            # What the LTX-2 adapter runs: plain CFG on both streams, no STG/modality/rescale.
            from diffusion_rollout.server.families.ltx2 import fixed_guidance_kwargs

            kw.update(fixed_guidance_kwargs(float(body.get("guidance_scale", 3.0))))
        seeds = body.get("seeds") or [body["seed"] + i for i in range(n)]
        kw["generator"] = [torch.Generator(self.generator_device).manual_seed(s) for s in seeds]
        return kw

    def _stock_image_kwargs(
        self, pipe: Any, body: dict[str, Any], kw: dict[str, Any], n: int
    ) -> dict[str, Any]:
        """The input image of an image-conditioned request (base64 ``image_data``) as the stock
        pipeline takes it, plus what the server's adapter fixes for the same call."""
        import base64
        import io

        from PIL import Image

        params = inspect.signature(type(pipe).__call__).parameters
        image = Image.open(io.BytesIO(base64.b64decode(body["image_data"][0]))).convert("RGB")
        out: dict[str, Any] = {"image": image}
        if "max_area" in params:  # Kontext: the server keeps the requested size (adapter's max_area)
            out["max_area"] = body["height"] * body["width"]
        transformer = getattr(pipe, "transformer", None)
        if (
            "image_embeds" in params
            and transformer is not None
            and transformer.config.get("image_dim")
            and isinstance(kw.get("prompt"), str)
            and n > 1
        ):
            # Wan 2.1 I2V repeats its CLIP image embedding by the number of prompts, not of videos, so
            # several videos per prompt fail in the stock pipeline. A user hands it the batch's prompt
            # embeddings instead: the prompt encoded once by the pipeline itself, repeated n times.
            with torch.inference_mode():
                pe, npe = pipe.encode_prompt(
                    kw.pop("prompt"),
                    negative_prompt=kw.pop("negative_prompt", None),
                    do_classifier_free_guidance=kw.get("guidance_scale", 5.0) > 1,
                    num_videos_per_prompt=n,
                    max_sequence_length=kw.get("max_sequence_length", 512),
                )
            kw["num_videos_per_prompt"] = 1
            out.update(prompt_embeds=pe, negative_prompt_embeds=npe)
        return out

    def stock_output(self, pipe: Any, output: Any, decoded: bool) -> torch.Tensor:
        """The stock output in the server's per-sample layout (Wan videos [B, C, F, H, W])."""
        from diffusion_rollout.server.families import adapter_for

        if decoded and self.is_video:
            return output.frames.permute(0, 2, 1, 3, 4)  # stock "pt" videos are [B, F, C, H, W]
        return adapter_for(pipe).output_tensor(output, decoded=decoded)

    def encode_for_stock(self, prompt: str, body: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Prompt embeddings computed once, for timing the stock pipeline without its text encoders."""
        from diffusion_rollout.server.families import CallSettings, adapter_for

        adapter = adapter_for(self.stock)
        settings = CallSettings(
            height=body["height"],
            width=body["width"],
            num_inference_steps=body["num_inference_steps"],
            guidance_scale=float(body.get("guidance_scale", adapter.default_guidance())),
            true_cfg_scale=body.get("true_cfg_scale", adapter.default_true_cfg()),
            guidance_scale_2=body.get("guidance_scale_2"),
            num_frames=body.get("num_frames"),
            max_sequence_length=body.get("max_sequence_length"),
            has_negative_prompt=body.get("negative_prompt") is not None,
        )
        with torch.inference_mode():
            if body.get("image_data") and adapter.encoding_uses_images():  # Qwen-Image-Edit
                enc = adapter.encode_with_images(
                    prompt, body.get("negative_prompt"), settings, _request_images(body)
                )
            else:
                enc = adapter.encode(prompt, body.get("negative_prompt"), settings)
        return {k: v for k, v in enc.items() if v is not None}


def _request_images(body: dict[str, Any]) -> tuple:
    """The request's ``image_data`` decoded as the server decodes it."""
    import base64

    from diffusion_rollout.server.core.images import ImageLimits, load_images

    data = [base64.b64decode(d) for d in body["image_data"]]
    return load_images(None, data, ImageLimits(max_bytes=2**31, max_pixels=2**31, path_root=None))


# Families whose stock pipeline is called with one prompt per output: HunyuanVideo 1.5's own
# num_videos_per_prompt > 1 fails (its image embeddings keep the prompt batch size), and its VAE
# decodes one video per call (the ODE gate compares decoded videos at batch 1).
_PROMPT_PER_OUTPUT = {"hunyuanvideo15"}


def _tiny_defaults(family: str) -> dict[str, Any]:
    from diffusion_rollout.models import TINY_CALL_DEFAULTS

    defaults = dict(TINY_CALL_DEFAULTS[family])
    defaults.pop("max_area", None)  # a pipeline argument (Kontext) the server derives from the size
    if family == "ltx2":  # its fixed guidance settings are the adapter's, not request fields
        from diffusion_rollout.server.families.ltx2 import fixed_guidance_kwargs

        for key in fixed_guidance_kwargs(1.0):
            defaults.pop(key, None)
    return defaults


def build(name: str, device: str = "cuda", dtype: torch.dtype | None = None, seed: int = 0) -> BenchModel:
    """A ``BenchModel`` by name: ``tiny-<family>`` or one of ``REAL_MODELS``."""
    t0 = time.perf_counter()
    if name.startswith("tiny-"):
        from diffusion_rollout.models import build_tiny_pipeline

        family = name.removeprefix("tiny-")
        dtype = dtype or torch.float32
        pipe = build_tiny_pipeline(family, seed)
        if dtype != torch.float32:
            pipe.to(dtype=dtype)
        pipe.to(device)
        defaults = _tiny_defaults(family)
    else:
        family = _REAL_FAMILY.get(name) or ""
        dtype = dtype or torch.bfloat16
        pipe = build_real_pipeline(name, device, dtype, seed)
        defaults = dict(REAL_DEFAULTS[name])
    if _needs_image(pipe):
        defaults.setdefault("image_data", [input_image_b64(defaults["width"], defaults["height"])])
    stock = stock_twin(pipe)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return BenchModel(
        name=name,
        family=family,
        device=device,
        dtype=dtype,
        pipe=pipe,
        stock=stock,
        stock_ode=_ode_reference(pipe, stock),
        defaults=defaults,
        build_s=time.perf_counter() - t0,
    )


@contextlib.contextmanager
def built_models(
    names: list[str], device: str, dtype: torch.dtype | None = None
) -> Iterator[list[BenchModel]]:
    """Every model of ``names`` built, and closed again on the way out (also when a build fails)."""
    models: list[BenchModel] = []
    try:
        for name in names:
            models.append(build(name, device, dtype))
        yield models
    finally:
        for m in models:
            m.close()


def _needs_image(pipe: Any) -> bool:
    from diffusion_rollout.errors import RequestError
    from diffusion_rollout.server.families import adapter_for

    try:
        return adapter_for(pipe).image_inputs > 0
    except RequestError:  # a family the server does not serve: nothing to send
        return False


def input_image_b64(width: int, height: int, seed: int = 0) -> str:
    """A deterministic RGB PNG (smooth gradients plus noise) of the target size, as base64 text: the
    input image of image-conditioned benchmark requests."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / max(1, width - 1), y / max(1, height - 1), (x + y) / max(1, width + height - 2)], -1)
    pixels = np.clip(base * 200 + rng.rand(height, width, 3) * 55, 0, 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def default_models(device: str) -> list[str]:
    if device.startswith("cuda"):
        return ["sd3.5-medium", "flux.1-dev"]
    from diffusion_rollout.models import FAMILIES
    from diffusion_rollout.server.families import ADAPTERS

    served = {c for a in ADAPTERS for c in a.pipeline_classes}
    return [f"tiny-{f}" for f in FAMILIES if _TINY_PIPELINE_CLASS.get(f) in served]


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
