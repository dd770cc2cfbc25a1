"""Context parallelism for one Wan video over k GPUs: ms/step and exactness against one GPU.

diffusers' own sequence parallelism (``transformer.enable_parallelism(config=ContextParallelConfig(
ulysses_degree=k))`` or ``ring_degree=k``) is SPMD: every rank runs the same pipeline call on the same
inputs and the transformer splits the token sequence across ranks inside attention, gathering the
output at the end. This script spawns k processes (NCCL on CUDA), builds the model once per rank
(``model_builders``: random weights, rank 0's broadcast to the others so every rank holds the same
bits), and measures:

1. **k = 1**: the stock pipeline on rank 0 alone (the others wait), ``output_type="latent"``.
2. **k = 2 (Ulysses, then ring)**: the same call on every rank with the transformer parallelised
   (ring with the ``_native_flash`` attention backend: ring merges partial attention by its
   log-sum-exp, which SDPA's default backend does not return).

Each timed call follows a warm-up call of the same shape. ms/step is the whole call (text
embeddings precomputed) over ``--steps``; ms/forward is one transformer call on a fixed input. The
k-GPU latents are compared with the 1-GPU ones on rank 0 (``bit_identical``, ``torch.equal``, and max
|difference|), so is that one transformer call (``forward_*``: what a 1-GPU replay of one step of a
k-GPU rollout would reproduce), and the ranks' outputs with each other.
Sharded attention sums in another order than one GPU, so the k-GPU result is not expected to be
bit-identical to k = 1; the JSON says how far it is. Replay on one GPU of a k-GPU rollout then
reproduces model outputs to that distance, not bit for bit (the ratio is 1 up to it).

Served with ``--context-parallel k`` (``diffusion_rollout/server/context_parallel.py``: the engine
is rank 0 and hands every transformer call to k-1 follower processes); this script measures the
stock pipeline on the same ranks, without the server, as the reference for that path.

    python -m benchmarks.context_parallel --gpus 2 --out $OUT                       # Wan 2.1 1.3B
    python -m benchmarks.context_parallel --gpus 2 --model wan2.2-a14b --out $OUT   # 14B experts
    python -m benchmarks.context_parallel --device cpu --gpus 2 --tiny              # harness only

On the CPU (gloo) diffusers' context parallelism is unavailable (it resolves ranks to accelerator
devices), so ``--device cpu`` runs the harness with k = 1 on every rank and reports ``cp: skipped``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from typing import Any

import torch

PROMPT = "a red fox running through snow, cinematic"
# Ring attention merges each key/value block's partial attention by its log-sum-exp; SDPA's default
# backend in diffusers does not return it ("Native attention does not support return_lse=True").
RING_BACKEND = "_native_flash"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _build(model: str, device: str, dtype: torch.dtype) -> Any:
    from benchmarks import model_builders_scale  # noqa: F401  (registers the large models)
    from benchmarks.model_builders import build_real_pipeline

    if model.startswith("tiny-"):
        from diffusion_rollout.models import build_tiny_pipeline

        pipe = build_tiny_pipeline(model.removeprefix("tiny-"))
        pipe.to(device=device, dtype=dtype)
        return pipe
    return build_real_pipeline(model, device, dtype)


def _broadcast_weights(pipe: Any) -> None:
    """Every rank gets rank 0's parameters and buffers, bit for bit."""
    import torch.distributed as dist

    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, src=0)


def _call(pipe: Any, embeds: dict[str, torch.Tensor], args: dict[str, Any], device: str) -> tuple[Any, float]:
    gen = [torch.Generator(device).manual_seed(7)]
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = pipe(**embeds, **args, generator=gen, output_type="latent").frames
    _sync(device)
    return out, time.perf_counter() - t0


def _forward_inputs(pipe: Any, opts: dict[str, Any], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed latent-sized model input (the same on every rank) and a timestep."""
    cfg = pipe.transformer.config
    shape = (
        1,
        int(cfg.in_channels),
        (opts["frames"] - 1) // int(pipe.vae_scale_factor_temporal) + 1,
        opts["height"] // int(pipe.vae_scale_factor_spatial),
        opts["width"] // int(pipe.vae_scale_factor_spatial),
    )
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(pipe.transformer.dtype)
    return x, torch.tensor([999.0], device=device)


def _forward(pipe: Any, x: torch.Tensor, t: torch.Tensor, pe: torch.Tensor, device: str) -> tuple[Any, float]:
    """One call of the (high-noise) transformer, timed after one warm-up call."""
    out = None
    for _ in range(2):
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=pe, return_dict=False)[
                0
            ]
        _sync(device)
    return out, time.perf_counter() - t0


def _worker(rank: int, world: int, port: int, opts: dict[str, Any], results: Any) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    cuda = opts["device"] == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    rows: list[dict[str, Any]] = []
    try:
        dtype = getattr(torch, opts["dtype"])
        pipe = _build(opts["model"], device, dtype)
        pipe.set_progress_bar_config(disable=True)
        _broadcast_weights(pipe)
        args = {
            "height": opts["height"],
            "width": opts["width"],
            "num_frames": opts["frames"],
            "num_inference_steps": opts["steps"],
            "guidance_scale": 5.0,
        }
        if getattr(pipe, "transformer_2", None) is not None:
            args["guidance_scale_2"] = 3.0
        with torch.inference_mode():
            pe, npe = pipe.encode_prompt(PROMPT, do_classifier_free_guidance=True, device=device)
        embeds = {"prompt_embeds": pe, "negative_prompt_embeds": npe}
        size = f"{opts['width']}x{opts['height']}x{opts['frames']}"
        base = {"model": opts["model"], "size": size, "steps": opts["steps"], "world": world}

        x, t = _forward_inputs(pipe, opts, device)
        ref = ref_forward = None
        if rank == 0:
            _call(pipe, embeds, args, device)  # warm-up
            ref, seconds = _call(pipe, embeds, args, device)
            ref_forward, forward_s = _forward(pipe, x, t, pe, device)
            rows.append({**base, "k": 1, "mode": "single_gpu", "seconds": seconds,
                         "ms_per_step": 1000 * seconds / opts["steps"],
                         "ms_per_forward": 1000 * forward_s})  # fmt: skip
        dist.barrier()

        modes = [("ulysses", {"ulysses_degree": world}), ("ring", {"ring_degree": world})]
        for index, (mode, kw) in enumerate(modes):
            if not cuda:
                if rank == 0:
                    rows.append({**base, "k": world, "mode": mode, "cp": "skipped (no accelerator)"})
                continue
            from diffusers import ContextParallelConfig

            if index:  # parallelism cannot be turned off in place: a fresh copy of the same weights
                del pipe
                gc.collect()
                torch.cuda.empty_cache()
                pipe = _build(opts["model"], device, dtype)
                pipe.set_progress_bar_config(disable=True)
                _broadcast_weights(pipe)
            try:
                backend = RING_BACKEND if mode == "ring" else None
                for m in (pipe.transformer, getattr(pipe, "transformer_2", None)):
                    if m is not None:
                        if backend is not None:
                            m.set_attention_backend(backend)
                        m.enable_parallelism(config=ContextParallelConfig(**kw))
                _call(pipe, embeds, args, device)  # warm-up
                out, seconds = _call(pipe, embeds, args, device)
                out_forward, forward_s = _forward(pipe, x, t, pe, device)
                gathered = [torch.empty_like(out) for _ in range(world)]
                dist.all_gather(gathered, out.contiguous())
                if rank == 0:
                    diff = (out.float() - ref.float()).abs()
                    fdiff = (out_forward.float() - ref_forward.float()).abs()
                    rows.append({
                        **base, "k": world, "mode": mode, "seconds": seconds,
                        "ms_per_step": 1000 * seconds / opts["steps"],
                        "ms_per_forward": 1000 * forward_s,
                        "bit_identical_to_k1": bool(torch.equal(out, ref)),
                        "max_abs_diff_vs_k1": float(diff.max()),
                        "mean_abs_diff_vs_k1": float(diff.mean()),
                        # One transformer call on the same input: what a 1-GPU replay of a k-GPU
                        # rollout's step reproduces (the model output, before any step compounds it).
                        "forward_bit_identical_to_k1": bool(torch.equal(out_forward, ref_forward)),
                        "forward_max_abs_diff_vs_k1": float(fdiff.max()),
                        "ranks_agree": all(torch.equal(g, gathered[0]) for g in gathered),
                    })  # fmt: skip
            except Exception as exc:  # one mode failing must not hide the other's figures
                traceback.print_exc()
                if rank == 0:
                    rows.append(
                        {**base, "k": world, "mode": mode, "error": f"{type(exc).__name__}: {exc}"[:1000]}
                    )
            dist.barrier()
    except Exception as exc:
        traceback.print_exc()
        rows.append({"rank": rank, "error": f"{type(exc).__name__}: {exc}"[:2000]})
    finally:
        if rank == 0:
            results.put(rows)
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", default="wan2.1-1.3b")
    p.add_argument("--tiny", action="store_true", help="the tiny Wan model at 32x32x5 (harness check)")
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dtype", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.model, args.height, args.width, args.frames = "tiny-wan", 32, 32, 5
    opts = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype or ("bfloat16" if args.device == "cuda" else "float32"),
        "height": args.height,
        "width": args.width,
        "frames": args.frames,
        "steps": args.steps,
    }
    import torch.multiprocessing as mp

    from benchmarks.common import document, free_port, print_table, write_json

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(
        _worker, args=(args.gpus, free_port(), opts, results), nprocs=args.gpus, start_method="spawn"
    )
    rows = results.get() if not results.empty() else [{"error": "rank 0 returned nothing"}]
    ok = all("error" not in r for r in rows)
    doc = document("context_parallel", args.device, opts | {"gpus": args.gpus}, rows, ok=ok, notes=[])
    write_json(args.out, "context_parallel", doc)
    columns = [("mode", "mode", ""), ("k", "k", ""), ("ms_per_step", "ms/step", ".1f"),
               ("ms_per_forward", "ms/forward", ".1f"), ("bit_identical_to_k1", "bit-identical", ""),
               ("max_abs_diff_vs_k1", "max |diff|", ".3g"), ("forward_max_abs_diff_vs_k1", "fwd max |diff|", ".3g"),
               ("error", "error", "")]  # fmt: skip
    print_table(
        f"Context parallel: {opts['model']} {opts['width']}x{opts['height']}x{opts['frames']}", rows, columns
    )
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
