"""The rollout request (``POST /rollout/generate``, api.md): the one request model that the HTTP
layer, the cluster and the client all import.

Field names and defaults follow SGLang's diffusion post-training API. The rollout request accepts
keys it does not know, as SGLang does (trainers send their own: Relax's ``_task``), and names every
one in the answer's ``ignored_fields``, so a misspelt field is reported, never silently dropped;
``serve --strict-fields`` makes them a 422 (the router checks :attr:`GenerateRequest.unknown_fields`).
The other bodies forbid unknown fields. ``extra_sampling_params`` is merged over the named fields
before validation, so its keys obey the same rules. Fields that SGLang or its trainers' patches
accept but that have no effect here are dropped first and reported too (``protocol/dialects.py``),
as is a ``rollout`` inside ``extra_sampling_params``: the top-level flag wins there, as in SGLang.

Precomputed conditioning (``prompt_embeds``, ``pooled_prompt_embeds`` and their negatives) arrives
as tensor envelopes (``protocol/request_tensors.py``); ``prompt`` is then optional and only a
label echoed back. Whether the tensors suit the loaded model is checked by the planner
(``server/core/prompt_embeds.py``), a 400 naming the field and the expected shape.

This module is pure data: it imports only the protocol package, the errors and the step math, so the
client can validate a body with it before sending. Turning a validated request into the engine's
``GenerateParams`` (and the checks that need them) is the HTTP layer's
(``entrypoints/request_params.py``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictInt, StrictStr, model_validator

from diffusion_rollout.protocol.dialects import split_noop_sampling_fields
from diffusion_rollout.protocol.request_tensors import WireTensor

StepKind = Literal["sde", "dance", "cps", "ode"]
LogProbForm = Literal["gaussian", "no_const", "scaled"]
NoiseKey = Annotated[str, Field(max_length=1024)] | int
# Most prompts (groups) one request may carry as a list; the outputs are bounded by the limits too.
MAX_PROMPTS = 1024
# The feature caches a request may ask for (``feature_cache.kind``); which families each one runs on
# is the server's (server/speed/options.py).
CACHE_KINDS = ("taylorseer", "first_block", "mag")
EMBEDDING_FIELDS = (
    "prompt_embeds",
    "pooled_prompt_embeds",
    "negative_prompt_embeds",
    "negative_pooled_prompt_embeds",
)


class FeatureCacheRequest(BaseModel):
    """``feature_cache`` (ext): a diffusers cache hook for this request's denoising (server/speed/options.py)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kind: Literal[CACHE_KINDS]  # type: ignore[valid-type]
    threshold: float | None = Field(None, gt=0, le=10)
    interval: int = Field(2, ge=1, le=64)
    warmup_steps: int = Field(1, ge=0, le=1000)
    max_order: int = Field(1, ge=1, le=4)


class BranchPoint(BaseModel):
    """One branch point of ``rollout_branch`` (server/core/branch_tree.py): at loop ``step`` every node
    splits into ``factor`` children."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0)
    factor: int = Field(ge=2, le=64)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # A list (SGLang's in-process form, which UniRL sends): one group of num_outputs_per_prompt
    # outputs per prompt (``group_params``).
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | None = None
    negative_prompt: str | None = None
    # Precomputed conditioning (ext, diffusers' names): one row, the pipeline's own encoding's shape.
    prompt_embeds: WireTensor | None = None
    pooled_prompt_embeds: WireTensor | None = None
    negative_prompt_embeds: WireTensor | None = None
    negative_pooled_prompt_embeds: WireTensor | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    seeds: list[int] | None = None
    initial_noise_seed: int | None = Field(None, ge=0, lt=2**63)
    generator_device: Literal["cuda", "cpu"] = "cuda"
    width: int | None = Field(None, ge=1)
    height: int | None = Field(None, ge=1)
    num_inference_steps: int | None = Field(None, ge=1)
    num_outputs_per_prompt: int | None = Field(1, ge=1)
    guidance_scale: float | None = Field(None, ge=0)
    true_cfg_scale: float | None = Field(None, ge=0)
    num_frames: int | None = Field(None, ge=1)
    fps: int | None = Field(None, ge=1)
    rollout: bool = True
    rollout_sde_type: StepKind = "sde"
    rollout_noise_level: float = Field(0.7, ge=0)
    rollout_log_prob_no_const: bool = False
    rollout_log_prob_form: LogProbForm | None = None
    rollout_debug_mode: bool = True
    rollout_return_denoising_env: bool = False
    rollout_return_dit_trajectory: bool = False
    rollout_sde_step_indices: list[int] | None = None
    rollout_return_step_indices: list[int] | None = None
    # A list (this API), or one path as SGLang's SamplingParams.image_path takes it.
    image_path: list[str] | str | None = None
    # Inline image files (ext): base64 text (a data: URI is fine) in JSON, raw bytes in msgpack.
    image_data: list[str | bytes] | None = None
    suppress_logs: bool = False
    extra_sampling_params: dict[str, Any] | None = None
    sigmas: list[float] | None = None
    timesteps: list[float] | None = None
    sigmas_are_shifted: bool = True
    flow_shift: float | None = Field(None, gt=0)
    guidance_scale_2: float | None = Field(None, ge=0)
    output_dtype: Literal["float32", "uint8"] = "float32"
    rollout_video_dtype: Literal["float32", "uint8"] | None = None
    return_generated_output: bool = True
    max_sequence_length: int | None = Field(None, ge=1, le=4096)
    # Relax/UniRL noise recipes (diffusion_rollout/protocol/noise_recipes.py); keys compare as strings.
    initial_noise_group_ids: list[NoiseKey] | None = Field(None, min_length=1)
    initial_noise_latent_shape: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, min_length=1, max_length=8
    )
    denoise_seeds: list[NoiseKey] | None = None
    # UniRL's x_T as a tensor (server/core/initial_noise.py checks shape, dtype and finiteness).
    initial_noise: WireTensor | None = None
    # UniRL's SGLang patch fields: answer the prompt encodings the outputs were conditioned on.
    return_prompt_embeds: bool = False
    return_negative_prompt_embeds: bool = False
    # SGLang's client-set request id: names the request for POST /abort_request and the response.
    rid: str | None = Field(None, min_length=1, max_length=256)
    feature_cache: FeatureCacheRequest | None = None
    allow_inexact: bool = False
    # The group's ODE steps before its first stochastic step, once (server/core/shared_prefix.py).
    rollout_share_prefix: bool = False
    # Cheaper ODE steps outside the SDE window (scheduler_mixins/outside_window.py).
    rollout_ode_solver: Literal["euler", "dpm2m"] = "euler"
    # A tree of rollouts grown from one x_T (server/core/branch_tree.py).
    rollout_branch: Annotated[list[BranchPoint], Field(min_length=1, max_length=8)] | None = None
    rollout_outside_window_stride: int = Field(1, ge=1, le=64)
    lean_response: bool = False
    # Rewards scored on the server (ext, server/core/reward_runner.py): names given to serve --reward.
    rewards: Annotated[list[Annotated[str, Field(min_length=1, max_length=64)]], Field(max_length=16)] | None = None
    # One object per prompt (a list prompt: one per prompt, in order), given to rewards that take it.
    reward_metadata: dict[str, Any] | list[dict[str, Any]] | None = None
    # False (ext): the answer carries no generated output (the rewards are still scored on it).
    return_output: bool = True
    # Bounded staleness (ext): the weights must be at least this version (weight_versions.py).
    min_weight_version: Annotated[StrictStr, Field(min_length=1, max_length=256)] | StrictInt | None = Field(
        None,
        description=(
            "Run only on weights at least this version: the server's current weight_version or one it "
            "applied before it (versions are ordered by when the server applied them and compare as "
            "text, so 7 and '7' are one version). A version the server has not applied yet is waited "
            "for, within request_timeout_s (504), or refused with 409 when min_weight_version_wait is "
            "false. Unset: any version."
        ),
    )
    min_weight_version_wait: bool = Field(
        True,
        description=(
            "With min_weight_version: wait for that version (true) or answer 409 at once (false) when "
            "the server does not hold it yet."
        ),
    )

    # Fields of other dialects that have no effect here (protocol/dialects.py), by name.
    _ignored_fields: list[str] = PrivateAttr(default_factory=list)

    # Fields no dialect list names (a peer's own key such as Relax's ``_task``, or a typo).
    _unknown_fields: list[str] = PrivateAttr(default_factory=list)

    @property
    def ignored_fields(self) -> list[str]:
        return list(self._ignored_fields)

    @property
    def unknown_fields(self) -> list[str]:
        """Of :attr:`ignored_fields`, those this server does not know at all (``serve
        --strict-fields`` refuses them with 422)."""
        return list(self._unknown_fields)

    @model_validator(mode="wrap")
    @classmethod
    def _accept_dialects(cls, data: Any, handler: Any) -> GenerateRequest:
        ignored: list[str] = []
        unknown: list[str] = []
        if isinstance(data, dict):
            data, ignored = split_noop_sampling_fields(data)
            data, unknown = cls._split_unknown(data)
            data, overridden = cls._merge_extra(data)
            ignored = sorted(ignored + overridden + unknown)
        model = handler(data)
        model._ignored_fields = ignored
        model._unknown_fields = sorted(unknown)
        if model.prompt is None and model.prompt_embeds is None:
            raise ValueError("prompt: field required (or prompt_embeds, precomputed conditioning)")
        return model

    @classmethod
    def _split_unknown(cls, data: dict) -> tuple[dict, list[str]]:
        """``data`` without the keys no field of this model has (top level and in
        ``extra_sampling_params``), and their names. SGLang accepts such keys (its trainers send their
        own: Relax's ``_task``), so they are accepted and reported rather than refused."""
        known = cls.model_fields
        unknown = [k for k in data if k not in known]
        out = {k: v for k, v in data.items() if k in known}
        extra = out.get("extra_sampling_params")
        if isinstance(extra, dict):
            names = [k for k in extra if k not in known or k == "extra_sampling_params"]
            unknown += [f"extra_sampling_params.{k}" for k in names]
            out["extra_sampling_params"] = {k: v for k, v in extra.items() if k not in names}
        return out, unknown

    @classmethod
    def _merge_extra(cls, data: dict) -> tuple[dict, list[str]]:
        extra = data.get("extra_sampling_params")
        if not extra:
            return data, []
        if not isinstance(extra, dict):
            raise ValueError("extra_sampling_params must be an object")
        ignored = []
        if "rollout" in extra:
            # SGLang's rule: the top-level rollout flag wins over one in extra_sampling_params.
            extra = {k: v for k, v in extra.items() if k != "rollout"}
            ignored.append("extra_sampling_params.rollout")
        merged = dict(data)
        merged.update(extra)
        merged["extra_sampling_params"] = None
        return merged, ignored
