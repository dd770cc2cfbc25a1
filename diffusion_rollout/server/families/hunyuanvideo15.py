"""HunyuanVideo 1.5 text-to-video (``HunyuanVideo15Pipeline``): two text encoders, a guider, channel-concat input.

Design decisions:

- **Scheduler.** The checkpoints ship flow-match Euler with a fixed shift (5.0 at 480p, 9.0 at
  720p), so the loader's rollout scheduler is the stock one plus the rollout mixin: ``rollout=false``
  and all-ODE rollouts are the stock pipeline bit for bit, and the SDE kinds run on the same sigmas.
  The pipeline always hands ``set_timesteps`` its own ``sigmas=linspace(1, 0, T + 1)[:-1]``, which the
  scheduler shifts; ``sigmas_are_shifted=false`` goes through the same ``sigmas=`` argument, and exact
  schedules (``sigmas``, ``timesteps``, ``flow_shift``) replace it in the rollout scheduler.
- **Guidance lives on a guider, not on ``__call__``.** The pipeline combines the branches with its
  ``guider`` component (``ClassifierFreeGuidance``: ``uncond + s * (cond - uncond)``, cond first, then
  uncond, two calls). The request's ``guidance_scale`` becomes a copy of the checkpoint's guider with
  that scale, swapped in for the one call (:meth:`call_context`); the loaded guider is never
  changed. CFG runs when the guider would run it: enabled and ``guidance_scale`` not close to 1
  (distilled checkpoints ship 1.0). Replay's ``true_cfg`` rule is that arithmetic in that order. A
  checkpoint guider with ``guidance_rescale``, the original formulation, or a start/stop window would
  need another replay rule; such a model refuses rollouts (400 naming ``guidance_scale``).
- **Negative prompt.** Without one the pipeline encodes the empty prompt; so does the adapter, so the
  cached encodings are what the stock pipeline computes.
- **Text encodings.** Qwen2.5-VL hidden states (fixed 1000 tokens after the cropped 108-token system
  prefix, padded, with a mask) and ByT5 glyph encodings (256 tokens; zeros and an all-zero mask
  unless the prompt quotes text). Their lengths are fixed by the pipeline, so ``max_sequence_length``
  is refused (400). The pipeline casts embeddings *and masks* to the transformer's dtype; so do we.
- **denoising_env.** ``pos_cond_kwargs``/``neg_cond_kwargs``: ``encoder_hidden_states``,
  ``encoder_attention_mask``, ``encoder_hidden_states_2``, ``encoder_attention_mask_2`` and
  ``image_embeds`` (729 zero SigLIP tokens for text-to-video; zeros tell the model it is t2v), all
  one row per sample. ``model_input_concat``: the channels the pipeline concatenates after the latent
  before every model call (the image-condition latent and its mask, zeros for t2v), ``[1, C + 1, F,
  H, W]``; replay concatenates it the same way. The timestep is handed to the model in the model's
  dtype (``timestep_dtype``); those rounded values are the env's ``timestep_map`` (what replay
  hands the model), while the trajectory's timesteps are the scheduler's, as for every family.
- **Noise and output.** ``prepare_latents`` draws x_T in the transformer's dtype (latents stay in it).
  The pipeline's VAE cannot decode a batch (its causal attention mask does not broadcast over more
  than one video: the stock pipeline raises for two), so the pipeline is called for latents and
  each video is decoded alone with the pipeline's own decode steps (scale, ``vae.decode``,
  ``postprocess_video``): bit-identical to the stock pipeline generating that video at batch 1.
  Responses carry ``[C, F, H, W]``.
- **Validation.** ``num_frames`` must be ``4k + 1`` and sizes multiples of 16 (the VAE's factors; the
  pipeline would silently floor them); ``true_cfg_scale`` and ``guidance_scale_2`` do not apply.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from diffusion_rollout.errors import RequestError
from diffusion_rollout.server.families.base import CallSettings, FamilyAdapter


class HunyuanVideo15Adapter(FamilyAdapter):
    name = "hunyuanvideo15"
    pipeline_classes = ("HunyuanVideo15Pipeline",)
    is_video = True
    cfg_layout = "sequential"
    batch_kwargs = (
        "encoder_hidden_states",
        "encoder_attention_mask",
        "encoder_hidden_states_2",
        "encoder_attention_mask_2",
        "image_embeds",
    )
    skip_kwargs = ("hidden_states", "timestep", "return_dict", "attention_kwargs")

    # ---------------------------------------------------------------- guidance
    def _guider_problem(self) -> str | None:
        """Why the checkpoint's guider cannot be replayed with the true_cfg rule, or None."""
        guider = self.pipe.guider
        if type(guider).__name__ != "ClassifierFreeGuidance":
            return f"its guider is {type(guider).__name__}, not ClassifierFreeGuidance"
        config = guider.config
        if config.get("guidance_rescale", 0.0) or config.get("use_original_formulation", False):
            return "its guider rescales guidance or uses the original CFG formulation"
        if config.get("start", 0.0) != 0.0 or config.get("stop", 1.0) != 1.0:
            return "its guider applies CFG to a window of steps only"
        return None

    @contextlib.contextmanager
    def call_context(self, settings: CallSettings) -> Iterator[None]:
        """The checkpoint's guider with the request's scale, for this one call."""
        loaded = self.pipe.guider
        if getattr(self, "_call_guider", None) is None:
            # One private copy, made once (constructing a guider logs a warning each time); the
            # loaded guider is never changed.
            self._call_guider = loaded.new()
        guider = self._call_guider
        guider.guidance_scale = settings.guidance_scale
        guider._enabled = loaded._enabled
        # Only the worker thread runs the pipeline, so swapping the component for one call is safe.
        self.pipe.guider = guider
        try:
            yield
        finally:
            self.pipe.guider = loaded

    def uses_cfg(self, settings: CallSettings) -> bool:
        # ClassifierFreeGuidance's rule: enabled, and the scale not close to 1.
        return bool(self.pipe.guider._enabled) and not math.isclose(settings.guidance_scale, 1.0)

    def guidance_info(self, settings: CallSettings) -> dict[str, Any]:
        return {
            "rule": "true_cfg" if self.uses_cfg(settings) else "none",
            "guidance_scale": settings.guidance_scale,
            "true_cfg_scale": None,
        }

    # ---------------------------------------------------------------- geometry and defaults
    def spatial_factor(self) -> int:
        return int(self.pipe.vae_scale_factor_spatial) * int(self.pipe.transformer.config.patch_size)

    def default_size(self) -> tuple[int, int]:
        # What the pipeline picks when called without a size: 16:9 at the model's target size.
        w, h = self.pipe.default_aspect_ratio
        height, width = self.pipe.video_processor.calculate_default_height_width(h, w, self.pipe.target_size)
        return int(height), int(width)

    def default_frames(self) -> int:
        return 121

    def default_steps(self) -> int:
        return 50

    def default_guidance(self) -> float:
        return float(self.pipe.guider.guidance_scale)

    def validate(self, settings: CallSettings) -> None:
        super().validate(settings)
        k = int(self.pipe.vae_scale_factor_temporal)
        frames = settings.num_frames
        if frames is not None and (frames - 1) % k:
            raise RequestError(
                f"num_frames={frames} must be {k}k+1 (the HunyuanVideo 1.5 VAE compresses time by {k}), e.g. "
                f"{(frames - 1) // k * k + 1} or {((frames - 1) // k + 1) * k + 1}",
                field="num_frames",
            )
        if settings.max_sequence_length is not None:
            raise RequestError(
                "max_sequence_length does not apply to HunyuanVideo 1.5: the pipeline encodes every prompt "
                f"at its fixed {self.pipe.tokenizer_max_length} tokens",
                field="max_sequence_length",
            )
        if settings.guidance_scale_2 is not None:
            raise RequestError("guidance_scale_2 applies to two-expert models only", field="guidance_scale_2")
        if settings.true_cfg_scale is not None:
            raise RequestError(
                "true_cfg_scale does not apply to HunyuanVideo 1.5: send guidance_scale",
                field="true_cfg_scale",
            )
        problem = self._guider_problem()
        if problem is not None:
            raise RequestError(
                f"this HunyuanVideo 1.5 checkpoint cannot serve requests: {problem}", field="guidance_scale"
            )

    # ---------------------------------------------------------------- prompts
    def _encode_one(self, text: str) -> tuple[torch.Tensor, ...]:
        return self.pipe.encode_prompt(
            prompt=text,
            device=self.pipe._execution_device,
            dtype=self.pipe.transformer.dtype,
            batch_size=1,
            num_videos_per_prompt=1,
        )

    def encode(self, prompt, negative_prompt, settings):
        pe, mask, pe2, mask2 = self._encode_one(prompt)
        enc = {
            "prompt_embeds": pe,
            "prompt_embeds_mask": mask,
            "prompt_embeds_2": pe2,
            "prompt_embeds_mask_2": mask2,
        }
        if self.uses_cfg(settings):
            npe, nmask, npe2, nmask2 = self._encode_one(negative_prompt or "")
            enc.update(
                negative_prompt_embeds=npe,
                negative_prompt_embeds_mask=nmask,
                negative_prompt_embeds_2=npe2,
                negative_prompt_embeds_mask_2=nmask2,
            )
        return enc

    def call_kwargs(self, settings):
        return {
            "height": settings.height,
            "width": settings.width,
            "num_frames": settings.num_frames,
            "num_inference_steps": settings.num_inference_steps,
        }

    # ---------------------------------------------------------------- noise and output
    def initial_latents(self, settings, generator, dtype, device):
        # In the transformer's dtype, as the pipeline's own prepare_latents call.
        return self.pipe.prepare_latents(
            1,
            self.pipe.num_channels_latents,
            settings.height,
            settings.width,
            settings.num_frames,
            self.pipe.transformer.dtype,
            torch.device(device),
            generator,
        )

    def pipeline_output_type(self, *, decoded: bool) -> str:
        # The VAE's causal attention mask does not broadcast over a batch (decoding more than one
        # video raises), so the pipeline returns latents and each video is decoded alone.
        return "latent"

    def output_tensor(self, output: Any, *, decoded: bool = True) -> torch.Tensor | None:
        latents = output.frames
        if not decoded:
            return latents
        return torch.cat([self.decode(latents[i : i + 1]) for i in range(latents.shape[0])])

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """One video ``[1, C, F, H, W]`` in [0, 1]: the pipeline's own decode steps, in its order."""
        pipe = self.pipe
        video = pipe.vae.decode(
            latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor, return_dict=False
        )[0]
        frames = pipe.video_processor.postprocess_video(video, output_type="pt")  # [1, F, C, H, W]
        return frames.permute(0, 2, 1, 3, 4)

    # ---------------------------------------------------------------- replay conditioning
    def split_env(self, calls, batch, settings, timestep_dtype):
        envs = super().split_env(calls, batch, settings, timestep_dtype)
        x = calls[0].get("hidden_states") if calls else None
        if isinstance(x, torch.Tensor):
            channels = int(self.pipe.num_channels_latents)
            for i, env in enumerate(envs):
                env["model_input_concat"] = x[i : i + 1, channels:]
        return envs
