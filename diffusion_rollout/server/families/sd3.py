"""SD3 / SD3.5 (``StableDiffusion3Pipeline``): CFG on one batched transformer call [uncond; cond]."""

from __future__ import annotations

from typing import Any

import torch

from diffusion_rollout.errors import RequestError
from diffusion_rollout.server.families.base import CallSettings, FamilyAdapter


class SD3Adapter(FamilyAdapter):
    name = "sd3"
    pipeline_classes = ("StableDiffusion3Pipeline",)
    cfg_layout = "batched"
    batch_kwargs = ("encoder_hidden_states", "pooled_projections")

    def spatial_factor(self) -> int:
        return int(self.pipe.vae_scale_factor) * int(self.pipe.patch_size)

    def default_size(self) -> tuple[int, int]:
        s = int(self.pipe.default_sample_size) * int(self.pipe.vae_scale_factor)
        return s, s

    def validate(self, settings: CallSettings) -> None:
        super().validate(settings)
        # The transformer's position table covers pos_embed_max_size patches a side; larger images
        # fail inside the pipeline (a 500), so they are refused here with the limit named.
        most = getattr(self.pipe.transformer.config, "pos_embed_max_size", None)
        if most:
            limit = int(most) * self.spatial_factor()
            for name in ("height", "width"):
                v = getattr(settings, name)
                if v > limit:
                    raise RequestError(
                        f"{name}={v} exceeds {limit}, the most this model's position table covers "
                        f"(pos_embed_max_size {most} patches)",
                        field=name,
                    )

    def default_guidance(self) -> float:
        return 7.0

    def uses_cfg(self, settings: CallSettings) -> bool:
        return settings.guidance_scale > 1  # the pipeline's own rule

    def guidance_info(self, settings: CallSettings) -> dict[str, Any]:
        return {
            "rule": "cfg_batched" if self.uses_cfg(settings) else "none",
            "guidance_scale": settings.guidance_scale,
        }

    def encode(self, prompt, negative_prompt, settings):
        cfg = self.uses_cfg(settings)
        kw = {"max_sequence_length": settings.max_sequence_length} if settings.max_sequence_length else {}
        pe, npe, ppe, nppe = self.pipe.encode_prompt(
            prompt=prompt,
            prompt_2=None,
            prompt_3=None,
            negative_prompt=negative_prompt,
            do_classifier_free_guidance=cfg,
            device=self.pipe._execution_device,
            num_images_per_prompt=1,
            **kw,
        )
        return {
            "prompt_embeds": pe,
            "pooled_prompt_embeds": ppe,
            "negative_prompt_embeds": npe if cfg else None,
            "negative_pooled_prompt_embeds": nppe if cfg else None,
        }

    def embedding_shapes(self):
        config = self.pipe.transformer.config
        tokens, pooled = (1, None, int(config.joint_attention_dim)), (1, int(config.pooled_projection_dim))
        shapes = {"prompt_embeds": tokens, "pooled_prompt_embeds": pooled}
        return {**shapes, **{f"negative_{k}": v for k, v in shapes.items()}}

    def max_embedding_tokens(self) -> int:
        # CLIP's tokens, then T5's: the pipeline refuses max_sequence_length above 512.
        return int(self.pipe.tokenizer_max_length) + 512

    def call_kwargs(self, settings):
        return {
            "height": settings.height,
            "width": settings.width,
            "num_inference_steps": settings.num_inference_steps,
            "guidance_scale": settings.guidance_scale,
        }

    def initial_latents(self, settings, generator, dtype, device):
        return self.pipe.prepare_latents(
            1,
            self.pipe.transformer.config.in_channels,
            settings.height,
            settings.width,
            dtype,
            torch.device(device),
            generator,
        )
