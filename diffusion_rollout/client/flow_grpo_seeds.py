"""diffusers' ``generator`` argument as rollout request fields, for the flow_grpo drop-in.

flow_grpo's pipeline seeds only ``x_T`` from the generators (its step noise comes from the global
RNG). Its scripts pass no generator, one, or one per image; with ``same_latent`` a later version
builds the list from the prompts, so images of one prompt repeat a seed to share ``x_T``.

Design decisions:

- **A seed that occurs once fixes the whole sample** (``seeds``: ``x_T`` and every step's noise), so
  a rollout can be repeated. One generator gives ``seed + k`` for image ``k`` (the server's rule).
- **A seed that repeats means a shared x_T** and nothing more: its images are sent with
  ``initial_noise_seed`` = that seed, which draws ``x_T`` exactly as a generator seeded with it does
  (server/core/initial_noise.py), so every image of that seed starts from the same ``x_T``, the one a lone
  image of that seed would get. Its step noise comes from a seed derived from the repeated seed and
  the image's occurrence (:func:`step_seed`), so the samples differ and the call still repeats bit
  for bit.
- **Rows with the same conditioning travel once** (:func:`plan_requests`): flow_grpo repeats each
  prompt over its group, and one request of ``G`` outputs sends the embeddings once instead of
  ``G`` times and runs as one pipeline call.
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


def plan_requests(
    keys: list[Any], seeds: list[int] | None, per_row: int
) -> list[tuple[int, dict[str, Any], list[int]]]:
    """The requests of one call: ``(row, seed fields, output indices)`` each.

    ``keys[r]`` names row ``r``'s conditioning: rows with equal keys (a prompt repeated over its
    group, as flow_grpo's sampler repeats it) become one request of several outputs, so their
    embeddings travel once and run in one pipeline call, when their seeds allow it (all distinct in
    the call, or one seed shared by exactly that group); otherwise each image is its own request.
    ``row`` is the row whose conditioning the request carries; the output indices say where its
    outputs go in the call's order (row-major).
    """
    groups: dict[Any, list[int]] = {}
    for r, key in enumerate(keys):
        groups.setdefault(key, []).append(r)
    counts = collections.Counter(seeds or ())
    seen: collections.Counter[int] = collections.Counter()
    plan = []
    for rows in groups.values():
        outputs = [r * per_row + k for r in rows for k in range(per_row)]
        mine = [seeds[o] for o in outputs] if seeds is not None else None
        if mine is None:
            plan.append((rows[0], {"num_outputs_per_prompt": len(outputs)}, outputs))
        elif all(counts[s] == 1 for s in mine):
            plan.append((rows[0], {"seeds": mine, "num_outputs_per_prompt": len(outputs)}, outputs))
        elif len(set(mine)) == 1 and counts[mine[0]] == len(mine):
            s = mine[0]
            fields = {"initial_noise_seed": s, "seeds": [step_seed(s, k) for k in range(len(mine))]}
            plan.append((rows[0], {**fields, "num_outputs_per_prompt": len(outputs)}, outputs))
            seen[s] += len(mine)
        else:
            for o, s in zip(outputs, mine, strict=True):
                if counts[s] == 1:
                    fields = {"seeds": [s]}
                else:
                    fields = {"initial_noise_seed": s, "seeds": [step_seed(s, seen[s])]}
                    seen[s] += 1
                plan.append((o // per_row, {**fields, "num_outputs_per_prompt": 1}, [o]))
    return plan
