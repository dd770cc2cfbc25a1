"""Wan 2.1 and Wan 2.2 text-to-video (``WanPipeline``), one expert or two.

Design decisions:

- **Two schedulers.** Wan checkpoints ship UniPC, a multistep solver with no per-step transition
  density. ``rollout=false`` runs the stock pipeline with its UniPC scheduler untouched, so plain
  generation is the stock pipeline bit for bit. A rollout (and any request with an exact schedule:
  custom ``sigmas``, ``timesteps`` or ``flow_shift``, even with ``rollout=false``) runs on a
  :class:`RolloutFlowMatchEulerScheduler` at the checkpoint's ``flow_shift``, swapped into the
  pipeline for that call only (:meth:`scheduler_for`). UniPC cannot follow an arbitrary sigma ladder
  (its multistep coefficients assume its own), so exact schedules always mean flow-match Euler; with
  ``rollout=false`` the Euler step is the stock one (nothing recorded). An all-ODE rollout therefore
  equals the stock pipeline given ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)``, not UniPC.
- **Schedules.** ``WanPipeline.__call__`` has no ``sigmas=``; ``sigmas_are_shifted=false`` applies the
  flow shift ``S*s / (1 + (S-1)*s)`` here and runs the result exactly.
- **Two experts (Wan 2.2 A14B).** The pipeline itself picks ``transformer`` while
  ``t >= boundary_ratio * num_train_timesteps`` and ``transformer_2`` below, with ``guidance_scale_2``
  (defaulting to ``guidance_scale``) for the low-noise expert. The adapter only watches both modules,
  so the response's ``expert_per_step`` is what actually ran, and ``denoising_env.guidance`` carries
  both scales for replay. Both experts see the same text conditioning.
- **Noise and dtypes.** ``prepare_latents`` draws x_T in float32 whatever the model dtype (the
  pipeline keeps its latents in float32 and casts the model input), so the initial latents ignore the
  embedding dtype the engine offers.
- **Output.** ``output_type="pt"`` gives ``[B, F, C, H, W]``; responses carry ``[C, F, H, W]`` per
  sample (api.md). Latent outputs are already ``[B, C, F', H', W']``.
- **Validation.** ``num_frames`` must be ``k * vae_scale_factor_temporal + 1`` (the pipeline would
  silently round it), sizes multiples of ``vae_scale_factor_spatial * patch_size`` and of 16 (the
  pipeline's own check); ``guidance_scale_2`` only for a pipeline with a ``boundary_ratio``.
- **Replay conditioning.** ``denoising_env.model_input_dtype`` is the dtype the pipeline casts its
  float32 latents to before the model (the transformer's); replay casts the trajectory latent the
  same way. With per-token timesteps (``expand_timesteps``, Wan 2.2 TI2V-5B) the pipeline hands the
  model a ``[B, tokens]`` timestep; ``denoising_env.timestep_tokens`` says so, and replay expands
  the same way.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from diffusion_rollout.errors import RequestError
from diffusion_rollout.scheduler_mixins import RolloutFlowMatchEulerScheduler
from diffusion_rollout.scheduler_mixins import shift_sigmas as apply_shift
from diffusion_rollout.server.families.base import CallSettings, FamilyAdapter

# WanPipeline.__call__'s defaults.
_DEFAULT_MAX_SEQUENCE_LENGTH = 512


class WanAdapter(FamilyAdapter):
    name = "wan"
    pipeline_classes = ("WanPipeline",)
    is_video = True
    cfg_layout = "sequential"
    batch_kwargs = ("encoder_hidden_states",)

    def __init__(self, pipe: Any) -> None:
        super().__init__(pipe)
        if self.has_experts():
            self.name = "wan2.2"

    # ---------------------------------------------------------------- schedulers
    def _flow_shift(self, scheduler: Any) -> float:
        config = scheduler.config
        shift = config.get("flow_shift") if "flow_shift" in config else config.get("shift")
        return float(shift if shift is not None else 1.0)

    def setup_schedulers(self, loaded: Any) -> None:
        super().setup_schedulers(loaded)
        stock = loaded.stock_scheduler
        self.flow_shift = self._flow_shift(stock)
        if loaded.rollout_scheduler is None:
            loaded.rollout_scheduler = RolloutFlowMatchEulerScheduler.from_config(
                {"num_train_timesteps": stock.config.num_train_timesteps, "shift": self.flow_shift}
            )

    def scheduler_for(self, rollout: bool) -> contextlib.AbstractContextManager:
        """The rollout (flow-match Euler) scheduler when ``rollout`` (a rollout or an exact schedule)."""
        rollout_scheduler = self.loaded.rollout_scheduler
        if not rollout or self.pipe.scheduler is rollout_scheduler:
            return contextlib.nullcontext()
        return self._swapped(rollout_scheduler)

    @contextlib.contextmanager
    def _swapped(self, scheduler: Any) -> Iterator[None]:
        # Only the worker thread runs the pipeline, so swapping the attribute for one call is safe.
        previous = self.pipe.scheduler
        self.pipe.scheduler = scheduler
        try:
            yield
        finally:
            self.pipe.scheduler = previous

    def accepts_stock_sigmas(self) -> bool:
        return False

    def shift_sigmas(self, sigmas: list[float]) -> list[float]:
        return apply_shift(sigmas, self.flow_shift)

    # ---------------------------------------------------------------- experts
    def has_experts(self) -> bool:
        return (
            getattr(self.pipe, "transformer_2", None) is not None
            and self.pipe.config.get("boundary_ratio") is not None
        )

    def transformers(self) -> dict[str, torch.nn.Module]:
        mods = {"transformer": self.pipe.transformer}
        if self.has_experts():
            mods["transformer_2"] = self.pipe.transformer_2
        return {k: m for k, m in mods.items() if m is not None}

    def _denoiser(self) -> torch.nn.Module:
        return self.pipe.transformer if self.pipe.transformer is not None else self.pipe.transformer_2

    # ---------------------------------------------------------------- geometry and defaults
    def spatial_factor(self) -> int:
        patch = self._denoiser().config.patch_size
        per_patch = int(self.pipe.vae_scale_factor_spatial) * int(patch[1])
        return per_patch * 16 // math.gcd(per_patch, 16)  # WanPipeline.check_inputs wants 16 too

    def default_size(self) -> tuple[int, int]:
        return 480, 832

    def default_frames(self) -> int:
        return 81

    def default_steps(self) -> int:
        return 50

    def default_guidance(self) -> float:
        return 5.0

    def validate(self, settings: CallSettings) -> None:
        super().validate(settings)
        k = int(self.pipe.vae_scale_factor_temporal)
        frames = settings.num_frames
        if frames is not None and (frames - 1) % k:
            raise RequestError(
                f"num_frames={frames} must be {k}k+1 (the Wan VAE compresses time by {k}), e.g. "
                f"{(frames - 1) // k * k + 1} or {((frames - 1) // k + 1) * k + 1}",
                field="num_frames",
            )
        self._validate_rope_extent(settings)
        if settings.guidance_scale_2 is not None and self.pipe.config.get("boundary_ratio") is None:
            raise RequestError(
                "guidance_scale_2 applies to two-expert models (a boundary_ratio); this model has one expert",
                field="guidance_scale_2",
            )

    def _validate_rope_extent(self, settings: CallSettings) -> None:
        # WanRotaryPosEmbed holds rope_max_seq_len positions per axis (frames, rows, columns of
        # patches); past them the model fails with a reshape error mid-call: refuse here with a 400.
        config = self._denoiser().config
        most = int(config.rope_max_seq_len)
        p_t, p_h, p_w = (int(n) for n in config.patch_size)
        vt, vs = int(self.pipe.vae_scale_factor_temporal), int(self.pipe.vae_scale_factor_spatial)
        extents = (
            (
                "num_frames",
                settings.num_frames,
                lambda v: ((v - 1) // vt + 1) // p_t,
                (most * p_t - 1) * vt + 1,
            ),
            ("height", settings.height, lambda v: v // vs // p_h, most * p_h * vs),
            ("width", settings.width, lambda v: v // vs // p_w, most * p_w * vs),
        )
        for name, value, positions, largest in extents:
            if value is not None and positions(value) > most:
                raise RequestError(
                    f"{name}={value} exceeds {largest}, the largest this Wan model has RoPE positions for "
                    f"(rope_max_seq_len={most})",
                    field=name,
                )

    def uses_cfg(self, settings: CallSettings) -> bool:
        return settings.guidance_scale > 1  # the pipeline's rule, for both experts

    def _guidance_scale_2(self, settings: CallSettings) -> float | None:
        if not self.has_experts():
            return None
        gs2 = settings.guidance_scale_2
        return float(gs2) if gs2 is not None else settings.guidance_scale

    def guidance_info(self, settings: CallSettings) -> dict[str, Any]:
        # Wan's CFG is two sequential calls, ``uncond + s * (cond - uncond)``: replay's true_cfg rule
        # with ``guidance_scale`` (no true_cfg_scale), and ``guidance_scale_2`` on ``transformer_2``.
        return {
            "rule": "true_cfg" if self.uses_cfg(settings) else "none",
            "guidance_scale": settings.guidance_scale,
            "guidance_scale_2": self._guidance_scale_2(settings),
            "true_cfg_scale": None,
        }

    # ---------------------------------------------------------------- prompts
    def encode(self, prompt, negative_prompt, settings):
        cfg = self.uses_cfg(settings)
        pe, npe = self.pipe.encode_prompt(
            prompt=prompt,
            negative_prompt=negative_prompt,
            do_classifier_free_guidance=cfg,
            num_videos_per_prompt=1,
            max_sequence_length=settings.max_sequence_length or _DEFAULT_MAX_SEQUENCE_LENGTH,
            device=self.pipe._execution_device,
        )
        return {"prompt_embeds": pe, "negative_prompt_embeds": npe if cfg else None}

    def call_kwargs(self, settings):
        kw: dict[str, Any] = {
            "height": settings.height,
            "width": settings.width,
            "num_frames": settings.num_frames,
            "num_inference_steps": settings.num_inference_steps,
            "guidance_scale": settings.guidance_scale,
            "max_sequence_length": settings.max_sequence_length or _DEFAULT_MAX_SEQUENCE_LENGTH,
        }
        if settings.guidance_scale_2 is not None:
            kw["guidance_scale_2"] = settings.guidance_scale_2
        return kw

    # ---------------------------------------------------------------- noise and output
    def initial_latents(self, settings, generator, dtype, device):
        # float32 as the pipeline's own prepare_latents call, whatever the model dtype.
        return self.pipe.prepare_latents(
            1,
            self._denoiser().config.in_channels,
            settings.height,
            settings.width,
            settings.num_frames,
            torch.float32,
            torch.device(device),
            generator,
        )

    def output_tensor(self, output: Any, *, decoded: bool = True) -> torch.Tensor | None:
        frames = output.frames
        if decoded:
            return frames.permute(0, 2, 1, 3, 4)  # [B, F, C, H, W] -> [B, C, F, H, W]
        return frames

    # ---------------------------------------------------------------- replay conditioning
    def split_env(self, calls, batch, settings, timestep_dtype):
        envs = super().split_env(calls, batch, settings, timestep_dtype)
        first = calls[0] if calls else {}
        t = first.get("timestep")
        x = first.get("hidden_states")
        for env in envs:
            if isinstance(x, torch.Tensor):
                # The pipeline keeps float32 latents and casts the model input to the transformer's
                # dtype; replay casts the trajectory latent the same way.
                env["model_input_dtype"] = str(x.dtype)
            if isinstance(t, torch.Tensor) and t.ndim == 2:
                env["timestep_tokens"] = int(t.shape[1])
        return envs
