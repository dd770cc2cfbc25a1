"""The trainer's side of a run: its device and dtype, its own copy of the denoiser, the LoRA it trains.

The trainer loads its own copy of the denoiser from the folder the server serves, in bf16 on CUDA
(float32 on a CPU), frozen, with a PEFT LoRA whose weights are kept in the model's dtype: the server
holds the pushed adapter in its dtype, and the same dtype on both sides is what makes the replayed
model output equal the server's bit for bit. (An fp32 master copy would be more precise for tiny
updates; the optimizer is Adam with a learning rate large enough for bf16 steps.)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from diffusion_rollout.recipes.options import LORA_TARGETS
from diffusion_rollout.recipes.ranks import Ranks


def trainer_device(args: argparse.Namespace, ranks: Ranks | None = None) -> torch.device:
    """This rank's device: ``--trainer-gpus[local_rank]`` (default the local rank's GPU) on CUDA."""
    ranks = ranks or Ranks()
    if args.cpu or not torch.cuda.is_available():
        device = torch.device("cpu")
    else:
        gpus = args.trainer_gpu or [ranks.local_rank]
        if ranks.local_rank >= len(gpus):
            raise SystemExit(
                f"--trainer-gpus names {len(gpus)} GPU(s) but this host runs local rank {ranks.local_rank}"
            )
        device = torch.device("cuda", gpus[ranks.local_rank])
        torch.cuda.set_device(device)  # so that generator_device "cuda" means the trainer's GPU in-process
    ranks.use_device(device)
    return device


def trainer_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    """``--dtype``; auto: bf16 on CUDA (what the server serves there), float32 on a CPU."""
    if args.dtype != "auto":
        return getattr(torch, args.dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_trainer_transformer(
    model_path: Path, *, device: torch.device, dtype: torch.dtype, gradient_checkpointing: bool = False
) -> torch.nn.Module:
    """The trainer's own copy of the denoiser, frozen (the LoRA added afterwards is what trains)."""
    from diffusers import AutoModel

    transformer = AutoModel.from_pretrained(str(model_path), subfolder="transformer", dtype=dtype).to(device)
    transformer.requires_grad_(False)
    if gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    return transformer


def add_lora(
    transformer: torch.nn.Module,
    rank: int,
    dtype: torch.dtype,
    name: str = "default",
    *,
    alpha: float | None = None,
    targets: Sequence[str] | None = None,
) -> list[torch.nn.Parameter]:
    """A PEFT LoRA adapter ``name`` in ``dtype`` (the served dtype); returns its trainable parameters.
    ``alpha`` defaults to the rank (scale 1), ``targets`` to :data:`LORA_TARGETS`."""
    import warnings

    from peft import LoraConfig

    config = LoraConfig(
        r=rank, lora_alpha=alpha or rank, target_modules=list(targets or LORA_TARGETS), lora_dropout=0.0,
        init_lora_weights=True,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns about a second adapter (DiffusionNFT's "old")
        transformer.add_adapter(config, adapter_name=name)
    # Not "the dtype of the first parameter": Wan keeps some (scale_shift_table) in float32, and a
    # float32 adapter on the trainer against the server's bf16 one breaks the ratio's exactness.
    params = []
    for n, p in transformer.named_parameters():
        if f".{name}." in n:
            p.data = p.data.to(dtype)  # see the module docstring: the server's dtype on both sides
            params.append(p)
    return params
