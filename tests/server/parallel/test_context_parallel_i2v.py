"""Context parallelism for Wan image-to-video on the CPU: ``context_parallel=2`` in mirror mode.

The three image-conditioned Wan layouts, on tiny models: Wan 2.1 I2V (``wan-i2v``: image latents
concatenated on channels, CLIP image tokens in cross-attention), Wan 2.2 I2V-A14B (``wan2.2-i2v``: the
same channel concatenation, no image encoder, two experts) and Wan 2.2 TI2V-5B (``wan2.2-ti2v-i2v``:
the first latent frame replaced by the image's, per-token timesteps). For each, the follower must run
every call rank 0 hands it with rank 0's inputs (the image conditioning included: equal output
checksums), rank 0's rollouts must equal a one-process server's bit for bit, a weight update must
reach the follower, and a dead follower must fail the engine with a 503 instead of hanging it.

One context-parallel engine per process (it owns the default process group): the module fixture is
parametrized by variant, so pytest runs one variant's tests before it builds the next one's servers,
and the last test of each variant kills its follower.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from tests.server.parallel.test_context_parallel import (
    Servers,
    assert_dead_follower_fails_with_503,
    assert_follower_ran_every_call,
    both,
    settled_stats,
    update_both,
)

T = 3


def _png(width: int, height: int) -> str:
    pixels = (np.random.RandomState(0).rand(height, width, 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


BODY = {
    "prompt": "a red cat",
    "seed": 7,
    "image_data": [_png(48, 40)],
    "width": 32,
    "height": 32,
    "num_frames": 5,
    "num_inference_steps": T,
    "guidance_scale": 4.0,
    "max_sequence_length": 16,
    "rollout_sde_step_indices": [0, 2],
    "rollout_return_denoising_env": True,
    "rollout_debug_mode": False,
}
CALLS_PER_ROLLOUT = 2 * T  # classifier-free guidance: two transformer calls per step
VARIANTS = ["wan-i2v", "wan2.2-i2v", "wan2.2-ti2v-i2v"]


def save_wan22_i2v(out) -> None:
    """A tiny Wan 2.2 I2V-A14B: ``WanImageToVideoPipeline`` with two experts at a boundary, the I2V
    input layout (16 noise + 4 mask + 16 image-latent channels) and no image encoder (so no image
    cross-attention). Built from the zoo's Wan 2.2 and Wan I2V parts."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    from diffusion_rollout.models import build_tiny_pipeline

    t2v = build_tiny_pipeline("wan2.2")
    i2v_config = dict(build_tiny_pipeline("wan-i2v").transformer.config)
    config = {k: v for k, v in i2v_config.items() if not k.startswith("_")}
    config.update(image_dim=None, added_kv_proj_dim=None)
    experts = []
    with torch.random.fork_rng(devices=[]):
        for seed in (11, 12):
            torch.manual_seed(seed)
            experts.append(WanTransformer3DModel(**config))
    pipe = WanImageToVideoPipeline(
        tokenizer=t2v.tokenizer,
        text_encoder=t2v.text_encoder,
        vae=t2v.vae,
        scheduler=t2v.scheduler,
        transformer=experts[0],
        transformer_2=experts[1],
        boundary_ratio=t2v.config.boundary_ratio,
    )
    pipe.save_pretrained(out)


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request, tiny_model_path, tmp_path_factory):
    family = request.param
    if family == "wan2.2-i2v":
        path = tmp_path_factory.mktemp("wan2.2-i2v")
        save_wan22_i2v(path)
    else:
        path = tiny_model_path(family)
    servers = Servers(path)
    body = {**BODY, "guidance_scale_2": 3.0} if family == "wan2.2-i2v" else BODY
    yield family, servers, body
    servers.close()


def test_i2v_rollouts_equal_one_process_and_the_follower_runs_every_call(variant):
    family, servers, body = variant
    assert servers.cp.engine.adapter.name == family
    before = settled_stats(servers.cp)["forwards"]
    ref, cp = both(servers, body)
    for key in ("generated_output", "rollout_log_probs"):
        assert torch.equal(ref[key], cp[key]), key
    assert cp["exact"] is True  # mirror mode: rank 0 computes alone
    env, ref_env = cp["denoising_env"], ref["denoising_env"]
    if family == "wan2.2-ti2v-i2v":  # the image's latent frame ran at timestep 0, per token
        first = env["latent_first_frame"]
        assert env["timestep_tokens"] > first["zero_timestep_tokens"] > 0
        assert torch.equal(first["latents"], ref_env["latent_first_frame"]["latents"])
    else:  # mask and image latents went in on channels; Wan 2.1 also cross-attends to CLIP tokens
        assert env["latent_condition"]["latents"].shape[1] == 20
        assert torch.equal(env["latent_condition"]["latents"], ref_env["latent_condition"]["latents"])
        has_image_tokens = "encoder_hidden_states_image" in env["pos_cond_kwargs"]
        assert has_image_tokens == (family == "wan-i2v")
    if family == "wan2.2-i2v":  # both experts ran, so both were mirrored
        assert set(cp["expert_per_step"]) == {"transformer", "transformer_2"}
    # The follower got rank 0's inputs (image conditioning and per-token timesteps included) and weights.
    assert_follower_ran_every_call(servers.cp, before + CALLS_PER_ROLLOUT)


def test_i2v_update_reaches_the_follower_before_the_next_rollout(variant):
    _, servers, body = variant
    _, ref, cp = update_both(servers, body)
    for key in ("generated_output", "rollout_log_probs"):
        assert torch.equal(ref[key], cp[key]), key


@pytest.mark.timeout(60)
def test_i2v_dead_follower_fails_the_engine_with_503(variant):
    _, servers, body = variant
    assert_dead_follower_fails_with_503(servers.cp, body)


# Every video family has a served plan now (LTX-2: tests/server/parallel/test_context_parallel_ltx2.py, HunyuanVideo 1.5:
# tests/server/parallel/test_context_parallel_hunyuanvideo15.py); the refusal of the other families: tests/server/parallel/test_context_parallel.py.


def test_per_token_timesteps_need_a_plan_that_shards_them():
    """An older diffusers plan without the ``timestep`` split would fail TI2V mid-request: refused."""
    from diffusers import WanTransformer3DModel

    from diffusion_rollout.errors import ContextParallelError
    from diffusion_rollout.server.parallel.context_parallel import _check_timestep_split

    module = WanTransformer3DModel(
        num_attention_heads=1, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=8, freq_dim=8,
        ffn_dim=8, num_layers=1,
    )  # fmt: skip
    _check_timestep_split({"transformer": module})  # diffusers >= 0.42's plan
    module._cp_plan = {k: v for k, v in module._cp_plan.items() if k != ""}  # an older one's
    with pytest.raises(ContextParallelError, match="per-token timesteps"):
        _check_timestep_split({"transformer": module})
