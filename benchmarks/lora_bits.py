"""Do a LoRA layer's bits depend on autograd? The trainer's replay runs PEFT's forward with its adapter
requiring grad; the server runs the same forward under ``torch.inference_mode``. This compares the
two on one device, per rank, and lists the kernels each launches (issue #41's GPU ratio drift).

    python -m benchmarks.lora_bits --device cuda --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import document, log, write_json


def lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.linear(F.linear(x, a), b)


def kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if e.device_type.name == "CUDA" or e.key.startswith("aten::")]
    return sorted(set(names))


def variants(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """No-grad ways of computing the same product, to find the one autograd's path equals."""
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    out = {
        "inference_linear": lora(x, a, b),
        "mm_flat": ((flat @ a.t()) @ b.t()).reshape(*x.shape[:-1], -1),
        "matmul": torch.matmul(torch.matmul(x, a.t()), b.t()),
        "bmm_expand": torch.bmm(
            torch.bmm(x, a.t().expand(x.shape[0], -1, -1)), b.t().expand(x.shape[0], -1, -1)
        ),
        "linear_contig_t": F.linear(F.linear(x, a.t().contiguous().t()), b.t().contiguous().t()),
    }
    return out


def case(device: str, dtype: torch.dtype, batch: int, tokens: int, hidden: int, rank: int) -> dict[str, Any]:
    g = torch.Generator(device="cpu").manual_seed(rank)
    x = torch.randn(batch, tokens, hidden, generator=g).to(device, dtype)
    a = (torch.randn(rank, hidden, generator=g) * 0.02).to(device, dtype)
    b = (torch.randn(hidden, rank, generator=g) * 0.02).to(device, dtype)
    with torch.inference_mode():
        ref = variants(x, a, b)
    pa, pb = torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())
    grad = lora(x, pa, pb).detach()
    xg = x.clone().requires_grad_(True)
    grad_x = lora(xg, a, b).detach()
    with torch.no_grad():
        nograd_params = lora(x, pa, pb)
    row: dict[str, Any] = {"rank": rank, "batch": batch, "tokens": tokens, "hidden": hidden}
    row["grad_params_eq_inference"] = torch.equal(grad, ref["inference_linear"])
    row["grad_input_eq_inference"] = torch.equal(grad_x, ref["inference_linear"])
    row["no_grad_params_eq_inference"] = torch.equal(nograd_params, ref["inference_linear"])
    row["max_diff_grad_vs_inference"] = float((grad.float() - ref["inference_linear"].float()).abs().max())
    row["grad_equals"] = [n for n, t in ref.items() if torch.equal(grad, t)]
    with torch.inference_mode():
        row["kernels_inference"] = kernels(lambda: lora(x, a, b))
    row["kernels_grad"] = kernels(lambda: lora(x, pa, pb))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    dtype = torch.bfloat16
    rows = []
    for rank in (4, 8, 16, 32, 64):
        for batch, tokens in ((16, 1024), (8, 1024), (16, 154)):
            row = case(args.device, dtype, batch, tokens, 1536, rank)
            log(
                f"r={rank} b={batch} t={tokens}: grad==inference {row['grad_params_eq_inference']} "
                f"(max {row['max_diff_grad_vs_inference']:.3g}); grad(x)==inference {row['grad_input_eq_inference']}; "
                f"grad equals {row['grad_equals']}"
            )
            rows.append(row)
    for row in rows[:1] + [r for r in rows if not r["grad_params_eq_inference"]][:2]:
        log(f"r={row['rank']} b={row['batch']} inference kernels: {row['kernels_inference']}")
        log(f"r={row['rank']} b={row['batch']} grad kernels: {row['kernels_grad']}")
    write_json(args.out, "lora_bits", document("lora_bits", args.device, vars(args), rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
