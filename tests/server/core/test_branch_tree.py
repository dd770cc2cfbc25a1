"""Branching trees (``rollout_branch``; server/core/branch_tree.py): one request grows G
leaves from one x_T, each node's steps computed once; the leaves share exactly their common
ancestors' latents, the transformer sees one row per node, and a trainer's replay of the tree
reproduces the server's model outputs bit for bit (ratio exactly 1)."""

from __future__ import annotations

import pytest
import torch

from diffusion_rollout.protocol import wire
from diffusion_rollout.protocol.row_sharing import branch_block, branch_path

T = 5
SIGMAS = [1.0, 0.85, 0.65, 0.45, 0.25]
TREE = [{"step": 1, "factor": 2}, {"step": 3, "factor": 2}]
BASE = {
    "prompt": "a red cat",
    "width": 32,
    "height": 32,
    "max_sequence_length": 16,
    "sigmas": SIGMAS,
    "seed": 21,
    "initial_noise_seed": 7,
    "num_outputs_per_prompt": 4,
    "rollout_sde_step_indices": [1, 2, 3],
    "rollout_branch": TREE,
    "rollout_return_dit_trajectory": True,
    "rollout_debug_mode": True,
}
CASES = [
    ("sd3", {}),
    ("sd3", {"guidance_scale": 4.0, "negative_prompt": "blurry"}),
    ("qwenimage", {"true_cfg_scale": 4.0, "negative_prompt": "blurry"}),
]


def post(srv, body: dict, expect: int = 200):
    r = srv.client.post(
        "/rollout/generate",
        content=wire.encode(body),
        headers={"Content-Type": wire.MSGPACK, "Accept": wire.MSGPACK},
    )
    assert r.status_code == expect, r.text[:2000]
    return wire.decode(r.content, r.headers["content-type"]) if expect == 200 else r


def test_the_tree_arithmetic():
    tree = [(1, 2), (3, 2)]
    assert [branch_path(r, tree) for r in range(4)] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert [branch_block(4, tree, s) for s in range(T)] == [4, 4, 2, 2, 1]
    assert [branch_path(r, [(0, 3)]) for r in range(3)] == [[0], [1], [2]]


@pytest.mark.parametrize(("family", "extra"), CASES, ids=["sd3", "sd3-cfg", "qwenimage-truecfg"])
def test_leaves_share_exactly_their_ancestors(served, family, extra):
    outs = post(served(family), {**BASE, **extra})
    assert [o["branch_path"] for o in outs] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert all(o["rollout_branch"] == [[1, 2], [3, 2]] for o in outs)
    lat = [o["dit_trajectory"]["latents"] for o in outs]

    def same(a: int, b: int, entry: int) -> bool:
        return torch.equal(lat[a][entry], lat[b][entry])

    # Entries 0-1 (before the first branch step): one node. Entries 2-3 (after step 1, and after the
    # stochastic non-branch step 2): one node per first-level child. Entry 4 on: every leaf its own.
    for entry in (0, 1):
        assert all(same(0, b, entry) for b in (1, 2, 3))
    for entry in (2, 3):
        assert same(0, 1, entry) and same(2, 3, entry) and not same(0, 2, entry)
    for entry in (4, 5):
        assert not same(0, 1, entry) and not same(2, 3, entry)
    # Log-probs: a node's step is scored once per leaf, identically.
    lp = torch.stack([o["rollout_log_probs"] for o in outs])
    assert torch.equal(lp[0, :3], lp[1, :3]) and not torch.equal(lp[0, 3], lp[1, 3])


def test_the_transformer_sees_one_row_per_node(served):
    from tests.family_helpers import transformer_rows

    srv = served("sd3")
    with transformer_rows(srv) as rows:
        post(srv, {**BASE, "guidance_scale": 4.0})
    # CFG doubles each: steps 0-1 one node, steps 2-3 two nodes, step 4 four leaves (not 5 x 8 rows).
    assert rows == [2, 2, 4, 4, 8]


@pytest.mark.parametrize(("family", "extra"), [CASES[1], CASES[2]], ids=["sd3-cfg", "qwenimage-truecfg"])
def test_a_trainer_replays_a_tree_with_ratio_exactly_1(served, tiny_model_path, family, extra):
    from diffusion_rollout.client import ReplayBatch, RolloutClient, replay_steps
    from tests.client.test_client_weights import trainer_transformer
    from tests.family_helpers import REPLAY

    srv = served(family)
    c = RolloutClient("http://testserver", http_client=srv.client)
    fields = {k: v for k, v in {**BASE, **extra, **REPLAY}.items() if k != "prompt"}
    outs = c.generate("a red cat", **fields)
    trainer = trainer_transformer(tiny_model_path(family)).requires_grad_(True)
    steps = list(replay_steps(trainer, outs))
    assert [s.step for s in steps] == [1, 2, 3]
    for s in steps:
        server_v = torch.stack([o.rollout_debug_tensors["rollout_model_outputs"][s.step] for o in outs])
        assert torch.equal(s.model_output.detach(), server_v)
        assert torch.equal(s.ratio.detach(), torch.ones(4))
    with pytest.raises(ValueError, match="all of its leaves"):
        ReplayBatch(outs[:2])


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"num_outputs_per_prompt": 3}, "num_outputs_per_prompt=4"),
        ({"rollout_sde_step_indices": [3]}, "not stochastic steps"),
        ({"rollout_branch": [{"step": 3, "factor": 2}, {"step": 1, "factor": 2}]}, "increase strictly"),
        ({"initial_noise_seed": None}, "initial_noise_seed"),
        ({"rollout_share_prefix": True}, "rollout_share_prefix"),
        ({"rollout_branch": [{"step": 1, "factor": 1}]}, "factor"),
    ],
)
def test_what_a_tree_refuses_names_the_field(served, patch, needle):
    r = post(served("sd3"), {**BASE, **patch}, expect=r_code(patch))
    assert needle in r.text and "rollout_branch" in r.text


def r_code(patch: dict) -> int:
    return 422 if patch.get("rollout_branch") == [{"step": 1, "factor": 1}] else 400


def test_a_lean_tree_sends_its_shared_trajectory_entries_once(served):
    from diffusion_rollout.protocol import lean

    srv = served("sd3")
    body = {**BASE, "rollout_return_denoising_env": True, "rollout_debug_mode": False}

    def raw(lean_response: bool):
        r = srv.client.post(
            "/rollout/generate", content=wire.encode({**body, "lean_response": lean_response}),
            headers={"Content-Type": wire.MSGPACK, "Accept": wire.MSGPACK},
        )  # fmt: skip
        assert r.status_code == 200, r.text[:500]
        return r.content, wire.decode(r.content, r.headers["content-type"])

    plain_bytes, plain = raw(False)
    lean_bytes, sent = raw(True)
    # Leaf 0 carries all 6 entries; leaf 1 shares entries 0-3 with leaf 0; leaf 2 shares 0-1 with
    # leaf 0; leaf 3 shares 0-1 with leaf 0 and 2-3 with leaf 2.
    froms = [o["dit_trajectory"].get(lean.FROM_KEY) for o in sent]
    assert froms == [None, [0, 0, 0, 0, -1, -1], [0, 0, -1, -1, -1, -1], [0, 0, 2, 2, -1, -1]]
    entry = (
        plain[0]["dit_trajectory"]["latents"][0].numel()
        * plain[0]["dit_trajectory"]["latents"].element_size()
    )
    assert len(plain_bytes) - len(lean_bytes) >= 10 * entry  # ten entries not sent (and the envs once)
    rebuilt = lean.from_lean(sent)
    for a, b in zip(plain, rebuilt, strict=True):
        assert torch.equal(a["dit_trajectory"]["latents"], b["dit_trajectory"]["latents"])
        assert lean.FROM_KEY not in b["dit_trajectory"]


def test_tree_advantages_normalise_node_rewards_by_depth():
    from diffusion_rollout.client import group_advantages, tree_advantages

    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0])
    adv = tree_advantages(rewards, [(1, 2), (3, 2)])
    node = torch.tensor([1.5, 4.0])  # the first-level nodes' mean rewards
    first = (node - node.mean()) / (node.std() + 1e-4)
    assert torch.equal(adv[1], first.repeat_interleave(2))
    assert torch.equal(adv[3], group_advantages(rewards, 4))  # the last level: the leaves themselves
    with pytest.raises(ValueError, match="one per leaf"):
        tree_advantages(rewards[:3], [(1, 2), (3, 2)])
