"""Qwen-Image-Edit (``QwenImageEditPipeline``): Qwen-Image conditioned on an input image, twice.

Design decisions:

- **Everything Qwen-Image has**, from :class:`QwenImageAdapter`: true CFG with the norm rescale,
  prompt encodings of their own length (grouped by length, never padded), the dynamic-shift schedule
  of the *target* token count.
- **The image reaches the model two ways.** The Qwen2.5-VL text encoder reads the prompt together
  with the image (resized to about 1024x1024 at its aspect ratio, as the pipeline does), so prompt
  encodings depend on the image: they are cached per (prompt, image digest). The pipeline also
  VAE-encodes the image at that size (the distribution's mode: no randomness) and appends its packed
  latents to the latent tokens; ``img_shapes`` lists both token grids. ``denoising_env`` carries the
  appended latents as ``latent_condition`` (see ``image_cond``), and the text encodings, as for
  Qwen-Image.
- **Default size.** Without ``height``/``width`` the output has the resized input's size, as in the
  stock pipeline.
"""

from __future__ import annotations

import torch

from diffusion_rollout.server.families.image_cond import LatentConcatMixin, packed_tokens
from diffusion_rollout.server.families.qwenimage import QwenImageAdapter

# QwenImageEditPipeline resizes the input image to this area (its aspect ratio kept).
_CONDITION_AREA = 1024 * 1024


class QwenImageEditAdapter(LatentConcatMixin, QwenImageAdapter):
    name = "qwenimage-edit"
    pipeline_classes = ("QwenImageEditPipeline",)

    def latent_extent(self, settings) -> int:
        return packed_tokens(self.pipe, settings.height, settings.width)

    def _condition_size(self, image) -> tuple[int, int]:
        """(height, width) the pipeline resizes the input image to (its ``calculate_dimensions``)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

        w, h = image.size
        cw, ch, _ = calculate_dimensions(_CONDITION_AREA, w / h)
        return ch, cw

    def default_size_for_images(self, images) -> tuple[int, int]:
        ch, cw = self._condition_size(images[0].image)
        m = int(self.pipe.vae_scale_factor) * 2
        return ch // m * m, cw // m * m

    def encoding_uses_images(self) -> bool:
        return True

    def _encode_with_image(self, text: str, prompt_image, settings) -> tuple[torch.Tensor, torch.Tensor]:
        pe, mask = self.pipe.encode_prompt(
            prompt=text,
            image=prompt_image,
            device=self.pipe._execution_device,
            num_images_per_prompt=1,
            max_sequence_length=self._max_sequence_length(settings),
        )
        if mask is None:
            mask = torch.ones(pe.shape[:2], dtype=torch.long, device=pe.device)
        return pe, mask

    def encode_with_images(self, prompt, negative_prompt, settings, images):
        image = images[0].image
        ch, cw = self._condition_size(image)
        prompt_image = self.pipe.image_processor.resize(image, ch, cw)  # what the pipeline encodes
        pe, mask = self._encode_with_image(prompt, prompt_image, settings)
        enc = {"prompt_embeds": pe, "prompt_embeds_mask": mask}
        if self.uses_cfg(settings):
            npe, nmask = self._encode_with_image(negative_prompt or "", prompt_image, settings)
            enc.update(negative_prompt_embeds=npe, negative_prompt_embeds_mask=nmask)
        return enc

    def initial_latents(self, settings, generator, dtype, device):
        latents, _image_latents = self.pipe.prepare_latents(
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
