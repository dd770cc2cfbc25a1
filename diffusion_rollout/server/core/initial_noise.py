"""Where each output's random numbers come from: its x_T and the noise of its stochastic steps.

Per output ``i`` of a request (``plan.seeds[i]`` is its seed):

- **Default**: a generator seeded ``seeds[i]`` on ``generator_device`` draws x_T with the pipeline's
  own ``prepare_latents`` at batch 1 (what the stock pipeline does with a list of generators), then
  the noise of every stochastic step, in order.
- ``initial_noise_seed`` alone: every output shares one x_T, drawn by ``prepare_latents`` from a
  generator seeded ``initial_noise_seed``; the output's own generator feeds only its step noise.
- ``initial_noise_group_ids`` (+ ``initial_noise_seed``, optional ``initial_noise_latent_shape``):
  the Relax/UniRL recipe (:mod:`diffusion_rollout.protocol.noise_recipes`): outputs with the same group id
  share the x_T derived from the base seed and the id, drawn on the CPU in float32 in the unpacked
  shape, cast to the pipeline's latent dtype and packed as the pipeline packs its own noise.
- ``initial_noise`` (UniRL's field, a tensor): the trainer's own x_T, ``[n, *noise_shape]`` or one
  ``[*noise_shape]`` for every output, unpacked, any floating dtype; cast to the pipeline's latent
  dtype and packed as the recipe's noise is. The output's generator then feeds only its step noise.
- ``denoise_seeds`` (one key per output): stochastic step ``k`` of output ``i`` draws from a fresh
  CPU generator derived from ``seed``, ``k`` and ``denoise_seeds[i]``, independent of x_T.

``validate`` runs in the planner (400s before anything is queued); ``sample_noise`` runs on the
worker for one request of a pipeline call. Nothing here depends on the rest of the batch, so these
requests batch with any other request of the same settings.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from diffusion_rollout.errors import RequestError
from diffusion_rollout.protocol import noise_recipes
from diffusion_rollout.server.core.params import GenerateParams
from diffusion_rollout.server.families import CallSettings, FamilyAdapter

StepGenerator = Callable[[int], torch.Generator]


@dataclass
class SampleNoise:
    """One request's x_T (``[1, ...]`` each), generators and optional per-step generators."""

    latents: list[torch.Tensor]
    generators: list[torch.Generator]
    step_generators: list[StepGenerator | None]


def validate(p: GenerateParams, n: int, adapter: FamilyAdapter, call: CallSettings) -> None:
    """Check the recipe fields of a request of ``n`` outputs against the model (``RequestError``)."""
    if p.initial_noise is not None:
        _validate_given_noise(p, n, adapter, call)
    ids = p.initial_noise_group_ids
    if ids is not None:
        if len(ids) not in (1, n):
            raise RequestError(
                f"initial_noise_group_ids has {len(ids)} entries; send one per output "
                f"(num_outputs_per_prompt={n}) or one for all",
                field="initial_noise_group_ids",
            )
        if p.initial_noise_seed is None:
            raise RequestError(
                "initial_noise_group_ids needs initial_noise_seed (the base every group's x_T is "
                "derived from)",
                field="initial_noise_seed",
            )
        expected = adapter.noise_shape(call)
        shape = p.initial_noise_latent_shape
        if shape is not None and tuple(shape) != tuple(expected):
            raise RequestError(
                f"initial_noise_latent_shape={list(shape)} is not this model's latent shape "
                f"{list(expected)} at {call.width}x{call.height}"
                + (f", {call.num_frames} frames" if call.num_frames else ""),
                field="initial_noise_latent_shape",
            )
    keys = p.denoise_seeds
    if keys is not None:
        if len(keys) != n:
            raise RequestError(
                f"denoise_seeds has {len(keys)} entries but num_outputs_per_prompt={n}",
                field="denoise_seeds",
            )
        if p.seed is None:  # only with ``seeds``: otherwise the planner has drawn one already
            raise RequestError(
                "denoise_seeds derives every step's noise from seed: send seed with seeds",
                field="seed",
            )


def _validate_given_noise(p: GenerateParams, n: int, adapter: FamilyAdapter, call: CallSettings) -> None:
    x = p.initial_noise
    if p.initial_noise_seed is not None or p.initial_noise_group_ids is not None:
        raise RequestError(
            "initial_noise is the x_T itself: send it without initial_noise_seed / "
            "initial_noise_group_ids (one source of x_T)",
            field="initial_noise",
        )
    if not x.is_floating_point():
        raise RequestError(
            f"initial_noise must be a floating-point tensor, got {x.dtype}", field="initial_noise"
        )
    expected = tuple(adapter.noise_shape(call))
    if tuple(x.shape) not in ((n, *expected), expected):
        raise RequestError(
            f"initial_noise has shape {list(x.shape)}; this model's x_T for {n} output(s) is "
            f"{[n, *expected]} (or {list(expected)} for all), unpacked, at {call.width}x{call.height}",
            field="initial_noise",
        )
    if not bool(torch.isfinite(x).all()):
        raise RequestError("initial_noise contains NaN or Inf", field="initial_noise")


def _step_generator(base_seed: int, key: str, step: int) -> torch.Generator:
    return noise_recipes.step_generator(base_seed, step, key)


def sample_noise(
    p: GenerateParams,
    seeds: list[int],
    adapter: FamilyAdapter,
    call: CallSettings,
    dtype: torch.dtype,
    device: str,
) -> SampleNoise:
    """Draw the x_T and build the generators of one request's outputs (on the worker thread)."""
    n = len(seeds)
    gen_device = p.generator_device
    shared = None
    grouped: list[torch.Tensor] | None = None
    if p.initial_noise is not None:
        ref = adapter.latent_reference(call, dtype)
        rows = p.initial_noise if p.initial_noise.ndim == len(adapter.noise_shape(call)) + 1 else None
        # Cast first, then pack, as for the recipe's noise (packing only moves elements).
        grouped = [
            adapter.pack_noise(
                call, (rows[i] if rows is not None else p.initial_noise).to(device=device, dtype=ref.dtype)
            )
            for i in range(n)
        ]
    elif p.initial_noise_group_ids is not None:
        ids = list(p.initial_noise_group_ids)
        ids = ids * n if len(ids) == 1 else ids
        shape = tuple(p.initial_noise_latent_shape or adapter.noise_shape(call))
        ref = adapter.latent_reference(call, dtype)
        drawn: dict[str, torch.Tensor] = {}
        for gid in ids:
            if gid not in drawn:
                raw = noise_recipes.group_noise(p.initial_noise_seed, gid, shape)
                # Cast first, then pack (the patch's order; packing only moves elements).
                drawn[gid] = adapter.pack_noise(call, raw.to(device=device, dtype=ref.dtype))
        grouped = [drawn[gid] for gid in ids]
    elif p.initial_noise_seed is not None:
        g0 = torch.Generator(gen_device).manual_seed(p.initial_noise_seed)
        shared = adapter.initial_latents(call, g0, dtype, device)

    latents, generators, step_generators = [], [], []
    for i, seed in enumerate(seeds):
        g = torch.Generator(gen_device).manual_seed(seed)
        # Without shared noise x_T comes from the sample's own generator, first, as in the stock
        # pipeline; with it, the generator only feeds the per-step noise.
        if grouped is not None:
            latents.append(grouped[i])
        elif shared is not None:
            latents.append(shared)
        else:
            latents.append(adapter.initial_latents(call, g, dtype, device))
        generators.append(g)
        step_generators.append(
            functools.partial(_step_generator, p.seed, p.denoise_seeds[i]) if p.denoise_seeds else None
        )
    if p.branch:  # a tree: every row's step noise keyed by its node (server/core/branch_tree.py)
        from diffusion_rollout.server.core.branch_tree import step_generators as node_generators

        step_generators = node_generators(p, n)
    return SampleNoise(latents, generators, step_generators)
