"""FLUX.1 (``FluxPipeline``): packed latents, distilled guidance embedding, optional true CFG.

True CFG (``true_cfg_scale > 1`` with a negative prompt) runs the transformer twice per step, cond
first, then uncond, and combines ``neg + scale * (pos - neg)``, exactly as the pipeline does.
"""

from __future__ import annotations

from typing import Any

import torch

from diffusion_rollout.server.families.base import CallSettings, FamilyAdapter


class FluxAdapter(FamilyAdapter):
    name = "flux"
    pipeline_classes = ("FluxPipeline",)
    cfg_layout = "sequential"
    batch_kwargs = ("encoder_hidden_states", "pooled_projections", "guidance")
    image_kwarg_names = ("img_ids",)
    packs_latents_2x2 = True

    def default_size(self) -> tuple[int, int]:
        s = int(self.pipe.default_sample_size) * int(self.pipe.vae_scale_factor)
        return s, s

    def default_guidance(self) -> float:
        return 3.5

    def default_true_cfg(self) -> float | None:
        return 1.0

    def uses_cfg(self, settings: CallSettings) -> bool:
        return bool(settings.true_cfg_scale and settings.true_cfg_scale > 1 and settings.has_negative_prompt)

    def guidance_info(self, settings: CallSettings) -> dict[str, Any]:
        return {
            "rule": "true_cfg" if self.uses_cfg(settings) else "none",
            "guidance_scale": settings.guidance_scale,
            "true_cfg_scale": settings.true_cfg_scale,
            "guidance_embeds": bool(self.pipe.transformer.config.guidance_embeds),
        }

    def _encode_one(self, text: str, settings: CallSettings):
        kw = {"max_sequence_length": settings.max_sequence_length} if settings.max_sequence_length else {}
        pe, ppe, _text_ids = self.pipe.encode_prompt(
            prompt=text, prompt_2=None, device=self.pipe._execution_device, num_images_per_prompt=1, **kw
        )
        return pe, ppe

    def encode(self, prompt, negative_prompt, settings):
        pe, ppe = self._encode_one(prompt, settings)
        enc = {"prompt_embeds": pe, "pooled_prompt_embeds": ppe}
        if self.uses_cfg(settings):
            npe, nppe = self._encode_one(negative_prompt or "", settings)
            enc.update(negative_prompt_embeds=npe, negative_pooled_prompt_embeds=nppe)
        return enc

    def max_embedding_tokens(self) -> int:
        return 512  # T5's: the pipeline refuses max_sequence_length above 512

    def embedding_shapes(self):
        config = self.pipe.transformer.config
        tokens, pooled = (1, None, int(config.joint_attention_dim)), (1, int(config.pooled_projection_dim))
        shapes = {"prompt_embeds": tokens, "pooled_prompt_embeds": pooled}
        return {**shapes, **{f"negative_{k}": v for k, v in shapes.items()}}

    def call_kwargs(self, settings):
        kw = {
            "height": settings.height,
            "width": settings.width,
            "num_inference_steps": settings.num_inference_steps,
            "guidance_scale": settings.guidance_scale,
        }
        if settings.true_cfg_scale is not None:
            kw["true_cfg_scale"] = settings.true_cfg_scale
        return kw

    def initial_latents(self, settings, generator, dtype, device):
        latents, _ids = self.pipe.prepare_latents(
            1,
            self.pipe.transformer.config.in_channels // 4,
            settings.height,
            settings.width,
            dtype,
            torch.device(device),
            generator,
        )
        return latents
