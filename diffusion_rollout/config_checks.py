"""How the server's options are checked: one option's value as it is read, then the options together.

``config.py`` declares the options and calls these from its pydantic validators; kept apart so that
each stays short. Every check raises ``ValueError`` naming the option(s), which pydantic reports (the
CLI prints it and exits; a bad environment variable fails the same way).

- **One option** (``reward_list``, ``gpu_indices``, ``warmup_shapes``, ``writable_folder``): parsed or
  refused before any other check runs.
- **Together** (:func:`check_options`): a combination that would otherwise load and then fail every
  request, or look applied and mean nothing, is refused at start-up in one line. These run after
  ``--speed`` expanded its preset (``ServerConfig._apply_speed_preset``), so they see the options as
  the server will use them, in a fixed order (the first refusal is the one reported).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffusion_rollout.config import ServerConfig


_SHAPE = r"\d+x\d+(?:x\d+)?"
_WARMUP_SHAPES = re.compile(rf"\s*(?:none|{_SHAPE}(?:\s*,\s*{_SHAPE})*)\s*", re.IGNORECASE)


# ------------------------------------------------------------------------------------- one option
def reward_list(value: object) -> object:
    """``--reward``: a list of ``NAME=SPEC`` (an environment variable: one string, ';' between them)."""
    if isinstance(value, str):
        value = [v for v in value.split(";") if v.strip()]
    if isinstance(value, list) and value:
        from diffusion_rollout.rewards import parse_named_reward

        names = [parse_named_reward(str(v))[0] for v in value]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"reward: the name(s) {twice} are given more than once")
    return value


def gpu_indices(name: str, value: str | None) -> str | None:
    if value is not None and not re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", value):
        raise ValueError(f"{name}={value!r}: expected CUDA device indices separated by commas (e.g. 1,2)")
    return value


def warmup_shapes(value: str | None) -> str | None:
    if value is not None and not _WARMUP_SHAPES.fullmatch(value):
        raise ValueError(
            f"warmup_shapes={value!r}: expected WIDTHxHEIGHT[xFRAMES] sizes separated by commas "
            "(e.g. 512x512,1024x768), or none"
        )
    return value


def writable_folder(name: str, value: str | None) -> str | None:
    """A folder made private if missing and writable by this process; its resolved path."""
    if value is None:
        return None
    from diffusion_rollout.own_files import make_private_dirs

    folder = Path(value).expanduser()
    try:
        make_private_dirs(folder)
    except OSError as exc:
        raise ValueError(f"{name}={value!r}: cannot make the folder ({exc})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{name}={value!r}: the folder is not writable")
    return str(folder.resolve())


# -------------------------------------------------------------------------------------- together
def check_options(config: ServerConfig) -> None:
    """Raise ``ValueError`` (pydantic reports it) for the first combination of options refused."""
    for check in (
        upload_port_differs,
        speed_options_fit_the_device,
        context_parallel_vae_needs_ranks,
        context_parallel_layout_fits,
        fast_tier_can_run,
        placement_needs_replicas,
    ):
        check(config)


def upload_port_differs(config: ServerConfig) -> None:
    # Both sockets bind the same host: the same fixed port would fail at start-up, less clearly.
    if config.upload_port and config.upload_port == config.port:
        raise ValueError(f"upload_port={config.upload_port} is the main port; pick another one, or 0")


def speed_options_fit_the_device(config: ServerConfig) -> None:
    # A clear start-up error rather than a server that loads and then fails every request.
    if config.cuda_graphs:
        device = config.resolved_device()
        if not device.startswith("cuda"):
            raise ValueError(f"cuda_graphs needs a CUDA device; this server runs on {device!r}")
        if config.compile:
            raise ValueError("cuda_graphs replays the eager denoiser; it cannot be combined with compile")
    if config.pipeline_lanes > 1:
        # Graph replays share static buffers, compiled blocks and the ranks' collectives their
        # caller: two calls at once on them would race.
        for name in ("compile", "cuda_graphs"):
            if getattr(config, name):
                raise ValueError(f"pipeline_lanes={config.pipeline_lanes} cannot be combined with {name}")
        if config.context_parallel > 1:
            raise ValueError(
                f"pipeline_lanes={config.pipeline_lanes} cannot be combined with "
                f"context_parallel={config.context_parallel}"
            )
    if config.context_parallel > 1:
        # Followers run the plain eager transformer; a compiled or graph-replayed rank 0 would not
        # call it through the hook that hands each call to them.
        for name in ("compile", "cuda_graphs"):
            if getattr(config, name):
                raise ValueError(f"context_parallel={config.context_parallel} cannot be combined with {name}")
        gpus = config.gpus_per_replica
        if config.replicas is not None and gpus is not None and 0 < gpus < config.context_parallel:
            raise ValueError(
                f"context_parallel={config.context_parallel} needs gpus_per_replica >= "
                f"{config.context_parallel} (got {gpus:g})"
            )


def context_parallel_vae_needs_ranks(config: ServerConfig) -> None:
    if config.context_parallel_vae == "split" and config.context_parallel < 2:
        raise ValueError(
            "context_parallel_vae=split spreads the VAE decode over the context-parallel ranks; it "
            f"needs context_parallel > 1 (got context_parallel={config.context_parallel})"
        )


def context_parallel_layout_fits(config: ServerConfig) -> None:
    ring = config.context_parallel_ring_degree
    if ring is not None and config.context_parallel_mode != "hybrid":
        # Refused rather than ignored: a ring degree given with ring mode (where it is k) or with
        # ulysses would otherwise look applied in the config and mean nothing.
        raise ValueError(
            f"context_parallel_ring_degree={ring} applies to context_parallel_mode=hybrid only "
            f"(got context_parallel_mode={config.context_parallel_mode}; ring mode's degree is "
            "context_parallel)"
        )
    if config.context_parallel_mode == "hybrid":
        ring, k = config.context_parallel_degrees()[0], config.context_parallel
        if not 1 < ring < k or k % ring:
            raise ValueError(
                f"context_parallel_mode=hybrid needs 1 < context_parallel_ring_degree < context_parallel "
                f"and context_parallel divisible by it (got context_parallel_ring_degree={ring}, "
                f"context_parallel={k}); for one ring over every rank use context_parallel_mode=ring"
            )


def fast_tier_can_run(config: ServerConfig) -> None:
    # quantize / attention_backend=fa4 (server/speed/fast_tier.py): refused at start-up where they cannot
    # run, in one line, rather than failing at load or on every request.
    fa4 = config.attention_backend is not None and config.attention_backend.lower() == "fa4"
    if config.quantize is None and not fa4:
        return
    names = [
        n
        for n, on in ((f"quantize={config.quantize}", config.quantize), ("attention_backend=fa4", fa4))
        if on
    ]
    if config.context_parallel > 1:
        raise ValueError(f"{names[0]} cannot be combined with context_parallel={config.context_parallel}")
    if config.quantize is not None and config.cuda_graphs:
        raise ValueError(f"quantize={config.quantize} cannot be combined with cuda_graphs (not tried yet)")
    from diffusion_rollout.fast_tier_checks import unsupported_reason

    # A Ray front may see no GPU: then only the device name is checked here, each replica's
    # loader checks the GPU and the packages.
    reason = unsupported_reason(
        quantize=config.quantize,
        attention_backend=config.attention_backend,
        device=config.resolved_device(),
        check_hardware=config.replicas is None,
    )
    if reason:
        raise ValueError(reason)


def placement_needs_replicas(config: ServerConfig) -> None:
    if config.placement is None:
        return
    if config.replicas is None:
        raise ValueError(f"placement={config.placement} places Ray replicas; set replicas too")
    if config.cpus_per_replica == 0 and config.gpus_per_replica == 0:
        # A placement group bundle must reserve something.
        raise ValueError(
            f"placement={config.placement} needs each replica to reserve a CPU or a GPU "
            "(cpus_per_replica and gpus_per_replica are both 0)"
        )
