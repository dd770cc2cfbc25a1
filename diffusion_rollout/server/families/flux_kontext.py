"""FLUX.1 Kontext (``FluxKontextPipeline``): FLUX.1 conditioned on an input image.

Design decisions:

- **Everything FLUX.1 has**, from :class:`FluxAdapter`: packed latents, the distilled guidance
  embedding, optional true CFG, the dynamic-shift schedule of the *target* token count.
- **The image.** The pipeline resizes the input image itself (to the Kontext resolution nearest its
  aspect ratio, its default), encodes it with the VAE (the distribution's mode: no randomness) and
  appends its packed latents to the latent tokens; ``img_ids`` holds both token sets' positions.
  ``denoising_env.latent_condition`` carries the appended latents (see ``image_cond``).
- **Output size.** The pipeline rescales the requested size to ``max_area`` keeping its aspect
  ratio. The adapter passes ``max_area = height * width``, so the output is exactly the requested
  (validated) size; with no size given that is the stock 1024x1024.
"""

from __future__ import annotations

import torch

from diffusion_rollout.server.families.flux import FluxAdapter
from diffusion_rollout.server.families.image_cond import LatentConcatMixin, packed_tokens


class FluxKontextAdapter(LatentConcatMixin, FluxAdapter):
    name = "flux-kontext"
    pipeline_classes = ("FluxKontextPipeline",)

    def latent_extent(self, settings) -> int:
        return packed_tokens(self.pipe, settings.height, settings.width)

    def call_kwargs(self, settings):
        kw = super().call_kwargs(settings)
        kw["max_area"] = settings.height * settings.width
        return kw

    def initial_latents(self, settings, generator, dtype, device):
        latents, _image_latents, _ids, _image_ids = self.pipe.prepare_latents(
            None,
            1,
            self.pipe.transformer.config.in_channels // 4,
            settings.height,
            settings.width,
            dtype,
            torch.device(device),
            generator,
        )
        return latents
