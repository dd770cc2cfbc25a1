"""Screen, then regenerate (Sol-RL): the request that re-runs chosen outputs exactly.

A screening request (the fast tier, a ``feature_cache`` with ``allow_inexact``, or any request)
returns candidates; the trainer keeps some and asks for exactly those again where the numbers are
exact. Everything random about an output is named by fields the server already takes:

- its seed (``seed`` in every answer: ``seed + i`` or ``seeds[i]``), which feeds its step noise and,
  without shared noise, its x_T;
- the request's shared x_T (``initial_noise_seed``; per output ``initial_noise_group_ids`` or rows
  of ``initial_noise``) and, with ``denoise_seeds``, the output's key and the request's ``seed``.

:func:`regenerate_body` keeps those for the chosen outputs only (``seeds`` lists the chosen seeds)
and drops what made the screen inexact. The regenerated outputs draw the same x_T and the same step
noise as the candidates; their model arithmetic is that of the new call (a batch of
``len(chosen)``), so they equal bit for bit a direct exact rollout of those seeds
(tests/server/core/test_shared_prefix.py), not the candidates' last bits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# Fields that change the numbers but not the random draws: the regeneration runs without them.
SCREEN_ONLY_FIELDS = ("feature_cache", "allow_inexact")


def _seed_of(answer: Any) -> int:
    return int(answer["seed"] if isinstance(answer, Mapping) else answer.seed)


def regenerate_body(
    screen_body: Mapping[str, Any], answers: Sequence[Any], chosen: Sequence[int], **changes: Any
) -> dict[str, Any]:
    """The ``/rollout/generate`` body that regenerates outputs ``chosen`` of ``screen_body``.

    ``answers`` are the screening request's outputs (decoded dicts or ``RolloutOutput``), in order;
    ``changes`` are applied last (e.g. ``rollout_return_dit_trajectory=True``).
    """
    if isinstance(screen_body.get("prompt"), list):
        raise ValueError("regenerate_body takes a one-prompt request; split a prompt list per group first")
    chosen = [int(i) for i in chosen]
    if not chosen:
        raise ValueError("choose at least one output to regenerate")
    for i in chosen:
        if not 0 <= i < len(answers):
            raise ValueError(f"output {i} is not one of the {len(answers)} answers")
    n = len(answers)
    body = {k: v for k, v in screen_body.items() if k not in SCREEN_ONLY_FIELDS}
    body["seeds"] = [_seed_of(answers[i]) for i in chosen]
    body["num_outputs_per_prompt"] = len(chosen)
    for name in ("initial_noise_group_ids", "denoise_seeds"):
        values = body.get(name)
        if values is not None and len(values) == n:
            body[name] = [values[i] for i in chosen]
    if body.get("initial_noise") is not None and "initial_noise" not in changes:
        # One unbatched x_T and per-output rows cannot be told apart without the model's latent
        # shape (a first dimension can equal the output count): the caller knows which it sent.
        raise ValueError("the screen sent initial_noise: pass the chosen outputs' x_T as initial_noise=...")
    body.update(changes)
    return body
