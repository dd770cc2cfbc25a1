"""FLUX.2 [klein] (``Flux2KleinPipeline``): patchified and packed latents, a Qwen3 text encoder, true CFG
on the undistilled variants.

Design decisions:

- **Guidance.** The base (undistilled) checkpoints run CFG when ``guidance_scale > 1``: a conditional
  transformer call, then an unconditional one on the negative encoding, combined
  ``neg + guidance_scale * (pos - neg)`` (replay's ``true_cfg`` rule with ``guidance_scale``). The
  distilled checkpoints (``model_index.json`` ``is_distilled: true``, FLUX.2-klein-4B/9B) never run
  CFG, whatever ``guidance_scale`` says; klein has no guidance embedding either. The stock pipeline
  always encodes the empty prompt as the negative; a request's ``negative_prompt`` is encoded instead
  when sent and handed over as ``negative_prompt_embeds``, the pipeline's own input for it.
- **Text.** ``encode_prompt`` pads every prompt to ``max_sequence_length`` (512 by default) and
  stacks three hidden layers of the text encoder, so encodings of different prompts share one shape
  and batch together. The transformer receives no text mask (as in the pipeline).
- **Noise.** ``prepare_latents`` draws ``[1, 4C, H/2, W/2]`` (2x2-patchified latents) and packs them
  to ``[1, HW, 4C]``; the pipeline accepts only the patchified form as ``latents=``, so the engine's
  x_T is the pipeline's own draw with the packing undone (a permutation: the same bits). The
  trajectory holds the packed latents the scheduler steps.
- **Schedule.** The pipeline's own: ``linspace(1, 1/T, T)`` with its empirical ``mu`` of image
  tokens and steps under the checkpoint's dynamic shifting. Custom sigmas are used exactly by the
  rollout scheduler; ``sigmas_are_shifted=false`` hands them to the pipeline's ``sigmas=``.
- **denoising_env.** ``encoder_hidden_states`` and ``txt_ids`` per sample; ``img_ids`` is geometry
  (``image_kwargs``, one row: the transformer reads the first row of a batched id tensor). The model
  sees ``t / 1000`` in the latents' dtype, which the trajectory reports as passed.
"""

from __future__ import annotations

from typing import Any

import torch

from diffusion_rollout.server.families.base import CallSettings, FamilyAdapter

# Flux2KleinPipeline.__call__'s defaults.
_DEFAULT_MAX_SEQUENCE_LENGTH = 512
_DEFAULT_STEPS = 50
_DEFAULT_GUIDANCE = 4.0
# What the distilled checkpoints are run with (their model cards: 4 steps, guidance 1).
_DISTILLED_STEPS = 4
_DISTILLED_GUIDANCE = 1.0


class Flux2KleinAdapter(FamilyAdapter):
    name = "flux2-klein"
    pipeline_classes = ("Flux2KleinPipeline",)
    cfg_layout = "sequential"
    batch_kwargs = ("encoder_hidden_states", "txt_ids", "img_ids")
    image_kwarg_names = ("img_ids",)

    def _distilled(self) -> bool:
        return bool(self.pipe.config.get("is_distilled", False))

    # ---------------------------------------------------------------- geometry and defaults
    def default_size(self) -> tuple[int, int]:
        s = int(self.pipe.default_sample_size) * int(self.pipe.vae_scale_factor)
        return s, s

    def default_steps(self) -> int:
        return _DISTILLED_STEPS if self._distilled() else _DEFAULT_STEPS

    def default_guidance(self) -> float:
        return _DISTILLED_GUIDANCE if self._distilled() else _DEFAULT_GUIDANCE

    def uses_cfg(self, settings: CallSettings) -> bool:
        # The pipeline's do_classifier_free_guidance.
        return settings.guidance_scale > 1 and not self._distilled()

    def guidance_info(self, settings: CallSettings) -> dict[str, Any]:
        return {
            "rule": "true_cfg" if self.uses_cfg(settings) else "none",
            "guidance_scale": settings.guidance_scale,
            "true_cfg_scale": None,
            "is_distilled": self._distilled(),
        }

    # ---------------------------------------------------------------- prompts
    def _max_sequence_length(self, settings: CallSettings) -> int:
        return settings.max_sequence_length or _DEFAULT_MAX_SEQUENCE_LENGTH

    def _encode_one(self, text: str, settings: CallSettings) -> torch.Tensor:
        embeds, _text_ids = self.pipe.encode_prompt(
            prompt=text,
            device=self.pipe._execution_device,
            num_images_per_prompt=1,
            max_sequence_length=self._max_sequence_length(settings),
        )
        return embeds

    def encode(self, prompt, negative_prompt, settings):
        enc = {"prompt_embeds": self._encode_one(prompt, settings)}
        if self.uses_cfg(settings):
            enc["negative_prompt_embeds"] = self._encode_one(negative_prompt or "", settings)
        return enc

    def call_kwargs(self, settings):
        return {
            "height": settings.height,
            "width": settings.width,
            "num_inference_steps": settings.num_inference_steps,
            "guidance_scale": settings.guidance_scale,
            "max_sequence_length": self._max_sequence_length(settings),
        }

    # ---------------------------------------------------------------- noise
    def initial_latents(self, settings, generator, dtype, device):
        packed, _ids = self.pipe.prepare_latents(
            1,
            self.pipe.transformer.config.in_channels // 4,
            settings.height,
            settings.width,
            dtype,
            torch.device(device),
            generator,
        )
        # Undo _pack_latents ([1, C, h, w] -> [1, h*w, C]): the pipeline takes latents patchified.
        f = int(self.pipe.vae_scale_factor) * 2
        h, w = int(settings.height) // f, int(settings.width) // f
        return packed.permute(0, 2, 1).reshape(1, packed.shape[2], h, w)
