"""diffusion-rollout: a rollout server for RL training of flow-matching image and video models.

Subpackages, imported one way only (``entrypoints -> server -> scheduler_mixins``):

- ``scheduler_mixins``: pure step math (SDE/CPS/Dance/ODE transitions, log-probs, schedules,
  per-request rollout state) mixed into diffusers' flow-match scheduler.
- ``server``: the engine that runs diffusers pipelines per family, batching and weight updates.
- ``entrypoints``: the FastAPI app, the request protocol and the CLI.
- ``client``: the thin trainer-side client and replay helpers.

``errors`` and ``wire`` are shared by all of them.
"""

__version__ = "0.1.0"
