"""Context parallel scaling of every video family's transformer over 1, 2 and 4 GPUs (issue #44).

One command spawns ``--gpus`` ranks (NCCL) and, per case (``model@WxHxF``), measures one transformer
call at the rollout's size for every layout that fits the ranks:

- ``k1``: the plain transformer, on every rank at once (each rank is an independent replica, so the
  figure is what each of ``--gpus`` single-GPU replicas gets while all of them work);
- ``ulysses2``, ``ring2``, ``ulysses4``, ``ring4``, ``usp2x2`` (Ulysses 2 x ring 2): diffusers'
  ``ContextParallelConfig(ulysses_degree=u, ring_degree=r, mesh=...)`` through the server's
  ``cp_plans.enable_plan`` (diffusers' plan for Wan, the server's for LTX-2 and HunyuanVideo 1.5).
  A layout of k < ``--gpus`` ranks runs as ``gpus / k`` groups side by side (a 3-D device mesh
  ``(group, ring, ulysses)``), so k = 2 on four GPUs is timed while the other pair runs too: what
  two replicas of k = 2 each get.

How, and why this way:

- **Every layout shares one copy of the weights.** diffusers' parallelism cannot be turned off in
  place, so each layout gets a *twin*: a module of the same class built on the meta device whose
  every parameter and buffer is the original's tensor (no copy). A 14B expert is built once per
  rank, not once per layout.
- **The inputs are the pipeline's own.** Rank 0 runs the real pipeline for one step (LTX-2: two,
  ``CAPTURE_STEPS``) at the case's size (``output_type="np"``: the VAE decode runs and is timed) with
  a forward pre-hook that keeps the transformer's first call; the call's tensors are broadcast to every rank. The same run counts
  the transformer calls per step (two with CFG for Wan: conditional and unconditional).
- **Timing:** one warm-up call, then ``--repeats`` timed calls, each started together on every
  rank (a barrier) and ended by a device synchronisation; the row gives the median on rank 0 and the
  spread over repeats. ms/step = calls per step x ms/forward (the scheduler's step is not in it).
- **Exactness:** rank 0's output (all output tensors: LTX-2's video and audio) against ``k1``'s, with
  ``torch.equal`` and the max |difference|.
- **The VAE decode:** the seconds of ``vae.decode`` in rank 0's one-step run (one GPU: served
  rollouts decode on rank 0), and its share of a whole rollout of ``--rollout-steps`` steps at each
  layout's ms/step.

- **The VAE decode split over the ranks** (``--vae-split``, Wan VAEs): one latent of the case's
  size decoded on rank 0 untiled (the served default) and tiled, then tiled with its tiles spread
  over 2 and 4 ranks (``--context-parallel-vae split``), ``torch.equal`` to the tiled decode.
- **What bounds a layout** (``--profile``): one more call per layout under ``torch.profiler``, its
  device time summed by kernel family (communication, attention, matmul, other; the kernels' own
  time, nothing counted twice) next to the call's wall time.

Ring attention needs a backend that returns the log-sum-exp: ``ring*`` and ``usp*`` layouts set
``_native_flash`` on the twin. LTX-2 and HunyuanVideo 1.5 run the server's Ulysses-only plans, so
their ring layouts are rows that say so.

    python -m benchmarks.cp_scaling --gpus 4 --out $OUT                                  # every case
    python -m benchmarks.cp_scaling --gpus 4 --cases wan2.1-1.3b@832x480x81 --out $OUT
    python -m benchmarks.cp_scaling --device cpu --gpus 2 --tiny                          # harness only

On the CPU (gloo) diffusers' parallelism is unavailable (it resolves ranks to accelerator devices):
the dry run measures ``k1`` on every rank, checks each twin against the original module bit for bit,
and reports the parallel layouts as skipped.
"""

from __future__ import annotations

import argparse
import gc
import os
import queue
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

PROMPT = "a red fox running through snow, cinematic"
# LTX-2's scheduler stretches its shift to a terminal sigma, which one step turns into 0 / 0 (NaN
# timesteps): its one-step capture run takes two steps.
CAPTURE_STEPS = {"LTX2VideoTransformer3DModel": 2}
RING_BACKEND = "_native_flash"  # returns the log-sum-exp ring merges by (half precision)
# The server's own plans exchange over the Ulysses group only (server/parallel/cp_plans.py).
ULYSSES_ONLY_CLASSES = ("LTX2VideoTransformer3DModel", "HunyuanVideo15Transformer3DModel")
# (name, ring degree, ulysses degree)
LAYOUTS: dict[str, tuple[int, int]] = {
    "ulysses2": (1, 2),
    "ring2": (2, 1),
    "ulysses4": (1, 4),
    "ring4": (4, 1),
    "usp2x2": (2, 2),
}
DEFAULT_LAYOUTS = "ulysses2,ring2,ulysses4,usp2x2"
# HunyuanVideo 1.5's attention processor builds a (tokens x tokens) mask, so its 720p case keeps 33
# frames (32,400 video tokens; a 1 GB mask) rather than 121 (111,600 tokens; 12.5 GB).
# Wan 2.2 A14B's experts are each the Wan 2.1 T2V 14B architecture, and a step runs one of them: its
# 720p case is ``wan2.1-14b@1280x720x81`` (one expert's memory leaves room for the 720p VAE decode).
DEFAULT_CASES = (
    "wan2.1-1.3b@832x480x81,wan2.1-14b@832x480x81,wan2.1-14b@1280x720x81,"
    "wan2.1-i2v-14b-480p@832x480x81,wan2.2-i2v-a14b@832x480x81,wan2.2-ti2v-5b@1280x704x121,"
    "hunyuanvideo-1.5-480p@1280x720x33,ltx-2@1280x704x121"
)
TINY_CASES = "tiny-wan,tiny-wan-i2v,tiny-hunyuanvideo15,tiny-ltx2"


@dataclass(frozen=True)
class Case:
    model: str
    width: int
    height: int
    frames: int

    @classmethod
    def parse(cls, text: str) -> Case:
        """``model@WxHxF``; a tiny model (``tiny-<family>``) takes its zoo size when none is given."""
        model, _, size = text.strip().partition("@")
        if not size:
            if not model.startswith("tiny-"):
                raise ValueError(f"case {text!r}: expected model@WIDTHxHEIGHTxFRAMES")
            from diffusion_rollout.models import TINY_CALL_DEFAULTS

            d = TINY_CALL_DEFAULTS[model.removeprefix("tiny-")]
            return cls(model, int(d["width"]), int(d["height"]), int(d.get("num_frames", 1)))
        w, h, f = (int(v) for v in size.lower().split("x"))
        return cls(model, w, h, f)

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}x{self.frames}"


# ---------------------------------------------------------------------------------------------
# Pieces that need no process group (tested on the CPU)
# ---------------------------------------------------------------------------------------------
def twin(module: nn.Module) -> nn.Module:
    """A module of ``module``'s class whose parameters and buffers are ``module``'s own tensors.

    Built on the meta device, so it costs no memory; enabling parallelism on it (hooks, attention
    processors, the parallel config) leaves ``module`` as it was.
    """
    with torch.device("meta"):
        copy = type(module).from_config(module.config)
    own = dict(copy.named_modules())
    for name, p in module.named_parameters(remove_duplicate=False):
        parent, _, leaf = name.rpartition(".")
        own[parent]._parameters[leaf] = p
    for name, b in module.named_buffers(remove_duplicate=False):
        parent, _, leaf = name.rpartition(".")
        own[parent]._buffers[leaf] = b
    left = [n for n, t in [*copy.named_parameters(), *copy.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"twin of {type(module).__name__}: tensors left on meta: {left[:5]}")
    return copy.eval()


def output_tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor of a transformer's output (tuple, dataclass or tensor), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in output_tensors(item)]
    if hasattr(out, "to_tuple"):
        return output_tensors(out.to_tuple())
    return []


def compare(out: Any, ref: Any) -> dict[str, Any]:
    """``torch.equal`` and max |difference| of every output tensor against the reference's."""
    pairs = list(zip(output_tensors(out), output_tensors(ref), strict=True))
    equal = all(torch.equal(a, b) for a, b in pairs)
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
    finite = all(bool(torch.isfinite(a).all()) for a, _ in pairs)
    return {"bit_identical_to_k1": equal, "max_abs_diff_vs_k1": diff, "finite": finite}


def layout_plan(
    layouts: list[str], world: int, cls_name: str, heads: int | None, cuda: bool
) -> list[tuple[str, int, int, str | None]]:
    """(name, ring, ulysses, reason it is not run or None) for each requested layout."""
    plan = []
    for name in layouts:
        ring, uly = LAYOUTS[name]
        k = ring * uly
        why = None
        if k > world or world % k:
            why = f"needs {k} ranks dividing {world}"
        elif ring > 1 and cls_name in ULYSSES_ONLY_CLASSES:
            why = f"{cls_name} runs the server's Ulysses-only plan"
        elif heads is not None and heads % uly:
            why = f"{heads} heads do not divide by the Ulysses degree {uly}"
        elif not cuda:
            why = "skipped (no accelerator)"
        plan.append((name, ring, uly, why))
    return plan


def decode_share(decode_s: float, ms_per_step: float, steps: int) -> float:
    """The VAE decode's share of a rollout of ``steps`` denoising steps then one decode."""
    denoise_s = steps * ms_per_step / 1000.0
    return decode_s / (denoise_s + decode_s)


# ---------------------------------------------------------------------------------------------
# Ranks
# ---------------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _build(model: str, device: str, dtype: torch.dtype) -> Any:
    if model.startswith("tiny-"):
        from diffusion_rollout.models import build_tiny_pipeline

        pipe = build_tiny_pipeline(model.removeprefix("tiny-"))
        pipe.to(device=device, dtype=dtype)
    else:
        from benchmarks import model_builders_scale  # noqa: F401  (registers the large models)
        from benchmarks.model_builders import build_real_pipeline

        pipe = build_real_pipeline(model, device, dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call_args(pipe: Any, case: Case, device: str) -> dict[str, Any]:
    """The one-step pipeline call of the case (the model's own defaults for guidance)."""
    from benchmarks.context_parallel import _image, _is_i2v

    if case.model.startswith("tiny-"):
        from diffusion_rollout.models import TINY_CALL_DEFAULTS

        defaults = dict(TINY_CALL_DEFAULTS[case.model.removeprefix("tiny-")])
    else:
        from benchmarks.model_builders import REAL_DEFAULTS

        defaults = dict(REAL_DEFAULTS[case.model])
    args = {k: v for k, v in defaults.items() if k not in ("prompt", "generator")}
    steps = CAPTURE_STEPS.get(type(pipe.transformer).__name__, 1)
    args.update(height=case.height, width=case.width, num_inference_steps=steps, output_type="np")
    if "num_frames" in args or case.frames > 1:
        args["num_frames"] = case.frames
    if _is_i2v(pipe):
        args["image"] = _image({"width": case.width, "height": case.height})
    args["generator"] = torch.Generator(device).manual_seed(7)
    return args


def _capture(pipe: Any, case: Case, device: str) -> tuple[Any, int, float, float]:
    """Rank 0: a one-step pipeline call (two for LTX-2); the transformer's first call (cloned), calls
    per step, the VAE decode's seconds and the whole call's."""
    first: list[Any] = []
    calls = [0]

    def clone(v: Any) -> Any:  # the pipeline may change its tensors in place after the call
        return v.detach().clone() if isinstance(v, torch.Tensor) else v

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        calls[0] += 1
        if not first:
            first.append(([clone(a) for a in args], {k: clone(v) for k, v in kwargs.items()}))

    decode_s = [0.0]
    vae_decode = pipe.vae.decode

    def timed_decode(*a: Any, **kw: Any) -> Any:
        _sync(device)
        t0 = time.perf_counter()
        out = vae_decode(*a, **kw)
        _sync(device)
        decode_s[0] += time.perf_counter() - t0
        return out

    handle = pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    pipe.vae.decode = timed_decode
    try:
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            pipe(prompt=PROMPT, **_call_args(pipe, case, device))
        _sync(device)
        total = time.perf_counter() - t0
    finally:
        handle.remove()
        del pipe.vae.decode  # the instance attribute: the class's method again
    steps = CAPTURE_STEPS.get(type(pipe.transformer).__name__, 1)
    return first[0], calls[0] // steps, decode_s[0], total


def _share_call(call: Any, device: str) -> tuple[list[Any], dict[str, Any]]:
    """Rank 0's captured call on every rank: its structure pickled, its tensors broadcast."""
    import torch.distributed as dist

    from diffusion_rollout.server.parallel.cp_calls import fill_tensors, slots, strip_tensors

    tensors: list[torch.Tensor] = []
    box = [strip_tensors(call, tensors) if call is not None else None]
    dist.broadcast_object_list(box, src=0)
    structure = box[0]
    if dist.get_rank() != 0:
        tensors = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in slots(structure)]
    for t in tensors:
        dist.broadcast(t, src=0)
    return fill_tensors(structure, tensors)


def _timed(
    module: nn.Module, call: tuple[list[Any], dict[str, Any]], device: str, repeats: int
) -> tuple[Any, list[float]]:
    import torch.distributed as dist

    args, kwargs = call
    out, times = None, []
    for i in range(1 + repeats):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = module(*args, **kwargs)
        _sync(device)
        if i:
            times.append(1000.0 * (time.perf_counter() - t0))
    return out, times


# Kernel families of a profiled call, by substring of the kernel's name (first match wins).
KERNEL_KINDS = (
    ("communication", ("nccl", "all_to_all", "alltoall", "allgather", "all_gather", "gloo")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
    # cuBLAS 12.8+ on Hopper names many GEMMs nvjet_*; the 4x H200 profiles of 2026-11-27 (before
    # this key) found about 0 ms of "matmul", so their GEMMs landed in "other" (RESULTS cp4-profile).
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "matmul", "_mm", "linear", "addmm")),
)


def kernel_kind(name: str) -> str:
    """``communication``, ``attention``, ``matmul`` or ``other`` for a kernel (or CPU op) name."""
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def profile_call(module: nn.Module, call: tuple[list[Any], dict[str, Any]], device: str) -> dict[str, float]:
    """One more call under ``torch.profiler``: milliseconds of device time (CPU time on a CPU) by
    kernel family, summed over the kernels themselves (``self`` time: nothing counted twice), and
    the call's wall milliseconds. What bounds a layout: its communication's share, next to the
    attention and matmuls that shrink with k."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    args, kwargs = call
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof, torch.inference_mode():
        module(*args, **kwargs)
        _sync(device)
    wall_ms = 1000.0 * (time.perf_counter() - t0)
    out = {"communication_ms": 0.0, "attention_ms": 0.0, "matmul_ms": 0.0, "other_ms": 0.0}
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us > 0 and (not cuda or event.device_type.name == "CUDA"):
            out[f"{kernel_kind(event.key)}_ms"] += us / 1000.0
    out["device_total_ms"] = sum(out.values())
    out["wall_ms"] = wall_ms
    return out


def _timed_once(fn: Any, device: str) -> tuple[Any, float]:
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def vae_split_rows(pipe: Any, case: Case, device: str, world: int) -> list[dict[str, Any]]:
    """The Wan VAE's decode of one latent of the case's size (random, the same on every rank): on
    rank 0 untiled (what a served rollout runs) and tiled (``vae.tiled_decode``), then tiled and split
    over ranks ``0..k-1`` for k = 2 and 4 (``server/parallel/vae_split.py``; ``--context-parallel-vae
    split``), each against the one-process tiled decode with ``torch.equal``. Every rank calls this
    (the groups are made by all); rank 0's rows, [] elsewhere."""
    import torch.distributed as dist

    from diffusion_rollout.server.parallel.vae_split import split_tiled_decode

    vae = pipe.vae
    for t in [*vae.parameters(), *vae.buffers()]:  # every rank decodes with rank 0's bits
        dist.broadcast(t.data, src=0)
    shape = (
        1,
        int(vae.config.z_dim),
        (case.frames - 1) // int(pipe.vae_scale_factor_temporal) + 1,
        case.height // int(pipe.vae_scale_factor_spatial),
        case.width // int(pipe.vae_scale_factor_spatial),
    )
    if case.model.startswith("tiny-"):  # tiles of 24 px at a 16 px stride: a tiny video has several
        vae.tile_sample_min_height = vae.tile_sample_min_width = 24
        vae.tile_sample_stride_height = vae.tile_sample_stride_width = 16
    z = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(device, vae.dtype)
    rank = dist.get_rank()
    base = {"model": case.model, "size": case.size, "latent_shape": list(shape)}
    rows: list[dict[str, Any]] = []
    if rank == 0:
        _timed_once(lambda: vae.decode(z).sample, device)  # warm-up
        _, untiled_s = _timed_once(lambda: vae.decode(z).sample, device)
        tiled, tiled_s = _timed_once(lambda: vae.tiled_decode(z).sample, device)
        rows.append(
            {**base, "layout": "vae_rank0", "k": 1, "vae_untiled_s": untiled_s, "vae_tiled_s": tiled_s}
        )
    for k in (2, 4):
        if k > world:
            continue
        group = dist.new_group(list(range(k)))  # every rank takes part in making it
        if rank < k:
            dist.barrier(group=group)
            out, seconds = _timed_once(lambda g=group: split_tiled_decode(vae, z, group=g), device)
            if rank == 0:
                rows.append({**base, "layout": f"vae_split{k}", "k": k, "vae_split_s": seconds,
                             "speedup_vs_untiled": untiled_s / seconds, "speedup_vs_tiled": tiled_s / seconds,
                             "split_bit_identical_to_tiled": bool(torch.equal(out, tiled))})  # fmt: skip
        dist.barrier()
    return rows


def _heads(module: nn.Module) -> int | None:
    cfg = module.config
    return int(cfg["num_attention_heads"]) if "num_attention_heads" in cfg else None


def _case(rank: int, world: int, case: Case, opts: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    cuda = opts["device"] == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    dtype = getattr(torch, opts["dtype"])
    pipe = _build(case.model, device, dtype)
    for name in ("transformer", "transformer_2"):  # every rank holds rank 0's bits
        module = getattr(pipe, name, None)
        if module is not None:
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, src=0)
    module = pipe.transformer
    cls_name = type(module).__name__
    captured, meta = None, [None]
    if rank == 0:
        try:
            captured = _capture(pipe, case, device)
            meta = [captured[1:]]
        except Exception as exc:  # every rank learns of it (they wait in the broadcast below)
            traceback.print_exc()
            meta = [f"capture on rank 0: {type(exc).__name__}: {exc}"[:2000]]
    dist.broadcast_object_list(meta, src=0)
    if isinstance(meta[0], str):
        raise RuntimeError(meta[0])
    calls_per_step, decode_s, one_step_s = meta[0]
    call = _share_call(captured[0] if captured else None, device)
    del captured
    hidden = call[1].get("hidden_states", call[0][0] if call[0] else None)
    base = {"model": case.model, "size": case.size, "class": cls_name, "world": world,
            "calls_per_step": calls_per_step, "vae_decode_s": decode_s, "one_step_call_s": one_step_s,
            "hidden_states_shape": list(hidden.shape) if isinstance(hidden, torch.Tensor) else None}  # fmt: skip
    rows = []
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    ref, times = _timed(module, call, device, opts["repeats"])
    k1_ms = statistics.median(times)
    k1_profile = profile_call(module, call, device) if opts.get("profile") else None
    row = {**base, "layout": "k1", "k": 1, "ring": 1, "ulysses": 1, "groups": world,
           "ms_per_forward": k1_ms, "ms_per_forward_runs": times, "ms_per_step": calls_per_step * k1_ms,
           "speedup_vs_k1": 1.0, "efficiency": 1.0}  # fmt: skip
    if cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if k1_profile is not None:
        row["profile"] = k1_profile
    if not cuda:  # the twin mechanism, checked where it costs nothing: bit for bit the original
        out, _ = _timed(twin(module), call, device, 0)
        row["twin_bit_identical"] = all(
            torch.equal(a, b) for a, b in zip(output_tensors(out), output_tensors(ref), strict=True)
        )
    rows.append(row)
    for name, ring, uly, why in layout_plan(opts["layouts"], world, cls_name, _heads(module), cuda):
        k = ring * uly
        entry = {**base, "layout": name, "k": k, "ring": ring, "ulysses": uly, "groups": world // k}
        if why is not None:
            rows.append({**entry, "skipped": why})
            continue
        try:
            from diffusers import ContextParallelConfig
            from torch.distributed.device_mesh import init_device_mesh

            from diffusion_rollout.server.parallel.cp_plans import enable_plan

            mesh = init_device_mesh(
                "cuda", (world // k, ring, uly), mesh_dim_names=("group", "ring", "ulysses")
            )
            par = twin(module)
            if ring > 1:
                from diffusers.models.attention_dispatch import _AttentionBackendRegistry

                # diffusers also makes it the process-wide default; the next case's masked
                # attention (HunyuanVideo 1.5, LTX-2) must not inherit it.
                default = _AttentionBackendRegistry._active_backend
                par.set_attention_backend(RING_BACKEND)
                _AttentionBackendRegistry.set_active_backend(default)
            enable_plan(
                par, ContextParallelConfig(ring_degree=ring, ulysses_degree=uly, mesh=mesh["ring", "ulysses"])
            )
            torch.cuda.reset_peak_memory_stats(device)
            out, times = _timed(par, call, device, opts["repeats"])
            ms = statistics.median(times)
            if opts.get("profile"):
                entry["profile"] = profile_call(par, call, device)
            rows.append({**entry, "ms_per_forward": ms, "ms_per_forward_runs": times,
                         "ms_per_step": calls_per_step * ms, "speedup_vs_k1": k1_ms / ms,
                         "efficiency": k1_ms / ms / k, "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                         **compare(out, ref)})  # fmt: skip
            del par, out
        except Exception as exc:  # one layout failing must not hide the others' figures
            traceback.print_exc()
            rows.append({**entry, "error": f"{type(exc).__name__}: {exc}"[:1000]})
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if opts.get("vae_split") and type(pipe.vae).__name__ == "AutoencoderKLWan":
        rows.extend(vae_split_rows(pipe, case, device, world))
    for r in rows:
        if "ms_per_step" in r:
            r["vae_decode_share"] = {
                str(s): decode_share(decode_s, r["ms_per_step"], s) for s in opts["rollout_steps"]
            }
    del pipe, module, call, ref
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rows


def _worker(rank: int, world: int, port: int, opts: dict[str, Any], results: Any) -> None:
    import datetime

    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    cuda = opts["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    try:
        for text in opts["cases"]:
            case = Case.parse(text)
            t0 = time.perf_counter()
            try:
                rows = _case(rank, world, case, opts)
            except Exception as exc:
                traceback.print_exc()
                rows = [
                    {"model": case.model, "size": case.size, "error": f"{type(exc).__name__}: {exc}"[:2000]}
                ]
            if rank == 0:
                for r in rows:
                    r["case_wall_s"] = time.perf_counter() - t0
                results.put(rows)
                print(f"[cp_scaling] {case.model}@{case.size}: {time.perf_counter() - t0:.1f} s", flush=True)
            dist.barrier()
    finally:
        if rank == 0:
            results.put(None)
        dist.destroy_process_group()


def run(opts: dict[str, Any], gpus: int) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    from diffusion_rollout.testing import free_port

    results = mp.get_context("spawn").Queue()
    ctx = mp.start_processes(_worker, args=(gpus, free_port(), opts, results), nprocs=gpus,
                             start_method="spawn", join=False)  # fmt: skip
    rows: list[dict[str, Any]] = []
    while True:
        try:
            got = results.get(timeout=5.0)
        except queue.Empty:
            try:
                if ctx.join(timeout=0):  # every rank has exited without rank 0's end mark
                    break
            except Exception as exc:  # a rank died: its figures so far are kept
                rows.append({"error": f"rank failed: {exc}"[:2000]})
                break
            continue
        if got is None:
            break
        rows.extend(got)
        if opts.get("out"):  # written after every case: a call cut short keeps what it measured
            _write(opts, rows)
    try:
        ctx.join()
    except Exception as exc:
        rows.append({"error": f"rank failed: {exc}"[:2000]})
    return rows


def _write(opts: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    from benchmarks.report import document, write_json

    ok = bool(rows) and all("error" not in r for r in rows)
    settings = {k: v for k, v in opts.items() if k != "out"}
    doc = document("cp_scaling", opts["device"], settings, rows, ok=ok, notes=[])
    write_json(opts.get("out"), "cp_scaling", doc)
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--cases", default=None, help=f"comma-separated model@WxHxF (default: {DEFAULT_CASES})")
    p.add_argument("--tiny", action="store_true", help=f"the tiny zoo's video families ({TINY_CASES})")
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, help=f"comma-separated of {', '.join(LAYOUTS)}")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--vae-split", action="store_true",
                   help="Wan VAEs: the decode untiled, tiled, and tiled split over 2 and 4 ranks")  # fmt: skip
    p.add_argument("--profile", action="store_true",
                   help="one more call per layout under torch.profiler: device ms by kernel family")  # fmt: skip
    p.add_argument("--rollout-steps", default="20,50", help="rollout lengths for the VAE decode's share")
    p.add_argument("--dtype", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        p.error(f"--layouts: unknown {unknown}; expected some of {', '.join(LAYOUTS)}")
    cases = a.cases or (TINY_CASES if a.tiny else DEFAULT_CASES)
    opts = {"device": a.device, "dtype": a.dtype or ("bfloat16" if a.device == "cuda" else "float32"),
            "cases": [c for c in cases.split(",") if c.strip()], "layouts": layouts, "repeats": a.repeats,
            "rollout_steps": [int(s) for s in a.rollout_steps.split(",")], "gpus": a.gpus, "out": a.out,
            "profile": a.profile, "vae_split": a.vae_split}  # fmt: skip
    for c in opts["cases"]:
        Case.parse(c)  # a malformed case fails here, not in a rank
    rows = run(opts, a.gpus)
    doc = _write(opts, rows)
    from benchmarks.report import print_table

    columns = [("model", "model", ""), ("size", "size", ""), ("layout", "layout", ""), ("k", "k", ""),
               ("ms_per_forward", "ms/forward", ".1f"), ("ms_per_step", "ms/step", ".1f"),
               ("speedup_vs_k1", "speedup", ".2f"), ("efficiency", "eff.", ".2f"),
               ("bit_identical_to_k1", "bit-identical", ""), ("max_abs_diff_vs_k1", "max |diff|", ".3g"),
               ("vae_decode_s", "decode s", ".2f"), ("skipped", "skipped", ""), ("error", "error", "")]  # fmt: skip
    print_table(f"Context parallel scaling over {a.gpus} ranks ({a.device})", rows, columns)
    return 0 if doc["ok"] else 2


if __name__ == "__main__":
    sys.exit(main())
