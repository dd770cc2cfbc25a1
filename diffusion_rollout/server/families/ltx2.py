"""LTX-2 text-to-video+audio (``LTX2Pipeline``): a video stream and an audio stream denoised jointly.

Design decisions:

- **Two streams, one rollout.** Every loop step the pipeline steps its scheduler on the packed video
  latent and then a deep copy of it on the packed audio latent. :attr:`streams` names them, so the
  engine binds a :class:`~diffusion_rollout.scheduler_mixins.MultiStreamRolloutState`: both streams
  run the same step kind with the one shared ``transition``, on the same sigmas, and each sample's
  generator draws the video ``eps`` then the audio ``eps`` at every stochastic step.
  ``rollout_log_probs`` is the joint per-step value (the mean over both streams' elements,
  ``joint_log_prob``); ``dit_trajectory`` is the video stream's, with ``dit_trajectory.streams.audio``
  holding the audio stream's latents and its own log-probs (and ``streams.video`` the video's), and
  ``rollout_debug_tensors.streams`` each stream's debug tensors. A trainer replays a step by scoring
  each stream's transition with ``transition``/``replay_log_prob`` (its own trajectory, the shared
  sigmas) and combining them with ``joint_log_prob([video, audio], [n_video, n_audio])``.
- **Schedule.** The checkpoint's flow-match Euler with dynamic shifting (``mu`` from the video token
  count) and ``shift_terminal``; the pipeline's own ``sigmas=linspace(1, 1/T, T)``. Custom sigmas run
  exactly in both schedulers (the audio one is a deep copy, so it carries the rollout mixin);
  ``sigmas_are_shifted=false`` goes through the pipeline's ``sigmas=``.
- **Noise.** The stock pipeline draws x_T per sample from its generator: video, then audio. The
  engine hands the pipeline the video x_T; given latents, the pipeline draws a video-sized noise from
  each generator again and scales it by ``noise_scale=0``, so :meth:`initial_latents` draws from a
  *copy* of the generator: the pipeline's own draw then repeats x_T, the audio x_T comes next, and
  every number is the stock pipeline's. (With ``initial_noise_seed`` the video x_T is shared and each
  output's audio x_T comes from its own generator.)
- **Guidance.** Only plain CFG on both streams (``guidance_scale`` for video and audio; one batched
  call on ``[uncond; cond]``, combined by the pipeline in x0 space): spatio-temporal guidance,
  modality isolation and the guidance rescale are switched off (each would add a transformer pass or
  a rescale that rollouts do not record).
- **denoising_env.** The step's one transformer call (``[uncond; cond]`` rows with CFG): per-sample
  ``pos_cond_kwargs``/``neg_cond_kwargs`` (the connectors' video and audio text states and masks, the
  video and audio position ids), geometry in ``image_kwargs`` (latent frames, height, width, fps,
  audio frames, ``use_cross_timestep``...), ``streams`` (the stream order), ``model_input_dtype``
  (the pipeline casts its float32 latents to the text embeddings' dtype for the model) and the rule
  ``ltx2_cfg_x0``: both outputs are turned into x0 with the step's sigma, combined
  ``x0_c + (s - 1) * (x0_c - x0_u)`` and turned back into velocities, in the pipeline's order.
  ``replay_stream_model_outputs`` in the client reproduces both streams' model outputs bit for bit.
- **Output.** ``generated_output`` is the video (``[C, F, H, W]`` in [0, 1], or the denormalised
  ``[C, F', H', W']`` latent); the audio waveform is not returned.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from diffusion_rollout.errors import RequestError
from diffusion_rollout.server.families.base import CallSettings, FamilyAdapter

# LTX2Pipeline.__call__'s default.
_DEFAULT_MAX_SEQUENCE_LENGTH = 1024


def fixed_guidance_kwargs(guidance_scale: float) -> dict[str, Any]:
    """The guidance arguments rollouts run with: CFG at ``guidance_scale`` on both streams, the rest off."""
    return {
        "guidance_scale": guidance_scale,
        "audio_guidance_scale": guidance_scale,
        "stg_scale": 0.0,
        "audio_stg_scale": 0.0,
        "modality_scale": 1.0,
        "audio_modality_scale": 1.0,
        "guidance_rescale": 0.0,
        "audio_guidance_rescale": 0.0,
        "spatio_temporal_guidance_blocks": None,
    }


# math.exp overflows a float beyond this.
_MAX_EXP_ARG = 709.0


class LTX2Adapter(FamilyAdapter):
    name = "ltx2"
    pipeline_classes = ("LTX2Pipeline",)
    is_video = True
    cfg_layout = "batched"
    streams: ClassVar[tuple[str, ...]] = ("video", "audio")
    batch_kwargs = (
        "encoder_hidden_states",
        "audio_encoder_hidden_states",
        "encoder_attention_mask",
        "audio_encoder_attention_mask",
        "video_coords",
        "audio_coords",
    )
    skip_kwargs = (
        "hidden_states",
        "audio_hidden_states",
        "timestep",
        "sigma",
        "return_dict",
        "attention_kwargs",
    )
    image_kwarg_names = (
        "num_frames",
        "height",
        "width",
        "fps",
        "audio_num_frames",
        "isolate_modalities",
        "use_cross_timestep",
    )

    # ---------------------------------------------------------------- geometry and defaults
    def spatial_factor(self) -> int:
        return int(self.pipe.vae_spatial_compression_ratio) * int(self.pipe.transformer_spatial_patch_size)

    def default_size(self) -> tuple[int, int]:
        return 512, 768

    def default_frames(self) -> int:
        return 121

    def default_steps(self) -> int:
        return 30

    def default_guidance(self) -> float:
        return 3.0

    def validate(self, settings: CallSettings) -> None:
        super().validate(settings)
        k = int(self.pipe.vae_temporal_compression_ratio)
        frames = settings.num_frames
        if frames is not None and (frames - 1) % k:
            raise RequestError(
                f"num_frames={frames} must be {k}k+1 (the LTX-2 VAE compresses time by {k}), e.g. "
                f"{(frames - 1) // k * k + 1} or {((frames - 1) // k + 1) * k + 1}",
                field="num_frames",
            )
        for field in ("height", "width"):
            value = getattr(settings, field)
            if value is not None and value % 32:
                # The pipeline's own rule (check_inputs): refused here as a 400, not a 500 mid-call.
                raise RequestError(
                    f"{field}={value} must be divisible by 32 for LTX-2, e.g. {value // 32 * 32 or 32} "
                    f"or {(value // 32 + 1) * 32}",
                    field=field,
                )
        self._validate_shift(settings)
        registers = self.pipe.connectors.config.get("video_connector_num_learnable_registers")
        msl = self._max_sequence_length(settings)
        if registers and msl % int(registers):
            raise RequestError(
                f"max_sequence_length={msl} must be a multiple of {registers} (the text connectors' "
                "learnable registers)",
                field="max_sequence_length",
            )
        if settings.guidance_scale_2 is not None:
            raise RequestError("guidance_scale_2 applies to two-expert models only", field="guidance_scale_2")
        if settings.true_cfg_scale is not None:
            raise RequestError(
                "true_cfg_scale does not apply to LTX-2: send guidance_scale", field="true_cfg_scale"
            )

    def _validate_shift(self, settings: CallSettings) -> None:
        # The schedule's shift mu grows linearly with the video token count and the scheduler takes
        # exp(mu): past ~709 that overflows (OverflowError mid-call). A model whose VAE compresses
        # little (the tiny zoo's) reaches it at the default size: refuse here with a 400.
        if settings.num_frames is None or settings.height is None or settings.width is None:
            return
        config = self.pipe.scheduler.config
        if not config.get("use_dynamic_shifting"):
            return
        _, f, h, w = self.noise_shape(settings)
        p, pt = int(self.pipe.transformer_spatial_patch_size), int(self.pipe.transformer_temporal_patch_size)
        tokens = -(-f // pt) * (h // p) * (w // p)
        base_len, max_len = config.get("base_image_seq_len", 1024), config.get("max_image_seq_len", 4096)
        base_shift, max_shift = config.get("base_shift", 0.95), config.get("max_shift", 2.05)
        slope = (max_shift - base_shift) / (max_len - base_len)
        mu = tokens * slope + base_shift - slope * base_len
        if mu > _MAX_EXP_ARG:
            raise RequestError(
                f"height={settings.height}, width={settings.width}, num_frames={settings.num_frames} give "
                f"{tokens} video tokens, too many for this model's dynamic shift (mu={mu:.0f}, exp(mu) "
                "overflows): send a smaller height, width or num_frames",
                field="num_frames",
            )

    def uses_cfg(self, settings: CallSettings) -> bool:
        return settings.guidance_scale > 1.0  # the pipeline's rule (audio uses the same scale here)

    def guidance_info(self, settings: CallSettings) -> dict[str, Any]:
        return {
            "rule": "ltx2_cfg_x0" if self.uses_cfg(settings) else "none",
            "guidance_scale": settings.guidance_scale,
            "audio_guidance_scale": settings.guidance_scale,
        }

    # ---------------------------------------------------------------- prompts
    def _max_sequence_length(self, settings: CallSettings) -> int:
        return settings.max_sequence_length or _DEFAULT_MAX_SEQUENCE_LENGTH

    def encode(self, prompt, negative_prompt, settings):
        cfg = self.uses_cfg(settings)
        pe, mask, npe, nmask = self.pipe.encode_prompt(
            prompt=prompt,
            negative_prompt=negative_prompt,
            do_classifier_free_guidance=cfg,
            num_videos_per_prompt=1,
            max_sequence_length=self._max_sequence_length(settings),
            device=self.pipe._execution_device,
        )
        enc = {"prompt_embeds": pe, "prompt_attention_mask": mask}
        if cfg:
            enc.update(negative_prompt_embeds=npe, negative_prompt_attention_mask=nmask)
        return enc

    def call_kwargs(self, settings):
        return {
            "height": settings.height,
            "width": settings.width,
            "num_frames": settings.num_frames,
            "num_inference_steps": settings.num_inference_steps,
            "max_sequence_length": self._max_sequence_length(settings),
            **fixed_guidance_kwargs(settings.guidance_scale),
        }

    # ---------------------------------------------------------------- noise and output
    def initial_latents(self, settings, generator, dtype, device):
        if generator is not None:
            # A copy: the pipeline redraws this noise from the generator itself (module docstring).
            copy = torch.Generator(generator.device)
            copy.set_state(generator.get_state())
            generator = copy
        return self.pipe.prepare_latents(
            1,
            self.pipe.transformer.config.in_channels,
            settings.height,
            settings.width,
            settings.num_frames,
            0.0,
            torch.float32,
            torch.device(device),
            generator,
        )

    def noise_shape(self, settings: CallSettings) -> tuple[int, ...]:
        """The video x_T before packing, ``[C, F', H', W']``, as ``prepare_latents`` draws it."""
        p = self.pipe
        frames = (settings.num_frames - 1) // int(p.vae_temporal_compression_ratio) + 1
        return (
            int(p.transformer.config.in_channels),
            frames,
            settings.height // int(p.vae_spatial_compression_ratio),
            settings.width // int(p.vae_spatial_compression_ratio),
        )

    def pack_noise(self, settings: CallSettings, noise: torch.Tensor) -> torch.Tensor:
        p = self.pipe
        return p._pack_latents(
            noise.unsqueeze(0), p.transformer_spatial_patch_size, p.transformer_temporal_patch_size
        )

    def split_env(self, calls, batch, settings, timestep_dtype):
        envs = super().split_env(calls, batch, settings, timestep_dtype)
        x = calls[0].get("hidden_states") if calls else None
        for env in envs:
            env["streams"] = list(self.streams)
            if isinstance(x, torch.Tensor):
                env["model_input_dtype"] = str(x.dtype)
        return envs

    def output_tensor(self, output: Any, *, decoded: bool = True) -> torch.Tensor | None:
        frames = output.frames
        if decoded:
            return frames.permute(0, 2, 1, 3, 4)  # [B, F, C, H, W] -> [B, C, F, H, W]
        return frames
