"""Seed derivations of the trainer-side noise recipes (Relax's and UniRL's SGLang patches).

Facts, read from the public sources (re-implemented here, not copied):

- Relax ships an SGLang patch (``redai-studio/Relax``, ``docker/patch/sglang/v0.5.17.patch``:
  ``runtime/pipelines_core/stages/latent_preparation.py`` and ``stages/denoising.py``); UniRL derives
  the same numbers trainer side (``Tencent-Hunyuan/UniRL``, ``unirl/sde/noise.py``) and in its own
  SGLang patches (``unirl/rollout/engine/sglang/_patches/patch_denoising.py``). Both agree on:
- **Group x_T** (``initial_noise_group_ids`` + ``initial_noise_seed`` + ``initial_noise_latent_shape``):
  output ``i`` starts from the x_T of its group id ``gid`` (compared as a string). The group's
  seed is the first 8 bytes of ``blake2b(f"{initial_noise_seed}::{gid}", digest_size=8)`` read
  big-endian, modulo ``2**63``; x_T is ``torch.randn(initial_noise_latent_shape)`` in float32 from a
  CPU ``torch.Generator`` seeded with it, then cast to the pipeline's latent dtype and device, then
  packed the way the pipeline packs its own noise (FLUX, Qwen-Image). The shape is the unpacked
  latent of one output (``[C, h, w]``, video ``[C, f, h, w]``).
- **Per-step noise** (``denoise_seeds``, one key per output): at loop step ``k`` output ``i`` draws
  its noise from a fresh CPU generator seeded with ``blake2b(f"{seed}::step::{k}::sample::{key_i}",
  digest_size=8)`` big-endian modulo ``2**63 - 1`` (not ``2**63``: the patches differ from the
  x_T rule here, and this keeps their numbers), where ``seed`` is the request's ``seed``. Steps that
  are not stochastic draw nothing.

Where this server differs from the patches (documented in docs/dialects.md, "Noise recipes"):

- The patches silently fall back to ordinary noise when part of the x_T recipe is missing; here
  ``initial_noise_group_ids`` without ``initial_noise_seed`` is a 400, and a shape that is not this
  model's latent shape is a 400 (the patch would draw the wrong shape and fail later or mis-pack).
- The per-step noise is drawn in float32 from the derived generator (this server's rule for every
  stochastic step); the patches draw it in the model output's dtype. For float32 models the numbers
  are identical; for bf16 models the patches' noise is the bf16 draw.
- This project's older ``initial_noise_seed`` alone (no group ids) keeps its meaning: every output
  of the request shares one x_T drawn by the pipeline's own ``prepare_latents`` from
  ``torch.Generator(generator_device).manual_seed(initial_noise_seed)``, in the model's dtype. With
  group ids the same field is the base of the recipe above instead.

The functions are plain so a trainer can rebuild the exact x_T and step noise of any output.
"""

from __future__ import annotations

import hashlib

import torch

# The patches' bound: torch.Generator.manual_seed conventions (largest signed 64-bit value).
MAX_TORCH_SEED = (1 << 63) - 1


def _digest64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def group_seed(base_seed: int, group_id: str | int) -> int:
    """The seed of one x_T group (``initial_noise_seed`` and a group id)."""
    return _digest64(f"{int(base_seed)}::{group_id}") % (MAX_TORCH_SEED + 1)


def step_seed(base_seed: int, step_index: int, sample_key: str | int) -> int:
    """The seed of output ``sample_key``'s noise at loop step ``step_index`` (``denoise_seeds``)."""
    return _digest64(f"{int(base_seed)}::step::{int(step_index)}::sample::{sample_key}") % MAX_TORCH_SEED


def group_noise(base_seed: int, group_id: str | int, shape: tuple[int, ...]) -> torch.Tensor:
    """One group's x_T before packing: float32, on the CPU, ``shape`` as given."""
    generator = torch.Generator("cpu").manual_seed(group_seed(base_seed, group_id))
    return torch.randn(tuple(int(v) for v in shape), generator=generator, dtype=torch.float32, device="cpu")


def step_generator(base_seed: int, step_index: int, sample_key: str | int) -> torch.Generator:
    """The CPU generator output ``sample_key`` draws its step-``step_index`` noise from."""
    return torch.Generator("cpu").manual_seed(step_seed(base_seed, step_index, sample_key))
