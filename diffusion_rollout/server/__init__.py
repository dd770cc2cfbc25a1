"""One engine in one process, by concern.

- ``core``: the engine, requests to batches to pipeline calls to answers (planner, worker, batch
  runner, delivery), the loader, the rewards it scores;
- ``families``: one adapter per model family, the engine's only knowledge of each pipeline;
- ``parallel``: context parallelism, its ranks, calls and sharding plans;
- ``speed``: the speed options, the fast tier (FP8, FA4), compile, its cache and warm-up, CUDA
  graphs, pipeline lanes;
- ``weights``: hot full-weight and LoRA updates, staged and committed whole or not at all.
"""
