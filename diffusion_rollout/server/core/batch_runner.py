"""The worker side of the engine: a batch of planned jobs -> pipeline calls -> answers.

Design decisions:

- The engine (``server/core/engine.py``) validates, plans and queues; its worker thread hands each batch
  to :meth:`BatchRunner.run_batch` on the lane it picked. The runner encodes the prompts (through the
  engine's prompt cache), splits the batch into pipeline calls whose encodings stack, runs each
  call with the rollout scheduler attached (``rollout_context``), and hands the results to one
  results thread (``server/core/delivery.py``), which waits for the host copies and answers the requests
  while the worker already runs the next batch.
- It holds no state of its own beyond that results thread: what a call needs (weights version,
  lanes, speed options, context-parallel ranks) is read from the engine when the call starts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import logging
import time
from typing import TYPE_CHECKING

import torch

from diffusion_rollout.errors import (
    ContextParallelError,
    GenerationError,
    RequestError,
    ServiceUnavailableError,
)
from diffusion_rollout.logging_utils import request_id_var
from diffusion_rollout.protocol.row_sharing import branch_block, branch_path, shared_rows
from diffusion_rollout.scheduler_mixins import RolloutSettings, make_rollout_state, rollout_context
from diffusion_rollout.server.core.batch_split import split_batch
from diffusion_rollout.server.core.delivery import deliver
from diffusion_rollout.server.core.initial_noise import sample_noise
from diffusion_rollout.server.core.planner import Plan
from diffusion_rollout.server.core.recorder import TransformerCallRecorder
from diffusion_rollout.server.core.result_copy import HostCopier
from diffusion_rollout.server.core.shared_prefix import narrowed_prefix, prefix_steps
from diffusion_rollout.server.core.worker import Job
from diffusion_rollout.server.families import FamilyAdapter
from diffusion_rollout.server.speed.lanes import Lane, finish_before_sharing, on_lane_stream, share_tensors
from diffusion_rollout.server.speed.options import feature_cache_applied

if TYPE_CHECKING:
    from diffusion_rollout.server.core.engine import Engine

logger = logging.getLogger(__name__)


class BatchRunner:
    """Runs the engine's batches on its worker thread; answers them on a results thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # Results of a batch are finished here (host copies landed, futures set) while the worker
        # already runs the next batch (server/core/result_copy.py).
        self._results = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-results")

    def close(self) -> None:
        """Wait for the answers in hand (after the worker stopped)."""
        self._results.shutdown(wait=True)

    def after_error(self, exc: BaseException, jobs: list[Job]) -> None:
        """Worker hook after a failed batch (its frames already cleared): count it, free memory."""
        self.engine.metrics.batch_failed(getattr(exc, "error_type", "internal_error"))
        if isinstance(exc, ContextParallelError):
            # A missing rank cannot be replaced in place: later batches would fail or hang the same way.
            self.engine.status = "failed"
            logger.error("engine failed: %s", exc)
        gc.collect()
        if self.engine.device.startswith("cuda"):
            torch.cuda.empty_cache()

    def _encodings(self, plan: Plan, a: FamilyAdapter) -> dict[str, torch.Tensor]:
        p = plan.params
        if p.embeds:  # sent by the trainer (server/core/prompt_embeds.py): used as sent, never cached
            return a.embeddings(p.embeds)
        key = (p.prompt, p.negative_prompt, a.encoding_cache_key(plan.call))
        # Another lane may take the cached encodings: they must be complete before they are shared.
        shared = finish_before_sharing if len(self.engine.lanes) > 1 else (lambda v: v)
        if not plan.images:
            return self.engine.prompt_cache.get_or_compute(
                key, lambda: shared(a.encode(p.prompt, p.negative_prompt, plan.call))
            )
        if a.encoding_uses_images():
            key = (*key, plan.image_key)
        return self.engine.prompt_cache.get_or_compute(
            key, lambda: shared(a.encode_with_images(p.prompt, p.negative_prompt, plan.call, plan.images))
        )

    def run_batch(self, jobs: list[Job]) -> None:
        lane = self.engine.lanes[self.engine.worker.lane_index()]
        with on_lane_stream(lane):
            # Jobs of one batch share a batch key, but their prompt encodings can still differ in shape
            # (Qwen-Image's text has the prompt's own length, and padding would change the numbers):
            # those groups run as separate pipeline calls, in queue order.
            with torch.inference_mode():
                encodings = [self._encodings(j.payload, lane.adapter) for j in jobs]
            if len(self.engine.lanes) > 1:
                share_tensors(encodings)
            groups: dict[tuple, list[int]] = {}
            for i, (job, enc) in enumerate(zip(jobs, encodings, strict=True)):
                key = lane.adapter.encoding_group_key(enc)
                if job.payload.params.embeds:  # sent embeddings may differ in length (tokens)
                    key = (key, tuple((k, tuple(v.shape)) for k, v in enc.items()))
                groups.setdefault(key, []).append(i)
            for rows in groups.values():
                self._run_call([jobs[i] for i in rows], [encodings[i] for i in rows], lane)

    def _run_call(self, jobs: list[Job], encodings: list[dict[str, torch.Tensor]], lane: Lane) -> None:
        a = lane.adapter
        pipe = lane.pipe
        plans: list[Plan] = [j.payload for j in jobs]
        first = plans[0]
        call = first.call
        t0 = time.perf_counter()
        if self.engine.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(self.engine.device)
        version = self.engine.weight_version
        compiled = self.engine.loaded.speed.compile and not first.eager and self.engine.status == "ready"
        if compiled:
            self.engine.compiled.note_new_shape(call)

        with torch.inference_mode():
            encs = []
            for pl, enc in zip(plans, encodings, strict=True):
                encs.extend([enc] * len(pl.seeds))
            embeds = a.stack_encodings(encs)
            # From one sample's encoding: a family may stack encodings into a list (Z-Image).
            dtype = next(v for v in encs[0].values() if isinstance(v, torch.Tensor)).dtype
            generators: list[torch.Generator] = []
            step_generators: list = []
            latents = []
            for pl in plans:  # each output's x_T and noise sources: server/core/initial_noise.py
                noise = sample_noise(pl.params, pl.seeds, a, call, dtype, self.engine.device)
                latents.extend(noise.latents)
                generators.extend(noise.generators)
                step_generators.extend(noise.step_generators)
            batch = len(generators)
            kwargs = a.call_kwargs(call)
            kwargs.update(embeds)
            if first.images:  # one batch, one set of images (the batch key includes their digests)
                kwargs.update(a.image_call_kwargs(first.images))
            kwargs["latents"] = torch.cat(latents, dim=0)
            kwargs["generator"] = generators
            kwargs["output_type"] = a.pipeline_output_type(decoded=first.params.return_generated_output)
            if first.stock_sigmas is not None:
                kwargs["sigmas"] = first.stock_sigmas

            p0 = first.params
            settings = p0.settings if p0.rollout else RolloutSettings(record=False)
            need_state = p0.rollout or first.schedule is not None
            state = (
                make_rollout_state(
                    settings,
                    generators,
                    streams=a.streams,
                    sigmas=first.schedule,
                    step_generators=step_generators if any(step_generators) else None,
                )
                if need_state
                else None
            )
            recorder = TransformerCallRecorder((lambda: state.loop_index) if state else None)
            # Two experts: always watched, so every response names the expert of every step.
            watch = a.has_experts() or (
                p0.rollout
                and any(pl.params.return_denoising_env or pl.params.return_dit_trajectory for pl in plans)
            )
            if watch and state is None:
                kwargs["callback_on_step_end"] = recorder.on_step_end
            # A shared-prefix request runs alone (its batch key), so its rows are one group.
            shared = prefix_steps(settings, call.num_inference_steps) if p0.share_prefix and batch > 1 else 0
            cache = p0.feature_cache
            speed = self.engine.loaded.speed
            try:
                with (
                    a.scheduler_for(need_state),
                    a.call_context(call),
                    rollout_context(state),
                    feature_cache_applied(a.transformers(), cache, call.num_inference_steps),
                    speed.graphs_for_call(cache),
                    # Process-wide, but a compiled server runs one call at a time (no lanes).
                    torch.compiler.set_stance("force_eager")
                    if first.eager and speed.compile
                    else contextlib.nullcontext(),
                    # The recorder's hooks first: it records full batches, before the prefix narrows them.
                    recorder.attach(a.transformers()) if watch else contextlib.nullcontext(),
                    narrowed_prefix(a.transformers(), batch, shared, lambda: state.loop_index)
                    if shared
                    else shared_rows(
                        a.transformers().values(), batch, lambda: branch_block(batch, p0.branch, state.loop_index)
                    )
                    if p0.branch
                    else contextlib.nullcontext(),
                ):
                    output = pipe(**kwargs)
            except (RequestError, ContextParallelError):
                raise
            except torch.cuda.OutOfMemoryError as exc:
                torch.cuda.empty_cache()
                raise ServiceUnavailableError(f"CUDA out of memory in a batch of {batch}: {exc}") from exc
            except Exception as exc:
                raise GenerationError(f"generation failed: {type(exc).__name__}: {exc}") from exc
            images = a.output_tensor(output, decoded=first.params.return_generated_output)
        if compiled:  # served: the next start on this compile cache warms the shape (served_shapes.py)
            self.engine.compiled.note_served(call)

        elapsed = time.perf_counter() - t0
        peak = (
            torch.cuda.max_memory_allocated(self.engine.device) / 2**20
            if self.engine.device.startswith("cuda")
            else None
        )
        copier = HostCopier(self.engine.device)
        # Sharded attention (k GPUs) sums in another order than the stock pipeline on one.
        cp_exact = self.engine.context_parallel is None or self.engine.context_parallel.exact
        exact = speed.exact and cache is None and cp_exact
        results, flags = split_batch(
            a, plans, state, recorder, images, call, copier,
            version=version, elapsed=elapsed, peak=peak, exact=exact, device=self.engine.device,
            encodings=encodings,
        )  # fmt: skip
        copier.finish()
        if p0.share_prefix:
            for r in results:
                r.shared_prefix_steps, r.shared_prefix_outputs = shared, batch
        if p0.branch:  # a tree runs alone: its rows are its leaves, in order
            for row, r in enumerate(results):
                r.branch_path = branch_path(row, p0.branch)
                r.rollout_branch = [list(b) for b in p0.branch]
        args = (jobs, plans, results, flags, copier, call, version, elapsed)
        try:
            self._results.submit(self._deliver, *args)
        except RuntimeError:  # the results thread is shut down (a batch outlived stop()): finish here
            self._deliver(*args)

    def _mark_ok(self) -> None:
        self.engine.last_generate_ok_at = time.time()

    def _deliver(self, jobs, plans, results, flags, copier, call, version, elapsed) -> None:
        """On the results thread: wait for the host copies, check them, answer the requests."""
        token = request_id_var.set(",".join(j.request_id for j in jobs))  # log lines name the batch
        try:
            metrics = self.engine.metrics
            deliver(jobs, plans, results, flags, copier, call, version, elapsed, metrics, self._mark_ok)
        finally:
            request_id_var.reset(token)
