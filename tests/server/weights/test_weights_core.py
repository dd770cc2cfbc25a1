"""The update core, checksums and staging, directly on tiny pipelines (no engine, no HTTP)."""

from __future__ import annotations

import hashlib
import types

import pytest
import torch
from torch import nn

from diffusion_rollout.errors import WeightApplyError, WeightUpdateError
from diffusion_rollout.models import build_tiny_pipeline
from diffusion_rollout.protocol.checksums import (
    base_named_parameters,
    module_checksum,
    named_tensors_sha256,
    tensor_sha256,
    trainer_named_tensors_sha256,
    trainer_weights_checksum,
    weights_checksum,
)
from diffusion_rollout.server.weights.staging import StagingArea
from diffusion_rollout.server.weights.updater import apply_copies, plan_update


@pytest.fixture(scope="module")
def pipe():
    return build_tiny_pipeline("sd3")


def _reference_sglang_checksum(module: nn.Module) -> str:
    """SGLang's algorithm written out plainly: sorted names, UTF-8 name, raw bytes."""
    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        h.update(name.encode("utf-8"))
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _perturbed(module: nn.Module, seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: (p.detach().float() + 0.01 * torch.randn(p.shape, generator=g)).to(dtype)
        for n, p in module.named_parameters()
    }


# ---------------------------------------------------------------------------- checksums
def test_checksum_is_sglang_algorithm_over_parameters(pipe):
    tr = pipe.transformer
    assert module_checksum(tr) == _reference_sglang_checksum(tr)
    # Parameters only: the plain named_parameters view and ours agree name for name.
    assert dict(base_named_parameters(tr)).keys() == dict(tr.named_parameters()).keys()


def test_checksum_reads_bf16_bits_without_conversion():
    t = torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
    raw = t.view(torch.int16).numpy().tobytes()
    assert weights_checksum([("w", t)]) == hashlib.sha256(b"w" + raw).hexdigest()
    # One ulp apart in bf16 -> different checksum.
    u = t.clone()
    u.view(torch.int16)[0] += 1
    assert weights_checksum([("w", u)]) != weights_checksum([("w", t)])


def test_v2_separates_shape_and_dtype():
    a = torch.arange(6, dtype=torch.float32)
    b = a.reshape(2, 3)
    assert weights_checksum([("w", a)]) == weights_checksum([("w", b)])
    assert weights_checksum([("w", a)], "v2") != weights_checksum([("w", b)], "v2")
    c = a.view(torch.int32)
    assert weights_checksum([("w", a)], "v2") != weights_checksum([("w", c)], "v2")
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        weights_checksum([("w", a)], "md5")


def test_per_tensor_sha256_matches_sglang_manifest_format():
    t = torch.randn(3, 2)
    h = hashlib.sha256()
    h.update(b"torch.float32")
    h.update(b"(3, 2)")
    h.update(t.numpy().tobytes())
    assert tensor_sha256(t) == h.hexdigest()
    with pytest.raises(ValueError, match="duplicate"):
        named_tensors_sha256([("a", t), ("a", t)])


# ---------------------------------------------------------------------------- update core
def test_update_lands_and_client_checksum_matches(pipe):
    tr = pipe.transformer
    master = _perturbed(tr, 1)  # float32 "trainer master"
    payload = {"transformer": [(f"transformer.{n}", t) for n, t in master.items()]}  # verl-omni prefix
    plan = plan_update(pipe, payload)
    apply_copies(plan.copies)
    client = trainer_weights_checksum(master.items(), torch.float32)
    assert module_checksum(tr) == client
    assert (
        trainer_weights_checksum(payload["transformer"], torch.float32, strip_prefix="transformer") == client
    )
    manifest = trainer_named_tensors_sha256(master.items(), torch.float32)
    assert all(tensor_sha256(p) == manifest[n] for n, p in tr.named_parameters())


def test_update_casts_with_to_param_dtype():
    lin = nn.Linear(4, 3).to(torch.bfloat16)
    holder = nn.Module()
    holder.add_module("lin", lin)

    P = types.SimpleNamespace(components={"transformer": holder})

    master = {n: torch.randn(p.shape) for n, p in holder.named_parameters()}
    apply_copies(plan_update(P, {"transformer": list(master.items())}).copies)
    for n, p in holder.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, master[n].to(torch.bfloat16))
    assert module_checksum(holder) == trainer_weights_checksum(master.items(), torch.bfloat16)


@pytest.mark.parametrize(
    ("mutate", "expect"),
    [
        (lambda p: p.__setitem__("no.such.weight", torch.zeros(2)), "unknown tensor names (1): transformer.no.such.weight"),
        (lambda p: p.__setitem__("pos_embed.proj.bias", torch.zeros(3)), "shape mismatch (1): transformer.pos_embed.proj.bias"),
        (lambda p: p.__setitem__("pos_embed.proj.bias", torch.zeros_like(p["pos_embed.proj.bias"], dtype=torch.int64)), "dtype cannot convert"),
        (lambda p: p.__setitem__("pos_embed.proj.bias", torch.full_like(p["pos_embed.proj.bias"], float("nan"))), "non-finite values"),
    ],
)  # fmt: skip
def test_bad_update_names_the_problem_and_changes_nothing(pipe, mutate, expect):
    tr = pipe.transformer
    before = module_checksum(tr)
    payload = _perturbed(tr, 2)
    mutate(payload)
    with pytest.raises(WeightUpdateError) as info:
        plan_update(pipe, {"transformer": list(payload.items())})
    assert expect in info.value.message
    assert info.value.status_code == 400
    assert module_checksum(tr) == before


def test_float16_overflow_is_caught_before_copy():
    holder = nn.Linear(2, 2).to(torch.float16)

    P = types.SimpleNamespace(components={"transformer": holder})

    with pytest.raises(WeightUpdateError, match=r"non-finite.*float32 -> torch.float16"):
        plan_update(P, {"transformer": [("weight", torch.full((2, 2), 1e6)), ("bias", torch.zeros(2))]})


def test_many_unknown_names_are_listed_a_few_then_counted(pipe):
    with pytest.raises(WeightUpdateError) as info:
        plan_update(pipe, {"transformer": [(f"ghost.{i}", torch.zeros(1)) for i in range(12)]})
    assert "unknown tensor names (12)" in info.value.message and "and 7 more" in info.value.message


def test_unknown_target_module_and_duplicates(pipe):
    with pytest.raises(WeightUpdateError, match="module 'transformer_3' not found in pipeline"):
        plan_update(pipe, {"transformer_3": []})
    w = pipe.transformer.pos_embed.proj.bias
    with pytest.raises(WeightUpdateError, match="names sent more than once"):
        plan_update(
            pipe, {"transformer": [("pos_embed.proj.bias", w), ("transformer.pos_embed.proj.bias", w)]}
        )


def test_failure_during_copy_rolls_back_exactly(pipe):
    tr = pipe.transformer
    before = module_checksum(tr)
    plan = plan_update(pipe, {"transformer": list(_perturbed(tr, 3).items())})
    calls = []

    def explode(module: str, name: str) -> None:
        calls.append(name)
        if len(calls) == len(plan.copies) // 2:
            raise RuntimeError("injected device failure")

    with pytest.raises(WeightApplyError, match="injected device failure") as info:
        apply_copies(plan.copies, before_copy=explode)
    assert info.value.status_code == 500
    assert len(calls) == len(plan.copies) // 2 > 1
    assert module_checksum(tr) == before


# ---------------------------------------------------------------------------- staging
def test_staging_part_numbers_gaps_and_bounds():
    now = [0.0]
    area = StagingArea(ttl_s=10, max_uploads=2, clock=lambda: now[0])
    t = {"a": torch.zeros(1)}
    area.begin_part("u", 0)
    area.add_part("u", 0, "transformer", t)
    area.begin_part("u", 2)
    area.add_part("u", 2, "transformer", {"b": torch.zeros(1)})
    with pytest.raises(WeightUpdateError, match=r"missing parts \[1\]"):
        area.take_complete("u", 2)
    assert area.get("u") is None  # an incomplete upload is dropped, never applied

    with pytest.raises(WeightUpdateError, match="part 3 cannot start one"):
        area.begin_part("v", 3)
    area.begin_part("v", None)
    with pytest.raises(WeightUpdateError, match="mixes numbered and unnumbered"):
        area.begin_part("v", 1)

    # Idle uploads expire; a third upload evicts the least recently touched.
    area.add_part("v", None, "transformer", t)
    now[0] = 11.0
    assert area.get("v") is None
    for uid in ("x", "y", "z"):
        area.begin_part(uid, None)
        area.add_part(uid, None, "transformer", t)
        now[0] += 1
    assert area.ids() == ["y", "z"]


def test_staging_refuses_final_while_parts_are_in_flight():
    area = StagingArea()
    area.begin_part("u", None)
    area.begin_part("u", None)
    area.add_part("u", None, "transformer", {"a": torch.zeros(1)})
    with pytest.raises(WeightUpdateError, match="still arriving"):
        area.take_complete("u", None)


def test_a_part_parsed_while_a_concurrent_part_failed_reports_that_failure():
    """Concurrent parts: the one still being parsed when another fails names the failure (the cause)."""
    area = StagingArea()
    area.begin_part("u", 0)
    area.add_part("u", 0, "transformer", {"a": torch.zeros(1)})
    area.begin_part("u", 1)  # still being parsed
    area.begin_part("u", 2)  # a concurrent part, refused below
    area.discard("u", "part 2 failed: shape mismatch (1): x: got (3,), expected (32,)")
    with pytest.raises(WeightUpdateError, match=r"dropped \(part 2 failed: shape mismatch"):
        area.add_part("u", 1, "transformer", {"b": torch.zeros(1)})
    with pytest.raises(WeightUpdateError, match="was aborted"):  # later parts are refused
        area.begin_part("u", 3)
    # An upload dropped before any part was staged may be sent again under its id.
    area.begin_part("v", None)
    area.discard("v", "part ? failed: bad")
    area.begin_part("v", None)
    area.add_part("v", None, "transformer", {"a": torch.zeros(1)})
    assert area.get("v").num_tensors == 1


def test_a_retry_opening_part_0_restarts_the_upload_and_the_earlier_attempt_cannot_mix_in():
    """A non-final part 0 under an aborted id, or one with parts staged, starts the upload afresh; a
    part of the earlier attempt still being parsed is refused and its failure spares the new attempt."""
    area = StagingArea()
    old = area.begin_part("u", 0, opens=True)
    area.add_part("u", 0, "transformer", {"a": torch.zeros(1)}, began=old)
    stale = area.begin_part("u", 1)  # the earlier attempt's part 1, still being parsed
    area.discard("u", "part 2 failed: the body ended after 5 of the 9 bytes", abort=True)
    with pytest.raises(WeightUpdateError, match="was aborted"):  # a later part of the dead attempt
        area.begin_part("u", 2)
    with pytest.raises(WeightUpdateError, match="was aborted"):  # a one-part commit: never half a model
        area.begin_part("u", 0)

    new = area.begin_part("u", 0, opens=True)  # the trainer's retry
    area.add_part("u", 0, "transformer", {}, began=new)
    with pytest.raises(WeightUpdateError, match="restarted at part 0"):
        area.add_part("u", 1, "transformer", {"b": torch.ones(1)}, began=stale)
    assert not area.discard("u", "part 1 failed: restarted", began=stale)  # the new attempt stays
    assert area.get("u") is new and new.num_tensors == 0
    part1 = area.begin_part("u", 1)
    area.add_part("u", 1, "transformer", {"a": torch.ones(1), "b": torch.ones(1)}, began=part1)
    done = area.take_complete("u", 1)
    assert {n: t.item() for n, t in done.tensors["transformer"].items()} == {"a": 1.0, "b": 1.0}

    # A retry that opens again while parts are staged (an answer was lost) forgets them.
    first = area.begin_part("w", 0, opens=True)
    area.add_part("w", 0, "transformer", {"a": torch.zeros(1)}, began=first)
    again = area.begin_part("w", 0, opens=True)
    assert again is not first and again.num_tensors == 0 and first.tensors == {}
