"""Do a LoRA layer's bits depend on autograd? The trainer's replay runs PEFT's forward with its adapter
requiring grad; the server runs the same forward under ``torch.inference_mode``. This compares the
two on one device, per rank, and lists the kernels each launches (issue #41's GPU ratio drift).

    python -m benchmarks.investigations.lora_bits --device cuda --out $OUT
    python -m benchmarks.investigations.lora_bits --device cuda --model SD35_DIR --out $OUT   # the whole transformer

With ``--model``, the trainer's side (``diffusion_rollout.recipes.trainer.add_lora``, its adapter moved off zero) and the
server's (a second copy given that adapter by the server's own ``LoraManager``) run one CFG batch,
in grad mode and under ``inference_mode``; forward hooks name the first LoRA layer whose output differs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.report import document, log, write_json


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


def elsewhere(fn, *, thread: bool, stream: bool):
    """``fn()`` under ``inference_mode``, in another thread and/or on a new CUDA stream (the server's
    worker thread and its pipeline lanes)."""
    import threading

    out: list[Any] = []

    def body() -> None:
        with torch.inference_mode():
            if stream and torch.cuda.is_available():
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    r = fn()
                torch.cuda.current_stream().wait_stream(s)
                s.synchronize()
            else:
                r = fn()
        out.append(r)

    if thread:
        t = threading.Thread(target=body)
        t.start()
        t.join()
    else:
        body()
    return out[0]


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
    for thread in (False, True):
        for stream in (False, True):
            got = elsewhere(lambda: lora(x, a, b), thread=thread, stream=stream)
            row[f"thread{int(thread)}_stream{int(stream)}_eq_grad"] = torch.equal(got, grad)
    with torch.inference_mode():
        row["kernels_inference"] = kernels(lambda: lora(x, a, b))
    row["kernels_grad"] = kernels(lambda: lora(x, pa, pb))
    return row


def model_case(folder: str, device: str, rank: int, batch: int, size: int) -> dict[str, Any]:
    """Trainer vs server copy of one transformer with the same rank-``rank`` adapter."""
    from diffusers import SD3Transformer2DModel

    from diffusion_rollout.client.weights.lora import lora_state_dict
    from diffusion_rollout.recipes.trainer import add_lora
    from diffusion_rollout.server.weights.lora import LoraManager
    from diffusion_rollout.server.weights.lora_io import parse_lora_tensors

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    load = lambda: SD3Transformer2DModel.from_pretrained(folder, subfolder="transformer", torch_dtype=dtype)  # noqa: E731
    trainer, server = load().to(device), load().to(device)
    trainer.requires_grad_(False)
    params = add_lora(trainer, rank, dtype)
    g = torch.Generator(device="cpu").manual_seed(rank)
    with torch.no_grad():
        for p_ in params:  # an adapter moved off zero, as after a few optimizer steps
            p_.copy_((torch.randn(p_.shape, generator=g) * 1e-3).to(p_.dtype))
    sd = lora_state_dict(trainer, adapter_name="default", target_module="transformer")
    manager = LoraManager()
    manager.load(
        "transformer", server, "default", parse_lora_tensors(sd.items(), "transformer"), lora_alpha=rank
    )
    manager.activate("transformer", server, "default", mode="dynamic")
    cfg = trainer.config
    side = size // 8
    x = torch.randn(batch, cfg.in_channels, side, side, generator=g).to(device, dtype)
    t = torch.full((batch,), 700.0, device=device)
    ctx = torch.randn(batch, 205, cfg.joint_attention_dim, generator=g).to(device, dtype)
    pooled = torch.randn(batch, cfg.pooled_projection_dim, generator=g).to(device, dtype)
    kw = {"hidden_states": x, "timestep": t, "encoder_hidden_states": ctx, "pooled_projections": pooled}

    def run(model: torch.nn.Module, inference: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        seen: dict[str, torch.Tensor] = {}
        hooks = [
            m.register_forward_hook(lambda mod, i, o, n=n: seen.__setitem__(n, o.detach().clone()))
            for n, m in model.named_modules()
            if hasattr(m, "lora_A")
        ]
        try:
            if inference:
                with torch.inference_mode():
                    out = model(**kw, return_dict=False)[0]
            else:
                out = model(**kw, return_dict=False)[0].detach()
        finally:
            for h in hooks:
                h.remove()
        return out.clone(), seen

    def run_elsewhere(model: torch.nn.Module, thread: bool, stream: bool):
        return elsewhere(lambda: run(model, False), thread=thread, stream=stream)

    results = {
        "server_thread": run_elsewhere(server, True, False),
        "server_thread_stream": run_elsewhere(server, True, True),
        "server_stream": run_elsewhere(server, False, True),
        "trainer_grad": run(trainer, False),
        "trainer_inference": run(trainer, True),
        "server_inference": run(server, True),
        "server_grad_off": run(server, False),
    }
    ref_out, ref_layers = results["trainer_grad"]
    row: dict[str, Any] = {"model": folder, "rank": rank, "batch": batch, "size": size}
    for name, (out, layers) in results.items():
        row[f"{name}_eq_trainer_grad"] = torch.equal(out, ref_out)
        row[f"{name}_max_diff"] = float((out.float() - ref_out.float()).abs().max())
        first = next(
            (n for n in ref_layers if n in layers and not torch.equal(layers[n], ref_layers[n])), None
        )
        row[f"{name}_first_layer_differing"] = first
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default=None, help="an SD3 diffusers folder: compare whole transformers")
    p.add_argument("--ranks", default="4,32")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.model:
        rows = []
        for rank in [int(r) for r in args.ranks.split(",")]:
            row = model_case(args.model, args.device, rank, args.batch, args.size)
            log(str(row))
            rows.append(row)
        write_json(args.out, "lora_bits_model", document("lora_bits", args.device, vars(args), rows))
        return 0
    dtype = torch.bfloat16
    rows = []
    for rank in (4, 8, 16, 32, 64):
        for batch, tokens in ((16, 1024), (8, 1024), (16, 154)):
            row = case(args.device, dtype, batch, tokens, 1536, rank)
            log(
                "  elsewhere==grad: "
                + ", ".join(
                    f"{k.removesuffix('_eq_grad')}={v}" for k, v in row.items() if k.endswith("_eq_grad")
                )
            )
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
