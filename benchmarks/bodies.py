"""The request bodies the benchmarks send: one definition, so every script measures the same request."""

from __future__ import annotations

from typing import Any

from benchmarks.model_builders import BenchModel

# The prompt of the Flow-GRPO workload, in throughput and in speed_options alike.
GRPO_PROMPT = "a watercolor painting of a lighthouse at dusk"
# An SDE rollout as a Flow-GRPO trainer asks for it: every step stochastic (noise level 0.7), per-step
# log-probabilities and the full ``dit_trajectory``. The debug tensors are off: they are for checking
# the math, not for training.
SDE_ROLLOUT: dict[str, Any] = {
    "rollout": True,
    "rollout_sde_type": "sde",
    "rollout_noise_level": 0.7,
    "rollout_return_dit_trajectory": True,
    "rollout_debug_mode": False,
}
# The same with ``denoising_env``, what a trainer that replays the rollout needs as well.
SDE_ROLLOUT_ENV: dict[str, Any] = {**SDE_ROLLOUT, "rollout_return_denoising_env": True}


def request_body(model: BenchModel, prompt: str, **fields: Any) -> dict[str, Any]:
    """The model's defaults for ``prompt`` (seed 0, the model's generator device); ``fields`` win."""
    return {
        "prompt": prompt,
        "seed": 0,
        "generator_device": model.generator_device,
        **model.defaults,
        **fields,
    }


def size_label(body: dict[str, Any]) -> str:
    """``WxH``, or ``WxHxF`` for a video request, as the tables show it."""
    return f"{body['width']}x{body['height']}" + (f"x{body['num_frames']}" if body.get("num_frames") else "")
