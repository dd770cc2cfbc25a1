"""Qwen-Image (``QwenImagePipeline``): packed latents, true CFG with a norm rescale, variable-length text.

Design decisions:

- **True CFG as the pipeline does it.** With ``true_cfg_scale > 1`` and a negative prompt the
  transformer runs twice per step, conditional first, and the pipeline combines
  ``neg + s * (pos - neg)`` and then rescales the result to the conditional branch's norm over the
  last dim. Replay uses the ``norm_rescale`` rule, which is that arithmetic in that order. Without a
  negative prompt the pipeline runs no CFG whatever ``true_cfg_scale`` says; the adapter then passes
  ``true_cfg_scale=1`` so the pipeline does not log a warning on every request (same computation).
- **Text encodings have the prompt's own length.** A batch-1 ``encode_prompt`` returns the prompt's
  tokens without padding (and no mask: the pipeline drops an all-ones mask). Padding prompts of
  different lengths to one length would change the model's numbers (RoPE text positions, attention
  over padded keys), so :meth:`encoding_group_key` keeps encodings of different lengths out of one
  pipeline call instead; a GRPO group (one prompt, many samples) still batches. An all-ones mask is
  handed to the pipeline rather than ``None``: the pipeline turns it back into ``None`` (same
  computation) and does not warn that embeddings came without a mask.
- **Schedule.** The default is the pipeline's own: ``linspace(1, 1/T, T)`` with the dynamic shift
  ``mu`` of the image's token count and the checkpoint's ``shift_terminal`` stretch. Custom sigmas are
  used exactly by the rollout scheduler; ``sigmas_are_shifted=false`` hands them to the pipeline's
  ``sigmas=``, which applies its dynamic shift, as for FLUX.
- **denoising_env.** The transformer's kwargs as the pipeline passed them: ``encoder_hidden_states``
  (and ``encoder_hidden_states_mask`` when the pipeline passes one) per sample; ``img_shapes`` is
  geometry (``image_kwargs``), one entry per sample, of which the transformer reads the first; the
  timestep the model sees is ``t / 1000`` in the latents' dtype, recorded as such in the trajectory.
"""

from __future__ import annotations

from typing import Any

import torch

from diffusion_rollout.errors import RequestError
from diffusion_rollout.server.families.base import CallSettings, FamilyAdapter

# QwenImagePipeline.__call__'s default, and the most its check_inputs accepts.
_DEFAULT_MAX_SEQUENCE_LENGTH = 512
_MAX_SEQUENCE_LENGTH = 1024


class QwenImageAdapter(FamilyAdapter):
    name = "qwenimage"
    pipeline_classes = ("QwenImagePipeline",)
    cfg_layout = "sequential"
    batch_kwargs = ("encoder_hidden_states", "encoder_hidden_states_mask", "guidance")
    batch_list_kwargs = ("img_shapes",)
    image_kwarg_names = ("img_shapes",)
    packs_latents_2x2 = True

    def _guidance_embeds(self) -> bool:
        return bool(self.pipe.transformer.config.guidance_embeds)

    def default_size(self) -> tuple[int, int]:
        s = int(self.pipe.default_sample_size) * int(self.pipe.vae_scale_factor)
        return s, s

    def default_steps(self) -> int:
        return 50

    def default_guidance(self) -> float:
        # Only guidance-distilled variants read it (as an embedding); Qwen-Image itself ignores it.
        return 1.0

    def default_true_cfg(self) -> float | None:
        return 4.0

    def validate(self, settings: CallSettings) -> None:
        super().validate(settings)
        msl = settings.max_sequence_length
        if msl is not None and msl > _MAX_SEQUENCE_LENGTH:
            raise RequestError(
                f"max_sequence_length={msl} exceeds {_MAX_SEQUENCE_LENGTH}, the most Qwen-Image takes",
                field="max_sequence_length",
            )

    def max_embedding_tokens(self) -> int:
        return _MAX_SEQUENCE_LENGTH

    def uses_cfg(self, settings: CallSettings) -> bool:
        # The pipeline's rule: do_true_cfg = true_cfg_scale > 1 and a negative prompt was given.
        return bool(settings.true_cfg_scale and settings.true_cfg_scale > 1 and settings.has_negative_prompt)

    def guidance_info(self, settings: CallSettings) -> dict[str, Any]:
        return {
            "rule": "norm_rescale" if self.uses_cfg(settings) else "none",
            "true_cfg_scale": settings.true_cfg_scale,
            "guidance_scale": settings.guidance_scale if self._guidance_embeds() else None,
            "guidance_embeds": self._guidance_embeds(),
        }

    # ---------------------------------------------------------------- prompts
    def _max_sequence_length(self, settings: CallSettings) -> int:
        return settings.max_sequence_length or _DEFAULT_MAX_SEQUENCE_LENGTH

    def _encode_one(self, text: str, settings: CallSettings) -> tuple[torch.Tensor, torch.Tensor]:
        pe, mask = self.pipe.encode_prompt(
            prompt=text,
            device=self.pipe._execution_device,
            num_images_per_prompt=1,
            max_sequence_length=self._max_sequence_length(settings),
        )
        if mask is None:
            mask = torch.ones(pe.shape[:2], dtype=torch.long, device=pe.device)
        return pe, mask

    def encode(self, prompt, negative_prompt, settings):
        pe, mask = self._encode_one(prompt, settings)
        enc = {"prompt_embeds": pe, "prompt_embeds_mask": mask}
        if self.uses_cfg(settings):
            npe, nmask = self._encode_one(negative_prompt or "", settings)
            enc.update(negative_prompt_embeds=npe, negative_prompt_embeds_mask=nmask)
        return enc

    def encoding_group_key(self, enc: dict[str, torch.Tensor]) -> tuple:
        neg = enc.get("negative_prompt_embeds")
        return (int(enc["prompt_embeds"].shape[1]), int(neg.shape[1]) if neg is not None else None)

    def call_kwargs(self, settings):
        kw: dict[str, Any] = {
            "height": settings.height,
            "width": settings.width,
            "num_inference_steps": settings.num_inference_steps,
            "true_cfg_scale": settings.true_cfg_scale if self.uses_cfg(settings) else 1.0,
            "max_sequence_length": self._max_sequence_length(settings),
        }
        if self._guidance_embeds():
            kw["guidance_scale"] = settings.guidance_scale
        return kw

    # ---------------------------------------------------------------- noise
    def initial_latents(self, settings, generator, dtype, device):
        return self.pipe.prepare_latents(
            1,
            self.pipe.transformer.config.in_channels // 4,
            settings.height,
            settings.width,
            dtype,
            torch.device(device),
            generator,
        )
