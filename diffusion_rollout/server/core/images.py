"""Input images of image-conditioned requests: reading, decoding and validating them.

A request names its conditioning images in one of two ways (api.md):

- ``image_path`` (SGLang's field): paths the server reads from its own disk. A remote caller must not
  be able to read arbitrary files, so paths are served only under ``image_path_root`` (after
  resolving symlinks and ``..``); with no root configured, ``image_path`` is refused.
- ``image_data``: the image file's bytes inline (base64 text in JSON bodies, raw bytes in msgpack
  bodies), for a trainer on another host.

Every image is checked before anything is queued, and a bad one is a 400 naming the field and its
index: not a PNG, JPEG or WebP file (by content, not by name), larger than ``max_image_bytes``,
more than ``max_image_pixels`` pixels (checked from the header, before the pixels are decoded, so a
small file that expands to a huge bitmap is refused cheaply), a side shorter than
:data:`MIN_IMAGE_SIDE` or an aspect ratio beyond :data:`MAX_IMAGE_ASPECT`, or a path that cannot be
read or lies outside the root. Accepted images are converted to RGB, as the pipelines' own image
processors expect, and carry a digest of their decoded pixels: requests whose images are identical
(by path or by bytes alike) may share a pipeline call, others may not.
"""

from __future__ import annotations

import hashlib
import io
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffusion_rollout.errors import RequestError

#: File formats accepted, by Pillow's name for them.
FORMATS = ("PNG", "JPEG", "WEBP")
#: Shortest accepted side in pixels: smaller images cannot survive the pipelines' resizing rules.
MIN_IMAGE_SIDE = 16
#: Most accepted ratio of the long side to the short one (resizing to a fixed area keeps the ratio,
#: so an extreme one asks the pipeline for an absurdly long and thin latent).
MAX_IMAGE_ASPECT = 8.0


@dataclass(frozen=True)
class ConditionImage:
    """One decoded, validated input image (RGB) and the digest of its pixels."""

    image: Any = field(compare=False, repr=False)  # PIL.Image.Image
    width: int
    height: int
    digest: str


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int
    path_root: str | None


def load_images(
    image_path: list[str] | None, image_data: list[bytes] | None, limits: ImageLimits
) -> tuple[ConditionImage, ...]:
    """The request's images, paths first then inline ones; raises ``RequestError`` naming the field."""
    images: list[ConditionImage] = []
    for i, path in enumerate(image_path or ()):
        name = f"image_path[{i}]"
        images.append(decode_image(_read_path(path, name, limits), name, limits))
    for i, data in enumerate(image_data or ()):
        name = f"image_data[{i}]"
        if len(data) > limits.max_bytes:
            raise RequestError(
                f"{name}: {len(data)} bytes exceeds max_image_bytes={limits.max_bytes} (limit max_image_bytes)",
                field="image_data",
            )
        images.append(decode_image(data, name, limits))
    return tuple(images)


def _read_path(path: str, name: str, limits: ImageLimits) -> bytes:
    if limits.path_root is None:
        raise RequestError(
            f"{name}: this server reads no image paths (image_path_root is unset); send the image's "
            "bytes in image_data, or start the server with --image-path-root",
            field="image_path",
        )
    root = Path(limits.path_root).resolve()
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = root / candidate
    # resolve() follows symlinks and collapses "..", so a link or a relative climb out of the root
    # is judged by where it really points.
    resolved = candidate.resolve()
    if resolved != root and root not in resolved.parents:
        raise RequestError(f"{name}: {path!r} is outside image_path_root", field="image_path")
    try:
        size = resolved.stat().st_size
        if not resolved.is_file():
            raise RequestError(f"{name}: {path!r} is not a file", field="image_path")
        if size > limits.max_bytes:
            raise RequestError(
                f"{name}: {size} bytes exceeds max_image_bytes={limits.max_bytes} (limit max_image_bytes)",
                field="image_path",
            )
        with open(resolved, "rb") as f:
            return f.read(limits.max_bytes + 1)
    except OSError as exc:
        raise RequestError(
            f"{name}: cannot read {path!r}: {exc.strerror or type(exc).__name__}", field="image_path"
        ) from None


def decode_image(data: bytes, name: str, limits: ImageLimits) -> ConditionImage:
    """Decode and validate one image file's bytes (``name`` is the field and index for messages)."""
    from PIL import Image, UnidentifiedImageError

    field_name = name.split("[", 1)[0]
    try:
        # Pillow's own decompression-bomb guard would warn or raise at its own limit; ours is checked
        # from the header below, before any pixel is decoded.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=list(FORMATS))
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError):
        raise RequestError(
            f"{name}: not an image (send a {', '.join(FORMATS)} file's bytes)", field=field_name
        ) from None
    width, height = img.size
    if width * height > limits.max_pixels:
        raise RequestError(
            f"{name}: {width}x{height} = {width * height} pixels exceeds max_image_pixels="
            f"{limits.max_pixels} (limit max_image_pixels)",
            field=field_name,
        )
    if min(width, height) < MIN_IMAGE_SIDE:
        raise RequestError(
            f"{name}: {width}x{height} is too small; each side must be at least {MIN_IMAGE_SIDE} pixels",
            field=field_name,
        )
    if max(width, height) > MAX_IMAGE_ASPECT * min(width, height):
        raise RequestError(
            f"{name}: {width}x{height} has an aspect ratio beyond {MAX_IMAGE_ASPECT:g}:1", field=field_name
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            rgb = img.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError):
        raise RequestError(f"{name}: the image data is truncated or corrupt", field=field_name) from None
    digest = hashlib.sha256(f"{width}x{height}:".encode() + rgb.tobytes()).hexdigest()
    return ConditionImage(image=rgb, width=width, height=height, digest=digest)


def image_limits(config: Any) -> ImageLimits:
    """The limits of a ``ServerConfig``."""
    root = config.image_path_root
    return ImageLimits(
        max_bytes=config.max_image_bytes,
        max_pixels=config.max_image_pixels,
        path_root=os.path.expanduser(root) if root else None,
    )


def probe_image_png(side: int = 64) -> bytes:
    """A plain grey PNG of ``side`` x ``side`` pixels: the input image of readiness probes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (128, 128, 128)).save(buf, format="PNG")
    return buf.getvalue()
