"""Where a FLUX.1-dev 1024x1024 transformer call spends its time: matmuls, attention, the rest.

The compiled server's full FLUX rollout step is about 140 ms on an H200; the issue asks for 120.
This times one transformer forward, one rollout step's worth (batch 1, 1024x1024, 512 text tokens,
inputs captured from a real pipeline call):

- eager, under each SDPA kernel PyTorch offers for it (flash, cuDNN, memory-efficient);
- with the server's regional compile (``--compile``), under the default and the cuDNN kernel
  (``--compile-mode max-autotune-no-cudagraphs`` tries Inductor's GEMM autotuning instead).

``--fp8`` adds the server's FP8 linears on the compiled blocks, ``--fp8-all`` the same with every
linear not kept by name in FP8, and ``--fa4`` FlashAttention-4 after each (issue #26).

It also sorts the compiled call's GPU kernels, seen by the CUDA profiler, into matmuls, attention
and the rest. For each it gives ms per forward and, from ``FlopCounterMode``'s count of the eager
call, the TFLOP/s achieved.

    python -m benchmarks.investigations.flux_breakdown --device cuda --out $OUT
    python -m benchmarks.investigations.flux_breakdown --tiny --out /tmp/fb     # a CPU check of the script
"""

from __future__ import annotations

import contextlib
import copy
import re
import sys
from typing import Any

import torch

from benchmarks.bodies import GRPO_PROMPT, request_body
from benchmarks.cli import base_parser, quiet_libraries, resolve_device
from benchmarks.model_builders import build
from benchmarks.report import document, log, print_table, write_json
from benchmarks.timing import median, spread, timed
from diffusion_rollout.server.speed.precompiled_blocks import rel_diff

_ATTENTION = re.compile(r"flash|fmha|attention|sdpa|cudnn", re.IGNORECASE)
_MATMUL = re.compile(r"gemm|nvjet|xmma|cutlass|matmul|_mm_|triton_tem|splitk", re.IGNORECASE)
COLUMNS = [
    ("variant", "variant", ""),
    ("ms", "ms/forward", ".2f"),
    ("spread", "spread", ".3f"),
    ("note", "note", ""),
]
KERNEL_COLUMNS = [
    ("kind", "kernels", ""),
    ("ms", "ms/forward", ".2f"),
    ("share", "share", ".3f"),
    ("tflops", "TFLOP/s", ".0f"),
]


def captured_inputs(model) -> dict[str, Any]:
    """The transformer's keyword arguments of a real one-step pipeline call (batch 1)."""
    body = {**request_body(model, GRPO_PROMPT, num_outputs_per_prompt=1), "num_inference_steps": 1}
    kwargs = model.stock_kwargs(model.stock, body)
    seen: dict[str, Any] = {}

    def grab(module, args, kw):
        if not seen:
            seen.update(kw)

    handle = model.stock.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.inference_mode():
            model.stock(output_type="latent", **kwargs)
    finally:
        handle.remove()
    return seen


def time_forward(transformer, inputs: dict[str, Any], device: str, reps: int) -> dict[str, float]:
    def once() -> float:
        with torch.inference_mode():
            return timed(lambda: transformer(**inputs), device)[1]

    for _ in range(2):  # warm-up: kernel selection, compilation
        once()
    times = [once() for _ in range(reps)]
    return {"ms": 1000 * median(times), "spread": spread(times)}


def _sample(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out.sample


def fp8_rows(
    transformer,
    inputs,
    device: str,
    reps: int,
    label: str,
    reference: torch.Tensor,
    fa4: bool = False,
    rule=None,
) -> list[dict]:
    """The server's ``--quantize fp8`` (``fast_tier.quantize_fp8``: torchao rowwise, its per-family
    keep-bf16 rule) on the compiled blocks, which recompile for the quantized weights; with each
    row the output's relative L2 difference from the eager bf16 forward (same inputs). ``rule``:
    another ``fast_tier.Fp8Rule``. ``fa4``: also with ``--attention-backend fa4`` (last; the
    transformer keeps it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from diffusion_rollout.fast_tier_checks import unsupported_reason
    from diffusion_rollout.server.speed.fast_tier import quantize_fp8

    reason = unsupported_reason(quantize="fp8", attention_backend=None, device=device)
    if reason:
        return [{"variant": f"{label} + fp8", "ms": None, "spread": None, "note": f"skipped: {reason}"}]
    report = quantize_fp8(transformer, rule=rule)
    note = f"{report['fp8_linears']} linears FP8, {report['bf16_linears']} bf16"
    rows = []
    for name, backends in (("default sdpa", None), ("sdpa cudnn", [SDPBackend.CUDNN_ATTENTION])):
        ctx = sdpa_kernel(backends) if backends else contextlib.nullcontext()
        with ctx:
            timing = time_forward(transformer, inputs, device, reps)
            with torch.inference_mode():
                out = _sample(transformer(**inputs)).float()
        drift = rel_diff(out, reference)
        rows.append({"variant": f"{label} + fp8, {name}", **timing, "rel_l2_vs_eager_bf16": drift,
                     "note": f"{note}; output rel. L2 vs eager bf16 {drift:.4f}"})  # fmt: skip
    if fa4:
        rows += fa4_rows(transformer, inputs, device, reps, f"{label} + fp8", reference, note)
    return rows


def fa4_rows(
    transformer, inputs, device: str, reps: int, label: str, reference, note: str = ""
) -> list[dict]:
    """``label`` with FlashAttention-4 (the server's ``--attention-backend fa4``); compiled blocks
    recompile for it (the backend is read inside the traced code). The transformer keeps FA4."""
    from diffusion_rollout.fast_tier_checks import unsupported_reason
    from diffusion_rollout.server.speed.fast_tier import register_fa4

    reason = unsupported_reason(quantize=None, attention_backend="fa4", device=device)
    if reason:
        return [{"variant": f"{label}, fa4", "ms": None, "spread": None, "note": f"skipped: {reason}"}]
    register_fa4()
    transformer.set_attention_backend("fa4")
    timing = time_forward(transformer, inputs, device, reps)
    with torch.inference_mode():
        out = _sample(transformer(**inputs)).float()
    drift = rel_diff(out, reference)
    lead = f"{note}; " if note else ""
    return [{"variant": f"{label}, fa4", **timing, "rel_l2_vs_eager_bf16": drift,
             "note": f"{lead}output rel. L2 vs eager bf16 {drift:.4f}"}]  # fmt: skip


def fp8_all_rows(transformer, inputs, device: str, args, label: str, reference: torch.Tensor) -> list[dict]:
    """:func:`fp8_rows` with the family's size threshold lifted: every linear not kept by name
    (embedders, norms, final projection) goes FP8, the attention projections included. Whether the
    whole compiled model gains from them is what the per-family rule (``fast_tier.FP8_RULES``,
    provisional) has to settle."""
    from diffusion_rollout.server.core.loader import repeated_blocks
    from diffusion_rollout.server.speed import fast_tier

    for block in repeated_blocks(transformer):
        block.compile(mode=args.compile_mode)
    rows = fp8_rows(
        transformer, inputs, device, args.reps, label, reference, fa4=args.fa4, rule=fast_tier.EVERY_LINEAR
    )
    for r in rows:
        r["variant"] = r["variant"].replace("+ fp8", "+ fp8 (all by size)")
    return rows


def flop_counts(transformer, inputs: dict[str, Any]) -> tuple[float, float]:
    """(all FLOPs, attention FLOPs) of one eager forward."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), counter:
        transformer(**inputs)
    ops = counter.get_flop_counts().get("Global", {})
    attention = sum(v for k, v in ops.items() if "attention" in str(k))
    return float(counter.get_total_flops()), float(attention)


def kernel_breakdown(transformer, inputs, device: str, flops: tuple[float, float], n: int = 3):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        with torch.inference_mode():
            for _ in range(n):
                transformer(**inputs)
        if cuda:
            torch.cuda.synchronize()
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    totals = {"attention": 0.0, "matmul": 0.0, "other": 0.0}
    for e in prof.events():
        if e.device_type != kind:
            continue
        name = e.name
        key = "attention" if _ATTENTION.search(name) else "matmul" if _MATMUL.search(name) else "other"
        totals[key] += (e.time_range.end - e.time_range.start) / 1e3 / n  # ms per forward
    all_ms = sum(totals.values()) or 1.0
    total_flops, attention_flops = flops
    work = {"attention": attention_flops, "matmul": total_flops - attention_flops, "other": 0.0}
    return [
        {
            "kind": k,
            "ms": ms,
            "share": ms / all_ms,
            "tflops": work[k] / (ms / 1e3) / 1e12 if ms and work[k] else None,
        }
        for k, ms in totals.items()
    ]


def _save(args, name: str, flops: tuple[float, float], rows: list[dict], breakdown: list[dict], final: bool):
    """Write what has been measured so far (a device call that runs out of time keeps it)."""
    for r in rows:
        r.setdefault("note", "")
    doc = document(
        "flux_breakdown",
        resolve_device(args.device),
        {"model": name, "reps": args.reps, "compile_mode": args.compile_mode,
         "tflop_per_forward": flops[0] / 1e12, "attention_tflop_per_forward": flops[1] / 1e12,
         "complete": final},
        [*rows, *breakdown],
    )  # fmt: skip
    doc["forward"], doc["compiled_kernels"] = rows, breakdown
    doc["table"] = "\n\n".join(
        [
            print_table("One transformer forward (batch 1, one rollout step)", rows, COLUMNS),
            print_table("Compiled forward's GPU kernels", breakdown, KERNEL_COLUMNS),
        ]
    )
    write_json(args.out, f"flux_breakdown{'_' + args.compile_mode if args.compile_mode else ''}", doc)
    return doc


def run(args) -> dict[str, Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from diffusion_rollout.server.core.loader import repeated_blocks

    device = resolve_device(args.device)
    model = build("tiny-flux" if args.tiny else "flux.1-dev", device)
    name = model.name
    rows: list[dict[str, Any]] = []
    breakdown: list[dict[str, Any]] = []
    try:
        transformer = model.stock.transformer
        inputs = captured_inputs(model)
        flops = flop_counts(transformer, inputs)
        with torch.inference_mode():
            reference = _sample(transformer(**inputs)).float()  # eager bf16: the drift reference
        log(f"flux_breakdown: {flops[0] / 1e12:.1f} TFLOP per forward, {flops[1] / 1e12:.1f} in attention")
        kernels = (
            [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
             ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
            if device.startswith("cuda") else [("math", SDPBackend.MATH)]
        )  # fmt: skip
        for kname, backend in kernels:
            try:
                with sdpa_kernel([backend]):
                    rows.append(
                        {
                            "variant": f"eager, sdpa {kname}",
                            **time_forward(transformer, inputs, device, args.reps),
                        }
                    )
            except RuntimeError as exc:  # a kernel that does not take these inputs on this build
                rows.append(
                    {"variant": f"eager, sdpa {kname}", "ms": None, "spread": None, "note": str(exc)[:100]}
                )
        _save(args, name, flops, rows, breakdown, final=False)
        # A bf16 copy for the FP8 variant with every linear of its size quantized (made before
        # compiling: a compiled block's call is bound to the block it was compiled from).
        spare = copy.deepcopy(transformer) if args.fp8_all else None
        for block in repeated_blocks(transformer):
            block.compile(mode=args.compile_mode)
        label = f"compiled ({args.compile_mode})" if args.compile_mode else "compiled"
        rows.append(
            {"variant": f"{label}, default sdpa", **time_forward(transformer, inputs, device, args.reps)}
        )
        breakdown = kernel_breakdown(transformer, inputs, device, flops)
        if device.startswith("cuda"):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                rows.append(
                    {
                        "variant": f"{label}, sdpa cudnn",
                        **time_forward(transformer, inputs, device, args.reps),
                    }
                )
        _save(args, name, flops, rows, breakdown, final=False)
        if args.fa4 and not args.fp8:
            rows += fa4_rows(transformer, inputs, device, args.reps, label, reference)
        if args.fp8:
            rows += fp8_rows(transformer, inputs, device, args.reps, label, reference, fa4=args.fa4)
            _save(args, name, flops, rows, breakdown, final=False)
        if spare is not None:
            rows += fp8_all_rows(spare, inputs, device, args, label, reference)
            del spare
    finally:
        model.close()
    return _save(args, name, flops, rows, breakdown, final=True)


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the tiny FLUX model (a CPU check of the script)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument(
        "--fp8", action="store_true", help="also the compiled forward with --quantize fp8 (torchao), last"
    )
    p.add_argument(
        "--fp8-all", action="store_true",
        help="also FP8 on every linear not kept by name (a bf16 copy of the transformer, last)",
    )  # fmt: skip
    p.add_argument(
        "--fa4", action="store_true",
        help="also FlashAttention-4 (--attention-backend fa4) on the compiled forward, after each FP8 variant",
    )  # fmt: skip
    p.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile mode for the blocks (default: the server's, None), e.g. max-autotune-no-cudagraphs",
    )
    args = p.parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
