"""Context parallelism: one request's transformer calls run on k ranks (``config.context_parallel``).

diffusers' context parallelism (``enable_parallelism(config=ContextParallelConfig(ring_degree=r,
ulysses_degree=k / r))``: ``context_parallel_mode`` ulysses is r = 1, ring r = k, hybrid r =
``context_parallel_ring_degree``) is SPMD: every rank must call the transformer's forward with the same full
inputs; attention shards the token sequence over the ranks and the output is gathered, so every rank
gets the same output. The engine process is rank 0 and runs the whole pipeline as usual; this module
gives it k-1 *follower* processes that hold only the denoisers and run each transformer call with it.

Design decisions:

- **Rank 0 drives, followers mirror its calls.** A forward pre-hook on each rank-0 denoiser hands the
  call to the followers before rank 0 runs it: the call's structure (which denoiser, args and kwargs
  with every tensor replaced by its shape and dtype) goes to each follower over its own
  multiprocessing queue, the tensors go over ``torch.distributed`` broadcasts (NCCL on CUDA, so they
  stay on the GPU; gloo on the CPU). Followers block on the queue between requests, so an idle server
  never sits in a collective and ``context_parallel_timeout_s`` bounds only real work.
- **Everything happens on the engine's worker thread**, which alone calls the transformers: the
  followers see the calls in rank 0's order and a weight sync can never land inside a batch.
- **Weights follow rank 0 lazily.** The engine marks the weights changed whenever its
  ``weight_version`` changes (the one place every successful weight or LoRA change passes through,
  rollbacks of a cluster included); the next op sent to the followers (normally the next batch's
  first transformer call) is preceded by a broadcast of every denoiser parameter and buffer, which the
  followers copy in place. Dynamic-mode LoRA is refused on such an engine (``weights/lora_ops.py``):
  an adapter applied in forward would change what rank 0 computes without changing its parameters.
  Merged mode folds the adapter into the base weights, which the sync carries.
- **The VAE decode: rank 0's, or split** (``context_parallel_vae``). By default rank 0 decodes alone
  (the stock untiled decode). With ``split`` the followers also hold the VAE (loaded like the
  denoisers, rank 0's weights sent once at start-up: no weight update touches it) and rank 0's
  ``vae.decode`` hands each decode that its tiling would tile to them as a ``decode`` op (the latent
  broadcast, the tile settings in the op): every rank decodes its share of the tiles and rank 0
  blends them (``server/parallel/vae_split.py``): the one-process *tiled* decode, bit for bit, on CUDA and in
  CPU mirror mode alike.
- **CPU: mirror mode.** diffusers' parallelism resolves ranks to accelerator devices, so on the CPU
  (gloo) it is not enabled: each follower runs the *whole* transformer on the same inputs and its
  output is discarded. That serves nothing faster; it exists so the lockstep, the weight sync and the
  shutdown are tested on CPU. In mirror mode every rank records a checksum of its last output and
  of its weights (``stats()``), so tests compare follower and rank 0 bit for bit.
- **Failure is loud and bounded.** A follower that fails to start reports its error before exiting;
  rank 0 checks that every follower is alive before each op, and collectives time out after
  ``context_parallel_timeout_s``. Either raises ``ContextParallelError``, after which the engine
  reports itself failed (a rollout would otherwise hang or compute with a missing rank).
- **A ring runs ``_native_flash`` unless a backend is configured.** Ring attention (ring and hybrid)
  merges each key/value block's partial output by its log-sum-exp, which diffusers' default native
  backend does not return; ``_native_flash`` does, in bfloat16 or float16 only, so a float32 CUDA
  engine is refused at start-up. A configured ``attention_backend`` is left alone on every rank
  (``enable_parallelism`` refuses one without context parallelism). The rules are
  :func:`~diffusion_rollout.server.parallel.cp_plans.check_start`'s, on a CPU engine too (but the dtype's),
  so one configuration is accepted or refused the same everywhere.
- **Three modules.** This one is rank 0 (:class:`ContextParallelGroup`, :func:`start_for`);
  ``server/parallel/cp_follower.py`` is a follower rank; ``server/parallel/cp_calls.py`` is what both share (a call's
  structure without its tensors, the weight layout, the process group and the layout).
- Exactness: k GPUs sum attention in another order than one, so a k-GPU rollout is not expected to be
  bit-identical to a 1-GPU one; a 1-GPU replay reproduces it to that distance
  (``benchmarks/context_parallel.py`` measures it).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any

import torch
from torch import nn

from diffusion_rollout.errors import ContextParallelError
from diffusion_rollout.server.parallel.cp_calls import (
    DECODES,
    FORWARDS,
    LAST_OUTPUT,
    RELEASED,
    SYNCS,
    TILES,
    enable_layout,
    init_group,
    module_entry,
    output_checksum,
    strip_tensors,
    synced_tensors,
    weights_digest,
)
from diffusion_rollout.server.parallel.cp_follower import follower_main
from diffusion_rollout.server.parallel.cp_plans import check_start, ring_backend
from diffusion_rollout.server.parallel.vae_split import (
    TileSettings,
    install_split_decode,
    remove_split_decode,
    split_tiled_decode,
)
from diffusion_rollout.testing import free_port

logger = logging.getLogger(__name__)

# Families whose transformers diffusers ships a context-parallel plan for (``_cp_plan``): Wan text-to-
# video (one expert or two) and image-to-video. ``WanTransformer3DModel``'s plan shards the token
# sequence after the patch embedding, so I2V's channel-concatenated input (noise, mask, image latents)
# is sharded like T2V's; cross-attention (text, and Wan 2.1 I2V's CLIP image tokens) is not sharded;
# TI2V-5B's per-token ``[B, tokens]`` timestep is split along the tokens with the sequence.
# LTX-2 (``ltx2``) and HunyuanVideo 1.5 (``hunyuanvideo15``, no diffusers plan) run the server's own
# plans (``server/parallel/cp_plans.py``).
SUPPORTED_FAMILIES = ("wan", "wan2.2", "wan-i2v", "wan2.2-i2v", "wan2.2-ti2v-i2v", "ltx2", "hunyuanvideo15")
# Of those, the families whose transformer gets one timestep per token (``expand_timesteps``).
_TIMESTEP_PER_TOKEN = ("wan2.2-ti2v-i2v",)


# ---------------------------------------------------------------------- rank 0
class ContextParallelGroup:
    """Rank 0's side: the followers, the hooks on its denoisers, the weight sync and the stats."""

    def __init__(
        self,
        denoisers: dict[str, nn.Module],
        *,
        ranks: int,
        mode: str,
        device: str,
        dtype: torch.dtype,
        model_path: str | None,
        ring_degree: int = 1,
        attention_backend: str | None = None,
        timeout_s: float = 600.0,
        vae: nn.Module | None = None,
    ) -> None:
        import multiprocessing as mp

        self.denoisers = denoisers
        # context_parallel_vae=split: the followers hold the VAE too and decode its tiles with rank 0.
        self.vae = vae
        self.decodes = 0
        self.ranks = ranks
        self.cuda = device.startswith("cuda")
        self.configured_mode = mode
        self.mode = mode if self.cuda else "mirror"
        self.ring_degree, self.ulysses_degree = ring_degree, ranks // ring_degree
        # Mirror mode shards nothing, so it sets no backend; on CUDA a ring needs the log-sum-exp.
        self.attention_backend = ring_backend(attention_backend, ring_degree, self.cuda)
        self.timeout_s = timeout_s
        self.error: str | None = None
        self.forwards = 0
        self.last_output: float | None = None
        self._weights_dirty = True  # the first op sends rank 0's weights: every rank holds the same bits
        self._hooks: list[Any] = []
        ctx = mp.get_context("spawn")
        first_gpu = (torch.device(device).index or 0) if self.cuda else 0
        spec = {
            "denoisers": {name: module_entry(m) for name, m in denoisers.items()},
            "vae": None if vae is None else (module_entry(vae), vae.dtype),
            "model_path": model_path,
            "dtype": dtype,
            "cuda": self.cuda,
            "first_gpu": first_gpu,
            "ring_degree": self.ring_degree,
            "ulysses_degree": self.ulysses_degree,
            "attention_backend": self.attention_backend,
            "threads": torch.get_num_threads(),
            "timeout_s": timeout_s,
        }
        port = free_port()
        self._events = ctx.Queue()
        self._ops = [ctx.Queue() for _ in range(ranks - 1)]
        self._stats = [ctx.Array("d", 6, lock=False) for _ in range(ranks - 1)]
        self._digests = [ctx.Array("c", 64, lock=False) for _ in range(ranks - 1)]
        self._procs = []
        for r in range(1, ranks):
            shared = (self._ops[r - 1], self._events, self._stats[r - 1], self._digests[r - 1])
            self._procs.append(
                ctx.Process(
                    target=follower_main,
                    args=(r, ranks, port, spec, *shared),
                    name=f"context-parallel-rank{r}",
                    daemon=True,
                )
            )
        logger.info("context parallel: starting %d follower rank(s), mode %s", ranks - 1, self.mode)
        for p in self._procs:
            p.start()
        try:
            if self.cuda:
                torch.cuda.set_device(first_gpu)
            init_group(0, ranks, port, self.cuda, timeout_s)
            self._wait_ready()
            if self.cuda:
                if self.attention_backend != attention_backend:  # chosen here: rank 0's loader set none
                    for module in denoisers.values():
                        module.set_attention_backend(self.attention_backend)
                enable_layout(denoisers, self.ring_degree, self.ulysses_degree)
            self._sync_weights()
            if vae is not None:
                # Once: no weight update changes the VAE, but a follower built from the config (an
                # in-memory pipeline) holds random weights until it gets rank 0's.
                self._broadcast_weights("vae", {"vae": vae})
        except BaseException as exc:
            self.stop()
            if isinstance(exc, ContextParallelError):
                raise
            raise ContextParallelError(f"context_parallel: starting the followers failed: {exc}") from exc
        for name, module in denoisers.items():
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._hooks.append(module.register_forward_hook(self._post_hook))
        if vae is not None:
            install_split_decode(vae, self._split_decode)
        logger.info(
            "context parallel: %d ranks ready (VAE decode: %s)",
            ranks,
            "split" if vae is not None else "rank 0",
        )

    @property
    def exact(self) -> bool:
        """Mirror mode leaves rank 0's computation alone; sharded attention does not."""
        return self.mode == "mirror"

    # ------------------------------------------------------------------ start-up and health
    def _wait_ready(self) -> None:
        ready: set[int] = set()
        waited = 0.0
        while len(ready) < self.ranks - 1:
            try:
                kind, rank, message = self._events.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                self._check_alive()
                if waited > self.timeout_s:
                    raise ContextParallelError(
                        f"context_parallel: followers not ready within context_parallel_timeout_s={self.timeout_s:g}"
                    ) from None
                continue
            if kind == "error":
                raise ContextParallelError(
                    f"context_parallel: follower rank {rank} failed to start: {message}"
                )
            ready.add(rank)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise ContextParallelError(self.error)
        dead = [p for p in self._procs if not p.is_alive()]
        if dead:
            detail = ""
            try:
                _, rank, message = self._events.get_nowait()
                detail = f"; rank {rank}: {message}"
            except queue.Empty:
                pass
            codes = ", ".join(f"{p.name} (exit code {p.exitcode})" for p in dead)
            self.error = f"context_parallel: follower process(es) ended: {codes}{detail}"
            raise ContextParallelError(self.error)

    def _send(self, op: tuple) -> None:
        self._check_alive()
        for q in self._ops:
            q.put(op)

    def _collective(self, fn, what: str) -> None:
        try:
            fn()
        except Exception as exc:  # a follower died inside the collective, or it timed out
            self.error = f"context_parallel: {what} with the followers failed: {type(exc).__name__}: {exc}"
            raise ContextParallelError(self.error) from exc

    # ------------------------------------------------------------------ memory
    def release_memory(self, release: bool) -> None:
        """Move the followers' denoisers to the CPU (``release``) or back to their GPUs; returns once
        every follower has done it. Called on the engine's worker, between batches."""
        import torch.distributed as dist

        self._send(("release" if release else "resume",))
        self._collective(dist.barrier, "releasing memory" if release else "resuming memory")

    # ------------------------------------------------------------------ weights
    def weights_changed(self) -> None:
        """Rank 0's weights changed: the followers get them before the next op."""
        self._weights_dirty = True

    def _sync_weights(self) -> None:
        self._broadcast_weights("denoisers", self.denoisers)
        self._weights_dirty = False

    def _broadcast_weights(self, target: str, modules: dict[str, nn.Module]) -> None:
        import torch.distributed as dist

        tensors = [(name, key, t) for name in sorted(modules) for key, t in synced_tensors(modules[name])]
        # With each tensor's dtype: a follower may hold some in another one (``from_pretrained`` keeps
        # ``_keep_in_fp32_modules`` in float32, the follower's ``.to(dtype)`` casts them), and a broadcast
        # between tensors of different dtypes is garbage on NCCL (gloo aborts: "size doesn't match").
        layout = [(name, key) for name, key, _ in tensors]
        self._send(("sync", target, layout, [t.dtype for _, _, t in tensors]))

        def run() -> None:
            with torch.no_grad():
                for _, _, t in tensors:
                    dist.broadcast(t.data.contiguous(), src=0)

        self._collective(run, "the weight sync" if target == "denoisers" else f"the {target} weight sync")

    # ------------------------------------------------------------------ the split VAE decode
    def _split_decode(self, z: torch.Tensor, settings: TileSettings) -> torch.Tensor:
        """Rank 0's side of one split decode (``vae_split.install_split_decode`` calls it from
        ``vae.decode``, on the worker thread): the latent and the VAE's tiling go to the followers,
        every rank decodes its tiles, and rank 0 gets the blended video."""
        import torch.distributed as dist

        z = z.contiguous()
        self._send(("decode", tuple(z.shape), z.dtype, settings))
        result: list[torch.Tensor | None] = []

        def run() -> None:
            dist.broadcast(z, src=0)
            result.append(split_tiled_decode(self.vae, z, settings))

        self._collective(run, "the split VAE decode")
        self.decodes += 1
        return result[0]

    # ------------------------------------------------------------------ the hooks
    def _pre_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            import torch.distributed as dist

            if self._weights_dirty:
                self._sync_weights()
            tensors: list[torch.Tensor] = []
            structure = strip_tensors((tuple(args), dict(kwargs)), tensors)
            self._send(("forward", name, structure))

            def run() -> None:
                for t in tensors:
                    dist.broadcast(t.contiguous(), src=0)

            self._collective(run, f"sending a {name} call")

        return hook

    def _post_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.forwards += 1
        if not self.cuda:  # a host sync per call: only where the checksums are compared (mirror mode)
            self.last_output = output_checksum(output)

    # ------------------------------------------------------------------ stats and stop
    def stats(self) -> dict[str, Any]:
        """Per rank: transformer calls run, weight syncs, and in mirror mode output and weight checksums."""
        followers = []
        for i, (s, d) in enumerate(zip(self._stats, self._digests, strict=True)):
            row = {"rank": i + 1, "alive": self._procs[i].is_alive(), "forwards": int(s[FORWARDS]),
                   "weight_syncs": int(s[SYNCS]), "released": bool(s[RELEASED]),
                   "decodes": int(s[DECODES]), "tiles_decoded": int(s[TILES])}  # fmt: skip
            if not self.cuda:
                row["last_output_checksum"] = s[LAST_OUTPUT]
                row["weights_digest"] = d.value.decode() or None
            followers.append(row)
        out = {"ranks": self.ranks, "mode": self.mode, "configured_mode": self.configured_mode,
               "ring_degree": self.ring_degree, "ulysses_degree": self.ulysses_degree,
               "attention_backend": self.attention_backend, "forwards": self.forwards,
               "vae": "split" if self.vae is not None else "rank0", "decodes": self.decodes,
               "followers": followers, "error": self.error}  # fmt: skip
        if not self.cuda:
            out["last_output_checksum"] = self.last_output
        return out

    def weights_digest(self) -> str:
        """Rank 0's :func:`weights_digest` (what mirror-mode followers report after each sync)."""
        return weights_digest(self.denoisers)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Send ``stop``, join the followers (terminate the ones that do not end), drop the group."""
        import torch.distributed as dist

        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.vae is not None:
            remove_split_decode(self.vae)
        for q, p in zip(self._ops, self._procs, strict=True):
            if p.is_alive():
                q.put(("stop",))
        # A follower leaves through destroy_process_group, which with NCCL returns only once rank 0
        # destroys the group too: rank 0 closes it on a side thread while it waits for the
        # followers, or every GPU shutdown waited out the timeout and terminated them (2 GPUs, H200).
        closer = None
        if dist.is_initialized():
            closer = threading.Thread(target=dist.destroy_process_group, name="cp-close", daemon=True)
            closer.start()
        for p in self._procs:
            if p.pid is not None:
                p.join(timeout_s)
                if p.is_alive():
                    logger.warning("context parallel: %s did not stop; terminating it", p.name)
                    p.terminate()
                    p.join(timeout_s)
        if closer is not None:
            closer.join(timeout_s)
            if closer.is_alive():  # a daemon thread: it cannot hold the process open
                logger.warning(
                    "context parallel: the process group did not close in %.0f s; left open", timeout_s
                )
        logger.info("context parallel: followers stopped")

    @property
    def processes(self) -> list[Any]:
        return list(self._procs)


def _check_timestep_split(denoisers: dict[str, nn.Module]) -> None:
    """Per-token timesteps need a plan that shards them with the sequence (diffusers >= 0.42's Wan
    plan splits the model's ``timestep`` input on dim 1 when it is ``[B, tokens]``); without it every
    rank would modulate its shard of tokens with the whole sequence's timesteps (a shape error)."""
    for name, module in denoisers.items():
        root = (getattr(module, "_cp_plan", None) or {}).get("", {})
        split = root.get("timestep") if isinstance(root, dict) else None
        if getattr(split, "split_dim", None) != 1:
            raise ContextParallelError(
                f"context_parallel: {name} ({type(module).__name__}) has per-token timesteps but its "
                "diffusers context-parallel plan does not shard them with the sequence; upgrade diffusers"
            )


def start_for(engine: Any) -> ContextParallelGroup:
    """The group for a loaded engine whose ``config.context_parallel`` > 1, after checking its family."""
    cfg = engine.config
    family = engine.adapter.name
    if family not in SUPPORTED_FAMILIES:
        raise ContextParallelError(
            f"context_parallel={cfg.context_parallel} is not supported for family {family!r}; "
            f"supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    if family in _TIMESTEP_PER_TOKEN:
        _check_timestep_split(engine.adapter.transformers())
    vae = _split_vae(engine) if cfg.context_parallel_vae == "split" else None
    # The layout's refusals (heads, dtype, server plans), before any follower is spawned.
    check_start(engine.adapter.transformers(), cfg, cuda=engine.device.startswith("cuda"), dtype=engine.dtype)
    if engine.device.startswith("cuda"):
        first = torch.device(engine.device).index or 0
        if first + cfg.context_parallel > torch.cuda.device_count():
            raise ContextParallelError(
                f"context_parallel={cfg.context_parallel} needs {cfg.context_parallel} GPUs from "
                f"{engine.device}; this process sees {torch.cuda.device_count()}"
            )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # followers inherit it: they read the same folder
    return ContextParallelGroup(
        dict(engine.adapter.transformers()),
        ranks=cfg.context_parallel,
        mode=cfg.context_parallel_mode,
        ring_degree=cfg.context_parallel_degrees()[0],
        device=engine.device,
        dtype=engine.dtype,
        # A folder the followers can read; else (an in-memory pipeline) they build from the config.
        model_path=engine.model_path if engine.model_path and os.path.isdir(engine.model_path) else None,
        attention_backend=cfg.attention_backend,
        timeout_s=cfg.context_parallel_timeout_s,
        vae=vae,
    )


def _split_vae(engine: Any) -> nn.Module:
    """The VAE whose decode ``context_parallel_vae=split`` spreads over the ranks: Wan's only
    (``AutoencoderKLWan``, the tiled decode ``server/parallel/vae_split.py`` reproduces)."""
    from diffusers import AutoencoderKLWan

    vae = getattr(engine.pipe, "vae", None)
    if not isinstance(vae, AutoencoderKLWan):
        raise ContextParallelError(
            f"context_parallel_vae=split splits the Wan VAE's tiled decode (AutoencoderKLWan); family "
            f"{engine.adapter.name!r} has {type(vae).__name__}: use context_parallel_vae=rank0"
        )
    return vae
