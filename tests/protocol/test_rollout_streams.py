"""Two latent streams stepped jointly (LTX-2's video and audio), one rollout scheduler each, driven by
hand with toy models: stock equality of all-ODE rollouts, per-stream recordings that are the shared
transition, the RNG order across streams, the joint log-prob, exact schedules in both schedulers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from diffusion_rollout.scheduler_mixins import (
    MultiStreamRolloutState,
    RolloutFlowMatchEulerScheduler,
    RolloutSettings,
    joint_log_prob,
    rollout_context,
    transition,
)

VIDEO, AUDIO = (4, 3, 4, 4), (5, 8)  # per-sample latent shapes of the two streams
STEPS = 4
CONFIG = {"shift": 3.0}


def velocity(x: torch.Tensor, other: torch.Tensor, gain: float) -> torch.Tensor:
    # Each stream's velocity depends on both streams (joint attention), sample by sample.
    coupling = other.float().flatten(1).mean(dim=1).reshape(-1, *([1] * (x.ndim - 1)))
    return (torch.tanh(gain * x.float()) - 0.5 * x.float() + 0.1 * coupling).to(x.dtype)


def draw(seeds, dtype=torch.float32):
    """x_T as the pipeline draws it from a list of generators: every video latent, then every audio one."""
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    video = randn_tensor((len(seeds), *VIDEO), generator=gens, dtype=torch.float32).to(dtype)
    audio = randn_tensor((len(seeds), *AUDIO), generator=gens, dtype=torch.float32).to(dtype)
    return video, audio, gens


def denoise(video_scheduler, video, audio, *, sigmas=None):
    """The joint loop: the audio scheduler is a deep copy of the video one; video steps first."""
    audio_scheduler = copy.deepcopy(video_scheduler)
    for s in (audio_scheduler, video_scheduler):
        if sigmas is None:
            s.set_timesteps(STEPS)
        else:
            s.set_timesteps(sigmas=sigmas)
    for t in video_scheduler.timesteps:
        v_video, v_audio = velocity(video, audio, 1.3), velocity(audio, video, 0.7)
        video = video_scheduler.step(v_video, t, video, return_dict=False)[0]
        audio = audio_scheduler.step(v_audio, t, audio, return_dict=False)[0]
    return video, audio


def rollout(settings, seeds=(0, 1), dtype=torch.float32, sigmas=None, step_generators=None):
    scheduler = RolloutFlowMatchEulerScheduler.from_config(FlowMatchEulerDiscreteScheduler(**CONFIG).config)
    video, audio, gens = draw(seeds, dtype)
    state = MultiStreamRolloutState(
        settings, gens, streams=("video", "audio"), sigmas=sigmas, step_generators=step_generators
    )
    with rollout_context(state):
        final = denoise(scheduler, video, audio)
    return state, final, gens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_all_ode_joint_rollout_is_the_stock_pair_of_schedulers(dtype):
    video, audio, _ = draw([3, 4], dtype)
    want_video, want_audio = denoise(FlowMatchEulerDiscreteScheduler(**CONFIG), video, audio)
    settings = RolloutSettings(kind="ode", log_prob_form="no_const")
    state, (got_video, got_audio), gens = rollout(settings, seeds=(3, 4), dtype=dtype)
    assert torch.equal(got_video, want_video) and torch.equal(got_audio, want_audio)
    assert state.finished and state.num_steps == STEPS
    for name, shape in (("video", VIDEO), ("audio", AUDIO)):
        stream = state.by_stream[name]
        assert stream.trajectory_latents.shape == (2, STEPS + 1, *shape)
        assert torch.equal(stream.log_probs, torch.zeros(2, STEPS))
    # Nothing drawn after x_T.
    for g, ref in zip(gens, draw([3, 4])[2], strict=True):
        assert torch.equal(g.get_state(), ref.get_state())


@pytest.mark.parametrize("kind", ["sde", "dance", "cps"])
def test_every_streams_step_is_the_shared_transition_and_the_joint_log_prob_replays(kind):
    steps = (0, 1, 2) if kind == "cps" else None  # cps has no density at the last step
    settings = RolloutSettings(kind=kind, eta=0.6, sde_step_indices=steps, debug=True)
    state, (final_video, final_audio), _ = rollout(settings)
    sigmas = state.sigmas.tolist()
    assert torch.equal(state.by_stream["audio"].sigmas, state.sigmas)  # one schedule for both streams
    per_stream = {}
    for name, final in (("video", final_video), ("audio", final_audio)):
        s = state.by_stream[name]
        traj = s.trajectory_latents
        assert torch.equal(traj[:, -1], final)
        scores = []
        for step in range(STEPS):
            replay = transition(
                settings.kind_at(step, STEPS),
                traj[:, step],
                s.model_outputs[:, step],
                sigmas[step],
                sigmas[step + 1],
                eta=settings.eta,
                sigma_max=sigmas[1],
                next_sample=traj[:, step + 1],
            )
            assert torch.equal(replay.log_prob, s.log_probs[:, step]), (name, step)
            scores.append(replay.log_prob)
        per_stream[name] = torch.stack(scores, dim=1)
    # The joint value: the mean over both streams' elements, replayed with the same function.
    joint = joint_log_prob([per_stream["video"], per_stream["audio"]], [torch.Size(VIDEO).numel(), 40])
    for i in range(2):
        view = state.per_sample(i)
        assert torch.equal(view["log_probs"], joint[i])
        assert torch.equal(view["streams"]["audio"]["log_probs"], per_stream["audio"][i])
        assert torch.equal(view["trajectory_latents"], state.by_stream["video"].trajectory_latents[i])
    stochastic = [t for t in range(STEPS) if settings.kind_at(t, STEPS) != "ode"]
    assert (joint[:, stochastic] != 0).all()


def test_joint_log_prob_is_the_mean_over_all_elements():
    video = torch.randn(3, 64, dtype=torch.float64)
    audio = torch.randn(3, 16, dtype=torch.float64)
    lp = joint_log_prob([video.mean(dim=1).float(), audio.mean(dim=1).float()], [64, 16])
    assert torch.allclose(lp.double(), torch.cat([video, audio], dim=1).mean(dim=1), atol=1e-6)
    with pytest.raises(ValueError):
        joint_log_prob([lp], [64, 16])


def test_noise_order_is_video_then_audio_per_sample_and_step():
    settings = RolloutSettings(kind="sde", eta=0.6, sde_step_indices=(1,), debug=True)
    state, _, _ = rollout(settings, seeds=(7, 9))
    video_noise = state.by_stream["video"].variance_noises[:, 1]
    audio_noise = state.by_stream["audio"].variance_noises[:, 1]
    for i, seed in enumerate((7, 9)):
        _, _, (g,) = draw([seed])  # the generator right after x_T
        assert torch.equal(video_noise[i], randn_tensor((1, *VIDEO), generator=g)[0])
        assert torch.equal(audio_noise[i], randn_tensor((1, *AUDIO), generator=g)[0])
    # ODE steps drew nothing in either stream.
    assert not state.by_stream["audio"].variance_noises[:, 0].any()


def test_a_per_step_generator_is_shared_by_the_streams_of_its_step():
    # denoise_seeds: a fresh generator per (sample, step); the audio eps continues the video's draw.
    def per_step(base):
        return lambda step: torch.Generator().manual_seed(1000 * base + step)

    settings = RolloutSettings(kind="sde", eta=0.6, sde_step_indices=(2,), debug=True)
    state, _, _ = rollout(settings, seeds=(7, 9), step_generators=[per_step(1), per_step(2)])
    for i, base in enumerate((1, 2)):
        g = torch.Generator().manual_seed(1000 * base + 2)
        video = state.by_stream["video"].variance_noises[i, 2]
        audio = state.by_stream["audio"].variance_noises[i, 2]
        assert torch.equal(video, randn_tensor((1, *VIDEO), generator=g)[0])
        assert torch.equal(audio, randn_tensor((1, *AUDIO), generator=g)[0])


def test_exact_sigmas_run_in_both_schedulers():
    sigmas = [1.0, 0.6, 0.3, 0.1]
    settings = RolloutSettings(kind="ode", log_prob_form="no_const")
    state, (video, audio), _ = rollout(settings, sigmas=sigmas)
    unshifted = FlowMatchEulerDiscreteScheduler(shift=1.0)
    x_video, x_audio, _ = draw([0, 1])
    want = denoise(unshifted, x_video, x_audio, sigmas=sigmas)
    assert torch.equal(video, want[0]) and torch.equal(audio, want[1])
    for s in state.by_stream.values():
        assert torch.equal(s.sigmas, torch.tensor([*sigmas, 0.0]))


def test_streams_must_be_two_or_more_distinct_names():
    for streams in (("video",), ("video", "video")):
        with pytest.raises(ValueError, match="distinct"):
            MultiStreamRolloutState(RolloutSettings(), None, streams=streams)
