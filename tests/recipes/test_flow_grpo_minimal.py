"""The minimal Flow-GRPO recipe (``examples/flow_grpo_minimal.py``) against the full one
(``examples/flow_grpo.py``) on the CPU: a tiny SD3 model, a server on a thread (real HTTP).

The minimal recipe sends the full recipe's requests (seeds, SDE window, prompts, fields), so its
first iteration's rewards are the full recipe's to the last bit; it replays the server's policy
exactly (ratio exactly 1); and it imports nothing from ``examples/``.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MINIMAL = EXAMPLES / "flow_grpo_minimal.py"
# 2 groups of 4 images per iteration, 2 iterations; the rest at both recipes' defaults.
SMALL = ["--iterations", "2", "--prompts", "2", "--group-size", "4"]


@pytest.fixture
def examples(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module


def test_minimal_recipe_matches_the_full_recipes_first_rewards_with_ratio_exactly_1(examples, monkeypatch):
    flow_grpo, minimal = examples("flow_grpo"), examples("flow_grpo_minimal")
    # The full recipe's iteration lives in the package; the example script runs it.
    iteration = importlib.import_module("diffusion_rollout.recipes.flow_grpo")
    # The full recipe's rewards as it trains on them (its record rounds them to 5 digits).
    full_rewards: list[torch.Tensor] = []
    advantages = iteration.group_advantages

    def recording(rewards, group_size):
        full_rewards.append(rewards.clone())
        return advantages(rewards, group_size)

    monkeypatch.setattr(iteration, "group_advantages", recording)
    full = flow_grpo.main(["--server", "thread", *SMALL])
    history = minimal.main(SMALL)

    assert len(full_rewards) == len(history) == 2
    first = torch.tensor(history[0]["rewards"], dtype=torch.float32)
    assert first.numel() == 8 and torch.equal(first, full_rewards[0])
    assert history[0]["sde_steps"] == full["history"][0]["sde_steps"]
    for h in history:
        # Every replayed step is on-policy (one optimizer step per iteration): ratio exactly 1.
        assert h["first_ratio_max_dev"] == 0.0
    assert full["summary"]["first_ratio_max_dev"] == 0.0
    # Same training step too: the second iteration's rewards (after one update and push) agree.
    assert torch.equal(torch.tensor(history[1]["rewards"], dtype=torch.float32), full_rewards[1])


def test_minimal_recipe_uses_the_public_package_alone():
    """No import from examples/ (``_common``, ``rewards``...), no sys.path edits, at most 200 lines."""
    source = MINIMAL.read_text()
    assert len(source.splitlines()) <= 200
    assert "sys.path" not in source
    tree = ast.parse(source)
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    local = {p.stem for p in EXAMPLES.glob("*.py")}
    assert not modules & local, modules & local
    assert {m for m in modules if m.startswith("diffusion_rollout")} >= {
        "diffusion_rollout.client",
        "diffusion_rollout.rewards",
    }
