"""Wan 2.1 / 2.2 image-to-video (``WanImageToVideoPipeline``), one expert or two.

Design decisions:

- **Everything Wan text-to-video has**, from :class:`WanAdapter`: UniPC for ``rollout=false``, the
  flow-match Euler rollout scheduler at the checkpoint's shift otherwise, two experts switched at
  ``boundary_ratio`` with ``guidance_scale_2``, float32 latents cast to the transformer's dtype.
- **The image.** The pipeline resizes the input image to the requested size, VAE-encodes it as the
  first frame of an otherwise black video (the distribution's mode: no randomness) and concatenates
  a first-frame mask and those latents to the noisy latent on the channel axis, every step.
  ``denoising_env.latent_condition`` carries that appended part (mask and latents, in the model's
  dtype); the transformer's output is the noise prediction of ``x_t`` alone, so nothing is cut.
  Wan 2.1 I2V also cross-attends to CLIP vision features of the image (``encoder_hidden_states_image``,
  the same for both guidance branches), recorded per sample; Wan 2.2 A14B I2V has no image encoder.
- **Noise.** x_T is the pipeline's draw (``randn_tensor`` of the latent shape in float32 from the
  sample's generator), made here without the image encoding ``prepare_latents`` would also run.
- **Not served:** per-token timesteps (``expand_timesteps``, Wan 2.2 TI2V-5B image-to-video) blend the
  first frame into x_t instead of concatenating it; such a model answers 400 naming ``model``.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor

from diffusion_rollout.errors import RequestError
from diffusion_rollout.server.families.image_cond import LatentConcatMixin
from diffusion_rollout.server.families.wan import WanAdapter


class WanI2VAdapter(LatentConcatMixin, WanAdapter):
    name = "wan-i2v"
    pipeline_classes = ("WanImageToVideoPipeline",)
    batch_kwargs = ("encoder_hidden_states", "encoder_hidden_states_image")
    slice_output = False

    def __init__(self, pipe: Any) -> None:
        super().__init__(pipe)
        if self.has_experts():
            self.name = "wan2.2-i2v"

    def latent_extent(self, settings) -> int:
        return int(self.pipe.vae.config.z_dim)

    def validate(self, settings) -> None:
        super().validate(settings)
        if self.pipe.config.get("expand_timesteps"):
            raise RequestError(
                "image-to-video with per-token timesteps (expand_timesteps, Wan 2.2 TI2V) is not served",
                field="model",
            )

    def initial_latents(self, settings, generator, dtype, device):
        t = int(self.pipe.vae_scale_factor_temporal)
        s = int(self.pipe.vae_scale_factor_spatial)
        shape = (
            1,
            int(self.pipe.vae.config.z_dim),
            (settings.num_frames - 1) // t + 1,
            settings.height // s,
            settings.width // s,
        )
        return randn_tensor(shape, generator=generator, device=torch.device(device), dtype=torch.float32)
