"""Speed options side by side: lean responses, CUDA graphs, FLUX overhead, and the drift table.

One command, one process, interleaved repeats (median), every server figure timed by a client in
another process from the request to the decoded response (lean references resolved):

1. ``grpo`` (SD3.5-medium 512x512, 10 steps, CFG 4.5, one request of ``group`` outputs): the
   Flow-GRPO request a replaying trainer sends (SDE, log-probs, ``dit_trajectory`` and
   ``denoising_env``) vs the stock pipeline at batch ``group`` (precomputed embeddings, images on the
   device). Variants: the plain per-output form with float32 images (what the issue measured at
   0.78x), the lean form (float32, then uint8 images), and lean + uint8 with CUDA graphs. Images/s,
   ratio, response MB.
   ``grpo_iteration``: a trainer's iteration, ``--iteration-groups`` such requests in flight at once
   (lean, uint8 images) vs the stock pipeline running the same batches back to back; images/s.
2. ``batch1`` (SD3.5-medium 512x512 10 steps, batch 1): a full SDE rollout (log-probs, trajectory,
   env, image) on the eager server and with CUDA graphs vs the stock eager pipeline; the ODE gate
   (``rollout=false`` latents vs the stock pipeline, ``torch.equal``) for both, and the on-policy ratio
   of a graphed rollout replayed by the eager transformer (must be exactly 1).
3. ``flux`` (FLUX.1-dev 1024x1024 28 steps, batch 1): the same full rollout, eager and graphed, vs
   stock, plus the graphed ODE gate.
4. ``drift``: per speed option (eager, CUDA graphs, attention backends, feature caches, regional
   compile last because it compiles the shared blocks in place): time per rollout, ``exact`` as the
   response says, max |diff| of the final latents and of the log-probs vs the eager server with the
   same seeds, the ODE gate vs eager, and max |ratio - 1| of the option's rollout replayed by the
   eager transformer. Feature caches run with ``allow_inexact``.

GPU (about 6-8 minutes on an H200; ``--budget`` skips phases that would overrun, and says so)::

    python -m benchmarks.speed_options --device cuda --out $OUT

``--phases`` picks phases (order fixed): ``grpo``, ``grpo_iteration``, ``grpo_profile`` (one iteration of
the stock pipeline and of the eager server under the CUDA profiler: GPU busy time and idle gaps),
``grpo_lanes`` (an experiment: the stock iteration's batches on two threads and CUDA streams vs back
to back, with a bit-exactness gate),
``batch1``, ``drift`` and
``grpo_compiled`` on SD3.5, ``flux`` and ``flux_compiled`` on FLUX.1-dev. ``grpo_compiled`` (also
``--grpo-compiled``) is the lean uint8 Flow-GRPO request, alone and ``--iteration-groups`` in flight,
with regional compile, vs the stock eager pipeline timed first (a few minutes, most of it compiling).
``flux_compiled`` is the batch-1 FLUX rollout compiled, vs stock eager (the issue's <= 120 ms/step).
``grpo_fast`` is the fast tier's Flow-GRPO throughput (issue #26): the lean uint8 request with
``--quantize fp8`` and regional compile, alone and ``--iteration-groups`` in flight, vs stock eager
timed first. ``--fp8`` adds the FP8 rows to the drift table (alone, then with compile; last, on a
quantized copy of the denoiser, so the stock pipeline and the eager replay stay bf16); the replay
columns are what a bf16 eager trainer recomputes: max and mean |log-prob difference| and the spread
of the first step's ratio::

    python -m benchmarks.speed_options --device cuda --phases drift,grpo_fast --fp8 --budget 560 --out $OUT

``--fp8-all`` adds a ``grpo_fast`` variant with every linear not kept by name in FP8 (no size
threshold: SD3.5's 1536x1536 attention projections too), to settle the provisional SD3 rule at the
Flow-GRPO batch. ``flux_fast`` is the same for the batch-1 FLUX.1-dev rollout (issue #26: <= 110 ms/step).
``fa4`` among ``--backends`` adds FlashAttention-4 to each: alone and compiled in the drift table,
with FP8 and compile in the drift table, ``grpo_fast`` and ``flux_fast``. SD3.5's attention processors
call SDPA themselves and refuse every backend, so FA4's drift rows come from FLUX: with ``--fp8`` the
``flux`` phase's drift takes the backends, FP8 and compile too::

    python -m benchmarks.speed_options --device cuda --phases flux,flux_fast --fp8 --backends fa4 \
        --budget 560 --out $OUT

    python -m benchmarks.speed_options --device cuda --phases drift,grpo_fast --fp8 \
        --backends _native_cudnn,fa4 --budget 560 --out $OUT

``--drift-options`` keeps only the named drift options beside eager (the reference), and then the
``flux`` phase times no batch-1 rows: a FLUX fast-tier drift run split over device calls (on an H100
the four FA4 and FP8 rows took 419 s with the GPU tests)::

    python -m benchmarks.speed_options --device cuda --phases flux --fp8 --backends fa4 --drift-options \
        "attention fa4,attention fa4 + regional compile,quantize fp8 + regional compile,quantize fp8 + attention fa4 + regional compile" \
        --budget 430 --out $OUT

``--no-flux`` drops the FLUX phases::

    python -m benchmarks.speed_options --device cuda --phases grpo_iteration,grpo_compiled,flux_compiled \
        --budget 560 --out $OUT

CPU check with the tiny models (small group, one repeat, no CUDA graphs, no compile)::

    python -m benchmarks.speed_options --tiny --out /tmp/speed
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from benchmarks.bodies import GRPO_PROMPT, SDE_ROLLOUT_ENV, request_body
from benchmarks.cli import base_parser, quiet_libraries, resolve_device
from benchmarks.model_builders import BenchModel, build
from benchmarks.ode_regression import compare, stock_reference
from benchmarks.report import document, log, print_table, write_json
from benchmarks.rollout_overhead import stock_runner
from benchmarks.timing import Deadline, median, spread, sync, timed
from diffusion_rollout.fast_tier_checks import is_fa4

THROUGHPUT_COLUMNS = [
    ("model", "model", ""),
    ("phase", "phase", ""),
    ("variant", "variant", ""),
    ("outputs", "outputs", ""),
    ("median_s", "median s", ".3f"),
    ("images_per_s", "images/s", ".2f"),
    ("ms_per_step", "ms/step", ".1f"),
    ("ratio", "vs stock", ".3f"),
    ("spread", "spread", ".3f"),
    ("response_mb", "response MB", ".1f"),
    ("server_pipeline_s", "pipeline s", ".3f"),
    ("outside_pipeline_s", "outside s", ".3f"),
    ("note", "note", ""),
]
GATE_COLUMNS = [
    ("model", "model", ""),
    ("check", "check", ""),
    ("exact", "bit-exact", ""),
    ("max_abs_diff", "max |diff|", ".3g"),
    ("note", "note", ""),
]
PROFILE_COLUMNS = [
    ("model", "model", ""),
    ("variant", "variant", ""),
    ("wall_s", "wall s", ".3f"),
    ("gpu_busy_s", "GPU busy s", ".3f"),
    ("gpu_idle_within_s", "idle between first and last kernel s", ".3f"),
    ("gaps_over_1ms", "gaps > 1 ms", ""),
    ("largest_gaps_ms_at_ms", "largest gaps (ms, at ms)", ""),
]
DRIFT_COLUMNS = [
    ("model", "model", ""),
    ("option", "option", ""),
    ("exact", "exact flag", ""),
    ("ms_per_rollout", "ms/rollout", ".1f"),
    ("ratio_vs_eager", "vs eager", ".3f"),
    ("latent_max_abs_diff", "latents max|diff|", ".3g"),
    ("log_prob_max_abs_diff", "log-prob max|diff|", ".3g"),
    ("ode_gate_exact", "ODE = eager", ""),
    ("replay_ratio_max_dev", "max|ratio-1| eager replay", ".3g"),
    ("replay_log_prob_mean_abs_diff", "mean|dlogp| eager replay", ".3g"),
    ("first_step_ratio_std", "1st-step ratio std", ".3g"),
    ("note", "note", ""),
]


def _body(model: BenchModel, **kw: Any) -> dict[str, Any]:
    return request_body(model, GRPO_PROMPT, **kw)


@contextlib.contextmanager
def _graphs(model: BenchModel, on: bool) -> Iterator[None]:
    """CUDA-graph replay on or off for the server's next calls (same process, same weights)."""
    speed = model.server().engine.loaded.speed
    saved = speed.use_graphs
    speed.use_graphs = on
    try:
        yield
    finally:
        speed.use_graphs = saved


@contextlib.contextmanager
def _equal_lane_priorities(model: BenchModel, on: bool) -> Iterator[None]:
    """The lanes server's lane 0 on a stream of the same priority as the others for the next calls
    (the experiment behind lane 0's higher priority, server/speed/lanes.py)."""
    lanes = model.lanes_server(2).engine._lanes
    saved = [lane.stream for lane in lanes]
    if on and saved[0] is not None:
        lanes[0].stream = torch.cuda.Stream(priority=0)
    try:
        yield
    finally:
        for lane, stream in zip(lanes, saved, strict=True):
            lane.stream = stream


def _has_graphs(model: BenchModel) -> bool:
    return model.server().engine.loaded.speed.graphs is not None


# The server's own pipeline seconds per timed call (the worker's clock, summed over the call's
# requests), keyed by variant: what a row's time minus this leaves is the part outside the pipeline
# (queueing, copies, serialization, transfer, the client's decode) that a request did not overlap.
_INFERENCE: dict[str, list[float]] = {}


def _time_interleaved(fns: dict[str, Any], reps: int, device: str) -> tuple[dict[str, list[float]], dict]:
    """Warm-up each, then ``reps`` interleaved rounds; fns return (seconds or None, bytes or None) or
    (seconds, bytes, server pipeline seconds)."""
    sizes: dict[str, int] = {}

    def one(name: str, timed_round: bool = True) -> float:
        sync(device)
        t0 = time.perf_counter()
        seconds, size, *inference = fns[name]()
        sync(device)
        if size is not None:
            sizes[name] = size
        if inference and timed_round:
            _INFERENCE.setdefault(name, []).append(inference[0])
        return seconds if seconds is not None else time.perf_counter() - t0

    for name in fns:
        _INFERENCE.pop(name, None)
        one(name, timed_round=False)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name in fns:
            times[name].append(one(name))
    return times, sizes


def _stock_fn(model: BenchModel, body: dict[str, Any]):
    run = stock_runner(model, body)

    def fn():
        run()
        return None, None  # timed around the call

    return fn


def _remote_fn(model: BenchModel, body: dict[str, Any], graphs: bool | None = None):
    remote = model.server().remote()

    def fn():
        with _graphs(model, graphs) if graphs is not None else contextlib.nullcontext():
            reply = remote.run([body], 1)
        return reply["times"][0], reply["bytes"][0], reply["pipeline_s"]

    return fn


def _rows(model, phase, times, sizes, outputs, steps, notes=None, nonfinite=None) -> list[dict[str, Any]]:
    """One row per variant of ``times``. ``nonfinite``: outputs the server flagged NaN/Inf per variant
    (``_time_options``); such times are of no usable rollout (FP8 on every Wan linear was once timed at
    1.42x stock that way, RESULTS.md#fast-fp8-every-linear-wan). None where nothing counted them (stock's
    pipeline runs outside the server)."""
    base = median(times["stock"])
    rows = []
    for name, ts in times.items():
        m = median(ts)
        inference = median(_INFERENCE[name]) if _INFERENCE.get(name) else None
        # With lanes the pipeline calls overlap: their seconds add up to more than the wait.
        overlapped = "_lanes_" in name
        rows.append(
            {
                "model": model.name,
                "phase": phase,
                "variant": name,
                "outputs": outputs,
                "median_s": m,
                "images_per_s": outputs / m,
                "ms_per_step": 1000 * m / steps,
                "ratio": base / m if phase.startswith("grpo") else m / base,
                "ratio_kind": "throughput vs stock (higher is faster)"
                if phase.startswith("grpo")
                else "time vs stock (lower is faster)",
                "spread": spread(ts),
                "times_s": ts,
                "response_mb": sizes[name] / 1e6 if name in sizes else None,
                "server_pipeline_s": inference,
                "outside_pipeline_s": m - inference if inference is not None and not overlapped else None,
                "note": (notes or {}).get(name, "")
                or ("pipeline s: the lanes' overlapping calls, summed" if overlapped else ""),
                "nonfinite_outputs": (nonfinite or {}).get(name),
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------
# 1. Flow-GRPO request, lean vs plain
# ---------------------------------------------------------------------------------------------
def grpo(model: BenchModel, *, group: int, reps: int) -> list[dict[str, Any]]:
    body = _body(model, num_outputs_per_prompt=group)
    full = {**body, **SDE_ROLLOUT_ENV}
    fns = {
        "stock": _stock_fn(model, body),
        "server_plain_float32": _remote_fn(model, {**full, "lean_response": False}, graphs=False),
        "server_lean_float32": _remote_fn(model, {**full, "lean_response": True}, graphs=False),
        "server_lean_uint8": _remote_fn(
            model, {**full, "lean_response": True, "output_dtype": "uint8"}, False
        ),
    }
    notes = {}
    if _has_graphs(model):
        fns["server_lean_uint8_cuda_graphs"] = _remote_fn(
            model, {**full, "lean_response": True, "output_dtype": "uint8"}, graphs=True
        )
    else:
        notes["server_lean_uint8"] = "CUDA graphs: needs CUDA (not measured)"
    times, sizes = _time_interleaved(fns, reps, model.device)
    return _rows(model, "grpo", times, sizes, group, body["num_inference_steps"], notes)


def _iteration_fns(model: BenchModel, *, group: int, groups: int):
    """(stock, served) for one Flow-GRPO iteration of ``groups`` requests of ``group`` outputs: the stock
    pipeline running the batches back to back, and ``served(graphs)``, a function sending the lean
    uint8 requests at once from the trainer process (returns seconds, bytes, server pipeline s)."""
    bodies = [_body(model, num_outputs_per_prompt=group, seed=1000 * k) for k in range(groups)]
    lean = {**SDE_ROLLOUT_ENV, "lean_response": True, "output_dtype": "uint8"}
    runs = [stock_runner(model, b) for b in bodies]

    def stock():
        for run in runs:
            run()
        return None, None

    def served(graphs: bool, lanes: int = 1, equal_priorities: bool = False, trainer: str = "default"):
        # Lanes run on a second server over the same pipeline, eager (the graphs are turned off).
        remote = (model.lanes_server(lanes) if lanes > 1 else model.server()).remote(trainer)

        def fn():
            with (
                _graphs(model, graphs),
                _equal_lane_priorities(model, equal_priorities) if lanes > 1 else contextlib.nullcontext(),
            ):
                reply = remote.run([{**b, **lean} for b in bodies], clients=groups)
            return reply["seconds"], sum(reply["bytes"]), reply["pipeline_s"]

        return fn

    return stock, served


def grpo_iteration(
    model: BenchModel,
    *,
    group: int,
    groups: int,
    reps: int,
    equal_priority: bool = True,
    whole_messages: bool = False,
    fresh_memory: bool = False,
    socket_answers: bool = False,
) -> list[dict[str, Any]]:
    """A Flow-GRPO iteration as a trainer sends it: ``groups`` requests of ``group`` outputs at once
    (``generate_many``), vs the stock pipeline running the same batches one after another.

    With several requests in flight the server overlaps one batch's host copies, serialization,
    transfer and client decode with the next batch's denoising, which one request at a time cannot.
    The ``2_lanes`` variant is the eager server with ``pipeline_lanes=2`` (two batches in flight on
    two CUDA streams, server/speed/lanes.py); ``2_lanes_equal_priority`` the same with lane 0's stream at
    the other lane's priority (what lane 0's higher priority is measured against; left out with
    ``equal_priority=False``). ``whole_messages`` adds the one-lane server sending each answer buffer
    as one body message, as before ``BuffersResponse.SEND_CHUNK`` sliced them (what slicing buys
    under uvicorn's h11). ``fresh_memory`` adds the one-lane server read by a trainer process that
    decodes as the clients did before the receive pool (``client/receive.py``): every answer read and
    decoded into fresh memory. ``socket_answers`` adds one and two lanes read by a trainer process
    that takes every answer through the socket, as before same-host answers (``client/segments.py``;
    the default trainer on this host has them written into its shared-memory files).
    """
    stock, served = _iteration_fns(model, group=group, groups=groups)
    fns = {
        "stock": stock,
        f"server_lean_uint8_{groups}_in_flight": served(False),
        f"server_lean_uint8_2_lanes_{groups}_in_flight": served(False, lanes=2),
    }
    if equal_priority:
        fns[f"server_lean_uint8_2_lanes_equal_priority_{groups}_in_flight"] = served(
            False, lanes=2, equal_priorities=True
        )
    if whole_messages:
        fns[f"server_lean_uint8_whole_messages_{groups}_in_flight"] = _whole_messages(served(False))
    for wanted, trainer in ((socket_answers, "socket"), (fresh_memory, "fresh_memory")):
        if wanted:
            fns[f"server_lean_uint8_{trainer}_{groups}_in_flight"] = served(False, trainer=trainer)
            fns[f"server_lean_uint8_2_lanes_{trainer}_{groups}_in_flight"] = served(
                False, lanes=2, trainer=trainer
            )
    if _has_graphs(model):
        fns[f"server_lean_uint8_cuda_graphs_{groups}_in_flight"] = served(True)
    times, sizes = _time_interleaved(fns, reps, model.device)
    steps = _body(model)["num_inference_steps"]
    return _rows(model, "grpo_iteration", times, sizes, group * groups, steps)


def _whole_messages(fn):
    """``fn`` with the in-process server sending every answer buffer as one body message."""
    from diffusion_rollout.entrypoints import buffers_response

    def whole():
        sliced = buffers_response.SEND_CHUNK
        buffers_response.SEND_CHUNK = 1 << 62
        try:
            return fn()
        finally:
            buffers_response.SEND_CHUNK = sliced

    return whole


def grpo_lanes(model: BenchModel, *, group: int, groups: int, reps: int, lanes: int = 2):
    """An experiment: the stock pipeline's ``groups`` batches back to back vs the same batches on
    ``lanes`` threads, each with its own CUDA stream and pipeline object (shared modules), so one
    call's kernels fill the gaps between another's. Returns (speed rows, exactness gate): every
    batch's images must be bit-identical (``torch.equal``) to the back-to-back run's."""
    import threading

    bodies = [_body(model, num_outputs_per_prompt=group, seed=1000 * k) for k in range(groups)]
    from diffusion_rollout.server.speed.lanes import guard_shared_modules, twin_of

    # The server's own lane recipe: shared modules, copied schedulers and tokenizers, locked VAE.
    guard_shared_modules(model.stock)
    pipes = [model.stock] + [twin_of(model.stock) for _ in range(lanes - 1)]
    cuda = model.device.startswith("cuda")
    streams = [torch.cuda.Stream() if cuda else None for _ in range(lanes)]
    runs = [[stock_runner(model, b, pipe=p) for b in bodies] for p in pipes]
    outputs: dict[str, list[Any]] = {}

    def back_to_back():
        outputs["seq"] = [run().images for run in runs[0]]
        return None, None

    def in_lanes():
        got: list[Any] = [None] * groups
        errors: list[BaseException] = []

        def lane(j: int) -> None:
            try:
                with torch.cuda.stream(streams[j]) if cuda else contextlib.nullcontext():
                    for i in range(j, groups, lanes):
                        got[i] = runs[j][i]().images
            except BaseException as exc:  # re-raised on the timing thread
                errors.append(exc)

        threads = [threading.Thread(target=lane, args=(j,)) for j in range(lanes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        outputs["lanes"] = got
        return None, None

    fns = {"stock": back_to_back, f"stock_{lanes}_lanes": in_lanes}
    times, sizes = _time_interleaved(fns, reps, model.device)
    sync(model.device)
    pairs = list(zip(outputs["seq"], outputs["lanes"], strict=True))
    diffs = [float((a.double() - b.double()).abs().max()) for a, b in pairs]
    gate = {
        "model": model.name,
        "check": f"stock in {lanes} lanes vs back to back ({groups} batches of {group}, images)",
        "exact": all(torch.equal(a, b) for a, b in pairs),
        "max_abs_diff": max(diffs),
        "note": "",
    }
    steps = _body(model)["num_inference_steps"]
    return _rows(model, "grpo_lanes", times, sizes, group * groups, steps), gate


def lanes_gates(model: BenchModel, *, groups: int, n: int = 2) -> list[dict[str, Any]]:
    """The two-lane server's exactness: ``groups`` requests sent at once (so both lanes run), each
    ``rollout=false`` result vs the stock eager pipeline (ODE gate), and an SDE rollout's log-probs
    replayed by the eager transformer in process (the on-policy ratio must be exactly 1)."""
    import threading

    srv = model.lanes_server(2)
    bodies = [_body(model, num_outputs_per_prompt=n, seed=7 + 100 * k) for k in range(groups)]
    sde = [{**b, **SDE_ROLLOUT_ENV, "lean_response": True} for b in bodies]
    ode = [{**b, "rollout": False, "return_generated_output": False} for b in bodies]
    got: dict[tuple[str, int], Any] = {}

    def send(kind: str, i: int, req: dict[str, Any]) -> None:
        client = srv.new_client()
        try:
            got[kind, i] = srv.generate(req, client=client)[0]
        finally:
            client.close()

    threads = [
        threading.Thread(target=send, args=(kind, i, req))
        for kind, reqs in (("ode", ode), ("sde", sde))
        for i, req in enumerate(reqs)
    ]
    before = list(srv.engine.worker.batches_per_lane)
    with _graphs(model, False):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    ran = [a - b for a, b in zip(srv.engine.worker.batches_per_lane, before, strict=True)]
    if len(got) != len(threads):
        raise RuntimeError(f"lanes gate: {len(threads) - len(got)} request(s) failed")
    rows = [compare(torch.stack([r["generated_output"] for r in got["ode", i]]),
                    stock_reference(model, model.stock, bodies[i], "latent")) for i in range(groups)]  # fmt: skip
    replay = [eager_replay(model, got["sde", i], sde[i]) for i in range(groups)]
    note = f"batches per lane {ran}"
    return [
        {
            "model": model.name,
            "check": f"ODE gate pipeline_lanes=2 vs stock eager ({groups} requests at once)",
            "exact": all(r["exact"] for r in rows),
            "max_abs_diff": max(r["max_abs_diff"] for r in rows),
            "note": note,
        },
        {
            "model": model.name,
            "check": "pipeline_lanes=2 rollout replayed by the eager transformer: ratio exactly 1",
            "exact": all(r["replay_ratio_max_dev"] == 0.0 for r in replay),
            "max_abs_diff": max(r["replay_log_prob_max_abs_diff"] for r in replay),
            "note": note,
        },
    ]


def _gpu_gaps(fn, device: str) -> dict[str, Any]:
    """Run ``fn`` once under the CUDA profiler: wall seconds, seconds the GPU ran anything (the union
    of every kernel and copy interval, all streams), and the largest idle gaps with their offsets."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    # On the CPU (the --tiny check of this code) the operators' intervals stand in for kernels.
    cuda = device.startswith("cuda")
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t0
    events = [e for e in prof.events() if e.device_type == kind]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    by_name: dict[str, float] = {}
    for e in events:
        by_name[e.name] = by_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / 1e6
    busy, gaps, cur = 0.0, [], None
    for start, end in spans:
        if cur is None:
            cur = [start, end]
            origin = start
        elif start > cur[1]:
            busy += cur[1] - cur[0]
            gaps.append((start - cur[1], cur[1] - origin))
            cur = [start, end]
        else:
            cur[1] = max(cur[1], end)
    if cur is not None:
        busy += cur[1] - cur[0]
    gaps.sort(reverse=True)
    # The profiler's clock starts with the profile (just before t0): what the GPU did not cover at
    # the start (host work before the first kernel) and at the end (the last answer's copies,
    # transfer and decode, which nothing later can hide).
    lead = spans[0][0] / 1e6 if spans else None
    tail = wall - max(end for _, end in spans) / 1e6 if spans else None
    return {
        "wall_s": wall,
        "before_first_kernel_s": lead,
        "after_last_kernel_s": tail,
        "seconds_by_kernel": by_name,
        "gpu_busy_s": busy / 1e6,
        "gpu_idle_within_s": sum(g for g, _ in gaps) / 1e6,
        "gaps_over_1ms": sum(1 for g, _ in gaps if g > 1000),
        "largest_gaps_ms_at_ms": [(round(g / 1e3, 2), round(at / 1e3, 1)) for g, at in gaps[:12]],
        "kernels_and_copies": len(spans),
    }


def grpo_profile(model: BenchModel, *, group: int, groups: int) -> list[dict[str, Any]]:
    """One Flow-GRPO iteration (as ``grpo_iteration``, eager) of the stock pipeline and of the server,
    each under the CUDA profiler: where the server's GPU sits idle that the stock pipeline's does not."""
    stock, served = _iteration_fns(model, group=group, groups=groups)
    rows = []
    for name, fn in (("stock", stock), (f"server_lean_uint8_{groups}_in_flight", served(False))):
        fn()  # warm-up
        rows.append(
            {"model": model.name, "phase": "grpo_profile", "variant": name, **_gpu_gaps(fn, model.device)}
        )
    # Where the server's GPU does other work than the stock pipeline's: the kernels whose summed
    # time differs most (server minus stock, seconds), in the server's row.
    base, mine = (r.pop("seconds_by_kernel") for r in rows)
    diff = {k: mine.get(k, 0.0) - base.get(k, 0.0) for k in set(base) | set(mine)}
    top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:15]
    rows[1]["kernel_s_vs_stock"] = [(name[:120], round(d, 4)) for name, d in top]
    return rows


# ---------------------------------------------------------------------------------------------
# 2/3. Batch-1 full rollout, eager and graphed, ODE gate, replay ratio
# ---------------------------------------------------------------------------------------------
def _decode_outputs(results: list[dict[str, Any]], body: dict[str, Any]):
    from diffusion_rollout.client.results import ReplaySettings, RolloutOutput
    from diffusion_rollout.protocol import lean

    settings = ReplaySettings.from_request(body)
    return [RolloutOutput.from_dict(d, settings) for d in lean.from_lean(results)]


def eager_replay(model: BenchModel, results: list[dict[str, Any]], body: dict[str, Any]) -> dict[str, float]:
    """Replay a server rollout with the eager bf16 transformer (in process, not graphed, not
    quantized: what a trainer recomputes): the ratio's and the log-probs' largest and mean deviation,
    and the spread of the first step's ratio."""
    from diffusion_rollout.client import ReplayBatch, replay_steps

    outs = _decode_outputs(results, body)
    batch = ReplayBatch(outs, device=model.device)
    dev = 0.0
    lp = 0.0
    diffs: list[torch.Tensor] = []
    first_ratios: torch.Tensor | None = None
    modules = {"transformer": model.pipe.transformer}
    if getattr(model.pipe, "transformer_2", None) is not None:
        modules["transformer_2"] = model.pipe.transformer_2
    with torch.inference_mode():
        for s in replay_steps(modules if len(modules) > 1 else modules["transformer"], batch):
            dev = max(dev, float((s.ratio.double() - 1).abs().max()))
            diff = (s.log_prob.double() - s.old_log_prob.to(s.log_prob.device).double()).abs()
            lp = max(lp, float(diff.max()))
            diffs.append(diff.flatten().cpu())
            if first_ratios is None:
                first_ratios = s.ratio.double().flatten().cpu()
    out = {"replay_ratio_max_dev": dev, "replay_log_prob_max_abs_diff": lp}
    if diffs:
        out["replay_log_prob_mean_abs_diff"] = float(torch.cat(diffs).mean())
    if first_ratios is not None and first_ratios.numel() > 1:
        out["first_step_ratio_std"] = float(first_ratios.std())
    return out


def _ode_gate(model: BenchModel, label: str, graphs: bool | None, n: int) -> dict[str, Any]:
    body = _body(model, num_outputs_per_prompt=n, seed=7)
    ref = stock_reference(model, model.stock, body, "latent")
    req = {**body, "rollout": False, "return_generated_output": False}
    rows = []
    with _graphs(model, graphs) if graphs is not None else contextlib.nullcontext():
        for _ in range(2):  # with graphs: capture, then replay
            results, _ = model.server().generate(req)
            rows.append(compare(torch.stack([r["generated_output"] for r in results]), ref))
    return {
        "model": model.name,
        "check": f"ODE gate {label} vs stock eager (2 calls)",
        "exact": all(r["exact"] for r in rows),
        "max_abs_diff": max(r["max_abs_diff"] for r in rows),
        "note": "",
    }


def batch1(
    model: BenchModel, *, reps: int, phase: str, n_gate: int = 2
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    body = _body(model, num_outputs_per_prompt=1)
    full = {**body, **SDE_ROLLOUT_ENV, "lean_response": True}
    # uint8 images: what a lean trainer asks for (its reward model reads 8-bit pixels); the float32
    # image alone is 12.6 MB of a FLUX 1024x1024 response.
    uint8 = {**full, "output_dtype": "uint8"}
    fns = {
        "stock": _stock_fn(model, body),
        "server_eager": _remote_fn(model, full, graphs=False),
        "server_eager_uint8": _remote_fn(model, uint8, graphs=False),
    }
    notes = {}
    if _has_graphs(model):
        fns["server_cuda_graphs"] = _remote_fn(model, full, graphs=True)
        fns["server_cuda_graphs_uint8"] = _remote_fn(model, uint8, graphs=True)
    else:
        notes["server_eager"] = "CUDA graphs: needs CUDA (not measured)"
    times, sizes = _time_interleaved(fns, reps, model.device)
    rows = _rows(model, phase, times, sizes, 1, body["num_inference_steps"], notes)
    gates = [_ode_gate(model, "eager", False, n_gate)]
    if _has_graphs(model):
        gates.append(_ode_gate(model, "cuda_graphs", True, n_gate))
        rb = _body(model, num_outputs_per_prompt=n_gate, seed=3, **SDE_ROLLOUT_ENV, lean_response=True)
        with _graphs(model, True):
            results, _ = model.server().generate(rb)
        r = eager_replay(model, results, rb)
        gates.append(
            {
                "model": model.name,
                "check": "replay ratio: cuda_graphs rollout replayed by the eager transformer",
                "exact": r["replay_ratio_max_dev"] == 0.0 and r["replay_log_prob_max_abs_diff"] == 0.0,
                "max_abs_diff": r["replay_log_prob_max_abs_diff"],
                "note": f"max |ratio - 1| = {r['replay_ratio_max_dev']:.3g}",
            }
        )
    return rows, gates


# ---------------------------------------------------------------------------------------------
# 4. Drift per speed option
# ---------------------------------------------------------------------------------------------
FP8_ALL_OPTION = "quantize fp8 every linear + regional compile"


def _option_contexts(
    model: BenchModel, backends, caches, with_compile: bool, fp8: bool = False, fp8_all: bool = False
):
    """(name, context manager factory, extra body fields) per option; compile is last. ``fp8_all``
    adds FP8 on every linear not kept by name (``fast_tier.EVERY_LINEAR``), compiled."""

    backend = functools.partial(_attention_backend, model)

    # Every option but "cuda_graphs" runs with graphs off: a graph captured earlier would replay the
    # kernels of its capture, not the option under test.
    options = [("eager", contextlib.nullcontext, {})]
    if _has_graphs(model):
        options.append(("cuda_graphs", contextlib.nullcontext, {}))
    for b in backends:
        options.append((f"attention {b}", lambda b=b: backend(b), {}))
    for c in caches:
        options.append(
            (
                f"feature_cache {c['kind']}",
                contextlib.nullcontext,
                {"feature_cache": c, "allow_inexact": True},
            )
        )
    # Lanes run on their own server over the same pipeline (``drift`` picks it by this name).
    options.append((LANES_OPTION, contextlib.nullcontext, {}))
    if with_compile:
        options.append(("regional compile", lambda: _compiled(model), {}))
    fa4 = any(is_fa4(b) for b in backends)
    if fa4 and with_compile:
        options.append(("attention fa4 + regional compile", lambda: _fa4_compiled(model), {}))
    if fp8:
        options.append(("quantize fp8", lambda: _fp8(model), {}))
        if with_compile:
            options.append(("quantize fp8 + regional compile", lambda: _fp8_compiled(model), {}))
        if fa4 and with_compile:
            options.append(
                (
                    "quantize fp8 + attention fa4 + regional compile",
                    lambda: _fp8_compiled(model, fa4=True),
                    {},
                )
            )
        if fp8_all and with_compile:
            options.append((FP8_ALL_OPTION, lambda: _fp8_compiled(model, every_linear=True), {}))
    return options


LANES_OPTION = "pipeline_lanes 2"


def drift(
    model: BenchModel,
    *,
    reps: int,
    backends,
    caches,
    with_compile: bool,
    deadline: Deadline,
    n: int = 2,
    fp8: bool = False,
    only: Sequence[str] | None = None,
    fp8_all: bool = False,
) -> list[dict[str, Any]]:
    """The drift table: each option's rollout against the eager server's (always first, the
    reference). ``only``: just these options (by name) beside eager, to split a long run over calls.
    ``fp8_all`` (with ``fp8``): also every linear not kept by name in FP8, compiled."""
    srv = model.server()
    body = _body(model, num_outputs_per_prompt=n, seed=5, **SDE_ROLLOUT_ENV, lean_response=True)
    body["return_generated_output"] = False
    ode = {
        **_body(model, num_outputs_per_prompt=n, seed=7),
        "rollout": False,
        "return_generated_output": False,
    }
    rows: list[dict[str, Any]] = []
    ref = ref_ode = None
    eager_ms = None
    options = _option_contexts(model, backends, caches, with_compile, fp8, fp8_all=fp8_all)
    if only is not None:
        unknown = sorted(set(only) - {name for name, _, _ in options})
        if unknown:
            raise ValueError(f"--drift-options: {unknown} not among {[name for name, _, _ in options]}")
        options = [o for o in options if o[0] == "eager" or o[0] in only]
    for name, ctx, extra in options:
        estimate = 120.0 if "compile" in name else 15.0
        if not deadline.allows(estimate):
            rows.append({"model": model.name, "option": name, "note": "skipped: time budget"})
            continue
        req = {**body, **extra}
        server = model.lanes_server(2) if name == LANES_OPTION else srv
        try:
            with _graphs(model, name == "cuda_graphs"), ctx():
                server.generate(req)  # warm-up (graph capture, compilation, kernel selection)
                times = []
                for _ in range(reps):
                    (results, _), seconds = timed(functools.partial(server.generate, req), model.device)
                    times.append(seconds)
                ode_out, _ = server.generate(
                    {**ode, **{k: v for k, v in extra.items() if k == "feature_cache"}}
                )
            replay = eager_replay(model, results, req)
        except Exception as exc:  # an option this build lacks (e.g. flash-attn not installed)
            rows.append(
                {"model": model.name, "option": name, "note": f"{type(exc).__name__}: {str(exc)[:100]}"}
            )
            continue
        final = torch.stack([r["dit_trajectory"]["latents"][-1] for r in results]).float()
        lps = torch.stack([r["rollout_log_probs"] for r in results]).double()
        ode_lat = torch.stack([r["generated_output"] for r in ode_out])
        if ref is None:
            ref, ref_ode, eager_ms = (final, lps), ode_lat, 1000 * median(times)
        ms = 1000 * median(times)
        rows.append(
            {
                "model": model.name,
                "option": name,
                "exact": all(r.get("exact") for r in results),
                "ms_per_rollout": ms,
                "ratio_vs_eager": ms / eager_ms,
                "spread": spread(times),
                "latent_max_abs_diff": float((final - ref[0]).abs().max()),
                "log_prob_max_abs_diff": float((lps - ref[1]).abs().max()),
                "ode_gate_exact": compare(ode_lat, ref_ode)["exact"],
                **replay,
                # One request at a time: lanes add speed only with several in flight (grpo_iteration).
                "note": "one request at a time" if name == LANES_OPTION else "",
            }
        )
    return rows


@contextlib.contextmanager
def _attention_backend(model: BenchModel, name: str) -> Iterator[None]:
    """diffusers' attention backend ``name`` for the server's next calls, then the default again."""
    from diffusion_rollout.server.core.loader import apply_speed_options

    speed = model.server().engine.loaded.speed
    apply_speed_options(model.pipe, attention_backend=name)
    speed.attention_backend = name  # so the response's exact flag tells the truth
    try:
        yield
    finally:
        apply_speed_options(model.pipe, attention_backend="native")
        speed.attention_backend = None


@contextlib.contextmanager
def _compiled(model: BenchModel) -> Iterator[None]:
    """Regional compile of the denoiser's repeated blocks for the server's next calls, then eager again
    (the compiled call is dropped, so whatever runs after, replays included, is the eager kernels)."""
    from diffusion_rollout.server.core.loader import apply_speed_options, repeated_blocks

    speed = model.server().engine.loaded.speed
    apply_speed_options(model.pipe, compile=True)
    speed.compile = True  # so the response's exact flag tells the truth
    try:
        yield
    finally:
        for m in (model.pipe.transformer, getattr(model.pipe, "transformer_2", None)):
            for block in repeated_blocks(m) if m is not None else ():
                block._compiled_call_impl = None
        speed.compile = False


def _require_fp8(model: BenchModel) -> None:
    """RuntimeError naming why ``--quantize fp8`` cannot run here (before any stock timing)."""
    from diffusion_rollout.fast_tier_checks import unsupported_reason

    reason = unsupported_reason(quantize="fp8", attention_backend=None, device=model.device)
    if reason:
        raise RuntimeError(reason)


@contextlib.contextmanager
def _fp8(model: BenchModel, every_linear: bool = False) -> Iterator[None]:
    """The server's ``--quantize fp8`` (``fast_tier.quantize_fp8``) on a copy of the denoiser swapped
    into the served pipeline for the server's next calls; the original bf16 module is put back after.
    The stock pipeline keeps the original throughout (it was timed, and replays run, on bf16)."""
    import copy
    import gc

    from diffusion_rollout.server.speed.fast_tier import EVERY_LINEAR, quantize_fp8

    _require_fp8(model)
    speed = model.server().engine.loaded.speed
    original = model.pipe.transformer
    quantized = copy.deepcopy(original)
    # With CUDA graphs on, the server's graph runner shadows the original's ``forward`` with a closure
    # over the original module; deepcopy keeps that closure, and the copy would run the original's
    # bf16 weights (seen on an H100: "quantize fp8" rows bit-identical to eager).
    quantized.__dict__.pop("forward", None)
    quantize_fp8(quantized, rule=EVERY_LINEAR if every_linear else None)
    model.pipe.transformer = quantized
    speed.quantize = "fp8"  # so the response's exact flag tells the truth
    try:
        yield
    finally:
        model.pipe.transformer = original
        speed.quantize = None
        del quantized
        gc.collect()
        if model.device.startswith("cuda"):
            torch.cuda.empty_cache()


@contextlib.contextmanager
def _fp8_compiled(model: BenchModel, fa4: bool = False, every_linear: bool = False) -> Iterator[None]:
    """FP8 (``every_linear``: without the family's size threshold), then (``fa4``) FlashAttention-4,
    then regional compile of the quantized copy: the loader's order (the attention backend is read
    inside the compiled code)."""
    attention = _attention_backend(model, "fa4") if fa4 else contextlib.nullcontext()
    with _fp8(model, every_linear), attention, _compiled(model):
        yield


@contextlib.contextmanager
def _fa4_compiled(model: BenchModel) -> Iterator[None]:
    """FlashAttention-4, then regional compile (the loader's order)."""
    with _attention_backend(model, "fa4"), _compiled(model):
        yield


def _time_options(model: BenchModel, options, fns_for, reps: int, phase: str):
    """Time ``fns_for(tag)`` ({name: fn}, interleaved) under each of ``options`` ({tag: context
    manager factory}) in turn, CUDA graphs off. An option this build lacks (FA4 missing, a refusal)
    is skipped; one whose outputs the server flagged non-finite is timed, named among the failures
    and named among the failures: (times, sizes, one line per failure, {variant: outputs flagged})."""
    times: dict[str, Any] = {}
    sizes: dict[str, Any] = {}
    failures: list[str] = []
    nonfinite: dict[str, int] = {}
    metrics = model.server().engine.metrics
    for tag, option in options.items():
        before = metrics.nonfinite_total
        try:
            with option(), _graphs(model, False):
                t, sz = _time_interleaved(fns_for(tag), reps, model.device)
        except Exception as exc:
            failures.append(f"{tag} failed: {type(exc).__name__}: {str(exc)[:200]}")
            log(f"{phase}: {failures[-1]}")
            continue
        flagged = metrics.nonfinite_total - before
        nonfinite.update(dict.fromkeys(t, flagged))
        if flagged:
            failures.append(
                f"{tag}: {flagged} outputs non-finite (NaN/Inf), its times are of no usable rollout"
            )
            log(f"{phase}: {failures[-1]}")
        times.update(t)
        sizes.update(sz)
    return times, sizes, failures, nonfinite


def _grpo_against_stock(
    model: BenchModel, options, *, phase: str, note: str, group: int, groups: int, reps: int
) -> list[dict[str, Any]]:
    """The lean uint8 Flow-GRPO request under each of ``options`` ({tag: context manager factory}, in
    turn), one request and ``groups`` in flight, vs the stock eager pipeline timed first (before any
    option applies)."""
    body = _body(model, num_outputs_per_prompt=group)
    full = {**body, **SDE_ROLLOUT_ENV, "lean_response": True, "output_dtype": "uint8"}
    stock_iteration, served = _iteration_fns(model, group=group, groups=groups)
    times, _ = _time_interleaved({"stock": _stock_fn(model, body)}, reps, model.device)
    it_times, _ = _time_interleaved({"stock": stock_iteration}, reps, model.device)
    served_times, sizes, failures, nonfinite = _time_options(
        model, options, lambda tag: {
            f"server_lean_uint8_{tag}": _remote_fn(model, full),
            f"server_lean_uint8_{tag}_{groups}_in_flight": served(False),
        }, reps, phase,
    )  # fmt: skip
    for name, ts in served_times.items():
        (it_times if name.endswith("_in_flight") else times)[name] = ts
    note = "; ".join([note, *failures])
    steps = body["num_inference_steps"]
    return [
        *_rows(model, phase, times, sizes, group, steps, {"stock": note}, nonfinite),
        *_rows(model, f"grpo_iteration_{phase.removeprefix('grpo_')}", it_times, sizes, group * groups, steps,
               {"stock": note}, nonfinite),
    ]  # fmt: skip


def grpo_compiled(model: BenchModel, *, group: int, groups: int, reps: int) -> list[dict[str, Any]]:
    """The lean uint8 Flow-GRPO request with the blocks compiled, one request and ``groups`` in flight,
    vs the eager stock pipeline (timed first, before anything is compiled)."""
    return _grpo_against_stock(
        model, {"compiled": lambda: _compiled(model)}, phase="grpo_compiled",
        note="stock eager timed before compiling, in the same process", group=group, groups=groups, reps=reps,
    )  # fmt: skip


def grpo_fast(
    model: BenchModel,
    *,
    group: int,
    groups: int,
    reps: int,
    fa4: bool = False,
    fp8_all: bool = False,
    family_rule: bool = True,
) -> list[dict[str, Any]]:
    """The fast tier's Flow-GRPO throughput (issue #26: at least 2x stock eager): the lean uint8
    request with ``--quantize fp8`` and regional compile (``fa4``: then also with FlashAttention-4),
    one request and ``groups`` in flight, vs the stock eager pipeline timed first in the same process.
    ``family_rule=False`` leaves out the family rule's variant (with ``fp8_all``: one compile, which
    fits one device call; stock, the family rule and every linear together did not on an H200)."""
    _require_fp8(model)
    options = {"fp8_compiled": lambda: _fp8_compiled(model)} if family_rule else {}
    if fa4:
        options["fp8_fa4_compiled"] = lambda: _fp8_compiled(model, fa4=True)
    if fp8_all:
        options["fp8_all_compiled"] = lambda: _fp8_compiled(model, every_linear=True)
    return _grpo_against_stock(
        model, options, phase="grpo_fast",
        note="stock eager timed first, in the same process", group=group, groups=groups, reps=reps,
    )  # fmt: skip


def flux_compiled(model: BenchModel, *, reps: int, cudnn_attention: bool = True) -> list[dict[str, Any]]:
    """FLUX.1-dev batch-1 full rollout (log-probs, trajectory, env, image) with the blocks compiled,
    vs the stock eager pipeline timed first; ms/step is what the issue bounds (<= 120)."""
    body = _body(model, num_outputs_per_prompt=1)
    full = {**body, **SDE_ROLLOUT_ENV, "lean_response": True}
    times, _ = _time_interleaved({"stock": _stock_fn(model, body)}, reps, model.device)
    with _compiled(model), _graphs(model, False):
        t2, sizes = _time_interleaved({"server_compiled": _remote_fn(model, full)}, reps, model.device)
    times.update(t2)
    note = {"stock": "stock eager timed before compiling, in the same process"}
    # Attention is about a fifth of a FLUX 1024x1024 step's FLOPs; cuDNN's fused attention is the
    # fastest kernel PyTorch has on Hopper. Compiled again (the backend is part of the traced code).
    if cudnn_attention and model.device.startswith("cuda"):
        try:
            with _attention_backend(model, "_native_cudnn"), _compiled(model), _graphs(model, False):
                t3, s3 = _time_interleaved(
                    {"server_compiled_cudnn_attention": _remote_fn(model, full)}, reps, model.device
                )
            times.update(t3)
            sizes.update(s3)
        except Exception as exc:  # a build without cuDNN attention: say so, keep the other rows
            note["server_compiled"] = (
                f"cuDNN attention variant failed: {type(exc).__name__}: {str(exc)[:120]}"
            )
    return _rows(model, "flux_compiled", times, sizes, 1, body["num_inference_steps"], note)


def flux_fast(
    model: BenchModel, *, reps: int, fa4: bool = False, fp8_all: bool = False
) -> list[dict[str, Any]]:
    """FLUX.1-dev batch-1 full rollout (log-probs, trajectory, env, image) with the fast tier
    (``--quantize fp8`` and regional compile; ``fa4``: then also FlashAttention-4), vs the stock eager
    pipeline timed first; issue #26 bounds ms/step at 110. ``fp8_all``: also every linear not kept by
    name in FP8 (``fast_tier.EVERY_LINEAR``)."""
    _require_fp8(model)
    body = _body(model, num_outputs_per_prompt=1)
    full = {**body, **SDE_ROLLOUT_ENV, "lean_response": True}
    times, _ = _time_interleaved({"stock": _stock_fn(model, body)}, reps, model.device)
    variants = {"server_fp8_compiled": lambda: _fp8_compiled(model)}
    if fa4:
        variants["server_fp8_fa4_compiled"] = lambda: _fp8_compiled(model, fa4=True)
    if fp8_all:
        variants["server_fp8_all_compiled"] = lambda: _fp8_compiled(model, every_linear=True)
    served, sizes, failures, nonfinite = _time_options(
        model, variants, lambda name: {name: _remote_fn(model, full)}, reps, "flux_fast"
    )
    times.update(served)
    note = {"stock": "; ".join(["stock eager timed first, in the same process", *failures])}
    return _rows(model, "flux_fast", times, sizes, 1, body["num_inference_steps"], note, nonfinite)


# ---------------------------------------------------------------------------------------------
SD_PHASES = {
    "grpo", "grpo_iteration", "grpo_profile", "grpo_lanes", "batch1", "drift", "grpo_compiled", "grpo_fast",
}  # fmt: skip
FLUX_PHASES = {"flux", "flux_compiled", "flux_fast"}
DEFAULT_PHASES = ("grpo", "grpo_iteration", "batch1", "drift", "flux")


def run(args) -> dict[str, Any]:
    device = resolve_device(args.device)
    tiny = args.tiny
    sd_name, flux_name = ("tiny-sd3", "tiny-flux") if tiny else ("sd3.5-medium", "flux.1-dev")
    graphs = device.startswith("cuda")
    server_cfg = {"cuda_graphs": graphs, "max_batch_size": max(16, args.group)}
    deadline = Deadline(args.budget)
    backends = [b for b in args.backends.split(",") if b]
    with_fa4 = any(is_fa4(b) for b in backends)
    speed_rows: list[dict[str, Any]] = []
    gate_rows: list[dict[str, Any]] = []
    drift_rows: list[dict[str, Any]] = []
    profile_rows: list[dict[str, Any]] = []
    notes: list[str] = []
    with_compile = args.compile if args.compile is not None else not tiny
    phases = set(args.phases)

    def phase(name: str, estimate: float) -> bool:
        save()
        if deadline.allows(estimate):
            log(f"speed_options: {name} ({deadline.elapsed():.0f} s elapsed)")
            return True
        notes.append(f"{name}: skipped, time budget ({deadline.left():.0f} s left, needs ~{estimate:.0f} s)")
        log(notes[-1])
        return False

    def save(final: bool = False) -> dict[str, Any]:
        # Written after every phase too, so a run cut short by the device's time limit keeps its figures.
        tables = []
        if final:
            tables = [
                print_table(
                    "Speed: Flow-GRPO request, batch-1 rollouts, FLUX", speed_rows, THROUGHPUT_COLUMNS
                ),
                print_table("Exactness gates (torch.equal)", gate_rows, GATE_COLUMNS),
                print_table(
                    "Drift per speed option (vs the eager server, same seeds)", drift_rows, DRIFT_COLUMNS
                ),
                print_table(
                    "GPU idle under the CUDA profiler (one iteration)", profile_rows, PROFILE_COLUMNS
                ),
            ]
        ok = all(g["exact"] for g in gate_rows) and all(
            r.get("ode_gate_exact") and r.get("replay_ratio_max_dev") == 0.0
            for r in drift_rows
            if r.get("exact") is True
        )
        doc = document(
            "speed_options",
            device,
            {
                "models": [
                    sd_name if phases & SD_PHASES else None,
                    flux_name if phases & FLUX_PHASES else None,
                ],
                "phases": sorted(phases),
                "group": args.group,
                "reps": args.reps,
                "reps_batch1": args.reps_b1,
                "backends": backends,
                "compile": with_compile,
                "budget_s": args.budget,
                "rollout": SDE_ROLLOUT_ENV,
                "prompt": GRPO_PROMPT,
                "elapsed_s": deadline.elapsed(),
            },
            [*speed_rows, *gate_rows, *drift_rows, *profile_rows],
            ok=ok,
            notes=notes,
        )
        doc["complete"] = final
        doc["speed"], doc["gates"], doc["drift"] = speed_rows, gate_rows, drift_rows
        doc["gpu_profile"] = profile_rows
        doc["table"] = "\n\n".join(tables)
        write_json(args.out, "speed_options", doc)
        return doc

    def sd_phases() -> None:
        if "grpo" in phases and phase("grpo", 60):
            speed_rows.extend(grpo(model, group=args.group, reps=args.reps))
        if "grpo_iteration" in phases and phase("grpo_iteration", 60):
            speed_rows.extend(
                grpo_iteration(model, group=args.group, groups=args.iteration_groups, reps=args.reps)
            )
            gate_rows.extend(lanes_gates(model, groups=args.iteration_groups))
        if "grpo_profile" in phases and phase("grpo_profile", 60):
            profile_rows.extend(grpo_profile(model, group=args.group, groups=args.iteration_groups))
        if "grpo_lanes" in phases and phase("grpo_lanes", 60):
            rows, gate = grpo_lanes(model, group=args.group, groups=args.iteration_groups, reps=args.reps)
            speed_rows.extend(rows)
            gate_rows.append(gate)
        if "batch1" in phases and phase("batch1", 30):
            rows, gates = batch1(model, reps=args.reps_b1, phase="batch1")
            speed_rows.extend(rows)
            gate_rows.extend(gates)
        if "drift" in phases and phase("drift", 40):
            sd_caches = [{"kind": "taylorseer", "interval": 2, "warmup_steps": 2}]
            compile_here = with_compile and deadline.allows(240)
            if with_compile and not compile_here:
                notes.append("regional compile: skipped, time budget")
            drift_rows.extend(
                drift(
                    model, reps=2, backends=backends, caches=sd_caches, with_compile=compile_here,
                    deadline=deadline, fp8=args.fp8, only=args.drift_options,
                )
            )  # fmt: skip
        # Last on this model: compiling takes minutes and the other phases must not wait for it.
        if "grpo_compiled" in phases and phase("grpo compiled", 150):
            speed_rows.extend(
                grpo_compiled(model, group=args.group, groups=args.iteration_groups, reps=args.reps)
            )
        if "grpo_fast" in phases and phase("grpo fast tier", 180):
            try:
                speed_rows.extend(
                    grpo_fast(
                        model, group=args.group, groups=args.iteration_groups, reps=args.reps,
                        fa4=with_fa4, fp8_all=args.fp8_all or args.fp8_all_only,
                        family_rule=not args.fp8_all_only,
                    )
                )  # fmt: skip
            except RuntimeError as exc:  # the fast tier cannot run here (CPU, old GPU, no torchao)
                notes.append(f"grpo_fast: {exc}")

    def flux_phases() -> None:
        model.server(**server_cfg)
        if not tiny:
            model.defaults["num_inference_steps"] = 28
        if "flux" in phases and phase("flux", 90):
            if args.drift_options is None:  # a split drift run (--drift-options) times only its rows
                rows, gates = batch1(model, reps=args.reps, phase="flux", n_gate=1)
                speed_rows.extend(rows)
                gate_rows.extend(gates)
            if phase("flux drift", 40):
                flux_caches = [
                    {"kind": "first_block", "threshold": 0.05 if not tiny else 0.5},
                    {"kind": "mag", "threshold": 0.06 if not tiny else 1.0},
                    {"kind": "taylorseer", "interval": 2, "warmup_steps": 2},
                ]
                # With --fp8 (a fast-tier run) FLUX's drift also takes the attention backends, FP8 and
                # compile, alone and combined: FLUX's processors go through diffusers' dispatcher, so
                # FA4's rows are measured here (SD3.5 refuses attention backends).
                fast = bool(args.fp8)
                drift_rows.extend(
                    drift(
                        model, reps=1, backends=backends if fast else [], caches=flux_caches,
                        with_compile=fast and with_compile, deadline=deadline, n=1,
                        fp8=fast, only=args.drift_options,
                    )
                )  # fmt: skip
        if "flux_compiled" in phases and phase("flux compiled", 150):
            speed_rows.extend(flux_compiled(model, reps=args.reps))
        if "flux_fast" in phases and phase("flux fast tier", 200):
            try:
                speed_rows.extend(flux_fast(model, reps=args.reps, fa4=with_fa4, fp8_all=args.fp8_all))
            except RuntimeError as exc:  # the fast tier cannot run here (CPU, old GPU, no torchao)
                notes.append(f"flux_fast: {exc}")

    if phases & SD_PHASES:
        model = build(sd_name, device)
        try:
            model.server(**server_cfg)
            sd_phases()
        finally:
            model.close()
    if with_compile is False and phases & {"drift", "grpo_compiled"}:
        notes.append("regional compile: not measured (--no-compile, or --tiny without --compile)")
    if phases & FLUX_PHASES:
        model = build(flux_name, device)
        try:
            flux_phases()
        finally:
            model.close()
    return save(final=True)


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny SD3/FLUX models (a CPU check of the script)")
    p.add_argument("--group", type=int, default=None, help="outputs per Flow-GRPO request (16; tiny: 4)")
    p.add_argument("--reps", type=int, default=None, help="repeats per variant (3; tiny: 1)")
    p.add_argument(
        "--iteration-groups", type=int, default=None, help="Flow-GRPO requests in flight at once (4; tiny: 2)"
    )
    p.add_argument("--reps-b1", type=int, default=None, help="repeats of the batch-1 rollouts (5; tiny: 1)")
    p.add_argument("--backends", default=None, help="attention backends for the drift table")
    p.add_argument("--compile", dest="compile", action="store_true", default=None)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument(
        "--phases",
        default=",".join(DEFAULT_PHASES),
        help="comma-separated, run in this fixed order: grpo, grpo_iteration, grpo_profile, grpo_lanes, batch1, "
        "drift, "
        "grpo_compiled, grpo_fast "
        f"(SD3.5), flux, flux_compiled, flux_fast (FLUX.1-dev); default {','.join(DEFAULT_PHASES)}",
    )
    p.add_argument("--grpo-compiled", action="store_true", help="add grpo_compiled to --phases")
    p.add_argument("--no-flux", dest="flux", action="store_false", default=True, help="drop flux phases")
    p.add_argument(
        "--fp8", action="store_true",
        help="drift: also the server's --quantize fp8, alone and with regional compile (last)",
    )  # fmt: skip
    p.add_argument(
        "--fp8-all", action="store_true",
        help="grpo_fast: also FP8 on every linear not kept by name (no size threshold), last",
    )  # fmt: skip
    p.add_argument(
        "--fp8-all-only", action="store_true",
        help="grpo_fast: only the every-linear FP8 variant against stock (one compile)",
    )  # fmt: skip
    p.add_argument(
        "--drift-options", default=None,
        help="drift: only these options beside eager, comma-separated names as in the table "
        "(e.g. 'attention fa4,quantize fp8 + attention fa4 + regional compile'); flux: no batch-1 rows",
    )  # fmt: skip
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (GPU: 470)")
    args = p.parse_args(argv)
    if args.drift_options is not None:
        args.drift_options = [x.strip() for x in args.drift_options.split(",") if x.strip()]
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    unknown = sorted(set(args.phases) - SD_PHASES - FLUX_PHASES)
    if unknown:
        p.error(f"--phases: unknown {unknown}; known: {sorted(SD_PHASES | FLUX_PHASES)}")
    if args.grpo_compiled:
        args.phases.append("grpo_compiled")
    if not args.flux:
        args.phases = [x for x in args.phases if x not in FLUX_PHASES]
    device = resolve_device(args.device)
    if args.tiny:
        args.group = args.group or 4
        args.iteration_groups = args.iteration_groups or 2
        args.reps = args.reps or 1
        args.reps_b1 = args.reps_b1 or 1
        args.backends = "_native_math" if args.backends is None else args.backends
    else:
        args.group = args.group or 16
        args.iteration_groups = args.iteration_groups or 4
        args.reps = args.reps or 3
        args.reps_b1 = args.reps_b1 or 5
        if args.backends is None:
            args.backends = "native,_native_cudnn,_native_flash,flash" if device.startswith("cuda") else ""
        if args.budget is None and device.startswith("cuda"):
            args.budget = 470.0
    doc = run(args)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
