"""Tiny, randomly initialised, complete diffusers pipelines of every supported family.

Each family is built from the real component classes (transformer, VAE, text encoders, tokenizers)
at one or two layers and widths of 8 to 32, with its real checkpoint's scheduler configuration
(see ``scheduler_configs``), so a 32x32 image or a five-frame 32x32 video runs in milliseconds on a
CPU while the pipeline code path, the sigma ladder and the folder layout are those of the real model.

Design decisions:

- Determinism: every component is constructed under its own seed, derived from the build seed and
  the component's name, so the same ``(family, seed)`` gives the same weights whatever else the
  process did before, and ``save_pretrained`` gives byte-identical folders. Module constructors draw
  from torch's global generator, so builds hold a lock and run inside ``torch.random.fork_rng``:
  concurrent builds in one process cannot interleave their draws, and the caller's RNG state is left
  untouched. The default dtype is pinned to float32 for the same reason.
- Shapes mirror the real models where it is free: 16 latent channels everywhere, FLUX packs 2x2
  latent patches (transformer ``in_channels`` 64), FLUX.1-dev's distilled guidance embedding is on,
  SD3 uses SD3.5-medium's qk RMS-norm and an MMDiT-X dual-attention block, SD3's two CLIP widths
  differ so the pipeline's zero-padding to the T5 width is exercised, and Qwen-Image's tokenizer
  makes the prompt template prefix exactly as long as the pipeline expects.
- FLUX.2 [klein] and Z-Image use a Qwen3 text encoder built from the offline Qwen3 tokenizer
  (with its chat template); klein's has 27 layers so the pipeline's default
  ``text_encoder_out_layers`` (9, 18, 27) exist, and its VAE's batch-norm statistics are not the
  identity, so the pipeline's latent de-normalisation is exercised.
- Layout: the family table and the image families' builders here; the seeded construction and the
  shared text encoders and VAE in ``tiny_parts``; the video families with their own text stacks
  (HunyuanVideo 1.5, LTX-2) in ``tiny_video``; the image-conditioned ones in ``tiny_image_cond``.
- Image VAEs downsample by 4 (not 8) so a 32x32 image still has 16 latent tokens; the Wan VAE keeps
  the real 8x spatial / 4x temporal factors because ``WanPipeline`` reads them from its config.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from diffusers import (
    AutoencoderKLFlux2,
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
    DiffusionPipeline,
    Flux2KleinPipeline,
    Flux2Transformer2DModel,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
    HunyuanVideo15Pipeline,
    LTX2Pipeline,
    QwenImageEditPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
    ZImagePipeline,
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
    UMT5Config,
    UMT5EncoderModel,
)

from . import tiny_image_cond
from .scheduler_configs import WAN22_A14B_BOUNDARY_RATIO, make_real_scheduler
from .tiny_parts import (
    LATENT_CHANNELS,
    TEXT_DIM,
    clip_config,
    image_vae,
    padded_vocab,
    pinned_rng_and_dtype,
    qwen25_text_config,
    qwen_ids,
    seeded,
    t5_kwargs,
)
from .tiny_video import hunyuanvideo15_components, ltx2_components
from .tokenizers import (
    make_clip_tokenizer,
    make_qwen2_tokenizer,
    make_qwen3_tokenizer,
    make_t5_tokenizer,
)

__all__ = [
    "FAMILIES",
    "IMAGE_FAMILIES",
    "TINY_CALL_DEFAULTS",
    "build_tiny_pipeline",
    "family_of",
    "save_tiny_model",
]

logger = logging.getLogger(__name__)

FAMILIES: tuple[str, ...] = (
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
#: Image-conditioned families (their pipelines need an input image; ``tiny_image_cond``).
IMAGE_FAMILIES: tuple[str, ...] = ("flux-kontext", "wan-i2v", "qwenimage-edit", "wan2.2-ti2v-i2v")

# ---------------------------------------------------------------------------------------------
# Families
# ---------------------------------------------------------------------------------------------


def _sd3_components(seed: int) -> dict[str, Any]:
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


def _flux_components(seed: int) -> dict[str, Any]:
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


def _qwenimage_components(seed: int) -> dict[str, Any]:
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
        rope_max_seq_len=32,
    )


def _wan_components(seed: int, *, two_experts: bool) -> dict[str, Any]:
    tokenizer = make_t5_tokenizer()
    return {
        # Wan2.2 A14B: `transformer` is the high-noise expert, `transformer_2` the low-noise one.
        "transformer": seeded(seed, "transformer", _wan_transformer),
        "transformer_2": seeded(seed, "transformer_2", _wan_transformer) if two_experts else None,
        "boundary_ratio": WAN22_A14B_BOUNDARY_RATIO if two_experts else None,
        "text_encoder": seeded(
            seed, "text_encoder", lambda: UMT5EncoderModel(UMT5Config(**t5_kwargs(tokenizer)))
        ),
        # Four levels: 8x spatial and (two temporal downsamples) 4x temporal, the real Wan 2.1 factors.
        "vae": seeded(
            seed,
            "vae",
            lambda: AutoencoderKLWan(
                base_dim=8,
                z_dim=LATENT_CHANNELS,
                dim_mult=[1, 1, 1, 1],
                num_res_blocks=1,
                temperal_downsample=[False, True, True],
            ),
        ),
        "scheduler": make_real_scheduler("wan2.2" if two_experts else "wan"),
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


def _flux2_klein_components(seed: int) -> dict[str, Any]:
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


def _zimage_components(seed: int) -> dict[str, Any]:
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
                axes_lens=[512, 32, 32],  # text positions for max_sequence_length up to 480
            ),
        ),
        # Z-Image reads the text encoder's second-to-last hidden state.
        "text_encoder": seeded(seed, "text_encoder", lambda: Qwen3Model(_qwen3_config(tokenizer, 2))),
        # Z-Image decodes with the FLUX.1 VAE (16 channels, its shift and scale).
        "vae": seeded(seed, "vae", lambda: image_vae(shift_factor=0.1159, scaling_factor=0.3611)),
        "scheduler": make_real_scheduler("zimage"),
        "tokenizer": tokenizer,
    }


@dataclass(frozen=True)
class _FamilySpec:
    pipeline_class: type[DiffusionPipeline]
    components: Callable[[int], dict[str, Any]]
    call_defaults: Mapping[str, Any]


_SPECS: Mapping[str, _FamilySpec] = MappingProxyType(
    {
        "sd3": _FamilySpec(
            StableDiffusion3Pipeline,
            _sd3_components,
            {
                "height": 32,
                "width": 32,
                "num_inference_steps": 4,
                "guidance_scale": 4.5,
                "max_sequence_length": 16,
            },
        ),
        "flux": _FamilySpec(
            FluxPipeline,
            _flux_components,
            # guidance_scale feeds the distilled guidance embedding; FLUX.1-dev runs no CFG.
            {
                "height": 32,
                "width": 32,
                "num_inference_steps": 4,
                "guidance_scale": 3.5,
                "max_sequence_length": 16,
            },
        ),
        "qwenimage": _FamilySpec(
            QwenImagePipeline,
            _qwenimage_components,
            # true CFG needs a negative prompt; " " is what the Qwen-Image examples pass.
            {
                "height": 32,
                "width": 32,
                "num_inference_steps": 4,
                "true_cfg_scale": 4.0,
                "negative_prompt": " ",
                "max_sequence_length": 16,
            },
        ),
        "wan": _FamilySpec(
            WanPipeline,
            lambda seed: _wan_components(seed, two_experts=False),
            # num_frames must be 4k + 1 (4x temporal VAE); 5 frames -> 2 latent frames.
            {
                "height": 32,
                "width": 32,
                "num_frames": 5,
                "num_inference_steps": 4,
                "guidance_scale": 5.0,
                "max_sequence_length": 16,
            },
        ),
        "wan2.2": _FamilySpec(
            WanPipeline,
            lambda seed: _wan_components(seed, two_experts=True),
            # Wan2.2-T2V-A14B's guidance: 4.0 on the high-noise expert, 3.0 on the low-noise one.
            # With 4 steps and flow_shift 3, timesteps ~(999, 900, 750, 500): both experts run.
            {
                "height": 32,
                "width": 32,
                "num_frames": 5,
                "num_inference_steps": 4,
                "guidance_scale": 4.0,
                "guidance_scale_2": 3.0,
                "max_sequence_length": 16,
            },
        ),
        "flux2-klein": _FamilySpec(
            Flux2KleinPipeline,
            _flux2_klein_components,
            # The base variant's CFG: a second call on the empty prompt, guidance_scale > 1.
            {
                "height": 32,
                "width": 32,
                "num_inference_steps": 4,
                "guidance_scale": 4.0,
                "max_sequence_length": 16,
            },
        ),
        "zimage": _FamilySpec(
            ZImagePipeline,
            _zimage_components,
            # Z-Image's CFG (guidance_scale > 0) batches [cond; uncond]; Z-Image-Turbo sends 0.
            {
                "height": 32,
                "width": 32,
                "num_inference_steps": 4,
                "guidance_scale": 4.0,
                "max_sequence_length": 16,
            },
        ),
        "hunyuanvideo15": _FamilySpec(
            HunyuanVideo15Pipeline,
            hunyuanvideo15_components,
            # 4k + 1 frames (4x temporal VAE): 5 frames -> 2 latent frames, 32 px -> 2 latent px.
            # Guidance is the guider's (6.0, HunyuanVideo-1.5 480p t2v), not a call argument.
            {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2},
        ),
        # Image-conditioned families (tiny_image_cond): the input image goes in the request.
        "flux-kontext": _FamilySpec(
            FluxKontextPipeline,
            lambda seed: tiny_image_cond.flux_kontext_components(seed, _flux_components, seeded),
            # Multiples of 32 (16x VAE, 2x2 packing); max_area keeps the pipeline at this size.
            {
                "height": 64,
                "width": 64,
                "max_area": 64 * 64,
                "num_inference_steps": 4,
                "guidance_scale": 2.5,
                "max_sequence_length": 16,
            },
        ),
        "wan-i2v": _FamilySpec(
            WanImageToVideoPipeline,
            lambda seed: tiny_image_cond.wan_i2v_components(seed, _wan_components, seeded, text_dim=TEXT_DIM),
            {
                "height": 32,
                "width": 32,
                "num_frames": 5,
                "num_inference_steps": 4,
                "guidance_scale": 5.0,
                "max_sequence_length": 16,
            },
        ),
        "wan2.2-ti2v-i2v": _FamilySpec(
            WanImageToVideoPipeline,
            lambda seed: tiny_image_cond.wan_ti2v_i2v_components(seed, _wan_components),
            {
                "height": 32,
                "width": 32,
                "num_frames": 5,
                "num_inference_steps": 4,
                "guidance_scale": 5.0,
                "max_sequence_length": 16,
            },
        ),
        "qwenimage-edit": _FamilySpec(
            QwenImageEditPipeline,
            lambda seed: tiny_image_cond.qwenimage_edit_components(seed, _qwenimage_components, seeded),
            # Multiples of 64 (32x VAE, 2x2 packing); true CFG needs the negative prompt.
            {
                "height": 64,
                "width": 64,
                "num_inference_steps": 4,
                "true_cfg_scale": 4.0,
                "negative_prompt": " ",
                "max_sequence_length": 16,
            },
        ),
        "ltx2": _FamilySpec(
            LTX2Pipeline,
            ltx2_components,
            # 9 frames -> 5 latent frames (the tiny VAE compresses time by 2; the real one 8x: 8k + 1
            # frames), 32 px -> 16 latent px; audio: 9 frames at 24 fps -> 9 latent audio frames. Plain
            # CFG on both streams; STG, modality isolation and the rescale off (server/families/ltx2.py).
            {
                "height": 32,
                "width": 32,
                "num_frames": 9,
                "num_inference_steps": 2,
                "guidance_scale": 3.0,
                "audio_guidance_scale": 3.0,
                "stg_scale": 0.0,
                "audio_stg_scale": 0.0,
                "modality_scale": 1.0,
                "audio_modality_scale": 1.0,
                "guidance_rescale": 0.0,
                "audio_guidance_rescale": 0.0,
                "max_sequence_length": 16,
            },
        ),
    }
)

#: Per-family keyword arguments for the stock pipeline call on a tiny model (read-only mappings;
#: use ``{**TINY_CALL_DEFAULTS[family], ...}`` to override). Prompt and generator are not included.
TINY_CALL_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {name: MappingProxyType(dict(spec.call_defaults)) for name, spec in _SPECS.items()}
)


def _spec(family: str) -> _FamilySpec:
    try:
        return _SPECS[family]
    except KeyError:
        known = ", ".join((*FAMILIES, *IMAGE_FAMILIES))
        raise ValueError(f"unknown model family {family!r}; expected one of {known}") from None


def build_tiny_pipeline(family: str, seed: int = 0) -> DiffusionPipeline:
    """A tiny random ``family`` pipeline in memory (float32, CPU). Same ``(family, seed)``, same weights."""
    spec = _spec(family)
    started = time.perf_counter()
    with pinned_rng_and_dtype():
        components = spec.components(seed)
    pipeline = spec.pipeline_class(**components)
    pipeline.set_progress_bar_config(disable=True)
    logger.debug("built tiny %s pipeline (seed %d) in %.2f s", family, seed, time.perf_counter() - started)
    return pipeline


def save_tiny_model(family: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny ``family`` pipeline and ``save_pretrained`` it into ``out_dir``; returns ``out_dir``.

    The folder loads with ``DiffusionPipeline.from_pretrained(out_dir)``; the same ``(family, seed)``
    writes byte-identical files.
    """
    out = Path(out_dir)
    pipeline = build_tiny_pipeline(family, seed)
    processor = pipeline.components.get("processor")
    if processor is not None and getattr(processor, "video_processor", False) is None:
        # tiny_image_cond.make_qwen2vl_processor without torchvision: usable in memory only.
        raise RuntimeError(
            f"saving the tiny {family} model needs torchvision (transformers 5's Qwen2-VL processor "
            "saves and loads a video processor); build_tiny_pipeline gives it in memory"
        )
    pipeline.save_pretrained(out)
    logger.info("saved tiny random %s model (seed %d) to %s", family, seed, out)
    return out


def family_of(pipeline: DiffusionPipeline) -> str:
    """The zoo family a loaded pipeline belongs to (``wan2.2`` when it has two experts and a boundary)."""
    name = type(pipeline).__name__
    if name == "WanImageToVideoPipeline":
        return "wan2.2-ti2v-i2v" if pipeline.config.get("expand_timesteps") else "wan-i2v"
    if name == "WanPipeline":
        two_experts = getattr(pipeline, "transformer_2", None) is not None
        return "wan2.2" if two_experts and pipeline.config.get("boundary_ratio") is not None else "wan"
    for family, spec in _SPECS.items():
        if spec.pipeline_class.__name__ == name:
            return family
    raise ValueError(f"pipeline class {name} is not one of the supported families ({', '.join(FAMILIES)})")
