"""Context parallelism for one Wan video over k GPUs: ms/step and exactness against one GPU.

Text-to-video (Wan 2.1 1.3B, Wan 2.2 A14B) and the image-to-video variants the server serves with
``--context-parallel k``: Wan 2.1 I2V 14B 480P (36 input channels, CLIP image tokens in
cross-attention), Wan 2.2 I2V-A14B (two experts, 36 channels) and Wan 2.2 TI2V-5B image-to-video
(per-token timesteps, the first latent frame the image's). Image-to-video calls get a 832x480 input
image; the pipeline encodes it in every call (diffusers takes ``image`` or ``image_embeds``, not both:
it needs the image for the first-frame latent), so Wan 2.1 I2V's ms/step includes one CLIP pass per
call (two small layers here); the one-transformer-call figures get its CLIP tokens; TI2V's transformer call gets per-token timesteps (the first
frame's tokens at 0), as the pipeline gives them.

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

Served with ``--context-parallel k`` (``diffusion_rollout/server/parallel/context_parallel.py``: the engine
is rank 0 and hands every transformer call to k-1 follower processes); this script measures the
stock pipeline on the same ranks, without the server, as the reference for that path.

    python -m benchmarks.context_parallel --gpus 2 --out $OUT                       # Wan 2.1 1.3B
    python -m benchmarks.context_parallel --gpus 2 --model wan2.2-a14b --out $OUT   # 14B experts
    python -m benchmarks.context_parallel --device cpu --gpus 2 --tiny              # harness only

The image-to-video rows (Ulysses; the server serves ring too, not measured for them yet), one model
per command (each builds its model twice: k = 1 and k = 2 share one build, the rest is the call),
480x832x81 on 2 GPUs:

    python -m benchmarks.context_parallel --gpus 2 --model wan2.1-i2v-14b-480p --modes ulysses --out $OUT
    python -m benchmarks.context_parallel --gpus 2 --model wan2.2-i2v-a14b --modes ulysses --out $OUT
    python -m benchmarks.context_parallel --gpus 2 --model wan2.2-ti2v-5b-i2v --modes ulysses --out $OUT

``--model`` takes a comma-separated list (one JSON, rows per model); ``speedup_vs_k1`` is the k = 1
ms/step over the row's. CPU dry run of the image-to-video path: ``--device cpu --tiny --model
tiny-wan-i2v,tiny-wan2.2-ti2v-i2v`` (the tiny zoo has no Wan 2.2 I2V-A14B; its layout is Wan 2.1
I2V's channels without the image encoder, two experts as ``tiny-wan2.2``).

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


def _image(opts: dict[str, Any]) -> Any:
    """The input image of an image-to-video call: a deterministic RGB picture of the output size."""
    import base64
    import io

    from PIL import Image

    from benchmarks.model_builders import input_image_b64

    data = base64.b64decode(input_image_b64(opts["width"], opts["height"]))
    return Image.open(io.BytesIO(data)).convert("RGB")


def _is_i2v(pipe: Any) -> bool:
    return type(pipe).__name__ == "WanImageToVideoPipeline"


def _forward_inputs(pipe: Any, opts: dict[str, Any], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed latent-sized model input (the same on every rank) and a timestep (per token where the
    model takes one per token: TI2V-5B, the first latent frame's tokens at 0 as in image-to-video)."""
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
    if pipe.config.get("expand_timesteps"):
        p_t, p_h, p_w = cfg.patch_size
        per_frame = (shape[3] // p_h) * (shape[4] // p_w)
        t = torch.full((1, (shape[2] // p_t) * per_frame), 999.0, device=device)
        if _is_i2v(pipe):
            t[:, :per_frame] = 0.0
        return x, t
    return x, torch.tensor([999.0], device=device)


def _forward(
    pipe: Any, x: torch.Tensor, t: torch.Tensor, pe: torch.Tensor, image_embeds: Any, device: str
) -> tuple[Any, float]:
    """One call of the (high-noise) transformer, timed after one warm-up call."""
    out = None
    extra = {"encoder_hidden_states_image": image_embeds} if image_embeds is not None else {}
    for _ in range(2):
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = pipe.transformer(
                hidden_states=x, timestep=t, encoder_hidden_states=pe, return_dict=False, **extra
            )[0]
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
        image_embeds = None
        if _is_i2v(pipe):
            args["image"] = _image(opts)
            if getattr(pipe, "image_encoder", None) is not None:  # Wan 2.1 I2V: CLIP image tokens
                with torch.inference_mode():
                    image_embeds = pipe.encode_image(args["image"], device).to(pipe.transformer.dtype)
        size = f"{opts['width']}x{opts['height']}x{opts['frames']}"
        base = {"model": opts["model"], "family": opts["family"], "size": size, "steps": opts["steps"],
                "world": world, "image_to_video": _is_i2v(pipe)}  # fmt: skip

        x, t = _forward_inputs(pipe, opts, device)
        ref = ref_forward = None
        if rank == 0:
            _call(pipe, embeds, args, device)  # warm-up
            ref, seconds = _call(pipe, embeds, args, device)
            ref_forward, forward_s = _forward(pipe, x, t, pe, image_embeds, device)
            rows.append({**base, "k": 1, "mode": "single_gpu", "seconds": seconds,
                         "ms_per_step": 1000 * seconds / opts["steps"],
                         "ms_per_forward": 1000 * forward_s})  # fmt: skip
        dist.barrier()

        modes = [("ulysses", {"ulysses_degree": world}), ("ring", {"ring_degree": world})]
        modes = [(m, kw) for m, kw in modes if m in opts["modes"]]
        k1_ms = rows[0]["ms_per_step"] if rows else None
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
                out_forward, forward_s = _forward(pipe, x, t, pe, image_embeds, device)
                gathered = [torch.empty_like(out) for _ in range(world)]
                dist.all_gather(gathered, out.contiguous())
                if rank == 0:
                    diff = (out.float() - ref.float()).abs()
                    fdiff = (out_forward.float() - ref_forward.float()).abs()
                    rows.append({
                        **base, "k": world, "mode": mode, "seconds": seconds,
                        "ms_per_step": 1000 * seconds / opts["steps"],
                        "ms_per_forward": 1000 * forward_s,
                        "speedup_vs_k1": k1_ms / (1000 * seconds / opts["steps"]),
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


def _family(model: str) -> str:
    from benchmarks import model_builders_scale  # noqa: F401  (registers the large models)
    from benchmarks.model_builders import _REAL_FAMILY

    return model.removeprefix("tiny-") if model.startswith("tiny-") else _REAL_FAMILY.get(model, "")


def _run_model(opts: dict[str, Any], gpus: int) -> list[dict[str, Any]]:
    """The k ranks for one model; rank 0's rows."""
    import torch.multiprocessing as mp

    from diffusion_rollout.testing import free_port

    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(gpus, free_port(), opts, results), nprocs=gpus, start_method="spawn")
    rows = results.get() if not results.empty() else [{"error": "rank 0 returned nothing"}]
    return [{"model": opts["model"], **r} for r in rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument(
        "--model",
        "--models",
        dest="model",
        default="wan2.1-1.3b",
        help="comma-separated: wan2.1-1.3b, wan2.2-a14b, wan2.1-i2v-14b-480p, wan2.2-i2v-a14b, "
        "wan2.2-ti2v-5b-i2v, or tiny-<family> (tiny-wan, tiny-wan-i2v, tiny-wan2.2-ti2v-i2v)",
    )
    p.add_argument("--modes", default="ulysses,ring", help="comma-separated: ulysses, ring")
    p.add_argument("--tiny", action="store_true", help="tiny models at their zoo size (harness check)")
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dtype", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    models = [m.strip() for m in args.model.split(",") if m.strip()]
    if args.tiny:
        models = [m if m.startswith("tiny-") else "tiny-wan" for m in models]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not set(modes) <= {"ulysses", "ring"}:
        p.error(f"--modes: ulysses and/or ring, got {args.modes!r}")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    rows: list[dict[str, Any]] = []
    settings: dict[str, Any] = {"models": models, "modes": modes, "gpus": args.gpus, "dtype": dtype}
    for model in models:
        size = {"height": args.height, "width": args.width, "frames": args.frames}
        if model.startswith("tiny-"):
            from diffusion_rollout.models import TINY_CALL_DEFAULTS

            d = TINY_CALL_DEFAULTS[model.removeprefix("tiny-")]
            size = {"height": d["height"], "width": d["width"], "frames": d["num_frames"]}
        opts = {"model": model, "family": _family(model), "device": args.device, "dtype": dtype,
                "steps": args.steps, "modes": modes, **size}  # fmt: skip
        settings.setdefault("per_model", {})[model] = opts
        rows.extend(_run_model(opts, args.gpus))
    ok = all("error" not in r for r in rows)
    if len(models) == 1:  # the single-model settings as before (model, size, ...) at the top level
        settings.update(settings["per_model"][models[0]])
    from benchmarks.report import document, print_table, write_json

    doc = document("context_parallel", args.device, settings, rows, ok=ok, notes=[])
    write_json(args.out, "context_parallel", doc)
    columns = [("model", "model", ""), ("mode", "mode", ""), ("k", "k", ""), ("ms_per_step", "ms/step", ".1f"),
               ("speedup_vs_k1", "speedup", ".2f"), ("ms_per_forward", "ms/forward", ".1f"),
               ("bit_identical_to_k1", "bit-identical", ""), ("max_abs_diff_vs_k1", "max |diff|", ".3g"),
               ("forward_max_abs_diff_vs_k1", "fwd max |diff|", ".3g"), ("cp", "cp", ""),
               ("error", "error", "")]  # fmt: skip
    print_table(f"Context parallel over {args.gpus} ranks ({args.device})", rows, columns)
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
