"""Every zoo model, served and asked with only a prompt (plus the input image of image-conditioned
families), answers 200 or a 400 naming the field: never a 500 with a raw exception, and every model
becomes ready (its readiness probe runs at the adapter's defaults).

The models are served from memory, without the ``request_defaults.json`` a saved tiny folder has
(that file's tiny sizes are tested in tests/support/test_tiny_request_defaults.py), so size, frame count and
text length are the server's stock defaults (the pipelines' own: 1024x1024 images,
480x832x81 Wan video, 512x768x121 LTX-2, 512 text tokens). The step count is 1: the default 28 to 50
steps at those sizes take minutes per family on a CPU, and no default step count was what broke.
Video families are left out here: one step of tiny Wan at 480x832x81 took 215 s on a 2-core CPU
(it answers 200 since the zoo's RoPE covers the default). The two refusals that guard video models
before they run (Wan's RoPE extent, LTX-2's dynamic shift) are tested below on requests that are
refused before any step runs.
"""

from __future__ import annotations

import base64
import time

import pytest

from diffusion_rollout.models import build_tiny_pipeline
from diffusion_rollout.server.core.images import probe_image_png
from tests.conftest import ServedModel

# A 400 must name one of these (the request's own fields or the limit it ran into).
FIELDS = ("height", "width", "num_frames", "max_sequence_length", "max_trajectory_bytes")


IMAGE_ONLY = ("sd3", "flux", "qwenimage", "flux2-klein", "zimage", "flux-kontext", "qwenimage-edit")


@pytest.mark.parametrize("family", IMAGE_ONLY)
def test_prompt_only_request_at_defaults_answers_200_or_400_naming_the_field(family):
    # From memory: no folder, so no request_defaults.json; the family's stock defaults apply.
    srv = ServedModel(None, pipeline=build_tiny_pipeline(family))
    try:
        assert srv.client.get("/health_generate").status_code == 200
        body = {"prompt": "a photo of a cat", "num_inference_steps": 1}
        if srv.engine.adapter.image_inputs:
            body["image_data"] = [base64.b64encode(probe_image_png(64)).decode()]
        t0 = time.monotonic()
        r = srv.client.post("/rollout/generate", json=body, headers={"Accept": "application/json"})
        print(f"{family}: {r.status_code} in {time.monotonic() - t0:.1f} s")
        assert r.status_code in (200, 400), r.text[:1000]
        if r.status_code == 400:
            message = r.json()["error"]["message"]
            assert any(f in message for f in FIELDS), message
    finally:
        srv.close()


def test_wan_refuses_a_size_beyond_its_rope_positions_naming_the_field():
    pipe = build_tiny_pipeline("wan")
    # The validation reads the model's config: a model with RoPE for 8 positions per axis.
    pipe.transformer.register_to_config(rope_max_seq_len=8)
    srv = ServedModel(None, pipeline=pipe)
    try:
        body = {"prompt": "a cat", "num_inference_steps": 1, "height": 64, "width": 512, "num_frames": 5}
        r = srv.client.post("/rollout/generate", json=body, headers={"Accept": "application/json"})
        assert r.status_code == 400, r.text[:500]
        message = r.json()["error"]["message"]
        assert "width=512" in message and "rope_max_seq_len=8" in message, message
        body["width"] = 64  # within the positions: served
        r = srv.client.post("/rollout/generate", json=body, headers={"Accept": "application/json"})
        assert r.status_code == 200, r.text[:500]
    finally:
        srv.close()


def test_ltx2_refuses_a_video_whose_shift_overflows_naming_the_field(served):
    srv = served("ltx2")
    # The pipeline's default size (512x768x121) on the tiny model (its VAE compresses little): exp(mu)
    # overflows. Named here: the tiny folder's own request defaults are tiny.
    a = srv.engine.adapter
    (height, width), frames = a.default_size(), a.default_frames()
    body = {"prompt": "a cat", "num_inference_steps": 3, "height": height, "width": width, "num_frames": frames}
    r = srv.client.post("/rollout/generate", json=body, headers={"Accept": "application/json"})
    assert r.status_code == 400, r.text[:500]
    message = r.json()["error"]["message"]
    assert "num_frames=" in message and "overflows" in message, message


def test_ltx2_refuses_a_size_not_divisible_by_32_naming_the_field(served):
    srv = served("ltx2")
    body = {"prompt": "a cat", "num_inference_steps": 2, "height": 34, "width": 32, "num_frames": 9}
    r = srv.client.post("/rollout/generate", json=body, headers={"Accept": "application/json"})
    assert r.status_code == 400, r.text[:500]  # was a 500 from the pipeline's own check mid-call
    message = r.json()["error"]["message"]
    assert "height=34" in message and "divisible by 32" in message, message
