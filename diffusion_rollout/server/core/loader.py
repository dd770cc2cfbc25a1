"""Loading a diffusers pipeline folder and fitting it with the rollout scheduler.

The pipeline is loaded with the ordinary ``DiffusionPipeline.from_pretrained`` (so any diffusers
folder of a supported family works), then its flow-match Euler scheduler is replaced by the
rollout-mixin subclass built from the same config: with no rollout attached it is the stock
scheduler bit for bit, so ``rollout=false`` stays identical to the stock pipeline.

``prepare_pipeline`` does the same fitting for a pipeline already in memory (benchmarks build the
real architectures with random weights directly on the GPU and serve them through this path).

Speed options (``ServerConfig.compile`` / ``attention_backend``), both off by default:

- ``attention_backend``: ``transformer.set_attention_backend(name)`` through diffusers' attention
  dispatcher (``"native"``, ``"_native_cudnn"``, ``"_native_flash"``, ``"flash"`` with flash-attn
  installed, ...). Another kernel sums in another order: outputs are not bit-identical to the
  default backend.
- ``compile``: *regional* ``torch.compile`` of the repeated transformer blocks (the model's
  ``_repeated_blocks`` classes where diffusers lists them, else every block of the model's top-level
  ``ModuleList``\\s). The blocks are identical in structure, so the compiled code is reused by all of
  them: compile time is that of one or two blocks, not of the whole model, and the denoising loop,
  the scheduler and the rollout recording stay eager Python. Compiled (fused) kernels round
  differently from eager ones: **a compiled server is not bit-identical to the stock pipeline**; the
  ODE regression gate (``benchmarks/ode_regression.py``) is defined for the eager path. The blocks'
  batch dimension is dynamic and the engine compiles them for ``warmup_shapes`` before it reports
  ready (``server/speed/warmup.py``); a shape not warmed up compiles on its first request. The compiled
  artifacts persist in ``compile_cache`` (``server/speed/compile_cache.py``).
- ``quantize="fp8"`` / ``attention_backend="fa4"``: the fast tier (``server/speed/fast_tier.py``): torchao
  FP8 linears (quantized here, before any compile) and FlashAttention-4 registered with diffusers'
  dispatcher. Checked first: without CUDA, on a GPU too old or without the package, loading fails
  with one line naming what is missing. Neither is bit-identical to eager.
- ``cuda_graphs``: the eager denoiser replayed from CUDA graphs captured per input-shape bucket
  (``server/speed/cuda_graphs.py``); bit-identical to eager, CUDA only, not combinable with ``compile``
  (the graph must record the eager kernels).

Whether the result is exact is decided in one place, ``server/speed/options.py``; the options applied are
returned as its ``SpeedOptions`` and reported by ``/server_info``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from diffusion_rollout.fast_tier_checks import FP8, is_fa4, unsupported_reason
from diffusion_rollout.scheduler_mixins import RolloutFlowMatchEulerScheduler
from diffusion_rollout.server.speed import fast_tier
from diffusion_rollout.server.speed.options import SpeedOptions
from diffusion_rollout.server.speed.warmup import CompileStats, compile_block

logger = logging.getLogger(__name__)

# Pipeline components that are denoisers (the modules speed options apply to).
DENOISER_COMPONENTS = ("transformer", "transformer_2")


@dataclass
class LoadedPipeline:
    pipe: Any
    stock_scheduler: Any
    rollout_scheduler: Any
    load_time_s: float
    speed: SpeedOptions = field(default_factory=SpeedOptions)


def load_pipeline(
    path: str,
    *,
    dtype: torch.dtype,
    device: str,
    compile: bool = False,
    attention_backend: str | None = None,
    quantize: str | None = None,
    cuda_graphs: bool = False,
    cuda_graph_max_buckets: int = 8,
) -> LoadedPipeline:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers import DiffusionPipeline

    t0 = time.perf_counter()
    logger.info("loading pipeline from %s (dtype %s, device %s)", path, dtype, device)
    pipe = DiffusionPipeline.from_pretrained(path, dtype=dtype)
    _log_components(pipe, path, time.perf_counter() - t0, device)
    return prepare_pipeline(
        pipe,
        device=device,
        compile=compile,
        attention_backend=attention_backend,
        quantize=quantize,
        cuda_graphs=cuda_graphs,
        cuda_graph_max_buckets=cuda_graph_max_buckets,
        started_at=t0,
    )


def _log_components(pipe: Any, path: str, seconds: float, device: str) -> None:
    """Progress for a large model (minutes to read): what was read, before the device copy starts."""
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            params = list(module.parameters())
            count = sum(p.numel() for p in params)
            mib = sum(p.numel() * p.element_size() for p in params) / 2**20
            logger.info("read %s (%s): %.1fM params, %.1f MiB", name, type(module).__name__, count / 1e6, mib)
    logger.info("read %s in %.1f s; moving it to %s", path, seconds, device)


def prepare_pipeline(
    pipe: Any,
    *,
    device: str,
    compile: bool = False,
    attention_backend: str | None = None,
    quantize: str | None = None,
    cuda_graphs: bool = False,
    cuda_graph_max_buckets: int = 8,
    started_at: float | None = None,
) -> LoadedPipeline:
    """Fit an in-memory pipeline for serving: device, rollout scheduler, optional speed options."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    t0 = time.perf_counter() if started_at is None else started_at
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device)
    stock = pipe.scheduler
    if isinstance(stock, FlowMatchEulerDiscreteScheduler):
        rollout = RolloutFlowMatchEulerScheduler.from_config(stock.config)
        pipe.scheduler = rollout
    else:
        # Families whose stock scheduler has no transition density (Wan's UniPC) run rollouts on a
        # flow-match Euler scheduler at the model's shift; the family adapter builds it.
        rollout = None
    speed = apply_speed_options(
        pipe,
        compile=compile,
        attention_backend=attention_backend,
        quantize=quantize,
        cuda_graphs=cuda_graphs,
        cuda_graph_max_buckets=cuda_graph_max_buckets,
        device=device,
    )
    dt = time.perf_counter() - t0
    logger.info("loaded %s in %.1f s", type(pipe).__name__, dt)
    return LoadedPipeline(
        pipe=pipe, stock_scheduler=stock, rollout_scheduler=rollout, load_time_s=dt, speed=speed
    )


def _require_dispatched_attention(name: str, model: torch.nn.Module, backend: str) -> None:
    """Refuse an attention backend the model would ignore. diffusers' ``set_attention_backend`` sets
    it only on processors that go through its attention dispatcher and silently skips the others
    (SD3's ``JointAttnProcessor2_0`` calls PyTorch's SDPA itself): the server would then say
    ``exact: false`` and run the default kernel. ``native``, the default named, changes nothing
    anywhere and stays accepted."""
    if backend.lower() == "native":
        return
    processors = {
        type(m.processor).__name__: hasattr(m.processor, "_attention_backend")
        for m in model.modules()
        if getattr(m, "processor", None) is not None
    }
    if processors and not any(processors.values()):
        raise ValueError(
            f"attention_backend={backend} would change nothing on {name} ({type(model).__name__}): its "
            f"attention processors ({', '.join(sorted(processors))}) call PyTorch's SDPA directly, not "
            "diffusers' attention dispatcher"
        )


def denoisers(pipe: Any) -> dict[str, torch.nn.Module]:
    """The pipeline's transformer modules, by component name."""
    found = {}
    for name in DENOISER_COMPONENTS:
        module = getattr(pipe, name, None)
        if isinstance(module, torch.nn.Module):
            found[name] = module
    return found


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated transformer blocks: its ``_repeated_blocks`` classes, else its block lists."""
    names = getattr(model, "_repeated_blocks", None) or ()
    if names:
        blocks = [m for m in model.modules() if type(m).__name__ in names]
        if blocks:
            return blocks
    blocks = []
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList) and len(child) > 1:
            blocks.extend(child)
    return blocks


def apply_speed_options(
    pipe: Any,
    *,
    compile: bool = False,
    attention_backend: str | None = None,
    quantize: str | None = None,
    cuda_graphs: bool = False,
    cuda_graph_max_buckets: int = 8,
    device: str | None = None,
) -> SpeedOptions:
    """Attention backend, FP8, regional compile and CUDA graphs on every denoiser (all opt-in; see the
    module doc)."""
    fast = quantize is not None or is_fa4(attention_backend)
    where = device
    if where is None and (fast or cuda_graphs):
        where = str(next(iter(denoisers(pipe).values())).device)
    if fast:
        reason = unsupported_reason(
            quantize=quantize, attention_backend=attention_backend, device=where
        )
        if reason:
            raise ValueError(reason)
        if is_fa4(attention_backend):
            fast_tier.register_fa4()
    quantized: dict[str, Any] = {}
    compile_stats = CompileStats() if compile else None
    if cuda_graphs:
        if not where.startswith("cuda"):
            raise ValueError(f"cuda_graphs needs a CUDA device; this pipeline runs on {where}")
        if compile:
            raise ValueError("cuda_graphs replays the eager denoiser; it cannot be combined with compile")
    for name, model in denoisers(pipe).items():
        if attention_backend:
            if not hasattr(model, "set_attention_backend"):
                raise ValueError(f"{name} ({type(model).__name__}) has no set_attention_backend")
            _require_dispatched_attention(name, model, attention_backend)
            model.set_attention_backend(attention_backend)
            logger.info("%s: attention backend %s", name, attention_backend)
        if quantize == FP8:
            quantized[name] = fast_tier.quantize_fp8(model, name)
        if compile:
            blocks = repeated_blocks(model)
            if not blocks:
                raise ValueError(f"{name} ({type(model).__name__}) has no repeated blocks to compile")
            for block in blocks:
                compile_block(block, compile_stats)
            kinds = sorted({type(b).__name__ for b in blocks})
            logger.info(
                "%s: regional torch.compile of %d blocks (%s), batch dimension dynamic; not "
                "bit-identical to eager",
                name,
                len(blocks),
                ", ".join(kinds),
            )
    graphs = None
    if cuda_graphs:
        from diffusion_rollout.server.speed.cuda_graphs import CudaGraphRunner

        graphs = CudaGraphRunner(denoisers(pipe), max_buckets=cuda_graph_max_buckets)
        logger.info("cuda graphs: on, at most %d bucket(s), captured on first use", cuda_graph_max_buckets)
    if quantize is not None and not compile:
        logger.warning(
            "quantize=%s without compile: eager FP8 linears were measured slower than bf16; "
            "add --compile",
            quantize,
        )
    return SpeedOptions(
        compile=compile,
        attention_backend=attention_backend,
        quantize=quantize,
        quantize_report=quantized or None,
        graphs=graphs,
        compile_stats=compile_stats,
    )
