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
- **Wan 2.2 TI2V-5B image-to-video** (``expand_timesteps``) does not concatenate: the pipeline writes
  the image's latent over the first latent frame of the model input, gives that frame's tokens
  timestep 0, and writes it over the final latents too. ``denoising_env.latent_first_frame``
  (``{latents, zero_timestep_tokens}``) holds that frame as the model saw it and how many leading
  tokens run at timestep 0; replay rebuilds the same input and timesteps. The rollout's trajectory is
  the scheduler's latents (their first frame is noise the model never reads).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor

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
        elif self._first_frame_blend():
            self.name = "wan2.2-ti2v-i2v"

    def latent_extent(self, settings) -> int:
        return int(self.pipe.vae.config.z_dim)

    def _first_frame_blend(self) -> bool:
        return bool(self.pipe.config.get("expand_timesteps"))

    def split_env(self, calls, batch, settings, timestep_dtype):
        if not self._first_frame_blend():
            return super().split_env(calls, batch, settings, timestep_dtype)
        envs = WanAdapter.split_env(self, calls, batch, settings, timestep_dtype)  # no concatenation
        x = calls[0].get("hidden_states") if calls else None
        t = calls[0].get("timestep") if calls else None
        if not isinstance(x, torch.Tensor) or not isinstance(t, torch.Tensor):
            return envs
        for row, env in enumerate(envs):
            env["latent_first_frame"] = {
                "latents": x[row : row + 1, :, :1],
                # Step 0's timestep is positive, so its zeros are exactly the first frame's tokens.
                "zero_timestep_tokens": int((t[row] == 0).sum()),
            }
        return envs

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
