"""``POST /rollout/generate`` on the tiny Wan 2.1 and Wan 2.2 (two experts) video models, through HTTP.

Exactness is equality (``torch.equal``): ``rollout=false`` against the stock ``WanPipeline`` with its
UniPC scheduler; ODE rollouts against the stock pipeline given a flow-match Euler scheduler at the
same shift (the only scheduler a rollout runs); custom sigmas against the stock Euler scheduler with
its shift disabled; replay of every step, with the expert and guidance scale each step used.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from diffusion_rollout.client.replay import replay_log_prob, replay_model_output

T = 4
FLOW_SHIFT = 3.0  # the tiny models' (and Wan2.1/2.2 480p checkpoints') UniPC flow_shift
BOUNDARY_T = 875.0  # boundary_ratio 0.875 * num_train_timesteps
BASE = {
    "prompt": "a red cat",
    "width": 32,
    "height": 32,
    "num_frames": 5,
    "num_inference_steps": T,
    "guidance_scale": 4.0,
    "max_sequence_length": 16,
}
LATENT = (16, 2, 4, 4)  # 5 frames -> 2 latent frames, 32 px -> 4 latent px
VIDEO = (3, 5, 32, 32)  # [C, F, H, W]
ODE = {"rollout_sde_type": "ode", "rollout_log_prob_no_const": True}


def body(family: str, **kw) -> dict:
    extra = {"guidance_scale_2": 3.0} if family == "wan2.2" else {}
    return {**BASE, "seed": 7, **extra, **kw}


_stock: dict = {}


def stock(path, family, *, seeds, output_type, scheduler="unipc", sigmas=None, **kw):
    """The stock pipeline from the same folder (UniPC, or a stock flow-match Euler scheduler)."""
    key = (str(path), scheduler)
    if key not in _stock:
        pipe = DiffusionPipeline.from_pretrained(str(path), dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        assert isinstance(pipe.scheduler, UniPCMultistepScheduler)
        if scheduler == "euler":
            pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=FLOW_SHIFT)
        elif scheduler == "unshifted":
            pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
        _stock[key] = pipe
    pipe = _stock[key]
    if sigmas is not None:
        # WanPipeline.__call__ has no sigmas=; its set_timesteps(T) call gets the schedule instead.
        sched = pipe.scheduler
        pipe.scheduler.set_timesteps = lambda *a, device=None, **k: type(sched).set_timesteps(
            sched, sigmas=sigmas, device=device
        )
    args = {**body(family), **kw}
    args.pop("seed")
    gens = [torch.Generator("cpu").manual_seed(s) for s in seeds]
    try:
        out = pipe(generator=gens, output_type=output_type, num_videos_per_prompt=len(seeds), **args).frames
    finally:
        pipe.scheduler.__dict__.pop("set_timesteps", None)
    return out if output_type == "latent" else out.permute(0, 2, 1, 3, 4)  # -> [B, C, F, H, W]


def stack(outs, key="generated_output"):
    return torch.stack([o[key] for o in outs])


def transformers(srv) -> dict:
    pipe = srv.engine.pipe
    return {"transformer": pipe.transformer, "transformer_2": getattr(pipe, "transformer_2", None)}


# --------------------------------------------------------------------------- bit-exact ODE paths
@pytest.mark.parametrize("family", ["wan", "wan2.2"])
def test_rollout_false_is_the_stock_unipc_pipeline(served, tiny_model_path, family):
    srv, path = served(family), tiny_model_path(family)
    lat = srv.generate(body(family, rollout=False, num_outputs_per_prompt=2, return_generated_output=False))
    assert torch.equal(stack(lat), stock(path, family, seeds=[7, 8], output_type="latent"))
    vid = srv.generate(body(family, rollout=False, num_outputs_per_prompt=2))
    assert vid[0]["generated_output"].shape == VIDEO
    assert torch.equal(stack(vid), stock(path, family, seeds=[7, 8], output_type="pt"))
    # A rollout in between must not leave the Euler scheduler in the pipeline.
    srv.generate(body(family, **ODE))
    assert isinstance(srv.engine.pipe.scheduler, UniPCMultistepScheduler)
    again = srv.generate(body(family, rollout=False, num_outputs_per_prompt=2, return_generated_output=False))
    assert torch.equal(stack(again), stack(lat))


@pytest.mark.parametrize("family", ["wan", "wan2.2"])
@pytest.mark.parametrize(
    "mode", [ODE, {"rollout_sde_step_indices": [], "rollout_log_prob_no_const": True}], ids=["ode", "no_sde"]
)
def test_ode_rollout_is_the_stock_pipeline_with_euler_at_the_same_shift(
    served, tiny_model_path, family, mode
):
    srv, path = served(family), tiny_model_path(family)
    lat = srv.generate(body(family, num_outputs_per_prompt=2, return_generated_output=False, **mode))
    assert torch.equal(stack(lat), stock(path, family, seeds=[7, 8], output_type="latent", scheduler="euler"))
    vid = srv.generate(body(family, num_outputs_per_prompt=2, **mode))
    assert torch.equal(stack(vid), stock(path, family, seeds=[7, 8], output_type="pt", scheduler="euler"))
    for o in vid:
        assert torch.equal(o["rollout_log_probs"], torch.zeros(T))
    # ...and it is not the UniPC result.
    assert not torch.equal(stack(lat), stock(path, family, seeds=[7, 8], output_type="latent"))


@pytest.mark.parametrize("rollout", [False, True], ids=["rollout_false", "ode_rollout"])
def test_custom_sigmas_are_used_exactly(served, tiny_model_path, rollout):
    sigmas = [1.0, 0.8, 0.45, 0.2]
    mode = {"rollout": False} if not rollout else {**ODE, "rollout_return_dit_trajectory": True}
    (out,) = served("wan").generate(body("wan", sigmas=sigmas, return_generated_output=False, **mode))
    ref = stock(
        tiny_model_path("wan"), "wan", seeds=[7], output_type="latent", scheduler="unshifted", sigmas=sigmas
    )
    assert torch.equal(out["generated_output"], ref[0])
    if rollout:
        assert torch.equal(out["dit_trajectory"]["sigmas"], torch.tensor([*sigmas, 0.0]))


def test_unshifted_sigmas_get_the_flow_shift(served):
    sigmas = [1.0, 0.75, 0.5, 0.25]
    (out,) = served("wan").generate(
        body("wan", sigmas=sigmas, sigmas_are_shifted=False, rollout_return_dit_trajectory=True, **ODE)
    )
    shifted = [FLOW_SHIFT * s / (1 + (FLOW_SHIFT - 1) * s) for s in sigmas]
    assert torch.equal(out["dit_trajectory"]["sigmas"], torch.tensor([*shifted, 0.0], dtype=torch.float32))


# --------------------------------------------------------------------------- two experts
def test_wan22_runs_both_experts_on_either_side_of_the_boundary(served, tiny_model_path):
    srv = served("wan2.2")
    (out,) = srv.generate(
        body("wan2.2", rollout_return_dit_trajectory=True, rollout_return_denoising_env=True)
    )
    experts = out["expert_per_step"]
    assert out["denoising_env"]["expert_per_step"] == experts
    ts = out["dit_trajectory"]["timesteps"][:T]
    assert experts == ["transformer" if t >= BOUNDARY_T else "transformer_2" for t in ts.tolist()]
    assert experts[0] == "transformer" and experts[-1] == "transformer_2"  # both really ran
    guidance = out["denoising_env"]["guidance"]
    assert guidance["guidance_scale"] == 4.0 and guidance["guidance_scale_2"] == 3.0
    # Without guidance_scale_2 the low-noise expert uses guidance_scale, as in the pipeline.
    (same,) = srv.generate(body("wan2.2", rollout_return_denoising_env=True, guidance_scale_2=None))
    assert same["denoising_env"]["guidance"]["guidance_scale_2"] == 4.0


def test_wan22_always_names_the_expert_of_every_step(served, tiny_model_path):
    # A trainer logging per-expert metrics needs expert_per_step on every response, not only when
    # it asked for the trajectory or the conditioning; plain generation (UniPC) included.
    srv = served("wan2.2")
    (full,) = srv.generate(body("wan2.2", rollout_return_dit_trajectory=True))
    (bare,) = srv.generate(body("wan2.2", rollout_debug_mode=False))
    assert bare["dit_trajectory"] is None and bare["denoising_env"] is None
    assert bare["expert_per_step"] == full["expert_per_step"]
    (plain,) = srv.generate(body("wan2.2", rollout=False))
    unipc = UniPCMultistepScheduler.from_pretrained(str(tiny_model_path("wan2.2")), subfolder="scheduler")
    unipc.set_timesteps(T)
    expected = ["transformer" if t >= BOUNDARY_T else "transformer_2" for t in unipc.timesteps.tolist()]
    assert set(expected) == {"transformer", "transformer_2"}
    assert plain["rollout_log_probs"] is None and plain["expert_per_step"] == expected
    (one_expert,) = served("wan").generate(body("wan", rollout_debug_mode=False))
    assert "expert_per_step" not in one_expert


@pytest.mark.parametrize("family", ["wan", "wan2.2"])
def test_replay_reproduces_every_step_with_its_expert_and_scale(served, family):
    srv = served(family)
    (out,) = srv.generate(
        body(
            family,
            rollout_sde_step_indices=[0, 2],  # one SDE window per expert on Wan 2.2
            rollout_return_dit_trajectory=True,
            rollout_return_denoising_env=True,
            rollout_debug_mode=True,
        )
    )
    traj, env = out["dit_trajectory"], out["denoising_env"]
    recorded = out["rollout_debug_tensors"]["rollout_model_outputs"]
    assert env["guidance"]["rule"] == "true_cfg" and env["neg_cond_kwargs"] is not None
    mods = transformers(srv)
    for step in range(T):
        x = traj["latents"][step : step + 1]
        with torch.no_grad():
            v = replay_model_output(mods, x, traj["timesteps"][step], env, step=step)
        assert torch.equal(v[0], recorded[step]), f"model output differs at step {step}"
        kind = "sde" if step in out["sde_step_indices"] else "ode"
        res = replay_log_prob(kind, x, v, traj["latents"][step + 1 : step + 2], traj["sigmas"], step, eta=0.7)
        assert torch.equal(res.log_prob[0], out["rollout_log_probs"][step]), f"log-prob differs at {step}"
    if family == "wan2.2":
        low = env["expert_per_step"].index("transformer_2")
        x = traj["latents"][low : low + 1]
        # The low-noise step needs guidance_scale_2 and transformer_2: either one wrong changes the bits.
        wrong_scale = {**env, "guidance": {**env["guidance"], "guidance_scale_2": None}}
        wrong_expert = {**env, "expert_per_step": ["transformer"] * T}
        with torch.no_grad():
            for bad in (wrong_scale, wrong_expert):
                v = replay_model_output(mods, x, traj["timesteps"][low], bad, step=low)
                assert not torch.equal(v[0], recorded[low])


def _replays_bitwise(srv, out) -> None:
    traj, env = out["dit_trajectory"], out["denoising_env"]
    recorded = out["rollout_debug_tensors"]["rollout_model_outputs"]
    for step in range(T):
        with torch.no_grad():
            v = replay_model_output(
                transformers(srv), traj["latents"][step : step + 1], traj["timesteps"][step], env, step=step
            )
        assert torch.equal(v[0], recorded[step]), f"model output differs at step {step}"


def test_bf16_replay_casts_the_float32_latents_like_the_pipeline(fresh_server):
    # Wan keeps float32 latents and casts the model input to the transformer's dtype.
    srv = fresh_server("wan2.2", dtype="bfloat16")
    (out,) = srv.generate(
        body("wan2.2", rollout_return_dit_trajectory=True, rollout_return_denoising_env=True)
    )
    assert out["denoising_env"]["model_input_dtype"] == "torch.bfloat16"
    assert out["rollout_debug_tensors"]["rollout_model_outputs"].dtype == torch.bfloat16
    assert set(out["expert_per_step"]) == {"transformer", "transformer_2"}
    _replays_bitwise(srv, out)


def test_per_token_timesteps_replay(tiny_model_path, tmp_path):
    """Wan 2.2 TI2V-style ``expand_timesteps``: the model gets a [B, tokens] timestep."""
    from tests.conftest import ServedModel

    folder = tmp_path / "wan-expand"
    shutil.copytree(tiny_model_path("wan"), folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "expand_timesteps": True}))
    srv = ServedModel(folder)
    try:
        (out,) = srv.generate(
            body("wan", rollout_return_dit_trajectory=True, rollout_return_denoising_env=True)
        )
        env = out["denoising_env"]
        assert env["timestep_tokens"] == 2 * 2 * 2  # latent frames * (4/2) * (4/2)
        _replays_bitwise(srv, out)
        # A [B] timestep is not the same computation (the time embedding runs per token).
        flat = {k: v for k, v in env.items() if k != "timestep_tokens"}
        traj = out["dit_trajectory"]
        with torch.no_grad():
            v = replay_model_output(
                transformers(srv), traj["latents"][1:2], traj["timesteps"][1], flat, step=1
            )
        assert not torch.equal(v[0], out["rollout_debug_tensors"]["rollout_model_outputs"][1])
    finally:
        srv.close()


# --------------------------------------------------------------------------- SDE rollouts, video shapes
@pytest.mark.parametrize("family", ["wan", "wan2.2"])
def test_sde_windows_log_probs_and_video_trajectory(served, family):
    (out,) = served(family).generate(
        body(
            family,
            rollout_sde_step_indices=[3, 0],
            rollout_return_dit_trajectory=True,
            rollout_return_step_indices=[0, 2, 4],
            rollout_debug_mode=False,
        )
    )
    lp = out["rollout_log_probs"]
    assert lp.shape == (T,) and lp.dtype == torch.float32
    assert lp[1].item() == 0.0 and lp[2].item() == 0.0
    assert lp[0].item() != 0.0 and lp[3].item() != 0.0
    assert out["sde_step_indices"] == [0, 3]
    traj = out["dit_trajectory"]
    assert traj["latents"].shape == (3, *LATENT) and traj["latent_step_indices"] == [0, 2, 4]
    assert traj["sigmas"].shape == (T + 1,) and traj["sigmas"][-1].item() == 0.0
    assert out["generated_output"].shape == VIDEO


def test_a_sample_depends_only_on_its_own_seed(served):
    srv = served("wan2.2")
    traj = {"rollout_return_dit_trajectory": True, "rollout_debug_mode": False}
    pair = srv.generate(body("wan2.2", seeds=[3, 5], num_outputs_per_prompt=2, **traj))
    other = srv.generate(body("wan2.2", seeds=[4, 5], num_outputs_per_prompt=2, **traj))
    (alone,) = srv.generate(body("wan2.2", seeds=[5], **traj))
    # Same batch shape: bitwise. Another batch size: x_T bitwise, the rest within the CPU GEMM bound
    # of test_rollout_api (measured here: outputs 1.5e-6, model outputs 4e-6, log-probs 2.4e-7).
    assert torch.equal(pair[1]["generated_output"], other[1]["generated_output"])
    assert torch.equal(pair[1]["rollout_log_probs"], other[1]["rollout_log_probs"])
    assert torch.equal(pair[1]["dit_trajectory"]["latents"][0], alone["dit_trajectory"]["latents"][0])
    for key in ("generated_output", "rollout_log_probs"):
        assert (pair[1][key] - alone[key]).abs().max().item() <= 1e-4


def test_shared_initial_noise_and_repeatability(served):
    srv = served("wan2.2")
    req = body("wan2.2", num_outputs_per_prompt=2, initial_noise_seed=5, rollout_return_dit_trajectory=True)
    a, b = srv.generate(req), srv.generate(req)
    assert torch.equal(a[0]["dit_trajectory"]["latents"][0], a[1]["dit_trajectory"]["latents"][0])
    assert not torch.equal(a[0]["generated_output"], a[1]["generated_output"])  # own per-step noise
    assert torch.equal(stack(a), stack(b)) and torch.equal(
        stack(a, "rollout_log_probs"), stack(b, "rollout_log_probs")
    )


def test_uint8_video_is_quantised_float_video_in_both_wire_formats(served):
    srv = served("wan")
    (f,) = srv.generate(body("wan"))
    (u,) = srv.generate(body("wan", output_dtype="uint8"))
    (j,) = srv.generate(body("wan", rollout_video_dtype="uint8"), accept="application/json")
    assert u["generated_output"].dtype == torch.uint8 and u["generated_output"].shape == VIDEO
    assert torch.equal(
        u["generated_output"], (f["generated_output"] * 255).round().clamp(0, 255).to(torch.uint8)
    )
    assert torch.equal(j["generated_output"], u["generated_output"])


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("family", "extra", "needle"),
    [
        ("wan", {"num_frames": 6}, "num_frames"),
        ("wan2.2", {"num_frames": 8}, "num_frames"),
        ("wan", {"width": 40}, "width"),
        ("wan", {"height": 24}, "height"),
        ("wan", {"guidance_scale_2": 3.0}, "guidance_scale_2"),
    ],
)
def test_unservable_requests_get_400_naming_the_field(served, family, extra, needle):
    r = served(family).generate(body(family, **extra), expect=400)
    err = r.json()["error"]
    assert err["code"] == 400 and needle in err["message"], err
    assert served(family).client.get("/health_generate").status_code == 200


def test_model_info_names_the_family(served):
    assert served("wan").client.get("/model_info").json()["family"] == "wan"
    info = served("wan2.2").client.get("/model_info").json()
    assert info["family"] == "wan2.2" and info["pipeline_class"] == "WanPipeline"
