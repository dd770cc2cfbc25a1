"""Each known trainer's request shapes, sent unchanged through the real HTTP app and read back the
way that trainer reads the answer (the README's compatibility table points here).

Field lists are the facts of ``shared/spec/api.md`` and the trainers' public sources: SGLang's own
``RolloutRequest``/``RolloutResponse`` (``multimodal_gen/runtime/entrypoints/post_training``),
miles-diffusion (``miles/rollout/sglang_diffusion_rollout.py``), Relax (``relax/backends/sglang/
diffusion_engine.py`` and its Qwen-Image adapter) and UniRL's SGLang engine (``unirl/rollout/
engine/sglang/request.py``). Bodies are plain dicts and answers are decoded here with a small
msgpack decoder written like those clients' (``safetensors`` bytes of a tensor named ``t``), not
with this project's client, so what is checked is the wire a foreign client sees.
"""

from __future__ import annotations

import msgpack
import pytest
import torch
from safetensors.torch import load as st_load

from diffusion_rollout.models.tiny import FAMILIES
from diffusion_rollout.protocol import weight_transport
from diffusion_rollout.protocol.checksums import trainer_weights_checksum

T = 3
IMAGE = {"width": 32, "height": 32, "num_inference_steps": T, "max_sequence_length": 16}


def decode_like_sglang_clients(obj):
    """msgpack body -> Python, tensor envelopes -> tensors (the clients' ``_maybe_deserialize``)."""
    if isinstance(obj, dict):
        if obj.get("__tensor__"):
            return st_load(bytes(obj["data"]))["t"]
        return {k: decode_like_sglang_clients(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_like_sglang_clients(v) for v in obj]
    return obj


def post(srv, body: dict, expect: int = 200):
    # requests' default Accept (*/*): these clients take the server's msgpack default.
    r = srv.client.post("/rollout/generate", json=body, headers={"Accept": "*/*"})
    assert r.status_code == expect, r.text[:2000]
    if expect != 200:
        return r
    assert r.headers["content-type"].startswith("application/msgpack")
    return decode_like_sglang_clients(msgpack.unpackb(r.content, raw=False))


def check_rollout_layout(out: dict, steps: int, *, debug: bool, trajectory: bool, env: bool) -> None:
    """Keys, shapes and dtypes every SGLang-dialect client relies on."""
    assert (
        isinstance(out["request_id"], str) and isinstance(out["seed"], int) and isinstance(out["prompt"], str)
    )
    image = out["generated_output"]
    assert image.dtype == torch.float32 and image.shape == (3, 32, 32)
    log_probs = out["rollout_log_probs"]
    assert log_probs.dtype == torch.float32 and log_probs.shape == (steps,)
    assert isinstance(out["inference_time_s"], float)
    assert "peak_memory_mb" in out
    if trajectory:
        traj = out["dit_trajectory"]
        assert traj["latents"].shape[0] == steps + 1
        assert traj["timesteps"].shape == (steps + 1,) and traj["sigmas"].shape == (steps + 1,)
        assert traj["sigmas"].dtype == torch.float32 and traj["sigmas"][-1] == 0
        assert traj["timesteps"][-1] == 0
    else:
        assert out["dit_trajectory"] is None
    if debug:
        dbg = out["rollout_debug_tensors"]
        latent = tuple(out["dit_trajectory"]["latents"].shape[1:]) if trajectory else None
        for key in ("rollout_variance_noises", "rollout_prev_sample_means", "rollout_model_outputs"):
            assert dbg[key].shape[0] == steps and (latent is None or tuple(dbg[key].shape[1:]) == latent)
        assert dbg["rollout_variance_noises"].dtype == torch.float32
        assert dbg["rollout_noise_std_devs"].shape == (steps, 1)
    else:
        assert out["rollout_debug_tensors"] is None
    if env:
        assert {"image_kwargs", "pos_cond_kwargs", "neg_cond_kwargs", "guidance"} <= set(out["denoising_env"])
    else:
        assert out["denoising_env"] is None


# ---------------------------------------------------------------------------- SGLang's own API
def test_sglang_rollout_request_and_response(served):
    srv = served("sd3")
    # RolloutRequest's fields at SGLang's defaults (rollout_debug_mode defaults to true there).
    body = {
        "prompt": "a red cat",
        "negative_prompt": None,
        "seed": 5,
        "generator_device": "cuda",
        "num_outputs_per_prompt": 2,
        "guidance_scale": None,
        "true_cfg_scale": None,
        "num_frames": None,
        "fps": None,
        "rollout": True,
        "rollout_sde_type": "sde",
        "rollout_noise_level": 0.7,
        "rollout_log_prob_no_const": False,
        "rollout_debug_mode": True,
        "rollout_return_denoising_env": True,
        "rollout_return_dit_trajectory": True,
        "rollout_sde_step_indices": None,
        "rollout_return_step_indices": None,
        "image_path": None,
        "suppress_logs": False,
        "extra_sampling_params": None,
        **IMAGE,
    }
    outs = post(srv, body)
    assert len(outs) == 2 and [o["seed"] for o in outs] == [5, 6]
    for out in outs:
        check_rollout_layout(out, T, debug=True, trajectory=True, env=True)
        assert "ignored_fields" not in out
    # Evaluation (rollout=false): only the image comes back.
    (plain,) = post(srv, {"prompt": "a red cat", "seed": 5, "rollout": False, **IMAGE})
    assert plain["rollout_log_probs"] is None and plain["generated_output"].shape == (3, 32, 32)
    # SGLang's route (rollout_api.py at 078e5e2a) answers msgpack whatever the client accepts; with
    # no Accept header at all the answer here is msgpack too.
    request = srv.client.build_request(
        "POST", "/rollout/generate", json={"prompt": "a red cat", "seed": 5, "rollout": False, **IMAGE}
    )
    del request.headers["accept"]
    r = srv.client.send(request)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/msgpack")
    (bare,) = decode_like_sglang_clients(msgpack.unpackb(r.content, raw=False))
    assert torch.equal(bare["generated_output"], plain["generated_output"])


def test_sglang_sampling_params_without_effect_are_reported_not_refused(served):
    srv = served("sd3")
    extra = {
        "save_output": False,
        "return_trajectory_latents": False,
        "enable_teacache": False,
        "rollout": False,
    }
    (out,) = post(
        srv,
        {
            "prompt": "a red cat",
            "seed": 5,
            "rollout_debug_mode": False,
            "extra_sampling_params": extra,
            **IMAGE,
        },
    )
    # SGLang's rule: the top-level rollout flag wins over one in extra_sampling_params.
    assert out["rollout_log_probs"] is not None
    assert out["ignored_fields"] == sorted(f"extra_sampling_params.{k}" for k in extra)
    # A name no SGLang version knows is accepted too, as SGLang accepts it, and named in the answer.
    (out,) = post(
        srv,
        {
            "prompt": "a red cat",
            "seed": 5,
            "rollout": False,
            "extra_sampling_params": {"save_outptu": 0},
            **IMAGE,
        },
    )
    assert out["ignored_fields"] == ["extra_sampling_params.save_outptu"]


def test_sglang_cps_with_the_default_log_prob_form_is_answered(served):
    """The cps script published with SGLang's rollout PRs (and miles with ``--diffusion-sde-type
    cps``) sends ``rollout_sde_type="cps"`` at the default ``rollout_log_prob_no_const=false`` and
    expects 200 with a ``[T]`` float32 ``rollout_log_probs``. cps's noise std is 0 at the last step,
    so that step is run and scored as an ODE step: its log-prob is exactly 0, it is left out of
    ``sde_step_indices``, and no log-prob is non-finite."""
    srv = served("sd3")
    body = {
        "prompt": "a red cat",
        "seed": 11,
        "rollout": True,
        "rollout_sde_type": "cps",
        "rollout_noise_level": 0.7,
        "rollout_debug_mode": True,
        "rollout_return_dit_trajectory": True,
        **IMAGE,
    }
    (out,) = post(srv, body)
    check_rollout_layout(out, T, debug=True, trajectory=True, env=False)
    log_probs = out["rollout_log_probs"]
    assert torch.isfinite(log_probs).all() and (log_probs[: T - 1] != 0).all() and log_probs[T - 1] == 0
    assert out["sde_step_indices"] == list(range(T - 1))
    assert out["rollout_debug_tensors"]["rollout_noise_std_devs"][T - 1].item() == 0


# ---------------------------------------------------------------------------- miles-diffusion
def miles_body(**kw) -> dict:
    return {
        "prompt": "a red cat",
        "negative_prompt": " ",
        "generator_device": "cuda",
        "guidance_scale": 4.5,
        "num_outputs_per_prompt": 2,  # a microgroup
        "seed": 11,
        "rollout": True,
        "rollout_sde_type": "sde",
        "rollout_noise_level": 0.7,
        "rollout_log_prob_no_const": False,
        "rollout_debug_mode": False,
        "rollout_return_denoising_env": True,
        "rollout_return_dit_trajectory": True,
        "rollout_sde_step_indices": [0, 1],
        "rollout_return_step_indices": None,
        "extra_sampling_params": {},
        **IMAGE,
        **kw,
    }


def test_miles_diffusion_image_rollout(served):
    outs = post(served("sd3"), miles_body())
    for out in outs:
        check_rollout_layout(out, T, debug=False, trajectory=True, env=True)
        lp = out["rollout_log_probs"]
        assert lp[2] == 0 and bool((lp[:2] != 0).all())  # step 2 is ODE: log-prob 0
        assert out["denoising_env"]["neg_cond_kwargs"] is not None  # CFG with the " " negative prompt


def sglang_style_checksum(named_tensors) -> str:
    """SGLang's checksum scheme as miles reproduces it on its side: SHA-256 over the entries sorted
    by name, each the UTF-8 name then the tensor's raw bytes (contiguous, CPU)."""
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(named_tensors, key=lambda item: item[0]):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_miles_diffusion_sync_check_hashes_the_state_dict(served, tiny_model_path):
    """miles' optional weight-sync check hashes its trainer module's ``state_dict()``, persistent
    buffers included (SD3's transformer has one: ``pos_embed.pos_embed``). The server's
    ``algorithm="state_dict"`` mode hashes the same entries, so a trainer holding the served weights
    matches; the default (SGLang's, parameters only) does not, which was the false mismatch."""
    from diffusers import SD3Transformer2DModel

    srv = served("sd3")
    trainer = SD3Transformer2DModel.from_pretrained(str(tiny_model_path("sd3")), subfolder="transformer")
    state = trainer.state_dict()
    assert set(state) - {n for n, _ in trainer.named_parameters()} == {"pos_embed.pos_embed"}

    def server_sum(**extra) -> str:
        r = srv.client.post("/get_weights_checksum", json={"module_names": ["transformer"], **extra})
        assert r.status_code == 200, r.text
        return r.json()["transformer"]

    assert server_sum(algorithm="state_dict") == sglang_style_checksum(state.items())
    assert (
        server_sum()
        == sglang_style_checksum(trainer.named_parameters())
        != server_sum(algorithm="state_dict")
    )


def test_miles_diffusion_wan22_with_preshifted_sigmas(served):
    sigmas = [0.95, 0.7, 0.35]
    body = miles_body(
        num_frames=5,
        guidance_scale=4.0,
        num_inference_steps=None,
        extra_sampling_params={"guidance_scale_2": 3.0, "sigmas": sigmas},
        num_outputs_per_prompt=1,
    )
    (out,) = post(served("wan2.2"), body)
    assert out["generated_output"].shape == (3, 5, 32, 32)
    traj = out["dit_trajectory"]
    assert torch.equal(traj["sigmas"], torch.tensor([*sigmas, 0.0], dtype=torch.float32))
    assert out["rollout_log_probs"].shape == (T,) and len(out["expert_per_step"]) == T
    assert out["denoising_env"]["guidance"]["guidance_scale_2"] == 3.0


def test_miles_diffusion_weight_calls(fresh_server):
    srv = fresh_server("sd3", allow_cpu_ipc=True)
    g = torch.Generator().manual_seed(1)
    master = {
        n: p.detach() + 0.05 * torch.randn(p.shape, generator=g)
        for n, p in srv.engine.pipe.transformer.named_parameters()
    }
    entry = weight_transport.serialize_named_tensors(master.items(), load_format="flattened_bucket")
    body = {
        "serialized_named_tensors": [entry],
        "load_format": "flattened_bucket",
        "target_modules": ["transformer"],
        "weight_version": "miles-3",  # a string, as miles sends it
    }
    r = srv.client.post("/update_weights_from_tensor", json=body)
    assert r.status_code == 200 and r.json()["weight_version"] == "miles-3", r.text
    sums = srv.client.post("/get_weights_checksum", json={"module_names": ["transformer"]}).json()
    assert sums["transformer"] == trainer_weights_checksum(master.items(), torch.float32)
    assert srv.client.post("/release_memory_occupation", json={}).status_code == 200
    assert srv.client.post("/resume_memory_occupation", json={}).status_code == 200
    (out,) = post(srv, miles_body(num_outputs_per_prompt=1))
    assert out["weight_version"] == "miles-3"


# ---------------------------------------------------------------------------- Relax (Qwen-Image)
def relax_map_response(resp, request: dict) -> dict:
    """What Relax's diffusion engine keeps from one answer (``_map_response``)."""
    assert isinstance(resp, list) and len(resp) == 1
    entry = resp[0]
    dit = entry.get("dit_trajectory") or {}
    log_probs = entry.get("rollout_log_probs")
    if isinstance(log_probs, dict):
        log_probs = log_probs["log_probs"]
    return {
        "request_id": entry.get("request_id"),
        "seed": entry.get("seed"),
        "trajectory_latents": dit.get("latents"),
        "timesteps": dit.get("timesteps"),
        "rollout_log_probs": log_probs,
        "denoising_env": entry.get("denoising_env"),
        "rollout_debug_tensors": entry.get("rollout_debug_tensors"),
        "generated_output": entry.get("generated_output"),
        "sde_indices": entry.get("sde_indices")
        or dit.get("sde_indices")
        or request.get("rollout_sde_step_indices"),
        "height": request.get("height"),
        "width": request.get("width"),
        "sigmas": dit.get("sigmas"),
    }


@pytest.mark.parametrize("sde_type", ["sde", "dance"])
def test_relax_qwen_image_rollout_with_its_noise_recipe(served, sde_type):
    srv = served("qwenimage")
    sigmas = [1.0, 2 / 3, 1 / 3]  # T values, no terminal 0
    request = {
        "prompt": "a red cat",
        "seed": 1234,
        "num_inference_steps": T,
        "height": 32,
        "width": 32,
        "max_sequence_length": 16,
        "rollout": True,
        "rollout_sde_type": sde_type,
        "rollout_sde_step_indices": [0, 1],
        "rollout_noise_level": 0.7,
        "rollout_return_dit_trajectory": True,
        "rollout_return_denoising_env": True,
        "num_outputs_per_prompt": 1,
        "true_cfg_scale": 1.0,
        "extra_sampling_params": {
            "sigmas": sigmas,
            "initial_noise_group_ids": ["r0:prompt:7:sample:0"],
            "initial_noise_latent_shape": None,  # set below: the model's [16, h, w]
            "initial_noise_seed": 1234,
            "denoise_seeds": ["prompt:7:sample:0"],
        },
    }
    shape = srv.engine.adapter.noise_shape(srv.engine.planner.plan(_params(request)).call)
    request["extra_sampling_params"]["initial_noise_latent_shape"] = list(shape)
    mapped = relax_map_response(post(srv, request), request)
    for key in ("trajectory_latents", "timesteps", "sde_indices", "height", "width"):
        assert mapped[key] is not None, key  # Relax's validate_rollout_response
    assert mapped["trajectory_latents"].shape[0] == T + 1
    assert mapped["timesteps"].shape[0] in (T, T + 1) and mapped["rollout_log_probs"].shape == (T,)
    assert torch.equal(mapped["sigmas"], torch.tensor([*sigmas, 0.0], dtype=torch.float32))
    assert mapped["sde_indices"] == [0, 1] and mapped["rollout_log_probs"][2] == 0
    assert mapped["generated_output"].shape == (3, 32, 32) and mapped["denoising_env"] is not None
    again = relax_map_response(post(srv, request), request)  # the recipe replays bit for bit
    assert torch.equal(again["trajectory_latents"], mapped["trajectory_latents"])


def relax_pack_sigmas(mapped: dict, steps: int) -> torch.Tensor:
    """Relax's Qwen-Image adapter packs a trajectory for training with ``sigmas = timesteps / 1000``
    (the SGLang convention it was written against: the scheduler's timesteps, 0..1000), using the
    first ``T`` timesteps of the answer."""
    return mapped["timesteps"][:steps].float() / 1000


def _family_body(family: str) -> dict:
    from diffusion_rollout.models.tiny import TINY_CALL_DEFAULTS

    defaults = TINY_CALL_DEFAULTS[family]
    keys = ("width", "height", "num_frames", "num_inference_steps", "max_sequence_length")
    return {k: defaults[k] for k in keys if k in defaults}


# What each family's pipeline hands its transformer, as a function of the scheduler's timestep t
# (docs/api.md lists the same); replay reads it from denoising_env.timestep_map.
MODEL_TIMESTEP = {
    "sd3": lambda t: t,
    "wan": lambda t: t,
    "wan2.2": lambda t: t,
    "hunyuanvideo15": lambda t: t,
    "ltx2": lambda t: t,
    "flux": lambda t: t / 1000,
    "flux2-klein": lambda t: t / 1000,
    "qwenimage": lambda t: t / 1000,
    "zimage": lambda t: (1000 - t) / 1000,
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_relax_pack_trajectory_sigmas_are_the_sigmas_used_on_every_family(served, family):
    """Relax derives its training sigmas from the answer's timesteps (``timesteps / 1000``), so the
    timesteps must be on SGLang's scale (the scheduler's, ``sigma * 1000``) for every family, including
    those whose pipelines feed the model another scale (Qwen-Image, FLUX: ``t / 1000``; Z-Image:
    ``(1000 - t) / 1000``). The derived sigmas must be the ones the server stepped with."""
    srv = served(family)
    request = {
        "prompt": "a red cat",
        "seed": 5,
        "rollout": True,
        "rollout_sde_type": "sde",
        "rollout_return_dit_trajectory": True,
        "rollout_return_denoising_env": True,
        "rollout_debug_mode": False,
        "_task": "t2i",
        **_family_body(family),
    }
    (resp,) = post(srv, request)
    mapped = relax_map_response([resp], request)
    steps = mapped["sigmas"].shape[0] - 1
    assert mapped["timesteps"].shape == (steps + 1,) and mapped["timesteps"][0] > 100  # 0..1000, not 0..1
    torch.testing.assert_close(relax_pack_sigmas(mapped, steps), mapped["sigmas"][:steps], rtol=0, atol=1e-6)
    assert resp["ignored_fields"] == ["_task"]
    tmap = resp["denoising_env"]["timestep_map"]
    assert torch.equal(tmap["timesteps"], mapped["timesteps"][:steps])
    assert torch.equal(tmap["model_timesteps"], MODEL_TIMESTEP[family](tmap["timesteps"]))


def _params(request: dict):
    from diffusion_rollout.entrypoints.request_params import to_params
    from diffusion_rollout.protocol.requests import GenerateRequest

    return to_params(GenerateRequest.model_validate(request), "probe")


# ---------------------------------------------------------------------------- UniRL (NFT / ODE path)
def test_unirl_nft_ode_request_and_sigma_check(served):
    srv = served("sd3")
    k = 3
    sigmas = [1.0 - i / T for i in range(T)]  # the interior T values of its T+1 schedule
    sample_ids = [f"s{i}" for i in range(k)]
    shape = list(
        srv.engine.adapter.noise_shape(srv.engine.planner.plan(_params({"prompt": "x", **IMAGE})).call)
    )
    body = {
        "prompt": "a red cat",
        "num_outputs_per_prompt": k,
        "seed": 17,
        "guidance_scale": 1.0,
        "sigmas": sigmas,
        "rollout": True,
        "rollout_sde_type": "ode",
        "rollout_log_prob_no_const": True,
        "rollout_sde_step_indices": [],
        "rollout_return_dit_trajectory": True,
        "rollout_debug_mode": False,
        "initial_noise_group_ids": sample_ids,  # init_same_noise=False: one x_T per sample
        "initial_noise_seed": 99,
        "initial_noise_latent_shape": shape,
        "denoise_seeds": sample_ids,
        # Fields its engine pins for SGLang's own machinery: no effect here, reported.
        "extra_sampling_params": {
            "save_output": False,
            "return_file_paths_only": False,
            "return_trajectory_latents": True,
        },
        **{k_: v for k_, v in IMAGE.items() if k_ != "num_inference_steps"},
    }
    outs = post(srv, body)
    assert len(outs) == k
    for out in outs:
        traj = out["dit_trajectory"]
        # UniRL compares the echoed schedule with the one it sent and fails on any difference.
        assert torch.equal(traj["sigmas"], torch.tensor([*sigmas, 0.0], dtype=torch.float32))
        assert torch.equal(out["rollout_log_probs"], torch.zeros(T))  # ODE steps, no_const form
        assert out["sde_step_indices"] == []
        assert len(out["ignored_fields"]) == 3
    x_t = [o["dit_trajectory"]["latents"][0] for o in outs]
    assert not torch.equal(x_t[0], x_t[1]) and not torch.equal(x_t[1], x_t[2])
    # Same recipe, one output per request (a de-expanded batch): the same x_T and the same ODE path.
    (alone,) = post(
        srv,
        {**body, "num_outputs_per_prompt": 1, "initial_noise_group_ids": ["s1"], "denoise_seeds": ["s1"]},
    )
    assert torch.equal(alone["dit_trajectory"]["latents"][0], x_t[1])


def envelope(t: torch.Tensor) -> dict:
    """A tensor as a foreign client packs one (the answers' own form)."""
    from safetensors.torch import save as st_save

    return {
        "__tensor__": True,
        "data": st_save({"t": t.contiguous()}),
        "shape": list(t.shape),
        "dtype": str(t.dtype),
    }


def post_msgpack(srv, body: dict, expect: int = 200):
    r = srv.client.post(
        "/rollout/generate",
        content=msgpack.packb(body),
        headers={"Content-Type": "application/msgpack", "Accept": "*/*"},
    )
    assert r.status_code == expect, r.text[:2000]
    return decode_like_sglang_clients(msgpack.unpackb(r.content, raw=False)) if expect == 200 else r


def test_unirl_grpo_request_over_http_with_prompt_list_noise_tensor_and_embeds(served):
    """UniRL's SGLang request builder (``unirl/rollout/engine/sglang/request.py``, read at commit
    02416b7e) de-expands a batch into unique prompts: ``prompt`` is a list, one group of
    ``num_outputs_per_prompt`` outputs per prompt; it sends its own x_T as ``initial_noise`` (a
    tensor, one row per output), ``denoise_seeds`` (one per output), interior ``sigmas``,
    ``return_prompt_embeds`` (and ``return_negative_prompt_embeds`` with CFG and a negative prompt)
    and its pinned SGLang flags. Its response translator (``response.py``) requires
    ``prompt_embeds`` on every result, reads ``pooled_prompt_embeds`` and the negatives, checks the
    trajectory has ``T + 1`` latents and that the returned timesteps match the sigmas it sent."""
    srv = served("sd3")
    k, prompts = 2, ["a red cat", "a blue dog"]
    sigmas = [1.0 - i / T for i in range(T)]
    shape = list(
        srv.engine.adapter.noise_shape(srv.engine.planner.plan(_params({"prompt": "x", **IMAGE})).call)
    )
    x_t = torch.randn(len(prompts) * k, *shape, generator=torch.Generator().manual_seed(3))
    sample_ids = [f"p{j}:s{i}" for j in range(len(prompts)) for i in range(k)]
    body = {
        "prompt": prompts,
        "negative_prompt": " ",
        "num_outputs_per_prompt": k,
        "guidance_scale": 4.5,
        "height": 32,
        "width": 32,
        "num_inference_steps": T,
        "max_sequence_length": 16,
        "sigmas": sigmas,
        "seed": 17,
        "save_output": False,
        "return_file_paths_only": False,
        "return_trajectory_latents": True,
        "return_trajectory_decoded": False,
        "return_prompt_embeds": True,
        "return_negative_prompt_embeds": True,
        "initial_noise": envelope(x_t),
        "denoise_seeds": sample_ids,
        "rollout": True,
        "rollout_return_dit_trajectory": True,
        "rollout_return_denoising_env": True,
        "rollout_sde_type": "sde",
        "rollout_noise_level": 0.7,
        "rollout_sde_step_indices": [0, 1],
        "rollout_debug_mode": False,
    }
    outs = post_msgpack(srv, body)
    assert [o["prompt"] for o in outs] == [p for p in prompts for _ in range(k)]
    assert [o["seed"] for o in outs] == [17 + n for n in range(len(prompts) * k)]
    for n, out in enumerate(outs):
        traj = out["dit_trajectory"]
        assert traj["latents"].shape[0] == T + 1
        assert torch.equal(traj["latents"][0], x_t[n])  # its x_T, as sent (float32 model)
        assert torch.equal(traj["sigmas"], torch.tensor([*sigmas, 0.0]))
        torch.testing.assert_close(traj["timesteps"][:T] / 1000, traj["sigmas"][:T], rtol=0, atol=1e-6)
        env = out["denoising_env"]
        # The encodings are the conditioning the transformer got (SD3: [neg; pos] batched CFG).
        assert torch.equal(out["prompt_embeds"][0], env["pos_cond_kwargs"]["encoder_hidden_states"][0])
        assert torch.equal(out["pooled_prompt_embeds"][0], env["pos_cond_kwargs"]["pooled_projections"][0])
        assert torch.equal(
            out["negative_prompt_embeds"][0], env["neg_cond_kwargs"]["encoder_hidden_states"][0]
        )
        assert out["negative_pooled_prompt_embeds"].shape == out["pooled_prompt_embeds"].shape
        assert "ignored_fields" in out and "return_prompt_embeds" not in out["ignored_fields"]
    assert torch.equal(outs[0]["prompt_embeds"], outs[1]["prompt_embeds"])
    assert not torch.equal(outs[0]["prompt_embeds"], outs[2]["prompt_embeds"])
    # Same sample ids and x_T, one prompt at a time: the same outputs (groups are independent).
    alone = post_msgpack(
        srv,
        {**body, "prompt": prompts[1], "initial_noise": envelope(x_t[k:]), "denoise_seeds": sample_ids[k:],
         "seeds": [17 + k, 17 + k + 1]},
    )  # fmt: skip
    for single, grouped in zip(alone, outs[k:], strict=True):
        assert torch.equal(single["dit_trajectory"]["latents"], grouped["dit_trajectory"]["latents"])
        assert torch.equal(single["rollout_log_probs"], grouped["rollout_log_probs"])


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda shape: torch.zeros(3, 1, 1), "initial_noise has shape [3, 1, 1]"),
        (lambda shape: torch.full((1, *shape), float("nan")), "NaN"),
        (lambda shape: torch.zeros(1, *shape, dtype=torch.int32), "floating-point"),
    ],
    ids=["shape", "nan", "dtype"],
)
def test_initial_noise_tensor_is_validated(served, make, words):
    srv = served("sd3")
    shape = srv.engine.adapter.noise_shape(srv.engine.planner.plan(_params({"prompt": "x", **IMAGE})).call)
    r = post_msgpack(
        srv, {"prompt": "a cat", "seed": 1, "initial_noise": envelope(make(shape)), **IMAGE}, 400
    )
    err = r.json()["error"]
    assert "initial_noise" in err["message"] and words in err["message"], err["message"]


def test_flow_grpo_embeddings_in_a_plain_msgpack_body(served):
    """flow_grpo's conditioning as a foreign client would pack it: msgpack with safetensors envelopes
    (the answers' own form), no prompt; the answer equals the one for the text that encoded them."""
    from safetensors.torch import save as st_save

    srv = served("sd3")
    ode = {"rollout_sde_type": "ode", "rollout_log_prob_no_const": True, "seed": 9, **IMAGE}
    (text,) = post(srv, {"prompt": "a red cat", "rollout_return_denoising_env": True, **ode})
    pos, neg = text["denoising_env"]["pos_cond_kwargs"], text["denoising_env"]["neg_cond_kwargs"]

    def envelope(t: torch.Tensor) -> dict:
        return {
            "__tensor__": True,
            "data": st_save({"t": t.contiguous()}),
            "shape": list(t.shape),
            "dtype": str(t.dtype),
        }

    body = {k: v for k, v in ode.items() if k != "max_sequence_length"}
    body.update(
        prompt_embeds=envelope(pos["encoder_hidden_states"]),
        pooled_prompt_embeds=envelope(pos["pooled_projections"]),
        negative_prompt_embeds=envelope(neg["encoder_hidden_states"]),
        negative_pooled_prompt_embeds=envelope(neg["pooled_projections"]),
    )
    r = srv.client.post(
        "/rollout/generate", content=msgpack.packb(body), headers={"Content-Type": "application/msgpack"}
    )
    assert r.status_code == 200, r.text[:500]
    (out,) = decode_like_sglang_clients(msgpack.unpackb(r.content, raw=False))
    assert out["prompt"] == ""
    assert torch.equal(out["generated_output"], text["generated_output"])
