"""The recipes' machinery (``diffusion_rollout.recipes``) as units, without a server or a pipeline:
checkpoints saved and resumed, the recovery's decisions against a scripted server, the ranks' split
of an iteration's groups, the rollout window, phase timing and the run's summary statistics.

The end-to-end runs (tests/test_examples.py) show that these pieces work together; these show what
each one decides, with values worked out by hand.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import time
import types
from pathlib import Path

import pytest
import torch

from diffusion_rollout.client import (
    ChecksumMismatchError,
    RolloutConnectionError,
    RolloutHTTPError,
    RolloutTimeoutError,
)
from diffusion_rollout.recipes import checkpoint as checkpoint_module
from diffusion_rollout.recipes.checkpoint import Checkpoint
from diffusion_rollout.recipes.flow_grpo import check_layout
from diffusion_rollout.recipes.flow_grpo_options import parse_args
from diffusion_rollout.recipes.flow_grpo_rollouts import Rollouts, request_fields, sde_window
from diffusion_rollout.recipes.ranks import Ranks
from diffusion_rollout.recipes.records import iteration_record, learning_stats, staleness_summary, summarize
from diffusion_rollout.recipes.recovery import Recovery, RecoveryError, failure_cause
from diffusion_rollout.recipes.timing import Phases
from diffusion_rollout.recipes.trainer import add_lora


# ---------------------------------------------------------------------------------------------- checkpoints
def _tiny_transformer() -> torch.nn.Module:
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=4, patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16,
        pos_embed_max_size=8,
    )  # fmt: skip
    model.requires_grad_(False)
    return model


def _trained(seed: int) -> tuple[torch.nn.Module, list[torch.nn.Parameter], torch.optim.Optimizer]:
    """A tiny transformer with two adapters, ``default`` moved off its start by two Adam steps."""
    model = _tiny_transformer()
    params = add_lora(model, 2, torch.float32, "default")
    add_lora(model, 2, torch.float32, "old")
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    return model, params, optimizer


def _adapter(model: torch.nn.Module, name: str) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if f".{name}." in n}


def test_a_checkpoint_resumes_adapters_optimizer_and_state_exactly(tmp_path):
    model, _, optimizer = _trained(seed=1)
    state = {"next_iteration": 3, "history": [{"iteration": 2, "rewards": [0.5]}], "recoveries": []}
    Checkpoint(str(tmp_path)).save(model, optimizer, ["default", "old"], state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "trainer.pt"]
    assert json.loads((tmp_path / "state.json").read_text()) == state

    fresh, _, fresh_optimizer = _trained(seed=2)  # other weights and moments, to be overwritten
    assert not all(torch.equal(a, b) for a, b in zip(_adapter(fresh, "default").values(),
                                                     _adapter(model, "default").values(), strict=True))  # fmt: skip
    loaded = Checkpoint(str(tmp_path)).load(fresh, fresh_optimizer)
    assert loaded == state
    for name in ("default", "old"):
        mine, theirs = _adapter(model, name), _adapter(fresh, name)
        assert mine.keys() == theirs.keys() and mine
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    saved, restored = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert saved["param_groups"] == restored["param_groups"]
    for k, st in saved["state"].items():
        assert torch.equal(st["exp_avg"], restored["state"][k]["exp_avg"])
        assert torch.equal(st["exp_avg_sq"], restored["state"][k]["exp_avg_sq"])
        assert torch.equal(st["step"], restored["state"][k]["step"])


def test_a_checkpoint_without_a_directory_or_a_file_resumes_nothing(tmp_path):
    model, _, optimizer = _trained(seed=1)
    Checkpoint(None).save(model, optimizer, ["default"], {"next_iteration": 1, "history": []})
    assert Checkpoint(None).load(model, optimizer) is None
    assert Checkpoint(str(tmp_path / "empty")).load(model, optimizer) is None


def test_an_older_checkpoint_reads_its_state_from_state_json(tmp_path):
    """Checkpoints that kept the state only beside ``trainer.pt`` still load."""
    model, _, optimizer = _trained(seed=1)
    Checkpoint(str(tmp_path)).save(model, optimizer, ["default"], {"next_iteration": 2, "history": []})
    saved = torch.load(tmp_path / "trainer.pt", weights_only=True)
    del saved["state"]
    torch.save(saved, tmp_path / "trainer.pt")
    (tmp_path / "state.json").write_text(json.dumps({"next_iteration": 5, "history": ["kept"]}))
    assert Checkpoint(str(tmp_path)).load(model, optimizer) == {"next_iteration": 5, "history": ["kept"]}


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "trainer.pt"
    checkpoint_module._write_atomically(path, lambda f: f.write(b"complete"))

    def fails(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        checkpoint_module._write_atomically(path, fails)
    assert path.read_bytes() == b"complete" and [p.name for p in tmp_path.iterdir()] == ["trainer.pt"]


# ---------------------------------------------------------------------------------------------- recovery
def _http(status: int, error_type: str) -> RolloutHTTPError:
    return RolloutHTTPError("no", status_code=status, error_type=error_type)


@pytest.mark.parametrize(
    ("exc", "phase", "cause"),
    [
        (RolloutTimeoutError("late"), "rollout", "rollout_timeout"),
        (RolloutConnectionError("reset"), "rollout", "rollout_connection_lost"),
        (_http(503, "unavailable"), "push", "push_server_unavailable"),
        (_http(502, "bad_gateway"), "rollout", "rollout_server_unavailable"),
        (_http(409, "replicas_diverged"), "push", "push_replicas_diverged"),
        (ChecksumMismatchError("differs"), "push", "push_not_verified"),
        (_http(400, "invalid_request"), "rollout", None),  # the request is wrong: raised, not retried
        (ValueError("a bug"), "rollout", None),
    ],
)
def test_failure_causes_name_what_the_run_recovers_from(exc, phase, cause):
    assert failure_cause(exc, phase) == cause


class ScriptedServer:
    """A client whose readiness follows a script: each ``wait_until_ready`` takes the next entry
    (an exception is raised; None means ready); after the script it stays ready."""

    url = "http://scripted"

    def __init__(self, *readiness: BaseException | None) -> None:
        self.readiness = list(readiness)
        self.waits = 0

    def wait_until_ready(self, timeout_s: float) -> None:
        self.waits += 1
        if self.readiness:
            step = self.readiness.pop(0)
            if step is not None:
                raise step


def _groups(version: str, n: int = 2) -> list[list[types.SimpleNamespace]]:
    return [[types.SimpleNamespace(weight_version=version)] * 4 for _ in range(n)]


def _recovery(server: ScriptedServer, **kw) -> Recovery:
    return Recovery(server, Ranks(), **{"timeout_s": 5.0, "attempts": 3, "backoff_s": 0.0, **kw})


def test_an_off_policy_batch_is_rejected_and_redone_once_the_server_holds_the_version():
    server, made, pushed = ScriptedServer(), [], []
    batches = [_groups("iter-7"), _groups("iter-3")]
    recovery = _recovery(server)

    def make():
        made.append(1)
        return batches[len(made) - 1]

    groups = recovery.rollouts(3, "iter-3", make, pushed.append, lambda v: v == "iter-3")
    assert groups is batches[1] and len(made) == 2
    assert pushed == []  # the server already held the version: asked, not pushed again
    [event] = recovery.events
    assert (event["iteration"], event["cause"], event["action"], event["attempts"]) == (
        3, "off_policy_batch", "already held", 1,
    )  # fmt: skip
    assert "iter-7" in event["detail"] and recovery.off_policy_rejected == 2  # groups, never trained on


def test_a_lost_connection_waits_for_the_server_then_repushes_and_redoes_the_rollouts():
    server = ScriptedServer(RolloutConnectionError("refused"), None)  # restarting, then back
    pushed, calls = [], []

    def make():
        calls.append(1)
        if len(calls) == 1:
            raise RolloutConnectionError("connection reset")
        return _groups("iter-1")

    def sync(version):
        pushed.append(version)
        return True

    recovery = _recovery(server)
    assert recovery.rollouts(1, "iter-1", make, sync, lambda v: False) == _groups("iter-1")
    assert pushed == ["iter-1"] and server.waits == 2
    [event] = recovery.events
    assert (event["cause"], event["action"], event["attempts"]) == ("rollout_connection_lost", "re-pushed", 2)
    record = recovery.record()
    assert record["recoveries_by_cause"] == {
        "rollout_connection_lost": {"count": 1, "seconds": event["seconds"]}
    }


def test_an_unverified_push_is_pushed_again_until_verified():
    verdicts = [False, False, True]
    pushed = []

    def sync(version):
        pushed.append(version)
        return verdicts.pop(0)

    recovery = _recovery(ScriptedServer())
    assert recovery.push(4, "iter-5", sync, lambda v: False) is True
    assert pushed == ["iter-5"] * 3
    [event] = recovery.events
    assert (event["cause"], event["action"], event["attempts"]) == ("push_not_verified", "re-pushed", 2)


def test_a_server_that_never_returns_stops_the_run_naming_the_cause():
    server = ScriptedServer(*[RolloutConnectionError("refused")] * 10)
    recovery = _recovery(server, timeout_s=0.5)
    with pytest.raises(
        RecoveryError, match=r"iteration 2: push_timeout: http://scripted did not hold .*supervised"
    ):
        recovery.push(
            2, "iter-3", lambda v: (_ for _ in ()).throw(RolloutTimeoutError("late")), lambda v: True
        )
    assert recovery.events == [] and server.waits == 3  # one wait per attempt, then it gives up


def test_a_real_error_is_raised_not_recovered():
    recovery = _recovery(ScriptedServer())
    with pytest.raises(ZeroDivisionError):
        recovery.rollouts(0, "iter-0", lambda: 1 / 0, lambda v: True, lambda v: True)
    assert recovery.events == []


def test_the_final_check_repushes_a_lost_adapter_or_reports_why_it_could_not():
    held = {"now": False}

    def sync(version):
        held["now"] = True
        return True

    recovery = _recovery(ScriptedServer())
    final = recovery.final(2, "iter-2", sync, lambda v: held["now"], lambda: {"checksum": "abc"})
    assert final == {"checksum": "abc"} and recovery.events[0]["cause"] == "final_weights_lost"

    gone = _recovery(ScriptedServer(*[RolloutConnectionError("refused")] * 10), timeout_s=0.2)
    final = gone.final(2, "iter-2", lambda v: True, lambda v: False, lambda: {"checksum": "abc"})
    assert list(final) == ["final_check_error"] and "final_weights_lost" in final["final_check_error"]


def test_a_resumed_run_keeps_counting_its_recoveries():
    first = _recovery(ScriptedServer())
    first.rollouts(0, "v", iter([_groups("old", 3), _groups("v")]).__next__, lambda v: True, lambda v: True)
    resumed = _recovery(ScriptedServer())
    resumed.restore(json.loads(json.dumps(first.state())))  # through the checkpoint's JSON
    assert resumed.record() == first.record() and resumed.off_policy_rejected == 3


# ---------------------------------------------------------------------------------------------- ranks
def test_each_rank_takes_a_contiguous_block_and_the_blocks_make_the_iteration():
    items = list(range(12))
    assert [Ranks(rank=r, world=3).share(items) for r in range(3)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
    ]
    one = Ranks()
    assert one.share(items) == items and one.gather("x") == ["x"] and one.sum(2.5) == 2.5
    assert one.broadcast({"url": "u"}) == {"url": "u"} and not one.active and one.is_main


def _flow_args(**kw) -> argparse.Namespace:
    base = dict(prompt_set="animals", async_depth=0, prompts=4, seed=1, steps=6, sde_window=2,
                sde_window_range=None, branch=None, iterations=3)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_two_ranks_ask_for_the_one_rank_iterations_groups_with_the_same_seeds():
    args = _flow_args()

    def jobs(ranks: Ranks, it: int) -> list[dict]:
        source = Rollouts(args, None, None, {}, ranks, None, None, None, first_iteration=0, version="iter-0")
        return source.jobs(it)

    whole = jobs(Ranks(), 2)
    assert jobs(Ranks(rank=0, world=2), 2) + jobs(Ranks(rank=1, world=2), 2) == whole
    # Group k of iteration 2: seed (2 * 4 + k) * 1000 + seed * 10^7, one x_T per group.
    assert [j["seed"] for j in whole] == [10_008_000, 10_009_000, 10_010_000, 10_011_000]
    assert all(j["initial_noise_seed"] == j["seed"] + 999 for j in whole)
    window = whole[0]["rollout_sde_step_indices"]
    assert whole[0]["rollout_return_step_indices"] == sorted({*window, *(s + 1 for s in window)})
    with pytest.raises(SystemExit, match="multiple of the number of ranks"):
        jobs(Ranks(rank=0, world=3), 0)


# ---------------------------------------------------------------------------------------------- rollouts
def test_the_sde_window_is_drawn_per_iteration_and_never_holds_the_last_step():
    args = _flow_args(steps=10)
    windows = [sde_window(args, it) for it in range(50)]
    assert windows == [sde_window(args, it) for it in range(50)]  # seeded: a resumed run draws the same
    assert len({w[0] for w in windows}) == 4  # starts 0..3: the window lies in the first half (5 steps)
    assert all(w == [w[0], w[0] + 1] and w[1] < 5 for w in windows)
    short = _flow_args(steps=3)
    assert {tuple(sde_window(short, it)) for it in range(20)} == {(0, 1)}  # step 2 ends at sigma 0
    assert sde_window(_flow_args(sde_window=0), 0) is None
    branch = [{"step": 1, "factor": 2}, {"step": 3, "factor": 2}]
    assert sde_window(_flow_args(branch=branch), 7) == [1, 3]


def test_requests_carry_only_the_options_that_are_set():
    args = parse_args(["--steps", "6", "--group-size", "4"])
    reward = types.SimpleNamespace(request_fields=lambda: {})
    shared = request_fields(args, 32, 48, torch.device("cpu"), reward)
    assert shared["num_outputs_per_prompt"] == 4 and (shared["width"], shared["height"]) == (32, 48)
    assert shared["generator_device"] == "cpu" and shared["rollout_sde_type"] == "sde"
    for unset in ("true_cfg_scale", "negative_prompt", "max_sequence_length", "rollout_share_prefix",
                  "rollout_branch", "rollout_ode_solver", "rewards"):  # fmt: skip
        assert unset not in shared
    args = parse_args(["--negative-prompt", "blurry", "--ode-solver", "dpm2m", "--share-prefix"])
    on_server = types.SimpleNamespace(request_fields=lambda: {"rewards": ["r"], "return_output": False})
    shared = request_fields(args, 32, 32, torch.device("cpu"), on_server)
    assert shared["negative_prompt"] == "blurry" and shared["rollout_share_prefix"] is True
    assert (shared["rollout_ode_solver"], shared["rollout_outside_window_stride"]) == ("dpm2m", 1)
    assert shared["rewards"] == ["r"] and shared["return_output"] is False


def test_options_the_layout_cannot_serve_are_refused():
    args = parse_args(["--branch", "1:2,3:2", "--group-size", "4"])
    assert args.branch == [{"step": 1, "factor": 2}, {"step": 3, "factor": 2}]
    check_layout(args, in_process=False)
    with pytest.raises(SystemExit, match="--branch needs the server layout"):
        check_layout(args, in_process=True)
    with pytest.raises(SystemExit, match="--branch needs"):
        check_layout(parse_args(["--branch", "1:2,3:2", "--group-size", "8"]), in_process=False)
    with pytest.raises(SystemExit, match="--screen K needs"):
        check_layout(parse_args(["--screen", "8", "--async-depth", "1"]), in_process=False)
    with pytest.raises(SystemExit):
        parse_args(["--full-finetune", "--layout", "in-process"])
    with pytest.raises(SystemExit):
        parse_args(["--branch", "1-2"])


# ---------------------------------------------------------------------------------------------- timing
def test_phases_add_up_their_seconds_and_keep_their_spans_in_order():
    phases = Phases(torch.device("cpu"))
    for name, seconds in (("rollout", 0.03), ("train", 0.01), ("rollout", 0.02)):
        with phases(name):
            time.sleep(seconds)
    record = phases.record()
    assert set(record) == {"rollout_s", "train_s", "spans"}  # no GPU memory keys on a CPU
    assert record["rollout_s"] >= 0.05 and 0.01 <= record["train_s"] < record["rollout_s"]
    spans = record["spans"]
    assert [s[0] for s in spans] == ["rollout", "train", "rollout"]
    assert all(a[2] <= b[1] for a, b in itertools.pairwise(spans))  # one after the other
    rollout = sum(end - start for name, start, end in spans if name == "rollout")
    assert abs(rollout - record["rollout_s"]) < 1e-3


def test_an_iteration_record_counts_images_and_their_rate():
    phases = Phases(torch.device("cpu"))
    with phases("rollout"):
        pass
    outputs = [types.SimpleNamespace(peak_memory_mb=m) for m in (512.0, None, 2048.0)]
    started = time.perf_counter() - 0.5
    record = iteration_record(1, "iter-2", torch.tensor([1.0, 2.0, 3.0]), outputs, phases, started, loss=0.25)
    assert (
        record["rewards"] == [1.0, 2.0, 3.0] and record["reward_mean"] == 2.0 and record["reward_std"] == 1.0
    )
    assert record["images"] == 3 and record["server_peak_gb"] == 2.0 and record["loss"] == 0.25
    assert record["iteration_s"] >= 0.5
    assert record["images_per_second"] == round(3 / record["iteration_s"], 4)


# ---------------------------------------------------------------------------------------------- summaries
def _history(n: int) -> list[dict]:
    return [
        {"iteration": i, "rewards": [float(i), i + 1.0], "reward_mean": i + 0.5, "first_ratio_max_dev": 0.0,
         "checksum_ok": True, "images": 2, "iteration_s": 2.0 if i else 10.0, "train_s": 1.0 if i else 7.0}
        for i in range(n)
    ]  # fmt: skip


def test_learning_stats_compare_the_first_and_last_iterations_in_standard_errors():
    stats = learning_stats(_history(10))
    # First five iterations' rewards 0,1,1,2,...,4,5 (mean 2.5, variance 2.5), the last five 5..10 (7.5, 2.5).
    assert stats["reward_first_k"] == 2.5 and stats["reward_last_k"] == 7.5 and stats["difference"] == 5.0
    assert stats["z_samples"] == pytest.approx(5 / math.sqrt(2.5 / 10 + 2.5 / 10), rel=1e-12)
    assert stats["z_iterations"] == pytest.approx(5.0, rel=1e-12)  # iteration means 0.5..4.5: variance 2.5
    assert stats["cohens_d"] == pytest.approx(5 / math.sqrt(2.5), rel=1e-12)
    assert learning_stats(_history(9)) == {}  # fewer than 2k iterations: nothing to compare


def test_summary_leaves_out_the_warm_up_and_flags_any_unverified_push():
    history = _history(3)
    summary = summarize(history, "first_ratio_max_dev")
    assert summary["mean_seconds"] == {"iteration_s": 2.0, "train_s": 1.0}  # iteration 0 left out
    assert summary["images_per_second"] == 1.0 and summary["checksums_ok"] is True
    history[1]["checksum_ok"], history[2]["first_ratio_max_dev"] = False, 0.5
    summary = summarize(history, "first_ratio_max_dev")
    assert summary["checksums_ok"] is False and summary["first_ratio_max_dev"] == 0.5


def test_staleness_summary_pools_the_ratios_of_each_staleness():
    history = [
        {"ratio_by_staleness": {"0": {"count": 4, "mean": 0.0, "max": 0.0},
                                "1": {"count": 2, "mean": 0.1, "max": 0.2}}},
        {"ratio_by_staleness": {"1": {"count": 2, "mean": 0.3, "max": 0.5}}},
        {},
    ]  # fmt: skip
    assert staleness_summary(history) == {
        "0": {"batches": 1, "count": 4, "mean": 0.0, "max": 0.0},
        "1": {"batches": 2, "count": 4, "mean": pytest.approx(0.2), "max": 0.5},
    }


INSERT_EXAMPLES = re.compile(r"sys\.path\.insert\(.*(examples|EXAMPLES)")


def test_no_example_imports_another_and_nothing_puts_examples_on_the_path():
    """The examples import the package only; no module inserts examples/ into ``sys.path``."""
    root = Path(__file__).resolve().parents[2]
    names = {p.stem for p in (root / "examples").glob("*.py")}
    for path in (root / "examples").glob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] in (["import"], ["from"]) and len(words) > 1:
                assert words[1].split(".")[0] not in names, f"{path.name} imports {words[1]}"
    assert not [p.name for p in (root / "examples").glob("_*.py")]
    for folder in ("benchmarks", "tests", "diffusion_rollout", "scripts", "examples"):
        for path in (root / folder).rglob("*.py"):
            for line in path.read_text().splitlines():
                assert not INSERT_EXAMPLES.search(line), f"{path}: {line.strip()}"
