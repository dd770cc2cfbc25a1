"""Qwen-Image-Edit on its tiny model, through the real HTTP app (``torch.equal`` throughout).

The tiny pipeline is served from memory: transformers 5's Qwen2-VL processor needs torchvision to be
saved and loaded (``tiny_image_cond.make_qwen2vl_processor``). Every request VAE-encodes the input
image at about 1024x1024, as the stock pipeline does, which is seconds on a CPU, so the checks are
few and each request carries several of them: ``rollout=false`` against the stock pipeline (latents
and images), an SDE rollout replayed step by step from ``denoising_env`` (image latents and the
image-dependent text encodings) with log-prob ratio exactly 1, the default size, and the 400s.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_rollout.client.replay import replay_log_prob, replay_model_output
from diffusion_rollout.models import TINY_CALL_DEFAULTS, build_tiny_pipeline
from tests.conftest import ServedModel

pytestmark = pytest.mark.slow

FAMILY = "qwenimage-edit"
T = TINY_CALL_DEFAULTS[FAMILY]["num_inference_steps"]


def _png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


IMAGE = _png(48, 40)


def body(**kw) -> dict:
    return {
        "prompt": "a red cat",
        "seed": 7,
        "image_data": [base64.b64encode(IMAGE).decode()],
        **TINY_CALL_DEFAULTS[FAMILY],
        **kw,
    }


@pytest.fixture(scope="module")
def served():
    srv = ServedModel(None, pipeline=build_tiny_pipeline(FAMILY))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def stock():
    pipe = build_tiny_pipeline(FAMILY)  # same family and seed: the same weights
    pipe.set_progress_bar_config(disable=True)

    def run(output_type: str) -> torch.Tensor:
        image = Image.open(io.BytesIO(IMAGE)).convert("RGB")
        gen = [torch.Generator("cpu").manual_seed(7)]
        return pipe(image=image, prompt="a red cat", generator=gen, output_type=output_type,
                    **TINY_CALL_DEFAULTS[FAMILY]).images  # fmt: skip

    return run


def test_rollout_false_is_the_stock_pipeline(served, stock):
    (lat,) = served.generate(body(rollout=False, return_generated_output=False))
    assert torch.equal(lat["generated_output"], stock("latent")[0])
    (img,) = served.generate(body(rollout=False))
    assert torch.equal(img["generated_output"], stock("pt")[0])
    assert img["generated_output"].shape == (3, 64, 64)


def test_sde_rollout_replays_exactly_with_the_image(served):
    (out,) = served.generate(
        body(
            rollout_sde_step_indices=[0, 2],
            rollout_return_dit_trajectory=True,
            rollout_return_denoising_env=True,
            rollout_debug_mode=True,
            return_generated_output=False,
        )
    )
    env, traj = out["denoising_env"], out["dit_trajectory"]
    assert env["guidance"]["rule"] == "norm_rescale" and env["neg_cond_kwargs"] is not None
    cond = env["latent_condition"]
    # The input resized to ~1024x1024 at 48:40 is 1120x928; 32x VAE and 2x2 packing: 14 x 17 tokens.
    assert cond["slice_output"] is True and tuple(cond["latents"].shape) == (1, 14 * 17, 64)
    shapes = [[list(s) for s in per_sample] for per_sample in env["image_kwargs"]["img_shapes"]]
    assert shapes == [[[1, 1, 1], [1, 14, 17]]]  # the 64x64 target's grid, then the input's
    recorded = out["rollout_debug_tensors"]["rollout_model_outputs"]
    transformer = served.engine.pipe.transformer
    for step in range(T):
        x = traj["latents"][step : step + 1]
        with torch.no_grad():
            v = replay_model_output(transformer, x, traj["timesteps"][step], env, step=step)
        assert torch.equal(v[0], recorded[step]), step
        kind = "sde" if step in out["sde_step_indices"] else "ode"
        res = replay_log_prob(kind, x, v, traj["latents"][step + 1 : step + 2], traj["sigmas"], step, eta=0.7)
        assert torch.equal(res.log_prob[0], out["rollout_log_probs"][step]), step
        assert torch.exp(res.log_prob[0] - out["rollout_log_probs"][step]).item() == 1.0
    assert [i for i in range(T) if out["rollout_log_probs"][i] != 0] == [0, 2]


def test_default_size_is_the_resized_input(served):
    b = body(rollout=False, return_generated_output=False)
    b.pop("height"), b.pop("width")
    (out,) = served.generate(b)
    # 1120x928 floored to multiples of 64 (32x VAE, 2x2 packing): 1088x896, 17 x 14 latent tokens.
    assert out["generated_output"].shape == (14 * 17, 64)


def test_missing_image_is_a_400(served):
    r = served.generate(body(image_data=None), expect=400)
    assert "image_path" in r.json()["error"]["message"]
