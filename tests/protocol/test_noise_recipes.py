"""The Relax/UniRL noise recipes through the real HTTP app: group-shared x_T and per-step seeds.

The references below are written out plainly from the patches' definitions (blake2b of a text,
8 bytes big-endian, a CPU float32 ``torch.randn``), independently of ``noise_recipes``. Every
comparison is ``torch.equal``.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from diffusion_rollout.models.tiny import FAMILIES

BASE = {"prompt": "a red cat", "width": 32, "height": 32, "num_inference_steps": 3, "max_sequence_length": 16}
T = 3


def ref_seed(text: str, modulus: int) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") % modulus


def ref_group_noise(base: int, gid: str, shape) -> torch.Tensor:
    g = torch.Generator("cpu").manual_seed(ref_seed(f"{base}::{gid}", 2**63))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32)


def ref_step_noise(base: int, step: int, key: str, shape) -> torch.Tensor:
    g = torch.Generator("cpu").manual_seed(ref_seed(f"{base}::step::{step}::sample::{key}", 2**63 - 1))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32)


def group_body(**kw) -> dict:
    return {
        **BASE,
        "seed": 5,
        "num_outputs_per_prompt": 4,
        "initial_noise_group_ids": ["g0", "g0", "g1", "g1"],
        "initial_noise_seed": 11,
        "denoise_seeds": ["s0", "s1", "s2", "s3"],
        "rollout_return_dit_trajectory": True,
        "rollout_debug_mode": True,
        **kw,
    }


def _call(adapter):
    from diffusion_rollout.server.families import CallSettings

    side = max(32, 2 * adapter.spatial_factor())
    return CallSettings(
        height=side,
        width=side,
        num_inference_steps=T,
        guidance_scale=1.0,
        true_cfg_scale=None,
        guidance_scale_2=None,
        num_frames=5 if adapter.is_video else None,
        max_sequence_length=None,
        has_negative_prompt=False,
    )


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "wan2.2"])
def test_packing_a_recipe_x_t_is_the_pipelines_own_packing(served, family):
    # The same CPU float32 numbers, drawn by the pipeline's prepare_latents or drawn unpacked and
    # packed by the adapter, must be the same latent bit for bit: that is what makes a recipe's x_T
    # land where the patches put it on every family (FLUX and Qwen-Image pack 2x2 patches).
    adapter = served(family).engine.adapter
    call = _call(adapter)
    shape = adapter.noise_shape(call)
    own = adapter.initial_latents(call, torch.Generator("cpu").manual_seed(3), torch.float32, "cpu")
    noise = torch.randn(shape, generator=torch.Generator("cpu").manual_seed(3), dtype=torch.float32)
    assert torch.equal(adapter.pack_noise(call, noise), own)


def test_group_x_t_is_shared_and_step_noise_follows_denoise_seeds(served):
    srv = served("sd3")
    outs = srv.generate(group_body())
    x0 = [o["dit_trajectory"]["latents"][0] for o in outs]
    x1 = [o["dit_trajectory"]["latents"][1] for o in outs]
    # One x_T per group, exactly the recipe's draw (SD3 keeps the unpacked [C, h, w] latent).
    assert torch.equal(x0[0], x0[1]) and torch.equal(x0[2], x0[3])
    assert not torch.equal(x0[0], x0[2])
    shape = tuple(x0[0].shape)
    assert torch.equal(x0[0], ref_group_noise(11, "g0", shape))
    assert torch.equal(x0[2], ref_group_noise(11, "g1", shape))
    # Same start, different per-step noise: the outputs of a group part after the first SDE step.
    assert not torch.equal(x1[0], x1[1]) and not torch.equal(x1[2], x1[3])
    for i, out in enumerate(outs):
        noises = out["rollout_debug_tensors"]["rollout_variance_noises"]
        for step in range(T):
            assert torch.equal(noises[step], ref_step_noise(5, step, f"s{i}", shape)), (i, step)
    # Bit-exact replay of the whole request.
    again = srv.generate(group_body())
    for a, b in zip(outs, again, strict=True):
        assert torch.equal(a["dit_trajectory"]["latents"], b["dit_trajectory"]["latents"])
        assert torch.equal(a["rollout_log_probs"], b["rollout_log_probs"])
        assert torch.equal(a["generated_output"], b["generated_output"])


def test_a_recipe_output_does_not_depend_on_its_request(served):
    # Relax sends one output per request, with the recipe in extra_sampling_params: output "s2" of
    # group "g1" then starts from the same x_T and draws the same step noise as in the group request.
    srv = served("sd3")
    group = srv.generate(group_body())
    (alone,) = srv.generate(
        {
            **BASE,
            "seed": 5,
            "rollout_return_dit_trajectory": True,
            "rollout_debug_mode": True,
            "extra_sampling_params": {
                "initial_noise_group_ids": ["g1"],
                "initial_noise_seed": 11,
                "initial_noise_latent_shape": list(group[2]["dit_trajectory"]["latents"].shape[1:]),
                "denoise_seeds": ["s2"],
            },
        }
    )
    assert torch.equal(alone["dit_trajectory"]["latents"][0], group[2]["dit_trajectory"]["latents"][0])
    assert torch.equal(
        alone["rollout_debug_tensors"]["rollout_variance_noises"],
        group[2]["rollout_debug_tensors"]["rollout_variance_noises"],
    )
    assert "ignored_fields" not in alone


def test_a_packed_family_gets_the_recipe_in_its_own_layout(served):
    # Relax's Qwen-Image adapter: initial_noise_latent_shape = [16, *latent_grid], integer keys.
    srv = served("qwenimage")
    adapter = srv.engine.adapter
    call = _call(adapter)
    shape = list(adapter.noise_shape(call))
    assert shape == [16, 8, 8]
    (out,) = srv.generate(
        {
            **BASE,
            "seed": 9,
            "true_cfg_scale": 1.0,
            "rollout_return_dit_trajectory": True,
            "extra_sampling_params": {
                "initial_noise_group_ids": [7],
                "initial_noise_seed": 1234,
                "initial_noise_latent_shape": shape,
                "denoise_seeds": [7],
            },
        }
    )
    expected = adapter.pack_noise(call, ref_group_noise(1234, "7", shape))[0]
    assert torch.equal(out["dit_trajectory"]["latents"][0], expected)


def test_the_older_initial_noise_seed_alone_keeps_its_meaning(served):
    srv = served("sd3")
    outs = srv.generate(
        {
            **BASE,
            "seed": 5,
            "num_outputs_per_prompt": 2,
            "initial_noise_seed": 11,
            "rollout_return_dit_trajectory": True,
        }
    )
    x0 = [o["dit_trajectory"]["latents"][0] for o in outs]
    adapter = srv.engine.adapter
    own = adapter.initial_latents(
        _call(adapter), torch.Generator("cpu").manual_seed(11), torch.float32, "cpu"
    )
    assert torch.equal(x0[0], x0[1]) and torch.equal(x0[0], own[0])


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"initial_noise_seed": None}, "initial_noise_seed"),
        ({"initial_noise_group_ids": ["a", "b"]}, "initial_noise_group_ids"),
        ({"initial_noise_latent_shape": [16, 4, 4]}, "initial_noise_latent_shape"),
        ({"denoise_seeds": ["x"]}, "denoise_seeds"),
        ({"seed": None, "seeds": [1, 2, 3, 4]}, "seed"),
    ],
    ids=["no-seed", "ids-length", "shape", "keys-length", "seeds-without-seed"],
)
def test_an_unservable_recipe_gets_400_naming_the_field(served, extra, field):
    r = served("sd3").generate(group_body(**extra), expect=400)
    err = r.json()["error"]
    assert err["code"] == 400 and field in err["message"], err["message"]


def test_a_shape_without_group_ids_is_accepted_and_reported(served):
    # Relax's patch reads the shape only together with the group ids; alone it changes nothing.
    (out,) = served("sd3").generate(
        {**BASE, "seed": 5, "extra_sampling_params": {"initial_noise_latent_shape": [1]}}
    )
    assert out["ignored_fields"] == ["extra_sampling_params.initial_noise_latent_shape"]
