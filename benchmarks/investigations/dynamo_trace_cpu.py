"""Where a compiled SD3.5-medium-sized denoiser's first calls spend their time, on a CPU (issue #43).

The fast tier's warm restart on an H100 spent ~100 s outside ``compile_fx`` with every graph a cache
hit. This reproduces the compile path of ``server/core/loader.py`` (regional compile of the repeated blocks
through ``warmup.compile_block``, FP8 linears through ``fast_tier.quantize_fp8`` when asked) on the
real-size transformer (or its first ``--layers`` blocks), runs the warm-up's two calls (batch 2, then
batch 1) in this process, and prints one JSON line: seconds per call, Dynamo's timers by phase (the
warm-up's own helper), frames and graphs counted, and the cache lookups. Run it twice with the same
``--cache`` to see a restart (a fresh process, inductor's on-disk caches warm)::

    python -m benchmarks.investigations.dynamo_trace_cpu --cache /tmp/dtc --quantize fp8   # cold
    python -m benchmarks.investigations.dynamo_trace_cpu --cache /tmp/dtc --quantize fp8   # warm

CPU only and for timing the compiler: the weights are random and nothing is checked for accuracy.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time


def build(layers: int, dtype, seed: int = 0):
    import torch
    from diffusers import SD3Transformer2DModel

    from benchmarks.model_builders import SD35_MEDIUM_TRANSFORMER

    cfg = dict(SD35_MEDIUM_TRANSFORMER)
    cfg["num_layers"] = layers
    cfg["dual_attention_layers"] = tuple(i for i in cfg["dual_attention_layers"] if i < layers - 1)
    with torch.device("meta"):
        model = SD3Transformer2DModel(**cfg)
    model = model.to_empty(device="cpu").to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02).to(dtype))
    return model.eval()


def inputs(batch: int, size: int, text_len: int, dtype):
    import torch

    g = torch.Generator().manual_seed(batch)
    return dict(
        hidden_states=torch.randn(batch, 16, size, size, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(batch, text_len, 4096, generator=g).to(dtype),
        pooled_projections=torch.randn(batch, 2048, generator=g).to(dtype),
        timestep=torch.full((batch,), 500.0).to(dtype),
        return_dict=False,
    )


def _allow_fp8_on_cpu() -> None:
    """torchao 0.18 asserts a float8-capable GPU when quantizing; its CPU fallback runs under
    inference mode (``torch._scaled_mm`` on CPU), which is all the compiler needs to trace it."""
    import torchao.float8.inference as inference
    import torchao.quantization.quant_api as quant_api

    inference._check_hardware_support = lambda *a, **k: None
    quant_api._check_hardware_support = lambda *a, **k: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", required=True, help="TORCHINDUCTOR_CACHE_DIR (same value = warm restart)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--quantize", choices=["none", "fp8"], default="none")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--size", type=int, default=16, help="latent side (16 -> 64 image tokens)")
    ap.add_argument("--text-len", type=int, default=32)
    ap.add_argument("--artifacts", action="store_true", help="load/save torch.compiler cache artifacts")
    ap.add_argument("--precompile", action="store_true", help="torch._dynamo.config.caching_precompile")
    ap.add_argument("--profile", default=None, help="write the first call's cProfile top-40 here")
    args = ap.parse_args()

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(args.cache, "inductor")
    import torch

    from diffusion_rollout.server.core.loader import repeated_blocks
    from diffusion_rollout.server.speed import fast_tier
    from diffusion_rollout.server.speed.warmup import (
        CompileStats,
        _cache_counts,
        _compile_phases,
        compile_block,
    )

    if args.precompile:
        torch._dynamo.config.caching_precompile = True
    art = os.path.join(args.cache, "artifacts.bin")
    loaded = None
    if args.artifacts and os.path.isfile(art):
        with open(art, "rb") as f:
            loaded = torch.compiler.load_cache_artifacts(f.read())
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model = build(args.layers, dtype)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = None
    if args.quantize == "fp8":
        _allow_fp8_on_cpu()
        report = fast_tier.quantize_fp8(model, "transformer")
    t_quant = time.perf_counter() - t0
    stats = CompileStats()
    blocks = repeated_blocks(model)
    for b in blocks:
        compile_block(b, stats)
    from torch._dynamo.utils import counters

    calls = []
    phases0 = _compile_phases()
    counts0 = _cache_counts()
    with torch.inference_mode():
        for i, n in enumerate((4, 2)):  # the warm-up's rows: 2 and 1 outputs, with CFG
            x = inputs(n, args.size, args.text_len, dtype)
            prof = cProfile.Profile() if (args.profile and i == 0) else None
            g0, t0 = stats.graphs, time.perf_counter()
            if prof:
                prof.enable()
            model(**x)
            if prof:
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(60)
                s.write("\n---- by tottime\n")
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
                prof.dump_stats(args.profile + ".prof")
                with open(args.profile, "w") as f:
                    f.write(s.getvalue())
            calls.append({"batch": n, "s": round(time.perf_counter() - t0, 3), "graphs": stats.graphs - g0})
        t0 = time.perf_counter()
        model(**inputs(3, args.size, args.text_len, dtype))
        steady = time.perf_counter() - t0
    phases = {k: round(v - phases0.get(k, 0.0), 3) for k, v in _compile_phases().items()}
    cache = {k: (h - counts0[k][0], m - counts0[k][1]) for k, (h, m) in _cache_counts().items()}
    saved = None
    if args.artifacts:
        out = torch.compiler.save_cache_artifacts()
        if out is not None:
            with open(art, "wb") as f:
                f.write(out[0])
            saved = len(out[0])
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "layers": args.layers,
                "blocks": len(blocks),
                "quantize": args.quantize,
                "dtype": args.dtype,
                "quantized_linears": None if report is None else len(report.get("quantized", report)),
                "build_s": round(t_build, 2),
                "quantize_s": round(t_quant, 2),
                "calls": calls,
                "batch3_s": round(steady, 3),
                "graphs_to_backend": stats.graphs,
                "compile_fx_s": round(stats.seconds, 3),
                "phases": phases,
                "frames": dict(counters["frames"]),
                "unique_graphs": counters["stats"].get("unique_graphs"),
                "recompiles": dict(counters.get("recompiles", {})),
                "cache": cache,
                "artifacts_loaded": loaded is not None,
                "artifacts_saved": saved,
            }
        )
    )


if __name__ == "__main__":
    main()
