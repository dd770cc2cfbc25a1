"""What the server and the client agree on: the bottom layer of the package.

The rollout request model (``requests``: ``GenerateRequest``, imported by the HTTP layer, the
cluster and the client), its tensor fields (``request_tensors``) and the other dialects' fields it
accepts with no effect (``dialects``); the wire codec (``wire``, the lean answer form ``lean``,
``msgpack_views``, ``safetensors_layout``); same-host answers (``answer_segments``), the weight formats and checks (``weight_transport``,
``checksums``, ``weight_versions``), which rows of a batch are computed once (``row_sharing``) and
the trainer-side noise recipes (``noise_recipes``). Modules here import only each other,
``diffusion_rollout.errors`` and the step math (``diffusion_rollout.scheduler_mixins``), so the
client can import any of them without the server (``tests/test_layers.py`` checks it).

Import the module you need (``from diffusion_rollout.protocol import wire``); this package
re-exports nothing.
"""
