"""A tiny model's folder answers a request that names only a prompt at its own tiny sizes.

``save_tiny_model`` writes ``request_defaults.json`` beside ``model_index.json`` (the tiny call
defaults' height, width, num_frames and steps), and the server gives a request that omits them the
folder's values before the family's stock ones. Before, a prompt alone to the tiny Wan folder made an
81x480x832 video at 50 steps: 271 s on a CPU.
"""

from __future__ import annotations

import base64
import json
import time

import pytest

from diffusion_rollout.models import FAMILIES, IMAGE_FAMILIES, REQUEST_DEFAULTS_FILE, TINY_CALL_DEFAULTS
from diffusion_rollout.models.tiny import _SPECS, tiny_request_defaults
from diffusion_rollout.server.core.images import probe_image_png
from diffusion_rollout.server.families.base import folder_request_defaults
from tests.conftest import ServedModel

VIDEO = {"wan", "wan2.2", "hunyuanvideo15", "ltx2", "wan-i2v", "wan2.2-ti2v-i2v"}


def test_the_light_family_names_are_the_builders():
    assert set(_SPECS) == {*FAMILIES, *IMAGE_FAMILIES}
    assert len(FAMILIES) + len(IMAGE_FAMILIES) == len(_SPECS)


@pytest.mark.parametrize("family", [*FAMILIES, *IMAGE_FAMILIES])
def test_every_family_records_tiny_sizes(family):
    d = tiny_request_defaults(family)
    calls = TINY_CALL_DEFAULTS[family]
    assert d["height"] == calls["height"] <= 64 and d["width"] == calls["width"] <= 64
    assert d["num_inference_steps"] == calls["num_inference_steps"] <= 4
    assert ("num_frames" in d) == (family in VIDEO)
    assert d.get("num_frames", 1) <= 9


def _prompt_only(srv: ServedModel) -> dict:
    body = {"prompt": "a photo of a cat", "rollout": False}
    if srv.engine.adapter.image_inputs:
        body["image_data"] = [base64.b64encode(probe_image_png(64)).decode()]
    t0 = time.monotonic()
    (out,) = srv.generate(body)
    out["seconds"] = time.monotonic() - t0
    return out


def _check(family: str, path) -> None:
    d = json.loads((path / REQUEST_DEFAULTS_FILE).read_text())
    assert d == tiny_request_defaults(family)
    srv = ServedModel(path)
    try:
        out = _prompt_only(srv)
    finally:
        srv.close()
    h, w = d["height"], d["width"]
    shape = (3, d["num_frames"], h, w) if "num_frames" in d else (3, h, w)
    assert tuple(out["generated_output"].shape) == shape
    assert out["seconds"] < 30, out["seconds"]


@pytest.mark.parametrize("family", ["wan", "sd3"])
def test_a_prompt_alone_gets_a_tiny_output_quickly(family, tiny_model_path):
    _check(family, tiny_model_path(family))


@pytest.mark.slow
@pytest.mark.parametrize(
    "family", [f for f in (*FAMILIES, *IMAGE_FAMILIES) if f not in ("wan", "sd3", "qwenimage-edit")]
)
def test_every_saved_family_answers_a_prompt_alone_at_its_tiny_size(family, tiny_model_path):
    # qwenimage-edit is left out: its processor needs torchvision to be saved.
    _check(family, tiny_model_path(family))


def test_a_folder_without_the_file_keeps_the_stock_defaults(tmp_path):
    assert folder_request_defaults(str(tmp_path)) == {}
    assert folder_request_defaults(None) == {}
    (tmp_path / REQUEST_DEFAULTS_FILE).write_text('{"height": 48, "width": 64, "num_frames": 9}')
    assert folder_request_defaults(str(tmp_path)) == {"height": 48, "width": 64, "num_frames": 9}


@pytest.mark.parametrize(
    "text", ['{"height": 32}', '{"height": 0, "width": 32}', '{"size": 3}', '[32, 32]', '{"width": 32.5, "height": 1}']
)
def test_a_bad_request_defaults_file_is_a_load_error(tmp_path, text):
    (tmp_path / REQUEST_DEFAULTS_FILE).write_text(text)
    with pytest.raises(ValueError, match=REQUEST_DEFAULTS_FILE):
        folder_request_defaults(str(tmp_path))
