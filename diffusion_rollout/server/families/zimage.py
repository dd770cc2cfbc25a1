"""Z-Image (``ZImagePipeline``): a single-stream DiT called on lists of per-sample tensors.

Design decisions:

- **How the pipeline calls the model.** ``transformer(x, t, cap_feats)`` positionally: ``x`` a list
  of per-sample ``[C, 1, H, W]`` latents in the transformer's dtype (the pipeline keeps float32
  latents), ``t`` the timestep ``(1000 - t) / 1000`` per sample, ``cap_feats`` a list of per-sample
  text features of each prompt's own length (the padding is cut off after encoding, so prompts of
  different lengths still batch: the model pads internally, as the stock pipeline does with a list
  of prompts). The pipeline stacks the float32 outputs and hands the scheduler their **negation**.
  ``denoising_env.model_call`` tells replay all of this (argument names, ``frame_list`` layout,
  ``negate``), so replay needs no Z-Image branch.
- **Guidance.** CFG runs when ``guidance_scale > 0`` (the pipeline's rule; Z-Image-Turbo is used
  with 0): one call on ``[x; x]`` with ``[pos; neg]`` features, combined per sample in float32 as
  ``pos + guidance_scale * (pos - neg)`` (replay's ``cfg_batched_cond_first`` rule). The pipeline's
  optional ``cfg_normalization`` and ``cfg_truncation`` stay at their defaults (off; truncation 1.0
  never triggers because the model's timestep is below 1), which ``denoising_env.guidance`` records.
- **Schedule.** ``linspace(1, 1/T, T)`` under the checkpoint's scheduler (Z-Image-Turbo: static
  shift 3, the pipeline's ``mu`` ignored). Custom sigmas are used exactly by the rollout scheduler;
  ``sigmas_are_shifted=false`` hands them to the pipeline's ``sigmas=``, which shifts them.
- **Noise and dtypes.** ``prepare_latents`` draws x_T in float32 whatever the model dtype; the model
  output reaching the scheduler is float32 too, so trajectories and model outputs are float32.
"""

from __future__ import annotations

from typing import Any

import torch

from diffusion_rollout.errors import RequestError
from diffusion_rollout.server.families.base import CallSettings, FamilyAdapter

# ZImagePipeline.__call__'s defaults.
_DEFAULT_SIZE = 1024
_DEFAULT_STEPS = 50
_DEFAULT_GUIDANCE = 5.0
_DEFAULT_MAX_SEQUENCE_LENGTH = 512

# The transformer pads caption tokens to a multiple of this (diffusers' SEQ_MULTI_OF).
_CAPTION_MULTIPLE = 32

# Replay's description of the call (client/replay.py, env["model_call"]).
_MODEL_CALL = {"latent_arg": "x", "timestep_arg": "t", "latent_layout": "frame_list", "negate": True}


class ZImageAdapter(FamilyAdapter):
    name = "zimage"
    pipeline_classes = ("ZImagePipeline",)
    cfg_layout = "batched"
    batch_list_kwargs = ("cap_feats",)
    skip_kwargs = ("x", "t", "return_dict")

    # ---------------------------------------------------------------- geometry and defaults
    def default_size(self) -> tuple[int, int]:
        return _DEFAULT_SIZE, _DEFAULT_SIZE

    def default_steps(self) -> int:
        return _DEFAULT_STEPS

    def default_guidance(self) -> float:
        return _DEFAULT_GUIDANCE

    def validate(self, settings: CallSettings) -> None:
        # The RoPE tables have axes_lens positions per axis: caption tokens take positions 1..P (P the
        # padded text length) and the image's time axis the next one, image rows and columns one per
        # patch. Beyond them the model fails with an index error: refuse here with a 400 instead.
        super().validate(settings)
        config = self.pipe.transformer.config
        t_len, h_len, w_len = (int(n) for n in config.axes_lens)
        msl = self._max_sequence_length(settings)
        padded = -(-msl // _CAPTION_MULTIPLE) * _CAPTION_MULTIPLE
        if padded + 1 >= t_len:
            most = self._most_text_tokens()
            raise RequestError(
                f"max_sequence_length={msl} exceeds {most}, the most text tokens this Z-Image model "
                f"has positions for",
                field="max_sequence_length",
            )
        f = self.spatial_factor()
        for name, limit in (("height", h_len), ("width", w_len)):
            v = getattr(settings, name)
            if v // f >= limit:
                raise RequestError(
                    f"{name}={v} exceeds {(limit - 1) * f}, the largest this Z-Image model has positions for",
                    field=name,
                )

    def uses_cfg(self, settings: CallSettings) -> bool:
        return settings.guidance_scale > 0  # the pipeline's do_classifier_free_guidance

    def guidance_info(self, settings: CallSettings) -> dict[str, Any]:
        return {
            "rule": "cfg_batched_cond_first" if self.uses_cfg(settings) else "none",
            "guidance_scale": settings.guidance_scale,
            "true_cfg_scale": None,
            "cfg_normalization": False,
            "cfg_truncation": 1.0,
        }

    # ---------------------------------------------------------------- prompts
    def _max_sequence_length(self, settings: CallSettings) -> int:
        # Unset: the pipeline's 512, or fewer where the model has fewer text positions (a request
        # that asks for more explicitly is refused by validate).
        if settings.max_sequence_length:
            return settings.max_sequence_length
        return min(_DEFAULT_MAX_SEQUENCE_LENGTH, self._most_text_tokens())

    def _most_text_tokens(self) -> int:
        t_len = int(self.pipe.transformer.config.axes_lens[0])
        return (t_len - 2) // _CAPTION_MULTIPLE * _CAPTION_MULTIPLE

    def encode(self, prompt, negative_prompt, settings):
        cfg = self.uses_cfg(settings)
        pos, neg = self.pipe.encode_prompt(
            prompt=prompt,
            device=self.pipe._execution_device,
            do_classifier_free_guidance=cfg,
            negative_prompt=negative_prompt,
            max_sequence_length=self._max_sequence_length(settings),
        )
        # One [L, D] tensor per prompt, L the prompt's own token count.
        return {"prompt_embeds": pos[0], "negative_prompt_embeds": neg[0] if cfg else None}

    def stack_encodings(self, encs: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        # The pipeline takes lists of per-sample features, not a stacked tensor.
        keys = encs[0].keys()
        return {k: [e[k] for e in encs] for k in keys if encs[0][k] is not None}

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
        # float32 as the pipeline's own prepare_latents call, whatever the model dtype.
        return self.pipe.prepare_latents(
            1,
            self.pipe.transformer.in_channels,
            settings.height,
            settings.width,
            torch.float32,
            torch.device(device),
            generator,
        )

    # ---------------------------------------------------------------- replay conditioning
    def split_env(self, calls, batch, settings, timestep_dtype):
        cfg = self.uses_cfg(settings)
        first = calls[0]
        x = first.get("x")
        out = []
        for i in range(batch):
            # One call on [cond; uncond]: row i is sample i's conditional branch, batch + i its
            # unconditional one.
            out.append(
                {
                    "image_kwargs": {},
                    "pos_cond_kwargs": self._slice(first, i),
                    "neg_cond_kwargs": self._slice(first, batch + i) if cfg else None,
                    "guidance": self.guidance_info(settings),
                    "batch_kwargs": list(self.batch_list_kwargs),
                    "timestep_dtype": str(timestep_dtype or torch.float32),
                    "model_input_dtype": str(x[0].dtype) if isinstance(x, list) and x else None,
                    "model_call": dict(_MODEL_CALL),
                }
            )
        return out
