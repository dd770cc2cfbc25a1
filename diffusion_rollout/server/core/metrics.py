"""Prometheus metrics of one engine, in the text exposition format (0.0.4), written by hand.

Design decisions:

- No ``prometheus_client`` dependency: the text format is a few lines per metric, and a registry per
  engine (tests start many engines in one process) is simpler than juggling the library's global one.
- The engine and the worker *record* (counters and histograms, under one lock, O(1) per event);
  ``GET /metrics`` *renders*. Values that are state rather than events (queue depth, busy, paused,
  status, ``weight_version``) are read from the engine at render time, so they can never drift.
- ``step_seconds`` is a pipeline call's wall time divided by its denoising steps (prompt encoding
  and VAE decoding amortised in): cheap, and what a trainer budgets with. ``batch_size`` counts the
  samples of one pipeline call.
- ``images_per_second`` is a gauge over a sliding window (60 s, or the uptime when shorter) for a
  human with ``curl``; a scraper should rather use ``rate(diffusion_rollout_images_total[1m])``.
- ``weight_version`` may be a string (the trainer picks it): it is exported as an info-style series
  ``diffusion_rollout_weight_version_info{weight_version="..."} 1`` and, when it is a number, also as
  the gauge ``diffusion_rollout_weight_version`` (NaN otherwise).
- On a GPU, ``cuda_memory_allocated_bytes`` and ``cuda_memory_reserved_bytes`` are read from torch's
  allocator at scrape time: a long run's memory is watched from outside the process
  (``benchmarks/soak.py``) without a request of its own.
- A compiled server adds ``compile_graphs_total``, ``compile_seconds_total``,
  ``compile_recompiles_total``, ``warmup_seconds`` and ``warmed_shapes`` (``server/speed/warmup.py``).
- Label values are bounded sets (outcome and error types, route templates, status codes), never
  request ids or prompts, so the series count stays small.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

PREFIX = "diffusion_rollout_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# A compiled server's series (server/speed/warmup.py): name, type, help, key of the engine's dict.
COMPILE_SERIES = (
    ("compile_graphs_total", "counter", "Graphs torch.compile compiled for the denoiser's blocks.", "graphs"),
    ("compile_seconds_total", "counter", "Seconds inductor spent compiling those graphs.", "seconds"),
    (
        "compile_recompiles_total",
        "counter",
        "Graphs compiled after the warm-up ended (a shape or batch it did not cover).",
        "recompiles",
    ),
    (
        "warmup_seconds",
        "gauge",
        "Seconds the compile warm-up took (so far, while it runs).",
        "warmup_seconds",
    ),
    ("warmed_shapes", "gauge", "Request shapes compiled before the server said ready.", "warmed_shapes"),
)
REQUEST_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Sequence[tuple[str, Any]]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _num(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Histogram:
    """Cumulative-bucket histogram (not thread-safe on its own: ``Metrics`` holds the lock)."""

    def __init__(self, buckets: Iterable[float]) -> None:
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * len(self.bounds)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{le="{_num(bound)}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {_num(self.sum)}")
        out.append(f"{name}_count {self.count}")
        return out


class Metrics:
    """Counters and histograms of one engine; ``render`` produces the exposition text."""

    def __init__(self, window_s: float = 60.0) -> None:
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self.window_s = window_s
        self.requests: collections.Counter[str] = collections.Counter()
        self.batch_failures: collections.Counter[str] = collections.Counter()
        self.cancelled: collections.Counter[str] = collections.Counter()
        self.http: collections.Counter[tuple[str, str, int]] = collections.Counter()
        self.batch_size = Histogram(BATCH_SIZE_BUCKETS)
        self.step_seconds = Histogram(STEP_SECONDS_BUCKETS)
        self.request_seconds = Histogram(REQUEST_SECONDS_BUCKETS)
        self.images_total = 0
        self.batches_total = 0
        self.nonfinite_total = 0
        self.weight_updates_total = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    # ------------------------------------------------------------------ recording
    def request_done(self, outcome: str, seconds: float) -> None:
        """One ``Engine.generate`` call ended: ``ok`` or the error type (``queue_full``, ...)."""
        with self._lock:
            self.requests[outcome] += 1
            self.request_seconds.observe(seconds)

    def request_cancelled(self, reason: str) -> None:
        """A request gave up before its result: ``disconnect`` or ``timeout``."""
        with self._lock:
            self.cancelled[reason] += 1

    def batch_done(self, samples: int, steps: int, seconds: float, nonfinite: int = 0) -> None:
        now = time.monotonic()
        with self._lock:
            self.batches_total += 1
            self.images_total += samples
            self.nonfinite_total += nonfinite
            self.batch_size.observe(samples)
            self.step_seconds.observe(seconds / max(1, steps))
            self._recent.append((now, samples))
            self._trim(now)

    def batch_failed(self, error_type: str) -> None:
        with self._lock:
            self.batch_failures[error_type] += 1

    def weight_updated(self) -> None:
        with self._lock:
            self.weight_updates_total += 1

    def http_response(self, method: str, route: str, status: int) -> None:
        with self._lock:
            self.http[(method, route, status)] += 1

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    def images_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            images = sum(n for _, n in self._recent)
        span = min(self.window_s, max(now - self._started, 1e-9))
        return images / span

    # ------------------------------------------------------------------ rendering
    def render(
        self,
        *,
        queue_depth: int,
        busy: bool,
        paused: bool,
        status: str,
        weight_version: Any,
        device_memory: dict[str, int] | None = None,
        compile_stats: dict[str, float] | None = None,
    ) -> str:
        """The exposition text; the arguments are the engine's state at scrape time
        (``device_memory``: ``{"allocated": bytes, "reserved": bytes}`` on a GPU, else None)."""
        ips = self.images_per_second()
        numeric_version = (
            float(weight_version)
            if isinstance(weight_version, (int, float)) and not isinstance(weight_version, bool)
            else math.nan
        )
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[Sequence, float]]) -> None:
            full = PREFIX + name
            out.append(f"# HELP {full} {help_text}")
            out.append(f"# TYPE {full} {kind}")
            out.extend(f"{full}{_labels(labels)} {_num(value)}" for labels, value in samples)

        def histogram(name: str, help_text: str, hist: Histogram) -> None:
            full = PREFIX + name
            out.append(f"# HELP {full} {help_text}")
            out.append(f"# TYPE {full} histogram")
            out.extend(hist.lines(full))

        with self._lock:
            metric("queue_depth", "gauge", "Requests waiting in the queue.", [((), queue_depth)])
            metric("busy", "gauge", "1 while the worker runs a batch or an admin job.", [((), int(busy))])
            metric("paused", "gauge", "1 while generation is paused.", [((), int(paused))])
            metric("status", "gauge", "Engine status (1 for the current one).", [((("status", status),), 1)])
            metric(
                "uptime_seconds",
                "gauge",
                "Seconds since the metrics started.",
                [((), time.monotonic() - self._started)],
            )
            metric(
                "requests_total",
                "counter",
                "Rollout requests ended, by outcome (ok or error type).",
                [((("outcome", k),), v) for k, v in sorted(self.requests.items())],
            )
            metric(
                "requests_cancelled_total",
                "counter",
                "Requests abandoned before their result, by reason (disconnect, timeout).",
                [((("reason", k),), v) for k, v in sorted(self.cancelled.items())],
            )
            metric(
                "batch_failures_total",
                "counter",
                "Pipeline batches that failed, by error type.",
                [((("type", k),), v) for k, v in sorted(self.batch_failures.items())],
            )
            metric("batches_total", "counter", "Pipeline calls that succeeded.", [((), self.batches_total)])
            metric(
                "images_total", "counter", "Outputs (images or videos) generated.", [((), self.images_total)]
            )
            metric(
                "nonfinite_outputs_total",
                "counter",
                "Outputs that held NaN or Inf.",
                [((), self.nonfinite_total)],
            )
            metric(
                "images_per_second",
                "gauge",
                f"Outputs per second over the last {self.window_s:g} s.",
                [((), ips)],
            )
            histogram("batch_size", "Samples per pipeline call.", self.batch_size)
            histogram(
                "step_seconds",
                "Pipeline call wall time divided by its denoising steps.",
                self.step_seconds,
            )
            histogram(
                "request_seconds", "Rollout request latency, queue wait included.", self.request_seconds
            )
            metric(
                "weight_updates_total",
                "counter",
                "Successful weight and LoRA changes.",
                [((), self.weight_updates_total)],
            )
            metric(
                "weight_version",
                "gauge",
                "Current weight_version when it is a number (NaN otherwise).",
                [((), numeric_version)],
            )
            metric(
                "weight_version_info",
                "gauge",
                "Current weight_version as a label.",
                [((("weight_version", weight_version),), 1)],
            )
            for kind, value in sorted((device_memory or {}).items()):
                metric(
                    f"cuda_memory_{kind}_bytes",
                    "gauge",
                    f"Bytes of GPU memory {kind} by torch's caching allocator.",
                    [((), value)],
                )
            if compile_stats is not None:
                for name, kind, help_text, key in COMPILE_SERIES:
                    if key in compile_stats:
                        metric(name, kind, help_text, [((), compile_stats[key])])
            metric(
                "http_responses_total",
                "counter",
                "HTTP responses by method, route template and status.",
                [
                    ((("method", m), ("route", r), ("code", c)), v)
                    for (m, r, c), v in sorted(self.http.items())
                ],
            )
        return "\n".join(out) + "\n"
