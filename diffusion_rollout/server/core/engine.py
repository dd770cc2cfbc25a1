"""The rollout engine: one pipeline, one worker thread, batches of compatible requests.

The engine knows nothing of HTTP. ``generate`` validates a request against the model and the limits
(raising ``RequestError`` for the HTTP layer to map), queues it, and resolves to one
``SampleResult`` per output. The worker runs the real diffusers pipeline ``__call__`` with a
per-batch ``RolloutState`` attached through ``rollout_context``, so the stock denoising loop is
reused as is and the ODE path stays bit-identical to diffusers.

RNG: every output owns a generator seeded ``seed + i`` (or ``seeds[i]``); the engine draws each
output's x_T from it with the pipeline's own ``prepare_latents`` at batch 1 (what the stock pipeline
does with a list of generators), then the scheduler draws each stochastic step's noise from the same
generator (shared x_T and trainers' noise recipes: ``server/core/initial_noise.py``). A sample's random numbers therefore never depend on what it was batched with; its
arithmetic can, in the last bits (matmul kernels block differently per batch size), which is why every
output names its pipeline call (``batch_id``, ``batch_index``, ``batch_size``) for exact replay.

Reliability (quality.md):

- ``generate`` waits at most ``request_timeout_s`` (queue wait included), then answers 504
  (``RequestTimeoutError``): queued work is dropped, a running batch finishes and its result is
  discarded (a denoising loop cannot be interrupted half way without corrupting the batch).
- ``plan`` rejects a rollout whose trajectory and debug tensors would exceed ``max_trajectory_bytes``
  (400 naming the limit), estimated from the family's exact latent shape (its own
  ``prepare_latents`` on the meta device: no memory, no RNG) times the entries it would return.
- A failed batch fails only its own requests; the worker clears the failed call's frames, then
  ``BatchRunner.after_error`` (``server/core/batch_runner.py``, the worker side) collects garbage and
  empties the CUDA cache, so the next batch starts from a clean allocator (CUDA OOM answers 503,
  anything else 500).
- Every output is checked for NaN/Inf (generated output and log-probs) and flagged per sample
  (``nonfinite_output``), logged with its request id and counted in ``/metrics``.
- ``min_weight_version``: a request waits (before it is queued, within the same
  ``request_timeout_s``) until the engine holds that version, or gets 409 at once when told not to
  wait; the order of versions is ``weight_versions.py``'s. ``abort`` reaches waiting requests
  too, so an aborted request never enters the queue later.
- ``begin_shutdown`` refuses new work with 503 at once; ``stop`` drains the queue and the running
  batch until the shutdown deadline (``shutdown_grace_s``) and fails what is left with 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from diffusion_rollout.config import ServerConfig
from diffusion_rollout.errors import (
    DiffusionRolloutError,
    NotReadyError,
    RequestAbortedError,
    RequestError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from diffusion_rollout.protocol.weight_versions import VersionGate, VersionHistory
from diffusion_rollout.server.core.batch_runner import BatchRunner
from diffusion_rollout.server.core.engine_api import QueueStats
from diffusion_rollout.server.core.images import probe_image_png
from diffusion_rollout.server.core.loader import LoadedPipeline, load_pipeline
from diffusion_rollout.server.core.metrics import Metrics
from diffusion_rollout.server.core.params import GenerateParams, SampleResult
from diffusion_rollout.server.core.planner import Plan, RequestPlanner
from diffusion_rollout.server.core.prompt_cache import PromptCache
from diffusion_rollout.server.core.reward_runner import RewardRunner
from diffusion_rollout.server.core.worker import Job, Worker
from diffusion_rollout.server.families import FamilyAdapter, adapter_for
from diffusion_rollout.server.speed.compiled_start import CompiledStart
from diffusion_rollout.server.speed.lanes import Lane, make_lane
from diffusion_rollout.server.speed.options import SUPPORTED_CACHES

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Engine:
    def __init__(self, config: ServerConfig, *, loaded: LoadedPipeline | None = None) -> None:
        self.config = config
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        self.model_path: str | None = config.model
        self.status = "loading"
        self.metrics = Metrics()
        self._weight_version: Any = 0  # not through the setter: the initial weights are no update
        # Every version held, in the order applied: what min_weight_version is checked against.
        self.versions = VersionHistory([self._weight_version])
        # Requests wait here for their min_weight_version before they are queued.
        self.version_gate = VersionGate(
            self.versions.holds,
            lambda: [self.versions],
            lambda: (
                f"the server holds weight_version={self.weight_version!r} (applied, oldest first: "
                f"{self.versions.describe()})"
            ),
            on_timeout=lambda: self.metrics.request_cancelled("timeout"),
        )
        self.loaded: LoadedPipeline | None = loaded
        # A compiled server's warm-up and compile cache (server/speed/compiled_start.py).
        self.compiled = CompiledStart()
        self.adapter: FamilyAdapter | None = None
        self.prompt_cache = PromptCache(config.prompt_cache_size)
        # serve --reward: scored on this engine's outputs as they finish (server/core/reward_runner.py).
        self.rewards = RewardRunner(config, self.device)
        # The worker side: batches of planned jobs -> pipeline calls -> answers (server/core/batch_runner.py).
        self.runner = BatchRunner(self)
        self.worker = Worker(
            self.runner.run_batch,
            max_queue_depth=config.max_queue_depth,
            max_batch_samples=config.max_batch_size,
            max_batch_pixels=config.max_batch_pixels,
            batch_wait_s=config.batch_wait_ms / 1000.0,
            on_batch_error=self.runner.after_error,
            lanes=config.pipeline_lanes,
        )
        # Pipeline calls in flight at once (server/speed/lanes.py); built by load().
        self._lanes: list[Lane] = []
        self.started_at = time.time()
        self.last_generate_ok_at: float | None = None
        self._shutdown_deadline: float | None = None
        self.planner: RequestPlanner | None = None
        # Follower ranks of a context-parallel engine (server/parallel/context_parallel.py); None for k = 1.
        self.context_parallel = None

    @property
    def lanes(self) -> list[Lane]:
        """The pipeline lanes (one per call in flight; built by ``load``)."""
        return self._lanes

    @property
    def weight_version(self) -> Any:
        return self._weight_version

    @weight_version.setter
    def weight_version(self, value: Any) -> None:
        # The weights manager assigns this once per successful change of the weights (weights.md),
        # which makes the setter the one place that counts weight updates for /metrics.
        self._weight_version = value
        self.versions.record(value)
        self.metrics.weight_updated()
        self.invalidate_captures()
        if self.context_parallel is not None:
            self.context_parallel.weights_changed()

    def invalidate_captures(self) -> None:
        """Weights replaced or memory moved: captured CUDA graphs may point at stale memory."""
        if self.loaded is not None:
            self.loaded.speed.invalidate()
        self.compiled.weights_changed()

    # ------------------------------------------------------------------ lifecycle
    def load(self) -> None:
        if self.config.compile:
            self.compiled.open_cache(self.config, self.model_path, self.device, self.dtype)
            self.compiled.start_workers()
        if self.loaded is None:
            if not self.model_path:
                raise ServiceUnavailableError("no model path configured")
            self.loaded = load_pipeline(
                self.model_path,
                dtype=self.dtype,
                device=self.device,
                compile=self.config.compile,
                attention_backend=self.config.attention_backend,
                quantize=self.config.quantize,
                cuda_graphs=self.config.cuda_graphs,
                cuda_graph_max_buckets=self.config.cuda_graph_max_buckets,
            )
        self.adapter = adapter_for(self.loaded.pipe)
        self.adapter.setup_schedulers(self.loaded)
        n = self.config.pipeline_lanes
        self._lanes = [make_lane(i, self.loaded, self.adapter, self.device, n) for i in range(n)]
        self.planner = RequestPlanner(
            self.config,
            self.adapter,
            device=self.device,
            dtype=self.dtype,
            num_train_timesteps=lambda: self.loaded.pipe.scheduler.config.num_train_timesteps,
        )
        # With the model, before ready: a reward that cannot load fails the start (serve exits).
        self.rewards.load()
        if self.config.context_parallel > 1 and self.context_parallel is None:
            # Imported here: a k = 1 engine never loads torch.distributed or spawns anything.
            from diffusion_rollout.server.parallel.context_parallel import start_for

            self.context_parallel = start_for(self)

    def start(self) -> None:
        choice = self.config.speed_choice
        if choice is not None:
            logger.info("speed: %s", choice.describe())
        if self.adapter is None:
            self.load()
        self.worker.start()
        if self.loaded.speed.compile:
            self.compiled.warm_up(self, on_warming=lambda: setattr(self, "status", "warming"))
        elif self.config.warmup_profile is not None:
            logger.warning("warmup_profile set, but this server does not compile: no warm-up to profile")
        self.status = "ready"
        logger.info("engine ready: %s (%s) on %s, %s", self.family, self.model_path, self.device, self.dtype)
        if self.loaded.speed.compile:
            self.compiled.after_ready(self)

    def begin_shutdown(self, grace_s: float | None = None) -> float:
        """From now on new rollouts get 503; returns the monotonic deadline for in-flight work."""
        if self._shutdown_deadline is None:
            grace = self.config.shutdown_grace_s if grace_s is None else grace_s
            self._shutdown_deadline = time.monotonic() + grace
            self.status = "stopping"
            logger.info(
                "shutting down: new rollouts get 503; draining queued=%d busy=%s within %.1f s",
                self.worker.depth,
                self.worker.busy,
                grace,
            )
        return self._shutdown_deadline

    def stop(self, grace_s: float | None = None) -> None:
        """Refuse new work, drain until the shutdown deadline, fail what is left with 503."""
        deadline = self.begin_shutdown(grace_s)
        self.worker.stop(max(0.0, deadline - time.monotonic()))
        self.runner.close()
        self.rewards.close()
        if self.context_parallel is not None:
            self.context_parallel.stop()
        logger.info("engine stopped")

    @property
    def pipe(self) -> Any:
        if self.loaded is None:
            raise NotReadyError("model is still loading", state="loading")
        return self.loaded.pipe

    @property
    def family(self) -> str | None:
        return self.adapter.name if self.adapter else None

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "family": self.family,
            "pipeline_class": type(self.loaded.pipe).__name__ if self.loaded else None,
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": self.device,
            "weight_version": self.weight_version,
            "status": self.status,
        }

    def speed_info(self) -> dict[str, Any]:
        """The speed options in force and whether they are exact (``/server_info``)."""
        if self.loaded is None:
            return {}
        info = {**self.loaded.speed.report(), "feature_caches": list(SUPPORTED_CACHES.get(self.family, ()))}
        info["pipeline_lanes"] = {
            "lanes": self.config.pipeline_lanes,
            "batches_per_lane": list(self.worker.batches_per_lane),
        }
        if self.context_parallel is not None:
            info["context_parallel"] = self.context_parallel.stats()
        if isinstance(info["compile"], dict):
            self.compiled.add_to(info["compile"])
        choice = self.config.speed_choice
        info["choice"] = choice.report() if choice is not None else None
        return info

    def warmup_info(self) -> dict[str, Any] | None:
        """The compile warm-up's progress (``/health``), or None when this server does not compile."""
        return self.compiled.warmup_report()

    # ------------------------------------------------------------------ router interface (engine_api)
    def queue_stats(self) -> QueueStats:
        return QueueStats(depth=self.worker.depth, busy=self.worker.busy, paused=self.worker.paused)

    async def metrics_text(self) -> str:
        stats = self.queue_stats()
        return self.metrics.render(
            queue_depth=stats.depth,
            busy=stats.busy,
            paused=stats.paused,
            status=self.status,
            weight_version=self.weight_version,
            device_memory=self._device_memory(),
            compile_stats=self._compile_metrics(),
        )

    def _compile_metrics(self) -> dict[str, float] | None:
        return self.compiled.metrics(self.loaded.speed.compile_stats if self.loaded is not None else None)

    def _device_memory(self) -> dict[str, int] | None:
        if not self.device.startswith("cuda"):
            return None
        return {
            "allocated": torch.cuda.memory_allocated(self.device),
            "reserved": torch.cuda.memory_reserved(self.device),
        }

    async def replica_info(self) -> None:
        """A single process has no replicas (the cluster engine lists its own)."""
        return None

    def weights(self):
        """The weight-manager facade of the weight, LoRA, memory and pause routes (weights.md)."""
        # Imported here: the manager attaches itself to an engine, the engine holds no reference.
        from diffusion_rollout.server.weights import get_weight_manager

        return get_weight_manager(self)

    # ------------------------------------------------------------------ public API
    async def generate(self, params: GenerateParams, *, probe: bool = False) -> list[SampleResult]:
        """Validate, queue, wait (at most ``request_timeout_s``). Cancelling the awaiting task drops
        queued work. ``probe``: the readiness probe (``Plan.as_probe``)."""
        t0 = time.monotonic()
        outcome = "ok"
        try:
            self._check_ready()
            self.rewards.check(params.rewards)
            plan = self.plan(params)
            if probe:
                plan.as_probe()
            timeout = self.config.request_timeout_s
            if params.min_weight_version is not None:
                await self.version_gate.admit(
                    params.request_id, params.min_weight_version, params.min_weight_version_wait,
                    t0 + timeout, timeout,
                )  # fmt: skip
                self._check_ready()
            fut = self.worker.submit(plan.job(params.request_id))
            try:
                remaining = max(0.0, t0 + timeout - time.monotonic())
                results = await asyncio.wait_for(asyncio.wrap_future(fut), remaining)
            except asyncio.TimeoutError:
                dropped = fut.cancel()  # False once the batch runs: it cannot be interrupted
                self.metrics.request_cancelled("timeout")
                raise RequestTimeoutError(
                    f"request did not finish within request_timeout_s={timeout:g} s "
                    "(limit request_timeout_s); "
                    + (
                        "it was still queued and has been dropped"
                        if dropped
                        else "its batch is running and will finish, but its result is discarded"
                    )
                ) from None
            except asyncio.CancelledError:
                fut.cancel()
                raise
            # The worker is on the next batch already: scoring overlaps it (server/core/reward_runner.py).
            await self.rewards.score(results, params, self.adapter.to_uint8)
            if not params.return_output:
                for r in results:
                    r.generated_output = None
            return results
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except DiffusionRolloutError as exc:
            outcome = exc.error_type
            raise
        except Exception:
            outcome = "internal_error"
            raise
        finally:
            self.metrics.request_done(outcome, time.monotonic() - t0)

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> dict[str, Any]:
        """Drop the queued work of request ``rid`` (of every request with ``abort_all``).

        SGLang's ``/abort_request``: a trainer that over-samples cancels the tail. Queued requests
        answer ``RequestAbortedError`` (499); a request whose batch already runs finishes normally
        (a denoising loop cannot be cut short without its batch mates). Unknown ids are not an error.
        """
        if not abort_all and not rid:
            raise RequestError("send the rid of the request to abort, or abort_all=true", field="rid")

        def match(job: Job) -> bool:
            return abort_all or job.request_id == rid

        def error(job: Job) -> RequestAbortedError:
            return RequestAbortedError(f"request {job.request_id} was aborted before it started")

        dropped, running = self.worker.abort(match, error)
        dropped += self.version_gate.abort(rid, abort_all)
        for _ in range(dropped):
            self.metrics.request_cancelled("abort")
        if dropped or running:
            logger.info(
                "abort rid=%s abort_all=%s: %d queued dropped, %d running", rid, abort_all, dropped, running
            )
        return {"rid": rid, "abort_all": abort_all, "dropped": dropped, "running": running}

    async def run_exclusive(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the worker thread between batches (weight updates, memory moves)."""
        return await asyncio.wrap_future(self.submit_exclusive(fn))

    def submit_exclusive(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        """Queue ``fn`` to run on the worker thread between batches; its future."""
        return self.worker.submit(Job(payload=self._between_lanes(fn), batch_key=None))

    def _between_lanes(self, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn`` fenced off from the lanes' streams: with several lanes, the kernels they queued may
        still read the weights ``fn`` changes, and what ``fn`` queues must land before they read
        again. (One lane runs everything on one stream, which orders it already.)"""
        if len(self._lanes) < 2 or not self.device.startswith("cuda"):
            return fn

        def fenced() -> T:
            torch.cuda.synchronize(self.device)
            try:
                return fn()
            finally:
                torch.cuda.synchronize(self.device)

        return fenced

    def generate_sync(self, params: GenerateParams, timeout: float | None = None) -> list[SampleResult]:
        """Blocking variant for in-process callers (benchmarks, examples); it does not wait for a
        ``min_weight_version`` (409 when not held)."""
        self._check_ready()
        if params.min_weight_version is not None:
            self.version_gate.check(params.min_weight_version)
        plan = self.plan(params)
        return self.worker.submit(plan.job(params.request_id)).result(timeout)

    async def readiness_probe(self) -> None:
        """A one-step, latent-only generation at a small size (``/health_generate``)."""
        f = self.adapter.spatial_factor()
        side = f * max(1, -(-64 // f))
        params = GenerateParams(
            prompt="readiness probe",
            seed=0,
            height=side,
            width=side,
            num_inference_steps=1,
            rollout=False,
            return_generated_output=False,
            request_id="health_generate",
        )
        if self.adapter.is_video:
            params.num_frames = 1
        if self.adapter.image_inputs:  # image-conditioned families need their input image
            params.image_data = [probe_image_png(side)]
        await self.generate(params, probe=True)

    def _check_ready(self) -> None:
        if self.status == "loading":
            raise NotReadyError("model is still loading", state="loading")
        if self.status == "released":
            raise NotReadyError(
                "model memory is released; POST /resume_memory_occupation first", state="released"
            )
        if self.status == "stopping":
            raise NotReadyError("server is shutting down", state="stopping")
        if self.status == "warming":
            raise NotReadyError(self.compiled.describe_warming(), state="warming")
        if self.status != "ready":  # "failed" (the load raised), or any state added later
            raise ServiceUnavailableError(f"model is not ready ({self.status}); see the server log")

    # ------------------------------------------------------------------ validation
    def plan(self, p: GenerateParams) -> Plan:
        """Validate ``p`` against the model and the limits (``RequestError``) and plan its batch."""
        if self.config.pipeline_lanes > 1 and p.feature_cache is not None:
            # A cache's hooks keep per-call state on the transformer, which the lanes share.
            raise RequestError(
                f"feature_cache is not supported with pipeline_lanes={self.config.pipeline_lanes} "
                "(the lanes share the transformer its hooks would keep state on)",
                field="feature_cache",
            )
        if self.context_parallel is not None and p.feature_cache is not None:
            # A cache skips blocks on rank 0 only; the followers would run them and fall out of step.
            raise RequestError(
                "feature_cache is not supported on a context_parallel engine", field="feature_cache"
            )
        plan = self.planner.plan(p)
        if self.context_parallel is not None:  # per-family shapes the ranks must shard evenly (LTX-2)
            from diffusion_rollout.server.parallel.cp_plans import check_call

            check_call(self, plan.call)
        return plan
