"""The fast tier on the CPU (``--quantize fp8``, ``--attention-backend fa4``; server/speed/fast_tier.py).

- Both options are refused at start-up without CUDA: one line, non-zero exit, through the real CLI.
- The config validates the values and the combinations; the GPU/package checks name what is missing.
- The FP8 layer rule (names, then size) and the FA4 registration with diffusers' dispatcher: a stand-in
  ``flash_attn.cute`` computing SDPA gives the native outputs through the dispatcher.
- With the options off nothing changes: ``exact: true``, no inexact option named.

The GPU side (a served model with each option): ``tests/server/speed/test_fast_tier_gpu.py``.
"""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
from pydantic import ValidationError

from diffusion_rollout import fast_tier_checks
from diffusion_rollout.config import ServerConfig
from diffusion_rollout.server.speed import fast_tier
from diffusion_rollout.server.speed.options import SpeedOptions
from tests.client.test_replay import call_defaults
from tests.entrypoints.test_cli_serve import _last_line, _serve_until_exit

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this process has CUDA")


# --------------------------------------------------------------------------- start-up refusals
@no_cuda
@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--quantize", "fp8"],
            "quantize=fp8 needs a CUDA GPU (compute capability >= 8.9); this server runs on 'cpu'",
        ),
        (
            ["--attention-backend", "fa4"],
            "attention_backend=fa4 needs a CUDA GPU (compute capability >= 9.0); this server runs on 'cpu'",
        ),
    ],
    ids=["fp8", "fa4"],
)
def test_cli_refuses_the_fast_tier_without_cuda(args, line):
    code, stderr, seconds = _serve_until_exit(args)
    assert code == 1, stderr[-3000:]
    assert _last_line(stderr) == f"diffusion-rollout serve: {line}"
    assert "Traceback" not in stderr and seconds < 60


def test_cli_rejects_an_unknown_quantize_value():
    from diffusion_rollout.entrypoints.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--quantize", "int8"])
    assert exc.value.code == 2  # argparse: invalid choice


def test_config_validates_the_values_and_combinations():
    with pytest.raises(ValidationError, match="quantize"):
        ServerConfig(quantize="int8")
    with pytest.raises(ValidationError, match="quantize=fp8 needs a CUDA GPU"):
        ServerConfig(device="cpu", quantize="fp8")
    with pytest.raises(ValidationError, match="attention_backend=fa4 needs a CUDA GPU"):
        ServerConfig(device="cpu", attention_backend="FA4")
    with pytest.raises(ValidationError, match="cannot be combined with context_parallel=2"):
        ServerConfig(device="cuda", quantize="fp8", context_parallel=2)
    with pytest.raises(ValidationError, match="cannot be combined with cuda_graphs"):
        ServerConfig(device="cuda", quantize="fp8", cuda_graphs=True, replicas=1)
    # A Ray front checks only the device name; each replica's loader checks the GPU and packages.
    cfg = ServerConfig(device="cuda", quantize="fp8", attention_backend="fa4", replicas=2)
    assert cfg.quantize == "fp8"
    # Off: nothing is checked, other backends pass as before.
    assert ServerConfig(device="cpu").quantize is None
    assert ServerConfig(device="cpu", attention_backend="_native_math").attention_backend == "_native_math"


def _fake_gpu(monkeypatch, capability, name="Fake GPU"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_gpu_and_package_checks_name_what_is_missing(monkeypatch):
    _fake_gpu(monkeypatch, (8, 0), "NVIDIA A100")
    reason = fast_tier_checks.unsupported_reason(quantize="fp8", attention_backend=None, device="cuda")
    assert reason == "quantize=fp8 needs a GPU of compute capability >= 8.9; cuda is NVIDIA A100 (8.0)"
    _fake_gpu(monkeypatch, (8, 9), "NVIDIA L40S")
    reason = fast_tier_checks.unsupported_reason(quantize=None, attention_backend="fa4", device="cuda:0")
    assert (
        reason
        == "attention_backend=fa4 needs a GPU of compute capability >= 9.0; cuda:0 is NVIDIA L40S (8.9)"
    )
    _fake_gpu(monkeypatch, (9, 0), "NVIDIA H100")
    monkeypatch.setattr(fast_tier_checks.importlib.util, "find_spec", lambda name: None)
    assert fast_tier_checks.unsupported_reason(quantize="fp8", attention_backend=None, device="cuda") == (
        "quantize=fp8 needs the torchao package, which is not installed: " + fast_tier_checks.FP8_INSTALL
    )
    assert fast_tier_checks.unsupported_reason(quantize=None, attention_backend="fa4", device="cuda") == (
        "attention_backend=fa4 needs the flash_attn.cute package, which is not installed: pip install flash-attn-4"
    )
    monkeypatch.setattr(fast_tier_checks.importlib.util, "find_spec", lambda name: object())
    assert fast_tier_checks.unsupported_reason(quantize="fp8", attention_backend="fa4", device="cuda") is None
    assert fast_tier_checks.unsupported_reason(quantize=None, attention_backend="flash", device="cpu") is None


def test_fp8_config_leaves_inductors_settings_alone(monkeypatch):
    """torchao's FP8 transform would turn on inductor's coordinate-descent tuning process-wide
    (minutes of serial Triton tuning at a compiled server's first call, issue #43): the config asks
    it not to. A stand-in torchao records what the fast tier asks for."""
    seen: dict = {}

    class Config:
        def __init__(self, **kwargs):
            seen.update(kwargs)

    quantization = types.ModuleType("torchao.quantization")
    quantization.Float8DynamicActivationFloat8WeightConfig = Config
    quantization.PerRow = lambda: "per-row"
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.quantization", quantization)
    fast_tier.fp8_config()
    assert seen == {
        "granularity": "per-row",
        "set_inductor_config": False,
        "activation_value_lb": fast_tier.FP8_ROW_AMAX_FLOOR,  # tests/server/speed/test_fp8_zero_rows.py
    }


def test_loader_refuses_the_fast_tier_on_a_cpu_pipeline(tiny_model_path):
    from diffusers import DiffusionPipeline

    from diffusion_rollout.server.core.loader import apply_speed_options

    pipe = DiffusionPipeline.from_pretrained(str(tiny_model_path("sd3")))
    with pytest.raises(ValueError, match=r"^quantize=fp8 needs a CUDA GPU"):
        apply_speed_options(pipe, quantize="fp8", device="cpu")
    with pytest.raises(ValueError, match=r"^attention_backend=fa4 needs a CUDA GPU"):
        apply_speed_options(pipe, attention_backend="fa4")  # device read from the module


# --------------------------------------------------------------------------- FP8 layer rule
def test_fp8_rule_keeps_embedders_norms_and_final_projection(tiny_model_path):
    from diffusers import DiffusionPipeline

    model = DiffusionPipeline.from_pretrained(str(tiny_model_path("flux"))).transformer
    # The tiny model's linears are all below FLUX's threshold (3072x3072, FLUX.1-dev's smallest).
    assert fast_tier.fp8_rule_for(model).min_weight_elements == 3072 * 3072
    plan = fast_tier.fp8_plan(model)
    assert plan["fp8"] == [] and "transformer_blocks.0.ff.net.0.proj" in plan["bf16_size"]
    assert fast_tier.fp8_rule_for(model) is fast_tier.FP8_RULES["FluxTransformer2DModel"]

    plan = fast_tier.fp8_plan(model, fast_tier.EVERY_LINEAR)  # the benchmarks' variant
    kept = set(plan["bf16_name"])
    assert {
        "x_embedder", "context_embedder", "time_text_embed.timestep_embedder.linear_1",
        "transformer_blocks.0.norm1.linear", "transformer_blocks.0.norm1_context.linear",
        "single_transformer_blocks.0.norm.linear", "norm_out.linear", "proj_out",
    } <= kept  # fmt: skip
    assert all("embed" in k or "norm" in k or k == "proj_out" for k in kept)
    # A block's own proj_out is not the final projection.
    assert "single_transformer_blocks.0.proj_out" in plan["fp8"]
    assert "transformer_blocks.0.attn.to_q" in plan["fp8"] and plan["bf16_size"] == []

    # Size: in*out below the threshold, or a dimension not a multiple of 16, stays bf16.
    rule = fast_tier.Fp8Rule(32 * 128)
    lin = torch.nn.Linear(32, 32)
    assert fast_tier.fp8_keeps_bf16(lin, "blocks.0.attn.to_q", rule) == "size"
    assert fast_tier.fp8_keeps_bf16(torch.nn.Linear(32, 128), "blocks.0.ff.proj", rule) is None
    assert fast_tier.fp8_keeps_bf16(torch.nn.Linear(40, 128), "blocks.0.ff.proj", rule) == "size"
    assert fast_tier.fp8_keeps_bf16(torch.nn.Linear(32, 128), "blocks.0.img_mod.1", rule) == "name"
    assert fast_tier.fp8_keeps_bf16(torch.nn.Linear(32, 128), "img_in", rule) == "name"
    flt = fast_tier.fp8_filter(rule)
    assert flt(torch.nn.Linear(32, 128), "blocks.0.ff.proj") and not flt(torch.nn.Conv2d(32, 128, 1), "x")


# --------------------------------------------------------------------------- FA4 registration
def _sdpa_as_fa4(calls: list):
    """A stand-in for ``flash_attn.cute.flash_attn_func``: SDPA on (batch, seq, heads, dim) tensors,
    opaque to Dynamo as FA4's launcher is (a graph break, which ``fullgraph=True`` refuses)."""

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_lse=False):
        torch._dynamo.graph_break()
        calls.append((tuple(q.shape), softmax_scale, causal))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=softmax_scale, is_causal=causal
        ).transpose(1, 2)
        return out, None

    module = types.ModuleType("flash_attn.cute")
    module.flash_attn_func = flash_attn_func
    return module


def test_fa4_is_registered_with_the_dispatcher_and_runs_the_model(tiny_model_path, monkeypatch):
    from diffusers import DiffusionPipeline
    from diffusers.models import attention_dispatch as ad

    pipe = DiffusionPipeline.from_pretrained(str(tiny_model_path("flux")))
    model = pipe.transformer
    active = ad._AttentionBackendRegistry._active_backend
    member = fast_tier.register_fa4()
    assert fast_tier.register_fa4() is member  # idempotent
    assert ad.AttentionBackendName("fa4") is member and member.value == "fa4"
    assert member not in ad._HUB_KERNELS_REGISTRY  # nothing to download
    assert not ad._AttentionBackendRegistry._is_context_parallel_available(member)

    gen = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(1, 16, 64, generator=gen),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=gen),
        "pooled_projections": torch.randn(1, 16, generator=gen),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(8, 3),
        "guidance": torch.tensor([3.5]),
    }
    calls: list = []
    try:
        with torch.no_grad():
            native = model(**inputs).sample
            model.set_attention_backend("fa4")
            assert model.transformer_blocks[0].attn.processor._attention_backend is member
            monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
            monkeypatch.setitem(sys.modules, "flash_attn.cute", _sdpa_as_fa4(calls))
            via_fa4 = model(**inputs).sample
    finally:
        ad._AttentionBackendRegistry.set_active_backend(active)  # diffusers sets it process-wide
    # One call per attention layer, with diffusers' (batch, seq, heads, dim) layout.
    n_attn = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    assert len(calls) == n_attn and calls[0][0][0] == 1 and calls[0][0][1] == 16 + 8
    torch.testing.assert_close(via_fa4, native)
    with pytest.raises(ValueError, match="no attention mask"):
        fast_tier._fa4_attention(*(torch.zeros(1, 2, 1, 8),) * 3, attn_mask=torch.ones(1, 2))


def test_fa4_compiles_as_one_op_without_a_graph_break(monkeypatch):
    """FA4's launcher is Python that Dynamo cannot follow; the custom op keeps a compiled block whole
    (``fullgraph=True`` fails on any graph break) and gives the kernel's own output."""
    calls: list = []
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", _sdpa_as_fa4(calls))
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 12, 3, 8, generator=gen) for _ in range(3))

    def attend(q, k, v):
        return fast_tier._fa4_attention(q * 2, k, v, scale=0.5) + 1

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    assert calls and calls[-1] == ((2, 12, 3, 8), 0.5, False)
    torch.testing.assert_close(out, attend(q, k, v))
    assert out.shape == (2, 12, 3, 8)


# --------------------------------------------------------------------------- exactness contract
def test_exactness_names_the_inexact_options():
    assert SpeedOptions().exact is True and SpeedOptions().inexact_options == []
    fp8 = SpeedOptions(quantize="fp8", compile=True, quantize_report={"transformer": {"fp8_linears": 3}})
    assert fp8.exact is False and fp8.inexact_options == ["compile", "quantize=fp8"]
    assert fp8.report()["quantize"] == {"mode": "fp8", "denoisers": {"transformer": {"fp8_linears": 3}}}
    fa4 = SpeedOptions(attention_backend="fa4")
    assert fa4.exact is False and fa4.report()["inexact_options"] == ["attention_backend=fa4"]
    assert SpeedOptions(attention_backend="native").exact is True


def test_options_off_change_nothing(served):
    server = served("sd3")
    body = {
        "prompt": "a red square on a table",
        "seed": 5,
        "rollout": False,
        "num_outputs_per_prompt": 1,
        **call_defaults("sd3"),
    }
    assert server.generate(body)[0]["exact"] is True
    speed = server.client.get("/server_info").json()["speed"]
    assert speed["exact"] is True and speed["inexact_options"] == [] and speed["quantize"] is None


def test_an_update_into_quantized_weights_is_refused_before_anything_is_copied(fresh_server):
    """Weights held as a tensor subclass (torchao's float8 under --quantize fp8) take no in-place
    copy: the update is a 400 naming them, and no weight changes (checked with a stand-in subclass)."""
    import torch
    from safetensors.torch import save

    class Quantized(torch.Tensor):  # a stand-in for torchao's Float8Tensor
        pass

    server = fresh_server("sd3")
    tr = server.engine.pipe.transformer
    name, param = next((n, p) for n, p in tr.named_parameters() if p.dim() == 2)
    owner = tr.get_submodule(name.rsplit(".", 1)[0])
    # As torchao's quantize_ leaves it: a Parameter over a tensor subclass.
    setattr(owner, name.rsplit(".", 1)[1], torch.nn.Parameter(param.detach().clone().as_subclass(Quantized)))
    before = {n: p.detach().clone() for n, p in tr.named_parameters()}
    update = {n: p.detach() + 1 for n, p in tr.named_parameters()}
    r = server.client.post(
        "/update_weights", content=save({n: t.as_subclass(torch.Tensor) for n, t in update.items()}),
        headers={"Content-Type": "application/octet-stream"},
    )  # fmt: skip
    assert r.status_code == 400, r.text
    assert "quantized" in r.json()["error"]["message"] and name in r.json()["error"]["message"]
    assert all(torch.equal(p.detach(), before[n]) for n, p in tr.named_parameters())


def _hold_quantized(tr, count: int):
    """``count`` 2-D weights of ``tr`` held as a stand-in subclass of torchao's Float8Tensor, as
    ``quantize_`` leaves them (a Parameter over the subclass); returns their names."""

    class Quantized(torch.Tensor):
        pass

    names = [n for n, p in tr.named_parameters() if p.dim() == 2][:count]
    for name in names:
        owner_path, attr = name.rsplit(".", 1)
        owner = tr.get_submodule(owner_path)
        held = getattr(owner, attr).detach().clone().as_subclass(Quantized)
        setattr(owner, attr, torch.nn.Parameter(held, requires_grad=False))
    return names, Quantized


def _post_update(server, update):
    from safetensors.torch import save

    return server.client.post(
        "/update_weights", content=save({n: t.as_subclass(torch.Tensor) for n, t in update.items()}),
        headers={"Content-Type": "application/octet-stream"},
    )  # fmt: skip


def test_an_update_into_quantized_weights_re_quantizes_them_when_the_loader_left_a_requantizer(fresh_server):
    """Under --quantize fp8 the loader leaves fast_tier.requantize_fp8 on the denoiser: a full update
    replaces each quantized weight with its new values quantized again, and writes the rest in place
    (a stand-in subclass and re-quantizer here; torchao's own runs in tests/server/speed/test_fast_tier_gpu.py)."""
    from diffusion_rollout.server.weights.updater import REQUANTIZE_ATTR

    server = fresh_server("sd3")
    tr = server.engine.pipe.transformer
    names, quantized = _hold_quantized(tr, 3)
    calls: list[tuple[int, ...]] = []

    def requantize(values, held):
        assert type(held) is not torch.Tensor and values.dtype == held.dtype
        calls.append(tuple(values.shape))
        return values.detach().clone().as_subclass(quantized)

    setattr(tr, REQUANTIZE_ATTR, requantize)
    update = {n: p.detach().as_subclass(torch.Tensor) + 1 for n, p in tr.named_parameters()}
    r = _post_update(server, update)
    assert r.status_code == 200, r.text
    assert len(calls) == len(names)
    for n, p in tr.named_parameters():
        assert torch.equal(p.detach().as_subclass(torch.Tensor), update[n]), n
        assert (type(p.data) is quantized) == (n in names), n


def test_a_failing_re_quantization_puts_every_weight_back(fresh_server):
    from diffusion_rollout.server.weights.updater import REQUANTIZE_ATTR

    server = fresh_server("sd3")
    tr = server.engine.pipe.transformer
    _, quantized = _hold_quantized(tr, 3)
    objects = dict(tr.named_parameters())
    before = {n: p.detach().as_subclass(torch.Tensor).clone() for n, p in tr.named_parameters()}
    seen: list[int] = []

    def requantize(values, held):
        seen.append(1)
        if len(seen) == 2:
            raise RuntimeError("the device refused the quantized copy")
        return values.detach().clone().as_subclass(quantized)

    setattr(tr, REQUANTIZE_ATTR, requantize)
    r = _post_update(server, {n: p.detach().as_subclass(torch.Tensor) + 1 for n, p in tr.named_parameters()})
    assert r.status_code >= 400 and "restored" in r.json()["error"]["message"], r.text
    for n, p in tr.named_parameters():
        assert p is objects[n], n  # the replaced parameters are the original objects again
        assert torch.equal(p.detach().as_subclass(torch.Tensor), before[n]), n


def test_flux1_dev_rule_quantizes_every_linear_not_kept_by_name():
    """The FLUX rule measured on the whole model (H200): on FLUX.1-dev's own config (built on the meta
    device, no weights) it quantizes the 3072x3072 attention projections too: 418 FP8, 86 bf16 by name."""
    from diffusers import FluxTransformer2DModel

    from benchmarks.model_builders import FLUX1_DEV_TRANSFORMER

    with torch.device("meta"):
        model = FluxTransformer2DModel(**FLUX1_DEV_TRANSFORMER)
    plan = fast_tier.fp8_plan(model)
    assert {k: len(v) for k, v in plan.items()} == {"fp8": 418, "bf16_name": 86, "bf16_size": 0}
    assert plan == fast_tier.fp8_plan(model, fast_tier.EVERY_LINEAR)
    assert "transformer_blocks.0.attn.to_q" in plan["fp8"]


def test_sd35_medium_rule_quantizes_every_linear_not_kept_by_name():
    """SD3's rule measured at the Flow-GRPO batch (H100, RESULTS grpo-fast-all): on SD3.5-medium's
    config (meta device) the 1536x1536 attention projections are FP8 too, as in EVERY_LINEAR."""
    from diffusers import SD3Transformer2DModel

    from benchmarks.model_builders import SD35_MEDIUM_TRANSFORMER

    with torch.device("meta"):
        model = SD3Transformer2DModel(**SD35_MEDIUM_TRANSFORMER)
    plan = fast_tier.fp8_plan(model)
    assert plan == fast_tier.fp8_plan(model, fast_tier.EVERY_LINEAR) and plan["bf16_size"] == []
    assert "transformer_blocks.0.attn.to_q" in plan["fp8"] and "transformer_blocks.0.ff.net.2" in plan["fp8"]


@pytest.mark.parametrize("rows", [1, 32, 127, 128, 300])
def test_fp8_linears_pad_inputs_of_few_rows(rows, monkeypatch):
    """cuBLASLt has no rowwise FP8 kernel for few rows and a long reduction (the readiness probe's 32
    rows failed on an H100): inputs under FP8_MIN_ROWS rows reach the matmul padded to it, the output
    keeps the real rows only and equals the plain linear's; larger inputs pass unchanged."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 16))
    x = torch.randn(1, rows, 64)
    plain = model(x)
    fast_tier.pad_small_inputs(model, ["0"])  # the first linear only, as a plan would name it
    assert type(model[0]) is fast_tier.PaddedLinear and type(model[1]) is torch.nn.Linear
    seen: list[tuple[int, ...]] = []
    linear = torch.nn.functional.linear

    def recording(inp, weight, bias=None):
        seen.append(tuple(inp.shape))
        return linear(inp, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", recording)
    out = model(x)
    assert seen[0] == ((fast_tier.FP8_MIN_ROWS, 64) if rows < fast_tier.FP8_MIN_ROWS else (1, rows, 64))
    assert out.shape == plain.shape == (1, rows, 16)
    torch.testing.assert_close(out, plain)
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    monkeypatch.undo()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # Dynamo traces the bound forward
    torch.testing.assert_close(compiled(x), plain)
    twin = copy.deepcopy(model)  # the padded forward follows the copy's own weights
    with torch.no_grad():
        twin[0].weight.zero_()
        twin[0].bias.zero_()
    torch.testing.assert_close(twin(x), twin[1](torch.zeros(1, rows, 48)))
