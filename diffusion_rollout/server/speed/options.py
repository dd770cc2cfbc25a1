"""Speed options and the exactness contract (every response says ``exact: true|false``).

``exact`` is true when no option that changes numerics was active for the output: the denoiser ran
its eager kernels (CUDA-graph replay counts as eager: the same kernels, proven bit-identical on the
GPU) with the default attention dispatch. Then the ODE path is bit-identical to the stock eager
pipeline and an eager replay of the same batch reproduces the log-probs bit for bit (docs/math.md).

Server-wide options (``ServerConfig``), applied by the loader:

| option | exact | why |
| --- | --- | --- |
| eager (default) | yes | the stock kernels |
| ``cuda_graphs`` | yes | the eager kernels replayed from a graph |
| ``attention_backend="native"`` | yes | the default dispatch, named |
| any other ``attention_backend`` (``fa4`` too) | no | another kernel sums in another order |
| ``compile`` | no | fused kernels round differently (~1e-5 on the on-policy ratio) |
| ``quantize="fp8"`` | no | FP8 linears (``server/speed/fast_tier.py``), ~3.7% per-layer difference |

``/server_info`` names the options that make a server inexact under ``speed.inexact_options``.

Per-request option: ``feature_cache`` (:class:`FeatureCacheSettings`), diffusers' own cache hooks
(TaylorSeer, first-block cache, MagCache) applied to the denoiser for one pipeline call and removed
afterwards. A cached step reuses or extrapolates block outputs instead of computing them, so the
model output is not the policy's: the log-probs of stochastic steps would score transitions the
trainer's replay cannot reproduce. Hence a request that asks for stochastic steps' log-probs with a
cache is refused (400) unless it also says ``allow_inexact: true``; DiffusionNFT-style rollouts
(``rollout=false``, or no stochastic step) may use it freely. Which cache works depends on the
family's blocks (diffusers 0.42.1: first-block cache fails on SD3's last, context-only joint block;
MagCache ships calibrated ratios only for FLUX): :data:`SUPPORTED_CACHES` lists what was checked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_rollout.errors import RequestError

# Attention backends whose kernels are the default dispatch's (None: diffusers' default, "native").
EXACT_ATTENTION_BACKENDS = (None, "native")

# Family -> cache kinds checked to run on its denoiser with diffusers 0.42.1 (the kinds a request may
# name are protocol/requests.py's CACHE_KINDS).
SUPPORTED_CACHES: dict[str, tuple[str, ...]] = {
    "sd3": ("taylorseer",),
    "flux": ("taylorseer", "first_block", "mag"),
    "qwenimage": ("taylorseer", "first_block"),
    # TaylorSeer's default module patterns match none of Wan's modules: it would change nothing.
    "wan": ("first_block",),
    "wan2.2": ("first_block",),
}


def attention_backend_is_exact(name: str | None) -> bool:
    return name in EXACT_ATTENTION_BACKENDS


@dataclass
class SpeedOptions:
    """The server-wide speed options the loader applied (reported by ``/server_info``)."""

    compile: bool = False
    attention_backend: str | None = None
    quantize: str | None = None  # "fp8" (server/speed/fast_tier.py)
    quantize_report: dict[str, Any] | None = None  # per denoiser: linears quantized and kept
    graphs: Any = None  # a CudaGraphRunner when cuda_graphs is on
    compile_stats: Any = None  # server/speed/warmup.py CompileStats when compile is on
    # Benchmarks switch graphs off and on to compare in one process; the server never does.
    use_graphs: bool = True

    @property
    def exact(self) -> bool:
        return not self.inexact_options

    @property
    def inexact_options(self) -> list[str]:
        """The options in force that change numerics, by name (empty: exact)."""
        names = []
        if self.compile:
            names.append("compile")
        if not attention_backend_is_exact(self.attention_backend):
            names.append(f"attention_backend={self.attention_backend}")
        if self.quantize is not None:
            names.append(f"quantize={self.quantize}")
        return names

    def report(self) -> dict[str, Any]:
        return {
            "exact": self.exact,
            "inexact_options": self.inexact_options,
            "compile": self.compile_report(),
            "attention_backend": self.attention_backend,
            "quantize": (
                None if self.quantize is None else {"mode": self.quantize, "denoisers": self.quantize_report}
            ),
            "cuda_graphs": self.graphs.report() if self.graphs is not None else {"enabled": False},
        }

    def compile_report(self) -> Any:
        """False, or the compile counters (the engine adds the warm-up and the cache)."""
        if not self.compile:
            return False
        return {"enabled": True, **(self.compile_stats.report() if self.compile_stats is not None else {})}

    def invalidate(self) -> None:
        """The weights or modules changed: captured graphs must not be replayed any more."""
        if self.graphs is not None:
            self.graphs.invalidate()

    def graphs_for_call(self, cache: FeatureCacheSettings | None):
        """The context in which a pipeline call replays graphs (none with a feature cache)."""
        if self.graphs is None or cache is not None or not self.use_graphs:
            return contextlib.nullcontext()
        return self.graphs.engaged()


@dataclass(frozen=True)
class FeatureCacheSettings:
    """A request's ``feature_cache`` (hashable: requests with different caches never share a call).

    ``threshold``: first-block and MagCache skip threshold. ``interval`` and ``warmup_steps``:
    TaylorSeer's refresh interval and the first steps it always computes. ``max_order``: TaylorSeer's
    expansion order.
    """

    kind: str
    threshold: float | None = None
    interval: int = 2
    warmup_steps: int = 1
    max_order: int = 1

    def diffusers_config(self, num_steps: int) -> Any:
        from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

        if self.kind == "taylorseer":
            return TaylorSeerCacheConfig(
                cache_interval=self.interval,
                disable_cache_before_step=self.warmup_steps,
                max_order=self.max_order,
                taylor_factors_dtype=torch.float32,
            )
        if self.kind == "first_block":
            return FirstBlockCacheConfig(threshold=0.05 if self.threshold is None else self.threshold)
        from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

        return MagCacheConfig(
            threshold=0.06 if self.threshold is None else self.threshold,
            num_inference_steps=num_steps,
            mag_ratios=FLUX_MAG_RATIOS,
        )


def check_feature_cache(
    cache: FeatureCacheSettings | None,
    *,
    family: str,
    rollout: bool,
    stochastic_steps: bool,
    allow_inexact: bool,
) -> None:
    """The 400 rules of a request's ``feature_cache`` (see the module docstring)."""
    if cache is None:
        return
    supported = SUPPORTED_CACHES.get(family, ())
    if cache.kind not in supported:
        raise RequestError(
            f"feature_cache.kind={cache.kind!r} is not available for the {family} family "
            f"(available: {list(supported) or 'none'})",
            field="feature_cache",
        )
    if rollout and stochastic_steps and not allow_inexact:
        raise RequestError(
            "feature_cache changes the model outputs, so the log-probs of the stochastic steps would not "
            "be the policy's and a trainer's replay could not reproduce them: send allow_inexact=true to "
            "accept that, or ask for no stochastic step (rollout=false, rollout_sde_step_indices=[] or "
            "rollout_sde_type='ode')",
            field="allow_inexact",
        )


def _hook_names(kind: str) -> tuple[str, ...]:
    if kind == "taylorseer":
        from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

        return (_TAYLORSEER_CACHE_HOOK,)
    if kind == "first_block":
        from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK

        return (_FBC_LEADER_BLOCK_HOOK, _FBC_BLOCK_HOOK)
    from diffusers.hooks.mag_cache import _MAG_CACHE_BLOCK_HOOK, _MAG_CACHE_LEADER_BLOCK_HOOK

    return (_MAG_CACHE_LEADER_BLOCK_HOOK, _MAG_CACHE_BLOCK_HOOK)


@contextlib.contextmanager
def feature_cache_applied(
    modules: dict[str, torch.nn.Module], cache: FeatureCacheSettings | None, num_steps: int
) -> Iterator[None]:
    """Apply ``cache`` to every denoiser for one pipeline call, then remove it (fresh state per call).

    The hooks are diffusers' own (``apply_*_cache``); not every transformer class has diffusers'
    ``CacheMixin.enable_cache``, so they are applied and removed through the hook registry directly.
    Pipelines that do not name a cache context (SD3) run under one context, ``"rollout"``; those
    that do (FLUX, Qwen-Image, Wan: ``cond``/``uncond``) override it per call.
    """
    if cache is None:
        yield
        return
    from diffusers.hooks import HookRegistry, apply_first_block_cache, apply_mag_cache, apply_taylorseer_cache
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    apply = {
        "taylorseer": apply_taylorseer_cache,
        "first_block": apply_first_block_cache,
        "mag": apply_mag_cache,
    }[cache.kind]
    applied = []
    try:
        for module in modules.values():
            registry = HookRegistry.check_if_exists_or_initialize(module)
            applied.append((module, registry))
            apply(module, cache.diffusers_config(num_steps))
            registry.invalidate_child_registries_cache()
            _set_cache_context(module, CacheContext("rollout"))
        yield
    finally:
        for module, registry in applied:
            _set_cache_context(module, None)
            for name in _hook_names(cache.kind):
                registry.remove_hook(name, recurse=True)
            registry.invalidate_child_registries_cache()
