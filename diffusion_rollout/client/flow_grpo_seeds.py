"""diffusers' ``generator`` argument as rollout request fields, for the flow_grpo drop-in.

flow_grpo's pipeline seeds only ``x_T`` from the generators (its step noise comes from the global
RNG). Its scripts pass no generator, one, or one per image; with ``same_latent`` a later version
builds the list from the prompts, so images of one prompt repeat a seed to share ``x_T``.

Design decisions:

- **A seed that occurs once fixes the whole sample** (``seeds``: ``x_T`` and every step's noise), so
  a rollout can be repeated. One generator gives ``seed + k`` for image ``k`` (the server's rule).
- **A seed that repeats means a shared x_T** and nothing more: each such image becomes its own
  request with ``initial_noise_seed`` = that seed, which draws ``x_T`` exactly as a generator seeded
  with it does (server/initial_noise.py), so every image of that seed starts from the same ``x_T``,
  the one a lone image of that seed would get. Its step noise comes from a seed derived from the
  repeated seed and the image's occurrence (:func:`step_seed`), so the samples differ and the call
  still repeats bit for bit.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Any


def step_seed(seed: int, occurrence: int) -> int:
    """The step-noise seed of the ``occurrence``-th image (0-based) sharing ``x_T`` seed ``seed``."""
    digest = hashlib.sha256(f"flow_grpo-step-noise:{seed}:{occurrence}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # below 2**63, as the server's seeds are


def generator_seeds(generator: Any, total: int) -> tuple[list[int] | None, str | None]:
    """The per-image seeds (repeats kept) and the device of diffusers' ``generator`` argument."""
    if generator is None:
        return None, None
    gens = list(generator) if isinstance(generator, (list, tuple)) else [generator]
    if len(gens) == 1:
        seeds = [gens[0].initial_seed() + k for k in range(total)]
    elif len(gens) == total:
        seeds = [g.initial_seed() for g in gens]
    else:
        raise ValueError(f"got {len(gens)} generators for {total} images: pass one, or one per image")
    devices = {g.device.type for g in gens}
    if len(devices) != 1:
        raise ValueError(f"generator: all generators must be on one device, got {sorted(devices)}")
    return seeds, devices.pop()


def noise_requests(seeds: list[int] | None, rows: int, per_row: int) -> list[list[dict[str, Any]]]:
    """Per prompt row, the requests (their seed fields and output counts) that make its images."""
    if seeds is None:
        return [[{"num_outputs_per_prompt": per_row}] for _ in range(rows)]
    counts = collections.Counter(seeds)
    seen: collections.Counter[int] = collections.Counter()
    plan = []
    for r in range(rows):
        mine = seeds[r * per_row : (r + 1) * per_row]
        if all(counts[s] == 1 for s in mine):
            plan.append([{"seeds": mine, "num_outputs_per_prompt": per_row}])
            continue
        requests = []
        for s in mine:
            if counts[s] == 1:
                requests.append({"seeds": [s], "num_outputs_per_prompt": 1})
            else:
                requests.append(
                    {"initial_noise_seed": s, "seeds": [step_seed(s, seen[s])], "num_outputs_per_prompt": 1}
                )
                seen[s] += 1
        plan.append(requests)
    return plan
