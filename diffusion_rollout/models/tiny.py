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
- Layout: the family table and the build/save API here; the text-to-image families' builders in
  ``tiny_image``; the video families (Wan, HunyuanVideo 1.5, LTX-2) in ``tiny_video``; the
  image-conditioned ones in ``tiny_image_cond``; the seeded construction and the shared text
  encoders and VAE in ``tiny_parts``.
- Image VAEs downsample by 4 (not 8) so a 32x32 image still has 16 latent tokens; the Wan VAE keeps
  the real 8x spatial / 4x temporal factors because ``WanPipeline`` reads them from its config.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from diffusers import (
    DiffusionPipeline,
    Flux2KleinPipeline,
    FluxKontextPipeline,
    FluxPipeline,
    HunyuanVideo15Pipeline,
    LTX2Pipeline,
    QwenImageEditPipeline,
    QwenImagePipeline,
    StableDiffusion3Pipeline,
    WanImageToVideoPipeline,
    WanPipeline,
    ZImagePipeline,
)

from . import tiny_image_cond
from .family_names import FAMILIES, IMAGE_FAMILIES, REQUEST_DEFAULTS_FILE
from .tiny_image import (
    flux2_klein_components,
    flux_components,
    qwenimage_components,
    sd3_components,
    zimage_components,
)
from .tiny_parts import (
    TEXT_DIM,
    pinned_rng_and_dtype,
    seeded,
)
from .tiny_video import hunyuanvideo15_components, ltx2_components, wan_components

__all__ = [
    "FAMILIES",
    "IMAGE_FAMILIES",
    "TINY_CALL_DEFAULTS",
    "build_tiny_pipeline",
    "family_of",
    "save_tiny_model",
]

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class _FamilySpec:
    pipeline_class: type[DiffusionPipeline]
    components: Callable[[int], dict[str, Any]]
    call_defaults: Mapping[str, Any]


_SPECS: Mapping[str, _FamilySpec] = MappingProxyType(
    {
        "sd3": _FamilySpec(
            StableDiffusion3Pipeline,
            sd3_components,
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
            flux_components,
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
            qwenimage_components,
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
            lambda seed: wan_components(seed, two_experts=False),
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
            lambda seed: wan_components(seed, two_experts=True),
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
            flux2_klein_components,
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
            zimage_components,
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
            lambda seed: tiny_image_cond.flux_kontext_components(seed, flux_components, seeded),
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
            lambda seed: tiny_image_cond.wan_i2v_components(seed, wan_components, seeded, text_dim=TEXT_DIM),
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
            lambda seed: tiny_image_cond.wan_ti2v_i2v_components(seed, wan_components),
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
            lambda seed: tiny_image_cond.qwenimage_edit_components(seed, qwenimage_components, seeded),
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


def tiny_request_defaults(family: str) -> dict[str, int]:
    """The tiny ``family``'s request defaults a saved folder records (``request_defaults.json``): its
    call defaults' height, width, num_frames and num_inference_steps."""
    keys = ("height", "width", "num_frames", "num_inference_steps")
    return {k: int(v) for k, v in _spec(family).call_defaults.items() if k in keys}


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
    writes byte-identical files. Beside ``model_index.json`` it holds ``request_defaults.json``
    (``tiny_request_defaults``): the server gives a request that names no size, frame count or step
    count these tiny ones rather than the real model's (a prompt alone to tiny Wan was an 81x480x832
    video at 50 steps, 271 s on a CPU).
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
    # A request that names no size gets the tiny size, not the real model's (server: families/base.py).
    defaults = json.dumps(tiny_request_defaults(family), indent=2, sort_keys=True)
    (out / REQUEST_DEFAULTS_FILE).write_text(defaults + "\n")
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
