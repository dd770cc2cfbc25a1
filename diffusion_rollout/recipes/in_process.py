"""``--layout in-process``: rollouts in the trainer's process, on the trainer's own transformer.

- SD3/SD3.5: :class:`InProcessSampler`, the stock pipeline with the scheduler mixin, as flow_grpo's
  own loop samples.
- Every other family (Qwen-Image, FLUX, Wan...): :class:`EngineSampler`, this project's engine run in
  the trainer's process on a pipeline whose transformer *is* the trainer's, answered over loopback by
  the same routes and client as a server. That is verl-omni's layout (each rank samples its own groups
  with its own copy of the model) with this project's family code, so the baseline and the server
  layouts differ only in where the sampling runs.

:func:`in_process_sampler` picks by the folder's pipeline class.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from diffusion_rollout.client import DitTrajectory, ReplaySettings, RolloutOutput


class InProcessSampler:
    """Rollouts in the trainer's process: the stock SD3 pipeline, the rollout scheduler, no server.

    The pipeline's transformer *is* the trainer's (PEFT-wrapped) transformer, so there is nothing to
    push. ``generate`` takes the same request fields as the client's and returns the same
    :class:`RolloutOutput` objects (tensors left on the device), so a recipe's training code does not
    know which layout it runs in. The pipeline is called as the server calls it: prompt encodings
    computed once and repeated for the group, ``initial_noise_seed``'s x_T drawn by
    ``prepare_latents`` and shared, generator ``i`` seeded ``seed + i`` drawing each step's noise.
    """

    def __init__(self, model_path: Path, transformer: torch.nn.Module, device: torch.device) -> None:
        from diffusers import DiffusionPipeline

        from diffusion_rollout.scheduler_mixins import RolloutFlowMatchEulerScheduler

        dtype = next(transformer.parameters()).dtype
        pipe = DiffusionPipeline.from_pretrained(str(model_path), transformer=transformer, dtype=dtype)
        if type(pipe).__name__ != "StableDiffusion3Pipeline":
            raise SystemExit(f"--layout in-process supports SD3/SD3.5 pipelines, not {type(pipe).__name__}")
        pipe.scheduler = RolloutFlowMatchEulerScheduler.from_config(pipe.scheduler.config)
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe.to(device)
        self.device = device
        self.weight_version: Any = None

    def generate_many(self, jobs: Sequence[Mapping[str, Any]], **fields: Any) -> list[list[RolloutOutput]]:
        return [self.generate(**{**fields, **job}) for job in jobs]

    @torch.no_grad()
    def generate(
        self, prompt: str, *, seed: int, num_outputs_per_prompt: int, num_inference_steps: int,
        width: int, height: int, guidance_scale: float, rollout_sde_type: str = "sde",
        rollout_noise_level: float = 0.7, rollout_sde_step_indices: Sequence[int] | None = None,
        rollout_return_step_indices: Sequence[int] | None = None, initial_noise_seed: int | None = None,
        generator_device: str = "cuda", rollout_ode_solver: str = "euler", rollout_outside_window_stride: int = 1,
        **_: Any,
    ) -> list[RolloutOutput]:  # fmt: skip
        from diffusion_rollout.scheduler_mixins import RolloutSettings, RolloutState, rollout_context
        from diffusion_rollout.scheduler_mixins.outside_window import coarse_settings

        pipe, n = self.pipe, num_outputs_per_prompt
        gen_device = generator_device if self.device.type == "cuda" else "cpu"
        cfg = guidance_scale > 1
        pe, npe, ppe, nppe = pipe.encode_prompt(
            prompt=prompt, prompt_2=None, prompt_3=None, do_classifier_free_guidance=cfg,
            device=self.device, num_images_per_prompt=1,
        )  # fmt: skip
        latents = None
        if initial_noise_seed is not None:
            g = torch.Generator(gen_device).manual_seed(initial_noise_seed)
            channels = pipe.transformer.config.in_channels
            x = pipe.prepare_latents(1, channels, height, width, pe.dtype, self.device, g)
            latents = x.repeat(n, *([1] * (x.ndim - 1)))
        generators = [torch.Generator(gen_device).manual_seed(seed + i) for i in range(n)]
        settings = RolloutSettings(
            kind=rollout_sde_type,
            eta=rollout_noise_level,
            sde_step_indices=rollout_sde_step_indices,
            return_step_indices=rollout_return_step_indices,
            ode_solver=rollout_ode_solver,
        )
        # The server's rule for a coarse outside (scheduler_mixins/outside_window.py), the same function.
        settings = coarse_settings(settings, num_inference_steps, rollout_outside_window_stride)
        state = RolloutState(settings, generators)
        rep = lambda t: None if t is None else t.repeat(n, *([1] * (t.ndim - 1)))  # noqa: E731
        with rollout_context(state):
            images = pipe(
                prompt_embeds=rep(pe), negative_prompt_embeds=rep(npe), pooled_prompt_embeds=rep(ppe),
                negative_pooled_prompt_embeds=rep(nppe), height=height, width=width,
                num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                generator=generators, latents=latents, output_type="pt",
            ).images  # fmt: skip
        as_bytes = (images.float() * 255.0).round().clamp(0, 255).to(torch.uint8).cpu()
        env = {
            "image_kwargs": {},
            "pos_cond_kwargs": {"encoder_hidden_states": pe, "pooled_projections": ppe},
            "neg_cond_kwargs": {"encoder_hidden_states": npe, "pooled_projections": nppe} if cfg else None,
            "guidance": {"rule": "cfg_batched" if cfg else "none", "guidance_scale": guidance_scale},
            "batch_kwargs": ["encoder_hidden_states", "pooled_projections"],
            "timestep_dtype": str(state.timesteps.dtype),
        }
        replay = ReplaySettings(kind=rollout_sde_type, eta=rollout_noise_level, log_prob_form="gaussian")
        return [
            RolloutOutput(
                request_id=f"in-process-{seed}",
                prompt=prompt,
                seed=seed + i,
                weight_version=self.weight_version,
                generated_output=as_bytes[i],
                rollout_log_probs=state.log_probs[i],
                denoising_env=env,
                dit_trajectory=DitTrajectory(
                    latents=state.trajectory_latents[i],
                    timesteps=state.timesteps,
                    sigmas=state.sigmas,
                    latent_step_indices=list(state.latent_step_indices),
                ),
                sde_step_indices=list(state.sde_step_indices),
                batch_index=i,
                batch_size=n,
                replay_settings=replay,
            )
            for i in range(n)
        ]


def in_process_sampler(
    model_path: Path, transformer: torch.nn.Module, device: torch.device, max_batch_size: int
):
    """The sampler of ``--layout in-process`` for the model folder (see the module docstring)."""
    pipeline_class = json.loads((Path(model_path) / "model_index.json").read_text())["_class_name"]
    if pipeline_class == "StableDiffusion3Pipeline":
        return InProcessSampler(model_path, transformer, device)
    return EngineSampler(model_path, transformer, device, max_batch_size)


class EngineSampler:
    """The engine in this process on the trainer's transformer, behind a loopback port (see above).

    Nothing is pushed: the adapter the trainer steps is the one the pipeline runs. ``close()`` stops
    the engine and its port.
    """

    def __init__(
        self, model_path: Path, transformer: torch.nn.Module, device: torch.device, max_batch_size: int
    ) -> None:
        from diffusers import DiffusionPipeline

        from diffusion_rollout.client import RolloutClient
        from diffusion_rollout.config import ServerConfig
        from diffusion_rollout.entrypoints.app import create_app
        from diffusion_rollout.entrypoints.http_server import make_server
        from diffusion_rollout.server.core.engine import Engine
        from diffusion_rollout.server.core.loader import prepare_pipeline
        from diffusion_rollout.testing import free_port, serve_in_thread

        dtype = next(transformer.parameters()).dtype
        pipe = DiffusionPipeline.from_pretrained(str(model_path), transformer=transformer, dtype=dtype)
        port, key = free_port(), secrets.token_hex(16)
        config = ServerConfig(
            model=str(model_path), device=str(device), dtype=str(dtype).removeprefix("torch."), host="127.0.0.1",
            port=port, admin_key=key, max_batch_size=max_batch_size, log_level="warning", shutdown_grace_s=5.0,
        )  # fmt: skip
        self.engine = Engine(config, loaded=prepare_pipeline(pipe, device=str(device)))
        self._server = make_server(create_app(config, self.engine), config)
        self._serving = contextlib.ExitStack()
        self._serving.enter_context(serve_in_thread(self._server, name="in-process-engine"))
        self.client = RolloutClient(f"http://127.0.0.1:{port}", admin_key=key)
        self.client.wait_until_ready(timeout_s=600)
        self.weight_version: Any = None

    def generate_many(self, jobs: Sequence[Mapping[str, Any]], **fields: Any) -> list[list[Any]]:
        return self.client.generate_many(jobs, **fields)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        self._serving.close()
        self.engine.stop()
