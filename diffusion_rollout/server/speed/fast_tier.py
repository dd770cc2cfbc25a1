"""The fast tier: options that trade bit-exactness for speed on recent GPUs.

Both are off by default, and with both off nothing here is imported or called: the exact tier and
its ODE gate are untouched. Either one makes every output ``exact: false`` (``server/speed/options.py``).

- ``quantize="fp8"``: torchao float8 on the denoiser's linear layers, dynamic rowwise scales for the
  activations and rowwise scales for the weights
  (``quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), filter_fn)``),
  applied by the loader after the pipeline is built and before any compile. torchao is an optional
  extra (``pip install -e .[fast]``), imported only when the option is on. Needs CUDA and a GPU of
  compute capability >= 8.9 (torchao asserts the same). Eager FP8 linears were measured *slower* than
  bf16 on an H100: use it with ``compile``.
- ``attention_backend="fa4"``: FlashAttention-4 (PyPI ``flash-attn-4``, module ``flash_attn.cute``,
  ``flash_attn_func(q, k, v, softmax_scale=, causal=, return_lse=)`` on ``(batch, seq, heads,
  head_dim)`` tensors, returning ``(out, lse)``), registered with diffusers' attention dispatcher
  under the name ``fa4``. diffusers 0.42 knows only ``flash_4_hub``, which downloads a Hub kernel
  and cannot load offline. Needs CUDA, a Hopper or newer GPU (compute capability >= 9.0) and the
  package. Deterministic, but not bit-identical to SDPA. No attention mask (families that pass one
  get an error naming it) and no context parallelism. Only for denoisers whose attention processors
  go through diffusers' dispatcher: SD3/SD3.5's call SDPA themselves, and the loader refuses any
  attention backend there (diffusers would skip them silently). Inside compiled blocks FA4 is one
  custom op, ``diffusion_rollout::fa4_attention``, which Dynamo does not trace into.

Which linears stay in bf16 (:data:`FP8_RULES`, :func:`fp8_plan`): a per-family rule keyed by the
denoiser's class name.

1. By name, whatever their size: embedders (a top-level module whose name contains ``embed`` or
   ends in ``_in``, e.g. ``x_embedder``, ``context_embedder``, ``time_text_embed``, ``img_in``,
   ``condition_embedder``), the final projection and norm (top-level ``proj_out``, ``norm_out``),
   and every norm/modulation linear (a path component starting with ``norm`` or ending in ``_mod`` /
   ``modulation``: AdaLN ``norm1.linear``, Qwen's ``img_mod``). These see one row per sample or few
   tokens, where FP8's dynamic scaling costs more than it saves, or they set the output scale.
2. By size: a linear is quantized only if ``in_features * out_features >= min_weight_elements`` of
   its family and both dimensions are multiples of 16 (``torch._scaled_mm``).

Each family's threshold is the one measured fastest on the whole compiled model: FLUX every
linear not kept by name (benchmarks/RESULTS.md#fast-fp8-flux-all), SD3 1536x1536
(benchmarks/RESULTS.md#grpo-fast-all), Wan its attention projections bf16, for less replay drift
at almost the same speed (benchmarks/RESULTS.md#fast-fp8-every-linear-wan). Qwen-Image's and the
default are still chosen by analogy. At small batches FP8 does not pay
(benchmarks/RESULTS.md#drift-fp8-compile-h100). ``benchmarks.investigations.flux_breakdown --fp8-all`` times FLUX
without the size threshold.

Inputs of few rows (:data:`FP8_MIN_ROWS`): cuBLASLt refused rowwise FP8 for the SD3.5 MLP's long
reduction at 64 rows or fewer (the readiness probe), so every FP8 linear pads such inputs.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_rollout.fast_tier_checks import FA4

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- FP8 linears
@dataclass(frozen=True)
class Fp8Rule:
    """Which of a denoiser's linears are quantized (module doc: names first, then size)."""

    # Quantize a linear only if in_features * out_features >= this (provisional, see the module doc).
    min_weight_elements: int
    # Top-level modules kept in bf16 by exact name, beyond the embedder pattern.
    keep_top: tuple[str, ...] = ("proj_out", "norm_out")
    note: str = "provisional: not measured on this family"


# Keyed by the denoiser's class name; others get DEFAULT_FP8_RULE.
FP8_RULES: dict[str, Fp8Rule] = {
    # On FLUX.1-dev every linear not kept by name (its smallest are 3072x3072): the whole compiled
    # model ran faster that way than with the attention projections in bf16 (module doc).
    "FluxTransformer2DModel": Fp8Rule(
        3072 * 3072, note="measured: whole compiled FLUX.1-dev at 1024², H200 (RESULTS fast-flux-step)"
    ),
    # SD3.5-medium is 1536 wide: every linear not kept by name, the 1536x1536 attention projections
    # too. The Flow-GRPO request of 16 ran 1.986x stock eager that way (4 in flight: 2.070x) against
    # 1.804x (1.861x) with those projections in bf16, same H100 machine kind.
    "SD3Transformer2DModel": Fp8Rule(
        1536 * 1536, note="measured: Flow-GRPO on SD3.5-medium at 512², H100 (RESULTS grpo-fast-all)"
    ),
    "QwenImageTransformer2DModel": Fp8Rule(3072 * 3072 + 1),
    # Wan 1.3B / TI2V-5B (1536 / 3072 wide): the feed-forward FP8, the attention projections bf16; the
    # 14B models (5120 wide) are every linear either way. Every linear on 1.3B ran a Flow-GRPO
    # iteration only 2.7% faster (1.318x stock against 1.283x) at 27% more replay drift.
    "WanTransformer3DModel": Fp8Rule(
        3072 * 3072 + 1,
        note="measured: Flow-GRPO on Wan 2.1 1.3B, H200 (RESULTS fast-fp8-every-linear-wan)",
    ),
}
DEFAULT_FP8_RULE = Fp8Rule(3072 * 3072 + 1)


def fp8_rule_for(model: torch.nn.Module) -> Fp8Rule:
    return FP8_RULES.get(type(model).__name__, DEFAULT_FP8_RULE)


# Every linear not kept by name goes FP8: what the benchmarks time to settle the provisional size
# thresholds (``quantize_fp8(model, rule=EVERY_LINEAR)``); the server never uses it.
EVERY_LINEAR = Fp8Rule(0, note="every linear not kept by name (a benchmark variant)")


def _kept_by_name(fqn: str, rule: Fp8Rule) -> bool:
    parts = fqn.split(".")
    top = parts[0]
    if top in rule.keep_top or "embed" in top or top.endswith("_in"):
        return True
    return any(p.startswith("norm") or p.endswith("_mod") or p.endswith("modulation") for p in parts)


def fp8_keeps_bf16(module: torch.nn.Module, fqn: str, rule: Fp8Rule) -> str | None:
    """Why the linear ``fqn`` stays bf16 (``"name"`` or ``"size"``), or None if it is quantized."""
    if _kept_by_name(fqn, rule):
        return "name"
    n_out, n_in = module.weight.shape
    if n_in * n_out < rule.min_weight_elements or n_in % 16 or n_out % 16:
        return "size"
    return None


def fp8_plan(model: torch.nn.Module, rule: Fp8Rule | None = None) -> dict[str, list[str]]:
    """The denoiser's linears by fate: ``fp8``, ``bf16_name`` and ``bf16_size`` (no change made)."""
    rule = rule or fp8_rule_for(model)
    plan: dict[str, list[str]] = {"fp8": [], "bf16_name": [], "bf16_size": []}
    for fqn, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            why = fp8_keeps_bf16(module, fqn, rule)
            plan["fp8" if why is None else f"bf16_{why}"].append(fqn)
    return plan


def fp8_filter(rule: Fp8Rule) -> Callable[[torch.nn.Module, str], bool]:
    """torchao's ``filter_fn(module, fqn)``: True for the linears to quantize."""

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        return isinstance(module, torch.nn.Linear) and fp8_keeps_bf16(module, fqn, rule) is None

    return keep


# torchao scales each activation row by its amax / 448 with no floor, so an all-zero row (Wan's
# zero-padded text context in the cross-attention K/V projections, the rows PaddedLinear adds) gets
# scale 0 and comes out NaN: Wan 2.1 1.3B with every linear in FP8 gave NaN rollouts until this floor
# (H200, benchmarks/RESULTS.md#fast-fp8-every-linear-wan). Only rows whose amax is below it are affected.
FP8_ROW_AMAX_FLOOR = 1e-12


def fp8_config() -> Any:
    """torchao's config for the FP8 linears: dynamic rowwise activations, rowwise weights.

    ``set_inductor_config=False``: by default torchao's transform sets inductor's process-wide
    ``coordinate_descent_tuning`` (its "recommended" settings), which makes inductor tune every Triton
    kernel at its first launch, compiling and timing its neighbouring configs one after another on
    the calling thread. A cold SD3.5-medium warm-up at 512² on an H100, cut off after 381 s, spent 69
    of its 76 stack samples there; without the tuning the whole cold warm-up took 49 s
    (benchmarks/RESULTS.md#fast-start-cold). The FP8 matmuls themselves are cuBLAS
    (``torch._scaled_mm``), which no Triton tuning touches. ``TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1``
    turns the tuning back on for whoever wants it.
    """
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    return Float8DynamicActivationFloat8WeightConfig(
        granularity=PerRow(), set_inductor_config=False, activation_value_lb=FP8_ROW_AMAX_FLOOR
    )


# cuBLASLt (torch 2.11+cu130, H100) has no rowwise-scaled FP8 kernel for a matrix of few rows and
# a long reduction: the SD3.5 MLP's 6144 -> 1536 projection failed with CUBLAS_STATUS_NOT_SUPPORTED at
# 1 to 64 rows and ran at 128, 333, 666, 1024 and 1332, eager and compiled (1536 -> 1536 ran at every
# count). The readiness probe's 64x64 image is 32 rows. An FP8 linear therefore pads its input to at
# least this many rows (zeros; the scales are per row, so the real rows are unchanged) and drops the
# extra rows of the output. Larger inputs are untouched.
FP8_MIN_ROWS = 128


def _padded_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A linear's forward with inputs of fewer than :data:`FP8_MIN_ROWS` rows padded to that."""
    rows = x.numel() // x.shape[-1]
    if rows >= FP8_MIN_ROWS:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    flat = torch.nn.functional.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, FP8_MIN_ROWS - rows))
    out = torch.nn.functional.linear(flat, self.weight, self.bias)[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


class PaddedLinear(torch.nn.Linear):
    """``torch.nn.Linear`` with :func:`_padded_forward`. A class, not a forward bound to each instance:
    Dynamo's serializer (server/speed/precompiled_blocks.py) names a bound method by its function's name
    and then looks it up on the module, which an instance-bound ``_padded_forward`` fails ("'Linear'
    object has no attribute '_padded_forward'": every SD3.5 block unsaved on an H100, 31 s lost)."""

    forward = _padded_forward


def pad_small_inputs(model: torch.nn.Module, names: list[str]) -> None:
    """Make each FP8 linear of ``names`` a :class:`PaddedLinear` (its class swapped in place): the
    module, its parameters and its path stay as they are (weight updates, LoRA layers that wrap it,
    ``isinstance(m, torch.nn.Linear)``), and a deep copy keeps it. A linear of another subclass gets
    the padded forward bound to it instead (its blocks are then not precompiled)."""
    for fqn in names:
        linear = model.get_submodule(fqn)
        if type(linear) is torch.nn.Linear:
            linear.__class__ = PaddedLinear
        else:
            linear.forward = types.MethodType(_padded_forward, linear)


def requantize_fp8(values: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """A weight update's new ``values`` for a linear quantized by :func:`quantize_fp8`, quantized
    the same way (a fresh linear of the same shape through torchao's ``quantize_``) on ``held``'s
    device. The updater sets it as the layer's new weight (``server/weights/updater.py``)."""
    from torchao.quantization import quantize_

    out_features, in_features = values.shape
    holder = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=False, device="meta"))
    holder[0].weight = torch.nn.Parameter(
        values.to(device=held.device, dtype=values.dtype), requires_grad=False
    )
    quantize_(holder, fp8_config())
    return holder[0].weight.data


def _float8_meta_like(func: Any, types: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``torch.empty_like(w, device="meta")`` for a ``Float8Tensor``: the same subclass over meta
    inner tensors. Dynamo's guard serializer makes one of every tensor it saves a guard for, and
    torchao implements no ``empty_like``; any other device stays unimplemented, as before."""
    weight = args[0]
    if torch.device(kwargs.get("device") or weight.device).type != "meta":
        raise NotImplementedError(f"Float8Tensor: empty_like on {kwargs.get('device')!r}, only on meta")
    names, context = weight.__tensor_flatten__()
    inner = {n: torch.empty_like(getattr(weight, n), device="meta") for n in names}
    return type(weight).__tensor_unflatten__(inner, context, weight.shape, weight.stride())


def fp8_precompilable(model: torch.nn.Module) -> None:
    """Let ``server/speed/precompiled_blocks.py`` save blocks whose linears torchao quantized. Two things
    stopped Dynamo's guard serializer (torch 2.11 on an H200, torch 2.13 on a CPU): torchao's
    ``Float8Tensor`` has no ``empty_like`` (registered here, meta only), and ``quantize_`` gives each
    quantized linear an instance ``extra_repr`` bound to a ``functools.partial``, which the serializer
    cannot pickle (dropped here: it changes ``repr(module)`` only)."""
    from torchao.quantization import Float8Tensor

    from diffusion_rollout.server.speed.precompiled_blocks import allow_subclass_weights

    Float8Tensor.implements([torch.ops.aten.empty_like.default])(_float8_meta_like)
    allow_subclass_weights(Float8Tensor)
    for module in model.modules():
        if isinstance(getattr(module, "weight", None), Float8Tensor):
            vars(module).pop("extra_repr", None)


def quantize_fp8(
    model: torch.nn.Module, name: str = "transformer", rule: Fp8Rule | None = None
) -> dict[str, Any]:
    """Quantize ``model``'s linears in place (torchao, rowwise) by ``rule`` (default: its family's);
    returns the report for /server_info. Full weight updates into the model then re-quantize those
    linears (:func:`requantize_fp8`)."""
    from torchao.quantization import quantize_

    from diffusion_rollout.server.weights.updater import REQUANTIZE_ATTR

    rule = rule or fp8_rule_for(model)
    plan = fp8_plan(model, rule)
    quantize_(model, fp8_config(), filter_fn=fp8_filter(rule))
    fp8_precompilable(model)
    pad_small_inputs(model, plan["fp8"])
    setattr(model, REQUANTIZE_ATTR, requantize_fp8)
    logger.info(
        "%s: FP8 (torchao, rowwise) on %d linears; %d kept bf16 by name (embedders, norms, final "
        "projection), %d by size (< %d weight elements; %s)",
        name, len(plan["fp8"]), len(plan["bf16_name"]), len(plan["bf16_size"]),
        rule.min_weight_elements, rule.note,
    )  # fmt: skip
    return {
        "fp8_linears": len(plan["fp8"]),
        "bf16_linears": len(plan["bf16_name"]) + len(plan["bf16_size"]),
        "min_weight_elements": rule.min_weight_elements,
        "rule": rule.note,
    }


# --------------------------------------------------------------------------- FlashAttention-4
def _fa4_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    return_lse: bool = False,
    _parallel_config: Any = None,
):
    """diffusers' dispatcher calls this with ``(batch, seq, heads, head_dim)`` tensors."""
    if attn_mask is not None:
        raise ValueError("attention_backend=fa4 takes no attention mask, and this model passed one")
    if _parallel_config is not None:
        raise ValueError("attention_backend=fa4 does not support context parallelism")
    if not return_lse:
        # Through the custom op, so that a compiled block keeps the kernel as one opaque node
        # instead of breaking its graph at FA4's Python launcher.
        return torch.ops.diffusion_rollout.fa4_attention(query, key, value, scale, is_causal)
    out = _flash_attn_func()(query, key, value, softmax_scale=scale, causal=is_causal, return_lse=True)
    return out[0], out[1]


def _flash_attn_func() -> Callable[..., Any]:
    from flash_attn.cute import flash_attn_func

    return flash_attn_func


@torch.library.custom_op("diffusion_rollout::fa4_attention", mutates_args=())
def fa4_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None, is_causal: bool
) -> torch.Tensor:
    """FA4's forward on ``(batch, seq, heads, head_dim)`` tensors, as one op ``torch.compile`` does not
    trace into (FA4's launcher compiles CuTe DSL kernels in Python, which Dynamo cannot follow)."""
    out = _flash_attn_func()(query, key, value, softmax_scale=scale, causal=is_causal)
    return (out[0] if isinstance(out, tuple) else out).contiguous()


@fa4_attention_op.register_fake
def _(query, key, value, scale, is_causal):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


def _add_enum_member(enum_cls: Any, name: str, value: str) -> Any:
    """Add a member to a ``(str, Enum)`` class after its creation (what ``aenum.extend_enum`` does)."""
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    member.__init__(value)
    member._sort_order_ = len(enum_cls._member_names_)
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def register_fa4() -> Any:
    """Register ``fa4`` with diffusers' attention dispatcher (once); returns its backend name member.

    After this, ``model.set_attention_backend("fa4")`` works as for diffusers' own backends: the name
    is a member of ``AttentionBackendName`` (so diffusers' requirement and Hub-download checks pass it
    by) and ``_AttentionBackendRegistry`` maps it to :func:`_fa4_attention`, with diffusers' own
    device, dtype (bf16/fp16) and shape constraints. ``flash_attn.cute`` is imported on the first call.
    """
    from diffusers.models import attention_dispatch as ad

    names = ad.AttentionBackendName
    member = names._value2member_map_.get(FA4)
    if member is None:
        member = _add_enum_member(names, "FA4", FA4)
    if member not in ad._AttentionBackendRegistry._backends:
        ad._AttentionBackendRegistry.register(
            member,
            constraints=[ad._check_device, ad._check_qkv_dtype_bf16_or_fp16, ad._check_shape],
            supports_context_parallel=False,
        )(_fa4_attention)
    return member
