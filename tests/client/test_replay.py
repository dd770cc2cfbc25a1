"""Trainer-side replay against the server: bit-exact log-probs (ratio exactly 1) and training use."""

from __future__ import annotations

import pytest
import torch

from diffusion_rollout.client import (
    ReplayBatch,
    ReplaySettings,
    RolloutClient,
    clipped_policy_loss,
    gaussian_kl,
    group_advantages,
    push_lora,
    replay_log_prob,
    replay_step,
    replay_steps,
    trainable_steps,
)
from diffusion_rollout.models import TINY_CALL_DEFAULTS
from tests.client.test_client_weights import trainer_transformer

REPLAY = {
    "rollout_return_dit_trajectory": True,
    "rollout_return_denoising_env": True,
    "rollout_debug_mode": True,
}


def call_defaults(family: str) -> dict:
    return {k: v for k, v in TINY_CALL_DEFAULTS[family].items()}


def rollout(server, family: str, n: int = 3, **fields):
    """One request of ``n`` outputs (one server batch), with everything replay needs."""
    c = RolloutClient("http://testserver", http_client=server.client)
    body = {"seed": 21, **call_defaults(family), **REPLAY, **fields}
    prompt = body.pop("prompt", "a red square on a table")
    return c.generate(prompt, num_outputs_per_prompt=n, **body)


def trainer_copy(path, family: str):
    """The trainer's own modules, loaded from the served folder (two experts for Wan 2.2)."""
    from diffusers import AutoModel

    model = trainer_transformer(path)
    if family != "wan2.2":
        return model
    second = AutoModel.from_pretrained(str(path), subfolder="transformer_2", dtype=torch.float32)
    return {"transformer": model, "transformer_2": second}


FAMILY_CASES = [
    pytest.param("sd3", {}, "cfg_batched", id="sd3-cfg"),
    pytest.param("sd3", {"guidance_scale": 1.0}, "none", id="sd3-nocfg"),
    pytest.param("flux", {}, "none", id="flux"),
    pytest.param("flux", {"negative_prompt": "blurry", "true_cfg_scale": 2.5}, "true_cfg", id="flux-truecfg"),
    pytest.param("qwenimage", {}, "norm_rescale", id="qwenimage"),
    pytest.param("wan", {}, "true_cfg", id="wan"),
    pytest.param("wan2.2", {}, "true_cfg", id="wan2.2-two-experts"),
]


@pytest.mark.parametrize(("family", "fields", "rule"), FAMILY_CASES)
def test_replay_reproduces_server_log_probs_bit_for_bit(served, tiny_model_path, family, fields, rule):
    server = served(family)
    outs = rollout(server, family, **fields)
    assert outs[0].denoising_env["guidance"]["rule"] == rule
    if family == "wan2.2":  # each step replays on the expert the server used
        assert set(outs[0].denoising_env["expert_per_step"]) == {"transformer", "transformer_2"}
    trainer = trainer_copy(tiny_model_path(family), family)
    for module in trainer.values() if isinstance(trainer, dict) else [trainer]:
        module.requires_grad_(True)  # replay under autograd, as a trainer does

    steps = list(replay_steps(trainer, outs))
    assert [s.step for s in steps] == list(range(outs[0].dit_trajectory.num_steps))
    for s in steps:
        server_v = torch.stack([o.rollout_debug_tensors["rollout_model_outputs"][s.step] for o in outs])
        assert torch.equal(s.model_output.detach(), server_v)  # the same velocity, every bit
        assert torch.equal(s.log_prob.detach(), s.old_log_prob)  # hence the same log-prob
        assert torch.equal(s.ratio.detach(), torch.ones(len(outs)))  # ratio exactly 1
        assert s.log_prob.requires_grad
        server_std = torch.stack([o.rollout_debug_tensors["rollout_noise_std_devs"][s.step] for o in outs])
        assert torch.equal(s.std.expand(len(outs)), server_std.reshape(-1))
        server_mean = torch.stack(
            [o.rollout_debug_tensors["rollout_prev_sample_means"][s.step] for o in outs]
        )
        assert torch.equal(s.mean.detach(), server_mean.float())
        assert torch.equal(s.std, s.g * s.sqrt_dt)


@pytest.mark.parametrize(
    ("kind", "form", "sde_steps"),
    [
        ("sde", "gaussian", None),
        ("dance", "scaled", [0, 2]),
        ("cps", "no_const", [1, 2]),
        ("sde", "no_const", [3]),
    ],
)
def test_replay_log_prob_from_server_model_outputs_is_exact(served, kind, form, sde_steps):
    """docs/math.md exactness target 2: given the server's model outputs, the same bits, every kind and form."""
    server = served("sd3")
    outs = rollout(
        server,
        "sd3",
        rollout_sde_type=kind,
        rollout_log_prob_form=form,
        rollout_noise_level=0.9,
        rollout_sde_step_indices=sde_steps,
    )
    batch = ReplayBatch(outs)
    assert batch.settings == ReplaySettings(kind=kind, eta=0.9, log_prob_form=form)
    assert batch.trainable_steps() == (sde_steps if sde_steps is not None else [0, 1, 2, 3])
    for step in range(batch.num_steps):
        v = torch.stack([o.rollout_debug_tensors["rollout_model_outputs"][step] for o in outs])
        res = replay_log_prob(
            batch.kind_at(step), batch.latents(step), v, batch.latents(step + 1), batch.sigmas, step,
            eta=0.9, log_prob_form=form,
        )  # fmt: skip
        assert torch.equal(res.log_prob, batch.old_log_probs(step))
        if batch.kind_at(step) == "ode":
            assert torch.equal(res.log_prob, torch.zeros(3))
            # The stored next latent is the deterministic Euler step, bit for bit.
            assert torch.equal(res.next_sample, batch.latents(step + 1))


def test_lora_policy_replays_exactly_and_trains(fresh_server, tiny_model_path):
    from peft import LoraConfig

    server = fresh_server("sd3", max_batch_size=4)
    c = RolloutClient("http://testserver", http_client=server.client)
    trainer = trainer_transformer(tiny_model_path("sd3"))
    trainer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v", "proj_out"]))
    with torch.no_grad():
        for n, p in trainer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)  # a policy that differs from the base model
    push_lora(c, trainer, weight_version="policy-1")
    outs = rollout(server, "sd3", n=4, rollout_debug_mode=False, seed=5)
    assert {o.weight_version for o in outs} == {"policy-1"}

    rewards = torch.tensor([0.1, 0.4, 0.2, 0.9])
    adv = group_advantages(rewards, 4)
    params = [p for p in trainer.parameters() if p.requires_grad]
    assert params and all(p.grad is None for p in params)
    batch = ReplayBatch(outs)
    for s in replay_steps(trainer, batch):
        assert torch.equal(s.ratio.detach(), torch.ones(4))  # same weights, same batch: exactly 1
        loss, stats = clipped_policy_loss(s.log_prob, s.old_log_prob, adv, clip_range=0.2)
        assert stats["ratio_min"] == stats["ratio_max"] == 1.0 and stats["clip_frac"] == 0.0
        loss.backward()
    assert any(float(p.grad.abs().sum()) > 0 for p in params)
    torch.optim.SGD(params, lr=1.0).step()
    after = replay_step(trainer, batch, 0)
    assert not torch.equal(after.log_prob.detach(), after.old_log_prob)  # the policy moved


def test_replay_follows_step_selection_and_trajectory_filter(served, tiny_model_path):
    server = served("sd3")
    outs = rollout(server, "sd3", n=2, rollout_sde_step_indices=[1, 2], rollout_return_step_indices=[1, 2, 3])
    assert trainable_steps(outs) == [1, 2]
    batch = ReplayBatch(outs)
    assert [batch.kind_at(s) for s in range(4)] == ["ode", "sde", "sde", "ode"]
    trainer = trainer_transformer(tiny_model_path("sd3"))
    with torch.no_grad():
        [one, two] = list(replay_steps(trainer, batch))
    assert (one.step, two.step) == (1, 2) and torch.equal(two.log_prob, two.old_log_prob)
    with pytest.raises(KeyError, match="was not returned"):
        replay_step(trainer, batch, 0)
    with pytest.raises(ValueError, match="outside"):
        replay_step(trainer, batch, 4)


def test_replay_refuses_what_it_cannot_replay(served):
    server = served("sd3")
    c = RolloutClient("http://testserver", http_client=server.client)
    bare = c.generate("x", seed=1, **call_defaults("sd3"))
    with pytest.raises(ValueError, match="rollout_return_dit_trajectory"):
        ReplayBatch(bare)
    a = rollout(server, "sd3", n=1)
    b = rollout(server, "sd3", n=1, num_inference_steps=3)
    with pytest.raises(ValueError, match="different schedules"):
        ReplayBatch(a + b)
    c_ = rollout(server, "sd3", n=1, rollout_noise_level=0.3)
    with pytest.raises(ValueError, match="different step settings"):
        ReplayBatch(a + c_)
    # Raw decoded dicts work when the settings are given.
    raw = {**a[0].__dict__, "dit_trajectory": a[0].dit_trajectory.__dict__}
    assert ReplayBatch([raw], settings=a[0].replay_settings).trainable_steps() == [0, 1, 2, 3]


def test_loss_helpers_match_their_definitions():
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 13.0])
    adv = group_advantages(rewards, 3, eps=0.0)
    assert torch.allclose(adv[:3], torch.tensor([-1.0, 0.0, 1.0]))
    assert torch.allclose(adv[3:].sum(), torch.tensor(0.0), atol=1e-6)
    with pytest.raises(ValueError, match="multiple"):
        group_advantages(rewards, 4)
    new, old = torch.tensor([0.0, 0.5, -0.5]), torch.zeros(3)
    a = torch.tensor([1.0, 1.0, -1.0])
    loss, stats = clipped_policy_loss(new, old, a, clip_range=0.2)
    r = new.exp()
    expected = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2)).mean()
    assert torch.equal(loss, expected) and stats["clip_frac"] == pytest.approx(2 / 3)
    mean, ref = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    std = torch.tensor(0.3)
    kl = gaussian_kl(mean, ref, std)
    truth = (
        torch.distributions.kl_divergence(
            torch.distributions.Normal(mean, std), torch.distributions.Normal(ref, std)
        )
        .flatten(1)
        .mean(1)
    )
    assert torch.allclose(kl, truth, atol=1e-6)


def test_replaying_a_server_batch_by_batch_id_is_bit_exact(fresh_server):
    """Concurrent requests batched together: regrouping by ``batch_id`` makes the ratio exactly 1."""
    import threading
    import time

    from diffusion_rollout.client import RolloutClient, group_by_server_batch, replay_steps

    srv = fresh_server("sd3", max_batch_size=8)
    client = RolloutClient("http://testserver", http_client=srv.client)
    kw = dict(
        num_inference_steps=3, width=32, height=32, max_sequence_length=16, rollout_debug_mode=False,
        rollout_return_dit_trajectory=True, rollout_return_denoising_env=True,
    )  # fmt: skip
    outs: list = []
    srv.engine.worker.pause()
    threads = [
        threading.Thread(
            target=lambda p=p, s=s: outs.extend(client.generate(p, seed=s, num_outputs_per_prompt=2, **kw))
        )
        for p, s in (("a red cat", 1), ("a blue dog", 2))
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while srv.engine.worker.depth < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    srv.engine.worker.resume()
    for t in threads:
        t.join(60)
    groups = group_by_server_batch(outs)
    assert len(groups) == 1 and [o.batch_index for o in groups[0]] == [0, 1, 2, 3]
    assert all(o.batch_size == 4 for o in outs)
    with torch.no_grad():
        for step in replay_steps(srv.engine.pipe.transformer, groups[0]):
            assert torch.equal(step.log_prob, step.old_log_prob), f"step {step.step}"
