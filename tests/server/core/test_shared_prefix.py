"""Issue #60: shared ODE prefixes and screen-then-regenerate, through the real HTTP app.

What is proven here, bit for bit (``torch.equal``), on the CPU in float32 with tiny SD3 and
Qwen-Image, with and without guidance:

- A ``rollout_share_prefix`` group of G equals the composition of two stock calls: the prefix at
  batch 1 (a solo rollout's first k trajectory entries), then the group at batch G from that x_k
  with the remaining sigmas (``initial_noise`` = x_k, ``sigmas`` = the tail of the schedule): every
  output, trajectory entry, log-prob and the branch's model outputs.
- It is not claimed equal to the unshared group: a transformer's rows at batch 1 and batch 4 differ
  in their last bits on these models (measured on the CPU, float32, all four cases below; not
  asserted, since it is a property of the kernels, not of this feature). That the prefix really
  ran narrowed is asserted by counting the transformer's rows.
- Regenerating outputs 1 and 3 of a group by naming their seeds equals those outputs of a direct
  rollout of the same two seeds (a batch of 2); against the group of 4 it is equal in what does not
  depend on the batch (x_T, the step noise), not in the model's last bits.
"""

from __future__ import annotations

import pytest
import torch

from diffusion_rollout.protocol import wire

T = 4
K = 2  # the first stochastic step: steps 0 and 1 are the shared prefix
SIGMAS = [1.0, 0.8, 0.55, 0.3]
BASE = {
    "prompt": "a red cat",
    "width": 32,
    "height": 32,
    "max_sequence_length": 16,
    "sigmas": SIGMAS,
    "initial_noise_seed": 7,
    "rollout_sde_step_indices": [K, K + 1],
    "rollout_return_dit_trajectory": True,
    "rollout_debug_mode": True,
}
CASES = [
    ("sd3", {}),
    ("sd3", {"guidance_scale": 4.0, "negative_prompt": "blurry"}),
    ("qwenimage", {}),
    ("qwenimage", {"true_cfg_scale": 4.0, "negative_prompt": "blurry"}),
]


def post(srv, body: dict) -> list[dict]:
    r = srv.client.post(
        "/rollout/generate",
        content=wire.encode(body),
        headers={"Content-Type": wire.MSGPACK, "Accept": wire.MSGPACK},
    )
    assert r.status_code == 200, r.text[:2000]
    return wire.decode(r.content, r.headers["content-type"])


def unpack(srv, x: torch.Tensor) -> torch.Tensor:
    """One packed latent ``[*latent]`` back to the unpacked x_T shape ``initial_noise`` takes."""
    a = srv.engine.adapter
    c, h, w = a.noise_shape(_call(srv))
    if not a.packs_latents_2x2:
        return x.reshape(c, h, w)
    # Inverse of the pipelines' _pack_latents: [(h/2)(w/2), 4c] -> [c, h, w].
    return x.reshape(h // 2, w // 2, c, 2, 2).permute(2, 0, 3, 1, 4).reshape(c, h, w)


def _call(srv):
    from diffusion_rollout.entrypoints.request_params import to_params
    from diffusion_rollout.protocol.requests import GenerateRequest

    return srv.engine.planner.plan(to_params(GenerateRequest(**BASE), "t")).call


def traj(out: dict) -> torch.Tensor:
    return out["dit_trajectory"]["latents"]


@pytest.mark.parametrize(("family", "extra"), CASES, ids=[f"{f}-{'cfg' if e else 'nocfg'}" for f, e in CASES])
def test_shared_prefix_group_is_prefix_at_batch_1_then_branch_at_batch_g(served, family, extra):
    srv = served(family)
    body = {**BASE, **extra, "seed": 40, "num_outputs_per_prompt": 4}
    shared = post(srv, {**body, "rollout_share_prefix": True})
    plain = post(srv, body)
    assert [o["shared_prefix_steps"] for o in shared] == [K] * 4
    assert [o["shared_prefix_outputs"] for o in shared] == [4] * 4
    assert "shared_prefix_steps" not in plain[0]

    # The prefix is a batch-1 rollout's prefix, bit for bit, in every output.
    solo = post(srv, {**body, "num_outputs_per_prompt": 1})[0]
    for o in shared:
        assert torch.equal(traj(o)[: K + 1], traj(solo)[: K + 1])
        assert torch.equal(o["rollout_log_probs"][:K], torch.zeros(K))
        assert o["sde_step_indices"] == [K, K + 1] and o["batch_size"] == 4

    # The branch: the group at batch 4 from x_k with the remaining sigmas, two stock calls in all.
    x_k = unpack(srv, traj(solo)[K])
    tail = post(srv, {
        **{k: v for k, v in body.items() if k != "initial_noise_seed"},
        "initial_noise": x_k, "sigmas": SIGMAS[K:], "rollout_sde_step_indices": [0, 1],
    })  # fmt: skip
    for o, t in zip(shared, tail, strict=True):
        assert torch.equal(traj(o)[K:], traj(t))
        assert torch.equal(o["rollout_log_probs"][K:], t["rollout_log_probs"])
        assert torch.equal(o["generated_output"], t["generated_output"])
        for name, v in t["rollout_debug_tensors"].items():
            if v.ndim > 1 and v.shape[0] == T - K:
                assert torch.equal(o["rollout_debug_tensors"][name][K:], v), name
    # The branches did branch: their own step noise.
    assert not torch.equal(shared[0]["generated_output"], shared[1]["generated_output"])


def test_the_prefix_runs_one_row_per_guidance_branch(served):
    """The saving itself: the transformer sees 2 rows (CFG) at the prefix steps, 2G after them."""
    from tests.family_helpers import transformer_rows

    srv = served("sd3")
    body = {
        **BASE,
        "guidance_scale": 4.0,
        "seed": 3,
        "num_outputs_per_prompt": 3,
        "rollout_share_prefix": True,
    }
    with transformer_rows(srv) as rows:
        post(srv, body)
    assert rows == [2] * K + [6] * (T - K)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"initial_noise_seed": None}, "initial_noise_seed"),
        ({"rollout": False}, "rollout=true"),
        ({"initial_noise_group_ids": ["a"]}, "initial_noise_group_ids"),
        ({"feature_cache": {"kind": "taylorseer"}, "allow_inexact": True}, "feature_cache"),
    ],
)
def test_share_prefix_refuses_groups_whose_rows_differ(served, change, needle):
    from tests.family_helpers import assert_400_naming

    body = {**BASE, "seed": 1, "num_outputs_per_prompt": 2, "rollout_share_prefix": True, **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = served("sd3").generate(body, expect=400)
    err = r.json()["error"]
    assert "rollout_share_prefix" in err["message"] and needle in err["message"], err
    assert_400_naming(
        served("flux"), {**BASE, "seed": 1, "rollout_share_prefix": True}, "rollout_share_prefix"
    )


@pytest.mark.parametrize("family", ["sd3", "qwenimage"])
def test_screen_then_regenerate_the_chosen_seeds_exactly(served, family):
    """Screen 4 candidates inexactly (a feature cache), regenerate outputs 1 and 3 exactly by their seeds."""
    from diffusion_rollout.client.regenerate import regenerate_body

    srv = served(family)
    screen_body = {
        **BASE, "seed": 20, "num_outputs_per_prompt": 4, "denoise_seeds": ["a", "b", "c", "d"],
        "feature_cache": {"kind": "taylorseer"}, "allow_inexact": True,
    }  # fmt: skip
    screen = post(srv, screen_body)
    assert not any(o["exact"] for o in screen)
    body = regenerate_body(screen_body, screen, [1, 3])
    assert body["seeds"] == [21, 23] and body["denoise_seeds"] == ["b", "d"] and "feature_cache" not in body
    again = post(srv, body)
    assert all(o["exact"] for o in again) and [o["seed"] for o in again] == [21, 23]

    # The same random numbers as the candidates: x_T and every step's noise.
    for o, i in zip(again, [1, 3], strict=True):
        assert torch.equal(traj(o)[0], traj(screen[i])[0])
        noises = o["rollout_debug_tensors"]["rollout_variance_noises"]
        assert torch.equal(noises, screen[i]["rollout_debug_tensors"]["rollout_variance_noises"])
        assert noises[K].abs().sum() > 0
    # Bit-equal to a direct exact rollout of those seeds, written out by hand.
    direct = post(srv, {
        **BASE, "seed": 20, "seeds": [21, 23], "num_outputs_per_prompt": 2,
        "denoise_seeds": ["b", "d"],
    })  # fmt: skip
    for o, d in zip(again, direct, strict=True):
        assert torch.equal(o["generated_output"], d["generated_output"])
        assert torch.equal(o["rollout_log_probs"], d["rollout_log_probs"])
        assert torch.equal(traj(o), traj(d))


def test_regenerate_body_validates_its_inputs():
    from diffusion_rollout.client.regenerate import regenerate_body

    answers = [{"seed": 5}, {"seed": 6}]
    with pytest.raises(ValueError, match="not one of"):
        regenerate_body({"prompt": "x"}, answers, [2])
    with pytest.raises(ValueError, match="initial_noise"):
        regenerate_body({"prompt": "x", "initial_noise": torch.zeros(2, 4)}, answers, [1])
    body = regenerate_body({"prompt": "x", "initial_noise_group_ids": ["g", "h"]}, answers, [1])
    assert body == {
        "prompt": "x",
        "initial_noise_group_ids": ["h"],
        "seeds": [6],
        "num_outputs_per_prompt": 1,
    }


@pytest.mark.parametrize(("family", "extra"), [CASES[1], CASES[3]], ids=["sd3-cfg", "qwenimage-truecfg"])
def test_a_trainer_replays_a_shared_prefix_group_with_ratio_exactly_1(served, tiny_model_path, family, extra):
    """The trainer's own transformer replays the window's steps (run at the group's batch): the
    server's model outputs bit for bit and a ratio of exactly 1; the prefix steps are not trainable."""
    from diffusion_rollout.client import RolloutClient, replay_steps
    from tests.client.test_client_weights import trainer_transformer
    from tests.family_helpers import REPLAY

    srv = served(family)
    c = RolloutClient("http://testserver", http_client=srv.client)
    fields = {k: v for k, v in {**BASE, **extra, **REPLAY}.items() if k != "prompt"}
    outs = c.generate("a red cat", seed=9, num_outputs_per_prompt=3, rollout_share_prefix=True, **fields)
    assert [o.extra["shared_prefix_steps"] for o in outs] == [K] * 3
    trainer = trainer_transformer(tiny_model_path(family)).requires_grad_(True)
    steps = list(replay_steps(trainer, outs))
    assert [s.step for s in steps] == [K, K + 1]
    for s in steps:
        server_v = torch.stack([o.rollout_debug_tensors["rollout_model_outputs"][s.step] for o in outs])
        assert torch.equal(s.model_output.detach(), server_v)
        assert torch.equal(s.ratio.detach(), torch.ones(3))
