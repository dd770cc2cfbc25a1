"""Which calls a precompiled block serves (server/speed/precompiled_blocks.py): the checks that stand in for
the guards torch could not save. The whole path (save, load, bit-identical rollouts, off at a weight
change) runs through real servers in tests/server/speed/test_compile_warmup.py."""

from __future__ import annotations

from pathlib import Path

import torch

from diffusion_rollout.server.speed.precompiled_blocks import (
    PrecompiledBlocks,
    call_signature,
    structure_digest,
)
from tests.torchao_helpers import run_check


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        return self.proj(x) * (scale or 1.0)


def _served(tmp_path) -> tuple[Block, PrecompiledBlocks, torch.Tensor]:
    block = Block()
    block._compiled_call_impl = lambda *a, **k: "ordinary"  # what compile_block installs
    pre = PrecompiledBlocks(tmp_path)
    pre.attach([block])
    x = torch.zeros(2, 3, 4)
    pre._table[(structure_digest(block), call_signature((x,), {}))] = lambda blk, *a, **k: "precompiled"
    pre.active, pre._examples = True, None
    return block, pre, x


def test_a_matching_call_runs_the_artifact_and_every_other_call_the_ordinary_path(tmp_path):
    block, pre, x = _served(tmp_path)
    with torch.no_grad():
        assert block(x) == "precompiled"
        assert block(torch.zeros(5, 3, 4)) == "precompiled"  # any batch of 2 or more
        assert block(torch.zeros(1, 3, 4)) == "ordinary"  # batch 1 is its own trace
        assert block(torch.zeros(2, 6, 4)) == "ordinary"  # another token count
        assert block(x, scale=0.5) == "ordinary"  # another non-tensor argument
        assert block(torch.zeros(2, 4, 3).transpose(1, 2)) == "ordinary"  # other strides
        assert block(x.to(torch.float64)) == "ordinary"
    assert block(x) == "ordinary", "grad mode on: the artifact was traced without autograd"
    with torch.no_grad():
        handle = block.register_forward_pre_hook(lambda m, a: None)
        assert block(x) == "ordinary", "a hooked block (a request's feature cache) must not skip its hooks"
        handle.remove()
        assert block(x) == "precompiled"
        pre.turn_off("the weights or modules changed")
        assert block(x) == "ordinary" and pre.report()["off_because"] == "the weights or modules changed"
    assert pre.report()["calls"] == 3


def test_the_structure_digest_sees_an_injected_adapter_and_a_new_dtype():
    block = Block()
    before = structure_digest(block)
    assert structure_digest(Block()) == before  # the same kind of block, other weights
    block.proj.lora_A = torch.nn.Linear(4, 2)  # what PEFT's injection adds
    assert structure_digest(block) != before
    assert structure_digest(Block().to(torch.bfloat16)) != before


def test_an_artifact_that_assumed_an_even_batch_is_caught_before_it_is_saved(tmp_path):
    """Torch's symbolic guards are off when an artifact serves, so saving compares it with the
    ordinary compiled path at the traced batch and others, an odd one among them."""
    from diffusion_rollout.server.speed.precompiled_blocks import _describe

    block = Block()
    block._compiled_call_impl = lambda x: x * 2
    pre = PrecompiledBlocks(tmp_path)
    pre.attach([block])
    described = _describe(((torch.zeros(4, 3, 4),), {}))
    assert pre._verify(lambda blk, x: x * 2, block, described, traced=4) is None

    assert pre.max_rel_diff == 0.0  # bit for bit

    def even_only(blk, x):  # what a graph specialised on an even batch would compute for an odd one
        return (x * 2).flip(0) if x.shape[0] == 3 else x * 2  # its rows mixed up

    assert "batch 3 differs" in pre._verify(even_only, block, described, traced=4)
    one = _describe(((torch.zeros(1, 3, 4),), {}))
    assert pre._verify(even_only, block, one, traced=1) is None  # a static trace of batch 1: that batch only


def test_an_artifact_that_differs_by_rounding_is_saved_with_the_difference_reported(tmp_path):
    """On GPUs the ahead-of-time compile may pick other kernels than the ordinary one (SD3.5 with FP8
    on an H100: every kind of block differed in its last bits): a difference at bfloat16's rounding
    passes and is reported, one over MAX_REL_DIFF (or a NaN) does not."""
    from diffusion_rollout.server.speed.precompiled_blocks import MAX_REL_DIFF, _describe

    block = Block()
    block._compiled_call_impl = lambda x: x * 2
    pre = PrecompiledBlocks(tmp_path)
    pre.attach([block])
    described = _describe(((torch.zeros(4, 3, 4),), {}))
    rounded = pre._verify(lambda blk, x: (x * 2).bfloat16().float(), block, described, traced=4)
    assert rounded is None and 0 < pre.max_rel_diff < MAX_REL_DIFF
    assert pre.report()["max_rel_diff"] == pre.max_rel_diff
    assert "relative L2" in pre._verify(lambda blk, x: x * 2.1, block, described, traced=4)
    assert "relative L2 nan" in pre._verify(lambda blk, x: x * float("nan"), block, described, traced=4)
    ints = _describe(((torch.zeros(4, 3, 4, dtype=torch.int64),), {}))  # no rounding excuse: must be equal
    block._compiled_call_impl = lambda x: x * 2
    assert "relative L2 inf" in pre._verify(lambda blk, x: x * 2 + 1, block, ints, traced=4)


class _Marked(torch.Tensor):
    """A tensor subclass holding weights that nothing made savable (unlike torchao's Float8Tensor)."""


def test_blocks_with_unknown_subclass_weights_are_skipped_and_a_restart_does_not_try_again(tmp_path):
    """A kind of weight Dynamo's guard serializer may not save (torchao's Float8Tensor failed there after
    34 s on an H200 before fast_tier.fp8_precompilable) is skipped before any tracing, the reason is
    left in the folder, and the next start on it reads the reason and captures nothing (no second
    attempt, no second cost)."""
    from diffusion_rollout.server.speed.precompiled_blocks import NOT_SAVED

    block = Block()
    block.proj.weight = torch.nn.Parameter(torch.randn(4, 4).as_subclass(_Marked))
    block._compiled_call_impl = lambda *a, **k: "ordinary"
    pre = PrecompiledBlocks(tmp_path)
    pre.attach([block])
    with torch.no_grad():
        assert block(torch.zeros(2, 3, 4)) == "ordinary"  # the warm-up's call, captured
    assert pre.save() == 0 and "_Marked" in pre.why_not
    assert (tmp_path / NOT_SAVED).read_text().strip() == pre.why_not
    restart = PrecompiledBlocks(tmp_path)
    restart.attach([block])
    assert restart.load() == 0 and restart.why_not == pre.why_not and not restart.active
    with torch.no_grad():
        assert block(torch.zeros(2, 3, 4)) == "ordinary"
    assert restart.save() == 0 and restart.save_s is None  # nothing captured: nothing tried


class Fp8Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * 2


def test_a_block_with_torchao_fp8_weights_is_saved_loaded_and_bit_identical(tmp_path):
    """torchao's Float8Tensor weights (the fast tier's), quantized as ``fast_tier.quantize_fp8`` does on
    the CPU (torchao's float8 hardware check bypassed, as ``benchmarks/investigations/dynamo_trace_cpu.py`` does):
    without ``fast_tier.fp8_precompilable`` they are skipped, with it the artifact saves, loads in a
    fresh table and computes bit for bit what the ordinary path does. All under torch's
    ``enable_aot_compile = False``, as torch 2.11 ships it (``torch.compile(fn)`` then has no
    ``.aot_compile``: what the first GPU run reported in ``why_not``); the save and the load turn the
    flag on for themselves."""
    run_check("tests.server.speed.test_precompiled_blocks", "_fp8_check", str(tmp_path))


def _fp8_check(tmp: str) -> None:
    """The body of the test above, in a process of its own (``tests/torchao_helpers.py``)."""
    from torchao.quantization import quantize_

    from diffusion_rollout.server.speed import fast_tier, precompiled_blocks

    tmp_path = Path(tmp)
    assert not precompiled_blocks._ALLOWED_SUBCLASSES
    torch.manual_seed(0)
    block = Fp8Block().to(torch.bfloat16)
    with torch.inference_mode():
        quantize_(block, fast_tier.fp8_config())
    fast_tier.pad_small_inputs(block, ["proj"])  # as quantize_fp8 does: x's 32 rows reach it padded
    assert type(block.proj) is fast_tier.PaddedLinear
    assert type(block.proj.weight).__name__ == "Float8Tensor"
    block.compile(dynamic=False)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)

    refused = PrecompiledBlocks(tmp_path / "before")
    refused.attach([block])
    with torch.inference_mode():
        block(x)
    assert refused.save() == 0 and "Float8Tensor" in refused.why_not  # skipped: not made savable

    fast_tier.fp8_precompilable(block)
    assert "extra_repr" not in vars(block.proj)
    pre = PrecompiledBlocks(tmp_path / "after")
    pre.attach([block])
    with torch._dynamo.config.patch(enable_aot_compile=False), torch.inference_mode():
        expected = block(x)
        assert pre.save() == 1 and pre.not_saved == 0, pre.why_not
        assert pre.max_rel_diff == 0.0  # on the CPU the saved artifact is bit-identical, not merely close
        again = PrecompiledBlocks(tmp_path / "after")
        again.attach([block])
        assert again.load() == 1 and again.active
        assert torch.equal(block(x), expected) and again.report()["calls"] == 1
