"""Validating a generation request against the model and the limits, and planning its batch.

``RequestPlanner.plan`` fills model defaults, resolves the sigma schedule (the trainer's sigmas
exactly, a ``flow_shift`` schedule, or the pipeline's own), checks every rule a request can break
(400 naming the field or limit), draws the server's seed when none was sent, and returns a ``Plan``
whose ``key`` says which requests may share one pipeline call. It runs on the event loop's side,
before anything is queued, so a bad request never reaches the GPU worker.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from diffusion_rollout.config import ServerConfig
from diffusion_rollout.errors import RequestError
from diffusion_rollout.scheduler_mixins import flow_shift_sigmas, validate_sigmas
from diffusion_rollout.scheduler_mixins.outside_window import coarse_settings
from diffusion_rollout.server.core import branch_tree, initial_noise, shared_prefix
from diffusion_rollout.server.core.images import ConditionImage, image_limits, load_images
from diffusion_rollout.server.core.params import GenerateParams
from diffusion_rollout.server.core.prompt_embeds import check_embeddings
from diffusion_rollout.server.core.prompt_limits import check_prompt_limits
from diffusion_rollout.server.core.worker import Job
from diffusion_rollout.server.families import CallSettings, FamilyAdapter
from diffusion_rollout.server.speed.options import check_feature_cache


class Plan:
    """A validated request: everything the worker needs, plus the batch key."""

    def __init__(
        self,
        params: GenerateParams,
        call: CallSettings,
        seeds: list[int],
        schedule,
        stock_sigmas,
        images: tuple[ConditionImage, ...] = (),
    ):
        self.params = params
        self.call = call
        self.seeds = seeds
        self.schedule = schedule  # exact sigma_0..sigma_{T-1}, or None for the pipeline's own
        self.stock_sigmas = stock_sigmas  # sigmas for the pipeline to shift itself, or None
        self.images = images  # decoded input images (image-conditioned families)
        self.eager = False  # run with compilation off (the readiness probe on a compiled server)
        # The output pixels the request adds to a call (frames counted): what max_batch_pixels caps.
        self.pixels = len(seeds) * call.height * call.width * (call.num_frames or 1)
        # Requests share a pipeline call only with identical input images (the call takes one set).
        self.image_key = tuple(im.digest for im in images)
        p = params
        self.key = (
            call,
            p.rollout,
            p.settings if p.rollout else None,
            tuple(schedule) if schedule is not None else None,
            tuple(stock_sigmas) if stock_sigmas is not None else None,
            p.generator_device,
            p.return_generated_output,
            p.rollout and p.return_denoising_env,
            p.feature_cache,
            self.image_key,
            # A shared-prefix request runs alone: its prefix is then one row per guidance branch,
            # the batch-1 call its exactness is stated against (server/core/shared_prefix.py).
            object() if p.share_prefix or p.branch else None,
        )

    def as_probe(self) -> Plan:
        """The readiness probe's plan: run eagerly even on a compiled server (its small image would
        otherwise compile the blocks once more for a shape no request uses; with FP8 that took
        minutes on an H100), and never batched with a request."""
        self.eager = True
        self.key = (*self.key, "probe")
        return self

    def job(self, request_id: str) -> Job:
        """The worker's unit of work for this plan: its batch key, samples and pixels (batching)."""
        return Job(
            payload=self,
            batch_key=self.key,
            samples=len(self.seeds),
            pixels=self.pixels,
            request_id=request_id,
        )


class RequestPlanner:
    def __init__(
        self,
        config: ServerConfig,
        adapter: FamilyAdapter,
        *,
        device: str,
        dtype: torch.dtype,
        num_train_timesteps: Callable[[], int],
    ) -> None:
        self.config = config
        self.adapter = adapter
        self.device = device
        self.dtype = dtype
        self.num_train_timesteps = num_train_timesteps
        self._latent_info_cache: dict[tuple, tuple[int, torch.dtype]] = {}

    def plan(self, p: GenerateParams) -> Plan:
        a = self.adapter
        assert a is not None
        cfg = self.config
        check_prompt_limits(p, cfg, a.pipe)
        if p.num_outputs_per_prompt < 1 or p.num_outputs_per_prompt > cfg.max_outputs_per_request:
            raise RequestError(
                f"num_outputs_per_prompt={p.num_outputs_per_prompt} must be in 1..{cfg.max_outputs_per_request}"
                " (limit max_outputs_per_request)",
                field="num_outputs_per_prompt",
            )
        n = p.num_outputs_per_prompt
        images = self._images(p)
        dh, dw = a.request_size(images)
        height, width = p.height or dh, p.width or dw
        if height * width > cfg.max_pixels:
            raise RequestError(
                f"width*height={width * height} exceeds max_pixels={cfg.max_pixels}", field="width"
            )

        # Schedule: the trainer's sigmas exactly, a flow_shift schedule, or the pipeline's own.
        schedule = stock_sigmas = None
        sigmas = p.sigmas
        if p.timesteps is not None:
            if sigmas is not None:
                raise RequestError("send either sigmas or timesteps, not both", field="timesteps")
            ntt = float(self.num_train_timesteps())
            sigmas = [float(t) / ntt for t in p.timesteps]
        steps = p.num_inference_steps
        if sigmas is not None:
            if steps is not None and steps != len(sigmas):
                raise RequestError(
                    f"num_inference_steps={steps} but {len(sigmas)} sigmas were sent", field="sigmas"
                )
            steps = len(sigmas)
        steps = steps or a.request_steps()
        if steps < 1 or steps > cfg.max_steps:
            raise RequestError(
                f"num_inference_steps={steps} must be in 1..{cfg.max_steps} (limit max_steps)",
                field="num_inference_steps",
            )
        if sigmas is not None:
            if p.flow_shift is not None:
                raise RequestError(
                    "flow_shift applies to the default schedule; not with sigmas", field="flow_shift"
                )
            sigmas = validate_sigmas(sigmas, steps)
            if p.sigmas_are_shifted:
                schedule = sigmas
            else:
                stock_sigmas = sigmas
        elif p.flow_shift is not None:
            if not (p.flow_shift > 0):
                raise RequestError("flow_shift must be > 0", field="flow_shift")
            schedule = flow_shift_sigmas(steps, p.flow_shift)
        if stock_sigmas is not None and not a.accepts_stock_sigmas():
            schedule = a.shift_sigmas(stock_sigmas)
            stock_sigmas = None
        if schedule is not None:
            # A derived schedule can still be unservable (an extreme flow_shift gives inf, or values
            # equal in float32): refuse it here, not as a failed batch in the worker.
            try:
                schedule = validate_sigmas(schedule, steps)
            except RequestError as exc:
                field = "flow_shift" if p.flow_shift is not None else "sigmas"
                message = f"the schedule {field} gives is not servable: {exc.message}"
                raise RequestError(message, field=field) from None

        frames = None
        if a.is_video:
            frames = p.num_frames or a.request_frames()
            if frames > cfg.max_frames:
                raise RequestError(
                    f"num_frames={frames} exceeds max_frames={cfg.max_frames}", field="num_frames"
                )
        call = CallSettings(
            height=height,
            width=width,
            num_inference_steps=steps,
            guidance_scale=float(p.guidance_scale if p.guidance_scale is not None else a.default_guidance()),
            true_cfg_scale=p.true_cfg_scale if p.true_cfg_scale is not None else a.default_true_cfg(),
            guidance_scale_2=p.guidance_scale_2,
            num_frames=frames,
            max_sequence_length=p.max_sequence_length,
            has_negative_prompt=p.negative_prompt is not None or "negative_prompt_embeds" in (p.embeds or {}),
        )
        a.validate(call)
        check_embeddings(p, a, call, cfg.max_prompt_tokens)
        check_feature_cache(
            p.feature_cache,
            family=a.name,
            rollout=p.rollout,
            stochastic_steps=bool(p.rollout and p.settings.stochastic_steps(steps)),
            allow_inexact=p.allow_inexact,
        )

        if p.rollout:
            p.settings.validate(steps)
            self._outside_window(p, steps)
            size = self.response_tensor_bytes(p, call, n)
            if size > cfg.max_trajectory_bytes:
                raise RequestError(
                    f"the trajectory and debug tensors of this request would take {size} bytes, over "
                    f"max_trajectory_bytes={cfg.max_trajectory_bytes} (limit max_trajectory_bytes): send "
                    "rollout_debug_mode=false, fewer rollout_return_step_indices, fewer steps or outputs",
                    field="max_trajectory_bytes",
                )

        if p.seeds is not None:
            if len(p.seeds) != n:
                raise RequestError(
                    f"seeds has {len(p.seeds)} entries but num_outputs_per_prompt={n}", field="seeds"
                )
            seeds = list(p.seeds)
        else:
            if p.seed is None:
                p.seed = random.randrange(0, 2**31 - n)
            seeds = [p.seed + i for i in range(n)]
        initial_noise.validate(p, n, a, call)
        shared_prefix.validate(p, a.name, context_parallel=self.config.context_parallel > 1)
        branch_tree.validate(p, a.name, steps, context_parallel=self.config.context_parallel > 1)
        if p.generator_device.startswith("cuda") and not self.device.startswith("cuda"):
            p.generator_device = "cpu"  # api.md: on a CPU-only server cuda falls back to cpu
        return Plan(p, call, seeds, schedule, stock_sigmas, images)

    def _outside_window(self, p: GenerateParams, steps: int) -> None:
        """``rollout_outside_window_stride`` / ``rollout_ode_solver``: the settings of the kept
        schedule (scheduler_mixins/outside_window.py), or a 400 naming what they cannot go with."""
        stride, solver = p.outside_window_stride, p.settings.ode_solver
        if stride == 1 and solver == "euler":
            return
        field = "rollout_outside_window_stride" if stride > 1 else "rollout_ode_solver"
        a = self.adapter
        why = (
            "a family with several latent streams or experts" if a.streams or a.has_experts()
            else "rollout_share_prefix" if p.share_prefix
            else "denoise_seeds (their keys are loop steps, which the kept schedule renumbers)" if p.denoise_seeds
            else "a context-parallel server" if self.config.context_parallel > 1
            else None
        )  # fmt: skip
        if why is not None:
            raise RequestError(f"{field} does not go with {why}", field=field)
        p.settings = coarse_settings(p.settings, steps, stride)

    def _images(self, p: GenerateParams) -> tuple[ConditionImage, ...]:
        """The request's input images, decoded and validated, checked against the family."""
        a = self.adapter
        sent = len(p.image_path or ()) + len(p.image_data or ())
        field = "image_path" if p.image_path else "image_data"
        if sent and not a.image_inputs:
            raise RequestError(f"{field}: this model ({a.name}) takes no input images", field=field)
        if a.image_inputs and not sent:
            raise RequestError(
                f"image_path: this model ({a.name}) is image-conditioned; send its input image in image_path "
                "or image_data",
                field="image_path",
            )
        if sent > a.image_inputs:
            raise RequestError(
                f"{field}: {sent} input images sent; this model ({a.name}) takes {a.image_inputs}",
                field=field,
            )
        return load_images(p.image_path, p.image_data, image_limits(self.config))

    def _latent_info(self, call: CallSettings) -> tuple[int, torch.dtype]:
        """(elements, dtype) of one sample's latent at this geometry, cached per size."""
        key = (call.height, call.width, call.num_frames)
        info = self._latent_info_cache.get(key)
        if info is None:
            try:
                # The family's own prepare_latents on the meta device: the exact (packed) shape and the
                # dtype the pipeline keeps latents in, without memory or RNG.
                x = self.adapter.initial_latents(call, None, self.dtype, "meta")
            except Exception:  # a family whose prepare_latents cannot run on meta: one small real draw
                g = torch.Generator("cpu").manual_seed(0)
                x = self.adapter.initial_latents(call, g, self.dtype, "cpu")
            info = (x.numel() // max(1, x.shape[0]), x.dtype)
            if len(self._latent_info_cache) < 1024:  # sizes are few in practice; never grow unbounded
                self._latent_info_cache[key] = info
        return info

    def response_tensor_bytes(self, p: GenerateParams, call: CallSettings, n: int) -> int:
        """Bytes of the latent-sized tensors a rollout response carries (``max_trajectory_bytes``).

        Per output: ``dit_trajectory.latents`` (K entries, in the promoted latent/model dtype) when
        asked, and with ``rollout_debug_mode`` the three ``[T, *latent]`` debug tensors (noises and
        means in float32, model outputs in the model dtype). Log-probs, sigmas and the generated
        output itself are small or bounded by ``max_pixels`` and are not counted.
        """
        if not p.rollout:
            return 0
        numel, latent_dtype = self._latent_info(call)
        steps = call.num_inference_steps
        model_item = torch.empty((), dtype=self.dtype).element_size()
        traj_item = torch.empty((), dtype=torch.promote_types(latent_dtype, self.dtype)).element_size()
        per_output = 0
        if p.return_dit_trajectory:
            per_output += len(p.settings.kept_trajectory_indices(steps)) * numel * traj_item
        if p.settings.debug:
            per_output += steps * numel * (4 + 4 + model_item)
        return n * per_output
