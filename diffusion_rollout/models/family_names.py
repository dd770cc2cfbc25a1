"""The tiny zoo's family names, importable without diffusers (``make-tiny-model --help`` lists them).

``tiny._SPECS`` builds exactly these families (tests/entrypoints/test_cli_help.py checks that the two agree).
"""

from __future__ import annotations

FAMILIES: tuple[str, ...] = (
    "sd3",
    "flux",
    "qwenimage",
    "wan",
    "wan2.2",
    "flux2-klein",
    "zimage",
    "hunyuanvideo15",
    "ltx2",
)
#: Image-conditioned families (their pipelines need an input image; ``tiny_image_cond``).
IMAGE_FAMILIES: tuple[str, ...] = ("flux-kontext", "wan-i2v", "qwenimage-edit", "wan2.2-ti2v-i2v")

#: The file a tiny model's folder keeps beside ``model_index.json``: the sizes (and steps) the server
#: gives a request that names none, so a prompt alone gets a tiny output from a tiny model.
REQUEST_DEFAULTS_FILE = "request_defaults.json"
