"""Engine-level request and result types (no HTTP here).

The HTTP protocol model turns a JSON body into ``GenerateParams`` (merging
``extra_sampling_params``); the engine fills model defaults, validates against the model and the
limits, and answers one ``SampleResult`` per output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from diffusion_rollout.scheduler_mixins import RolloutSettings
from diffusion_rollout.server.speed.options import FeatureCacheSettings


@dataclass
class GenerateParams:
    prompt: str
    negative_prompt: str | None = None
    # Precomputed conditioning by diffusers' argument name (server/core/prompt_embeds.py); with it the
    # prompt text is a label only and the prompt cache is not used.
    embeds: dict[str, torch.Tensor] | None = None
    seed: int | None = None
    seeds: list[int] | None = None
    initial_noise_seed: int | None = None
    # Relax/UniRL noise recipes (server/core/initial_noise.py): x_T per group id, step noise per key.
    initial_noise_group_ids: list[str] | None = None
    initial_noise_latent_shape: list[int] | None = None
    denoise_seeds: list[str] | None = None
    # x_T sent by the trainer (UniRL): [n, *noise_shape] or one [*noise_shape] for all outputs,
    # unpacked, any float dtype; cast to the pipeline's latent dtype and packed as its own noise.
    initial_noise: torch.Tensor | None = None
    generator_device: str = "cuda"
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    num_outputs_per_prompt: int = 1
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    guidance_scale_2: float | None = None
    num_frames: int | None = None
    fps: int | None = None
    max_sequence_length: int | None = None
    rollout: bool = True
    settings: RolloutSettings = field(default_factory=RolloutSettings)
    return_denoising_env: bool = False
    return_dit_trajectory: bool = False
    return_generated_output: bool = True
    # The prompt encodings the outputs were conditioned on (UniRL's SGLang patch fields).
    return_prompt_embeds: bool = False
    return_negative_prompt_embeds: bool = False
    output_dtype: str = "float32"
    sigmas: list[float] | None = None
    timesteps: list[float] | None = None
    sigmas_are_shifted: bool = True
    flow_shift: float | None = None
    feature_cache: FeatureCacheSettings | None = None
    allow_inexact: bool = False
    # Run the ODE steps before the first stochastic step once for the group (server/core/shared_prefix.py).
    share_prefix: bool = False
    # Keep every k-th sigma outside the SDE window (scheduler_mixins/outside_window.py).
    outside_window_stride: int = 1
    # A tree of rollouts: ((step, factor), ...) (server/core/branch_tree.py).
    branch: tuple[tuple[int, int], ...] | None = None
    # Conditioning images of image-conditioned families: server-side paths and inline file bytes.
    image_path: list[str] | None = None
    image_data: list[bytes] | None = None
    # Bounded staleness: run on weights at least this version (weight_versions.py), waiting
    # for it within the request's timeout, or refusing at once (409) when ``min_weight_version_wait``
    # is false.
    min_weight_version: Any = None
    min_weight_version_wait: bool = True
    # Rewards the server scores on the decoded outputs (server/core/reward_runner.py), by configured
    # name, with this prompt's metadata (an OCR target text...); ``return_output=False`` answers
    # without the generated output (the trainer needs only rewards, log-probs and latents).
    rewards: tuple[str, ...] = ()
    reward_metadata: dict[str, Any] | None = None
    return_output: bool = True
    request_id: str = "-"


@dataclass
class SampleResult:
    """One output of a request; tensors are on the CPU and have no batch dimension."""

    request_id: str
    prompt: str
    seed: int
    weight_version: Any
    generated_output: torch.Tensor | None
    rollout_log_probs: torch.Tensor | None
    rollout_debug_tensors: dict[str, torch.Tensor] | None
    denoising_env: dict[str, Any] | None
    dit_trajectory: dict[str, Any] | None
    sde_step_indices: list[int] | None
    expert_per_step: list[str] | None = None
    inference_time_s: float | None = None
    peak_memory_mb: float | None = None
    nonfinite_output: bool = False
    # Which pipeline call produced this output and its row there: a transformer's last bits depend
    # on the batch it ran in, so replaying a server batch as one batch is what makes ratios exactly 1.
    batch_id: str = ""
    batch_index: int = 0
    batch_size: int = 1
    # False when an option that changes numerics was active (server/speed/options.py): compile, a non-exact
    # attention backend, a feature cache. True: bit-identical to the stock eager pipeline.
    exact: bool = True
    # With return_prompt_embeds / return_negative_prompt_embeds: the encodings under the pipeline's
    # argument names (prompt_embeds, pooled_prompt_embeds, negative_..., masks), one row each
    # ([1, ...], the request's precomputed-conditioning form), answered as top-level fields.
    conditioning: dict[str, Any] | None = None
    # With rollout_share_prefix: the leading ODE steps computed once for the request's
    # ``shared_prefix_outputs`` outputs (server/core/shared_prefix.py); absent from answers otherwise.
    shared_prefix_steps: int | None = None
    shared_prefix_outputs: int | None = None
    # With ``rewards``: {name: value, or None when it failed}, why each failed one failed, and what
    # a reward reported beside its value (a judge's reading); absent from answers otherwise.
    # With rollout_branch: this leaf's child index at each branch point, and the request's tree.
    branch_path: list[int] | None = None
    rollout_branch: list[list[int]] | None = None
    rewards: dict[str, float | None] | None = None
    reward_errors: dict[str, str] | None = None
    reward_extras: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        for name in (
            "expert_per_step", "shared_prefix_steps", "shared_prefix_outputs", "branch_path", "rollout_branch",
            "rewards", "reward_errors", "reward_extras",
        ):  # fmt: skip
            if d[name] is None:
                d.pop(name)
        conditioning = d.pop("conditioning")
        if conditioning:
            d.update(conditioning)
        return d
