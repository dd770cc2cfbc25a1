"""Rewards scored on the server where the images are made (``serve --reward NAME=SPEC``).

A request names rewards in ``rewards``; each output's answer then carries ``rewards: {name:
value}``. The rewards are the recipes' own (``diffusion_rollout.rewards``), called the one way
(``rewards.score``), so the same callable on the same images gives the same values in either place.

Design decisions:

- **Off the critical path.** Each reward has a thread of its own. A batch's outputs are handed to
  it once the batch is answered by the worker, which goes on to the next pipeline call at once: the
  scoring of one batch overlaps the generation of the next. On CUDA a reward runs on a stream of its
  own, so its kernels can interleave with the denoiser's.
- **Batching across requests.** A reward's thread takes every waiting request whose images have the
  same shape, up to ``reward_batch_size`` samples, into one call, and splits the values back. Sized
  by memory: a call that runs out of GPU memory is retried in halves, and that reward's batch limit
  stays halved. (A batched model's last bits can depend on the batch it ran in: the values equal the
  trainer's call on the same batch; a request scored alone is that batch.)
- **Failures are per output and named.** A reward that raises, exceeds ``reward_timeout_s`` or
  returns a non-finite value fails that output's value: ``rewards[name]`` is ``null`` and
  ``reward_errors[name]`` says why; never a silent 0. The other rewards and the rollout are answered
  as usual. A timed-out call cannot be interrupted (it is user code); it finishes in its thread and
  its result is dropped.
- **Group-wise rewards** (``groupwise = True``) see one request's outputs (one prompt's group) at a
  time and are never merged across requests.
- **Load or never start.** Every reward is loaded with the model; one that fails to load fails the
  start (``serve`` exits naming it). Replicas on Ray each load their own, on their own GPUs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_rollout.config import ServerConfig
from diffusion_rollout.errors import RequestError, ServiceUnavailableError
from diffusion_rollout.rewards import Scores, is_groupwise, load_reward, score

logger = logging.getLogger(__name__)


@dataclass
class _Item:
    images: torch.Tensor  # uint8 [n, 3, H, W] or [n, 3, F, H, W], CPU
    prompts: list[str]
    metadata: list[dict[str, Any]]
    future: concurrent.futures.Future


class RewardLane:
    """One reward, its thread and its queue."""

    def __init__(self, name: str, spec: str, reward: Any, device: str | None, batch_size: int) -> None:
        self.name = name
        self.spec = spec
        self.reward = reward
        self.device = device
        self.batch_size = batch_size
        self.groupwise = is_groupwise(reward)
        self.calls = 0
        self.seconds = 0.0
        self.resident_bytes: int | None = None
        self._queue: deque[_Item] = deque()
        self._cv = threading.Condition()
        self._stopped = False
        cuda = device is not None and device.startswith("cuda") and torch.cuda.is_available()
        self._stream = torch.cuda.Stream(device=device) if cuda else None
        self._thread = threading.Thread(target=self._loop, name=f"reward-{name}", daemon=True)
        self._thread.start()

    def submit(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]
    ) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopped:
                raise ServiceUnavailableError("the server is shutting down: rewards are not scored")
            self._queue.append(_Item(images, prompts, metadata, fut))
            self._cv.notify()
        return fut

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            for item in self._queue:
                item.future.cancel()
            self._queue.clear()
            self._cv.notify()

    # ------------------------------------------------------------------ the reward's thread
    def _take(self) -> list[_Item] | None:
        with self._cv:
            while not self._queue and not self._stopped:
                self._cv.wait()
            if self._stopped:
                return None
            taken = []
            while self._queue:
                item = self._queue[0]
                if not item.future.set_running_or_notify_cancel():
                    self._queue.popleft()  # timed out or the client left while it waited
                    continue
                taken.append(self._queue.popleft())
                break
            if not taken or self.groupwise:
                return taken
            shape = taken[0].images.shape[1:]
            total = taken[0].images.shape[0]
            while self._queue:
                item = self._queue[0]
                n = item.images.shape[0]
                if item.images.shape[1:] != shape or total + n > self.batch_size:
                    break
                self._queue.popleft()
                if item.future.set_running_or_notify_cancel():
                    taken.append(item)
                    total += n
            return taken

    def _loop(self) -> None:
        while True:
            items = self._take()
            if items is None:
                return
            if not items:
                continue
            try:
                images = items[0].images if len(items) == 1 else torch.cat([i.images for i in items])
                prompts = [p for i in items for p in i.prompts]
                metadata = [m for i in items for m in i.metadata]
                t0 = time.perf_counter()
                scores = self._score(images, prompts, metadata)
                self.calls += 1
                self.seconds += time.perf_counter() - t0
            except BaseException as exc:  # never lose the waiting requests to a bug here
                scores = Scores.failed(sum(i.images.shape[0] for i in items), f"{type(exc).__name__}: {exc}")
            lo = 0
            for item in items:
                n = item.images.shape[0]
                part = Scores(
                    scores.values[lo : lo + n], scores.errors[lo : lo + n], scores.extras[lo : lo + n]
                )
                lo += n
                item.future.set_result(part)

    def _score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Scores:
        oom = (torch.cuda.OutOfMemoryError,)
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        try:
            with ctx:
                out = score(self.reward, images, prompts, metadata, reraise=oom)
            if self._stream is not None:
                self._stream.synchronize()
            return out
        except oom:
            n = images.shape[0]
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if n == 1 or self.groupwise:
                return Scores.failed(n, f"out of GPU memory scoring {n} sample(s)")
            self.batch_size = max(1, min(self.batch_size, n) // 2)
            logger.warning("reward %r: out of GPU memory at %d samples; its batch limit is now %d",
                           self.name, n, self.batch_size)  # fmt: skip
            h = n // 2
            first = self._score(images[:h], prompts[:h], metadata[:h])
            second = self._score(images[h:], prompts[h:], metadata[h:])
            return Scores(
                first.values + second.values, first.errors + second.errors, first.extras + second.extras
            )


class RewardRunner:
    """The configured rewards of one engine (empty when none are)."""

    def __init__(self, config: ServerConfig, device: str) -> None:
        self.config = config
        self.device = device
        self.specs = config.reward_specs()
        self.lanes: dict[str, RewardLane] = {}

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    def placement(self, index: int) -> str | None:
        """The device of the ``index``-th reward: ``reward_gpus`` in turn, else the rollout device."""
        gpus = self.config.reward_gpus
        if gpus:
            ids = [int(g) for g in gpus.split(",")]
            return f"cuda:{ids[index % len(ids)]}"
        return self.device

    def load(self) -> None:
        for index, (name, spec) in enumerate(self.specs.items()):
            if name in self.lanes:
                continue
            device = self.placement(index)
            t0 = time.perf_counter()
            before = _allocated(device)
            try:
                reward = load_reward(spec, device=device)
            except Exception as exc:
                raise ServiceUnavailableError(
                    f"reward {name!r} ({spec}) failed to load: {type(exc).__name__}: {exc}", field="reward"
                ) from exc
            self.lanes[name] = lane = RewardLane(name, spec, reward, device, self.config.reward_batch_size)
            # What the reward holds on its GPU once loaded (a judge that offloads holds ~0).
            lane.resident_bytes = None if before is None else _allocated(device) - before
            logger.info(
                "reward %r loaded from %s on %s in %.1f s", name, spec, device, time.perf_counter() - t0
            )

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.close()

    def check(self, names: tuple[str, ...]) -> None:
        """A request's reward names against the configured ones (400 naming ``rewards``)."""
        check_reward_names(names, self.names)

    def info(self) -> dict[str, Any]:
        return {
            name: {"spec": lane.spec, "device": lane.device, "batch_size": lane.batch_size,
                   "groupwise": lane.groupwise, "calls": lane.calls, "seconds": round(lane.seconds, 3),
                   "resident_bytes": lane.resident_bytes}
            for name, lane in self.lanes.items()
        }  # fmt: skip

    async def score(self, results: list, params: Any, to_uint8: Any) -> None:
        """Fill ``rewards`` (and ``reward_errors`` / ``reward_extras``) of one request's results."""
        names = tuple(params.rewards)
        if not names or not results:
            return
        self.check(names)
        rows = [r.generated_output for r in results]
        if any(r is None for r in rows):
            for r in results:
                r.rewards = dict.fromkeys(names)
                r.reward_errors = dict.fromkeys(names, "no decoded output to score")
            return
        images = torch.stack([r if r.dtype == torch.uint8 else to_uint8(r) for r in rows])
        prompts = [r.prompt for r in results]
        meta = [dict(params.reward_metadata or {}) for _ in results]
        timeout = self.config.reward_timeout_s
        futures = {n: self.lanes[n].submit(images, prompts, meta) for n in names}

        async def one(name: str, fut: concurrent.futures.Future) -> Scores:
            try:
                return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), timeout)
            except asyncio.TimeoutError:
                fut.cancel()  # dropped if it has not started; a running call finishes unheard
                return Scores.failed(len(results), f"timed out after {timeout:g} s (reward_timeout_s)")
            except asyncio.CancelledError:
                fut.cancel()
                raise

        outcomes = await asyncio.gather(*(one(n, f) for n, f in futures.items()))
        for row, r in enumerate(results):
            r.rewards = {}
            errors: dict[str, str] = {}
            extras: dict[str, Any] = {}
            for name, s in zip(names, outcomes, strict=True):
                value, error = s.values[row], s.errors[row]
                if r.nonfinite_output and error is None:
                    value, error = None, "the generated output is not finite"
                r.rewards[name] = value
                if error is not None:
                    errors[name] = error
                if s.extras[row]:
                    extras[name] = s.extras[row]
            r.reward_errors = errors or None
            r.reward_extras = extras or None


def _allocated(device: str | None) -> int | None:
    if device is None or not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    return int(torch.cuda.memory_allocated(device))


def check_reward_names(names: tuple[str, ...] | list[str], configured: list[str]) -> None:
    unknown = [n for n in names if n not in configured]
    if unknown:
        have = ", ".join(configured) if configured else "none (start the server with --reward NAME=SPEC)"
        raise RequestError(f"rewards: {unknown} not served here; this server scores: {have}", field="rewards")
