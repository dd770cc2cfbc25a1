"""A context-parallel follower rank (``server/parallel/context_parallel.py``): it loads the denoisers (and,
for ``context_parallel_vae=split``, the VAE), joins rank 0's process group, and runs rank 0's ops
(``forward``, ``sync``, ``decode``, ``release``/``resume``, ``stop``) in the order rank 0 sends them,
until ``stop`` or until rank 0 is gone."""

from __future__ import annotations

import importlib
import queue
from typing import Any

import torch
from torch import nn

from diffusion_rollout.server.parallel.cp_calls import (
    DECODES,
    FORWARDS,
    LAST_OUTPUT,
    RELEASED,
    SYNCS,
    TILES,
    enable_layout,
    fill_tensors,
    init_group,
    output_checksum,
    slots,
    synced_tensors,
    weights_digest,
)
from diffusion_rollout.server.parallel.vae_split import owned_tiles, split_tiled_decode, tile_grid


def _load_modules(
    spec: dict[str, Any], device: str, entries: dict[str, tuple], dtype: torch.dtype
) -> dict[str, nn.Module]:
    modules = {}
    for name, (module_path, cls_name, config) in entries.items():
        cls = getattr(importlib.import_module(module_path), cls_name)
        if spec["model_path"]:
            module = cls.from_pretrained(spec["model_path"], subfolder=name, torch_dtype=dtype)
        else:  # an in-memory pipeline: any weights do, rank 0's are broadcast before the first call
            # Built in its dtype on its device: a float32 copy of a 14B expert first would not fit.
            default = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                with torch.device(device):
                    module = cls.from_config(config)
            finally:
                torch.set_default_dtype(default)
        modules[name] = module.to(device=device, dtype=dtype).eval()
    return modules


def _load_denoisers(spec: dict[str, Any], device: str) -> dict[str, nn.Module]:
    modules = _load_modules(spec, device, spec["denoisers"], spec["dtype"])
    if spec["attention_backend"]:
        for module in modules.values():
            module.set_attention_backend(spec["attention_backend"])
    return modules


def _load_vae(spec: dict[str, Any], device: str) -> dict[str, nn.Module]:
    """``{"vae": ...}`` for a split VAE decode (``context_parallel_vae=split``), else empty. In
    rank 0's VAE dtype (a pipeline may hold its VAE in another dtype than its denoisers)."""
    if spec["vae"] is None:
        return {}
    entry, dtype = spec["vae"]
    return _load_modules(spec, device, {"vae": entry}, dtype)


def follower_main(rank: int, world: int, port: int, spec: dict[str, Any], ops, events, stats, digest) -> None:
    """A follower rank: load the denoisers, then run rank 0's ops until ``stop`` (or rank 0 is gone)."""
    import multiprocessing as mp

    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])  # the same kernels as rank 0 (mirror mode compares bits)
    cuda = spec["cuda"]
    device = f"cuda:{spec['first_gpu'] + rank}" if cuda else "cpu"
    try:
        if cuda:
            torch.cuda.set_device(device)
        init_group(rank, world, port, cuda, spec["timeout_s"])
        modules = _load_denoisers(spec, device)
        held = {"denoisers": modules, "vae": _load_vae(spec, device)}
        # "ready" before enabling: enable_parallelism builds device meshes, which every rank (rank 0
        # too, once all followers are ready) must build together.
        events.put(("ready", rank, None))
        if cuda:
            enable_layout(modules, spec["ring_degree"], spec["ulysses_degree"])
    except BaseException as exc:
        events.put(("error", rank, f"{type(exc).__name__}: {exc}"[:2000]))
        return
    parent = mp.parent_process()
    try:
        while True:
            try:
                op = ops.get(timeout=1.0)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return
                continue
            kind = op[0]
            if kind == "stop":
                return
            if kind == "sync":
                _, target, layout, dtypes = op
                with torch.no_grad():
                    for t, dtype in zip(_follower_tensors(held[target], layout), dtypes, strict=True):
                        if t.dtype != dtype:  # hold it as rank 0 does, so both compute the same
                            t.data = t.data.to(dtype)
                        dist.broadcast(t.data, src=0)
                if target == "denoisers":
                    stats[SYNCS] += 1
                    if not cuda:
                        digest.value = weights_digest(modules).encode()
            elif kind in ("release", "resume"):
                # The engine's /release_memory_occupation: the followers' GPUs are freed too (a
                # colocated trainer wants them), then everyone meets so rank 0 answers only after.
                target = "cpu" if kind == "release" else device
                for m in (*modules.values(), *held["vae"].values()):
                    m.to(target)
                if cuda and kind == "release":
                    torch.cuda.empty_cache()
                stats[RELEASED] = 1.0 if kind == "release" else 0.0
                dist.barrier()
            elif kind == "forward":
                _, name, structure = op
                tensors = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in slots(structure)]
                for t in tensors:
                    dist.broadcast(t, src=0)
                args, kwargs = fill_tensors(structure, tensors)
                with torch.inference_mode():
                    out = modules[name](*args, **kwargs)
                stats[FORWARDS] += 1
                if not cuda:
                    stats[LAST_OUTPUT] = output_checksum(out)
            elif kind == "decode":
                _, shape, dtype, settings = op
                z = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(z, src=0)
                vae = held["vae"]["vae"]
                with torch.inference_mode():
                    split_tiled_decode(vae, z, settings)
                # Tiles before the decode count: a reader that sees the decode counted sees its tiles.
                stats[TILES] += len(owned_tiles(tile_grid(vae, shape, settings).count, rank, world))
                stats[DECODES] += 1
    except BaseException as exc:
        events.put(("error", rank, f"{type(exc).__name__}: {exc}"[:2000]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _follower_tensors(modules: dict[str, nn.Module], layout: list[tuple[str, str]]) -> list[torch.Tensor]:
    own = {(name, key): t for name, m in modules.items() for key, t in synced_tensors(m)}
    missing = [f"{n}.{k}" for n, k in layout if (n, k) not in own]
    if missing or len(own) != len(layout):
        raise RuntimeError(f"weight layout differs from rank 0's (missing here: {missing[:5]})")
    return [own[item] for item in layout]
