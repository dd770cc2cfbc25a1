"""The fast tier's FP8 linears on an input with all-zero rows (Wan's zero-padded text context reaching
the cross-attention K/V projections; the rows ``PaddedLinear`` adds).

torchao scales each activation row by its amax, with no floor: a zero row gets scale 0 and comes out
NaN, and on a GPU Wan 2.1 1.3B with every linear in FP8 gave NaN rollouts that way. ``fp8_config``
floors the amax (``FP8_ROW_AMAX_FLOOR``): the zero rows come out finite (the bias alone) and every
other row is bit-identical to torchao's unfloored result. torchao's float8 needs a GPU of compute
capability 8.9+: the check runs in a process of its own with that check bypassed
(``tests/torchao_helpers.py``).
"""

from __future__ import annotations

import torch

from tests.torchao_helpers import run_check


def test_an_all_zero_row_comes_out_finite_and_the_other_rows_unchanged():
    run_check("tests.server.speed.test_fp8_zero_rows", "_check")


def _check() -> None:
    """The body of the test above, in a process of its own (``tests/torchao_helpers.py``)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    from diffusion_rollout.server.speed import fast_tier

    torch.manual_seed(0)
    source = torch.nn.Linear(64, 64).to(torch.bfloat16)
    x = torch.randn(1, 160, 64, dtype=torch.bfloat16)
    x[:, 100:] = 0  # a short prompt's context, zero-padded

    def fp8(config) -> torch.nn.Linear:
        linear = torch.nn.Linear(64, 64).to(torch.bfloat16)
        linear.load_state_dict(source.state_dict())
        quantize_(linear, config)
        return linear

    with torch.inference_mode():
        floored = fp8(fast_tier.fp8_config())(x)
        unfloored = fp8(Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))(x)
        padded = torch.nn.Sequential(fp8(fast_tier.fp8_config()))
        fast_tier.pad_small_inputs(padded, ["0"])
        assert type(padded[0]) is fast_tier.PaddedLinear
        few = padded(x[:, 95:105])  # 10 rows, padded to FP8_MIN_ROWS with zero rows inside
    # the hazard the floor removes: torchao alone turns every zero row into NaN
    assert torch.isnan(unfloored[:, 100:]).all() and torch.isfinite(unfloored[:, :100]).all()
    assert torch.isfinite(floored).all()
    assert torch.equal(floored[:, :100], unfloored[:, :100])  # the real rows: bit for bit
    assert torch.equal(floored[:, 100:], source.bias.expand(1, 60, 64))  # zero in, bias out
    assert torch.isfinite(few).all() and torch.equal(few, floored[:, 95:105])
