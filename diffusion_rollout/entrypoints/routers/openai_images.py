"""``POST /v1/images/generations``: OpenAI's image route, as SGLang's diffusion server offers it.

Evaluation traffic (SGLang's end-to-end refit test, the router's end-to-end test, evaluation
scripts) calls it with the ``openai`` client: ``images.generate(model, prompt, n, size,
response_format="b64_json")`` and reads ``data[i].b64_json``. It is a plain generation
(``rollout=false``) through the same engine, queue and limits as ``/rollout/generate``, answered
as OpenAI's ``ImagesResponse``: ``{"created", "data": [{"b64_json", "revised_prompt"}],
"output_format", "size"}`` with each image encoded as PNG (or JPEG/WebP with ``output_format``).

- ``size`` is ``"<width>x<height>"``; ``"auto"`` or none takes the model's default.
- ``response_format="url"`` is refused (400): this server stores no files, it answers inline.
- OpenAI's fields that steer a hosted model (``quality``, ``style``, ``background``,
  ``moderation``, ``output_compression``, ``user``) and any other key are accepted, as SGLang
  accepts them, and named in the answer's ``ignored_fields``.
- SGLang's extra sampling fields that mean something here are honoured: ``negative_prompt``,
  ``seed``, ``num_inference_steps``, ``guidance_scale``, ``true_cfg_scale``.
"""

from __future__ import annotations

import base64
import io
import time
from typing import Any, Literal

import torch
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from diffusion_rollout.entrypoints.routers.common import get_engine, require_api_key
from diffusion_rollout.errors import RequestError
from diffusion_rollout.protocol.dialects import log_ignored_once
from diffusion_rollout.scheduler_mixins import RolloutSettings
from diffusion_rollout.server.core.params import GenerateParams

router = APIRouter()
PATH = "/v1/images/generations"
FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


class ImageGenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(1, ge=1)
    size: str | None = None
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    negative_prompt: str | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0)
    true_cfg_scale: float | None = Field(None, ge=0)

    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _accept_unknown(cls, data: Any, handler: Any) -> ImageGenerationRequest:
        ignored: list[str] = []
        if isinstance(data, dict):
            ignored = sorted(k for k in data if k not in cls.model_fields)
            data = {k: v for k, v in data.items() if k in cls.model_fields}
        model = handler(data)
        model._ignored = ignored
        return model

    def to_params(self, request_id: str) -> GenerateParams:
        if self.response_format == "url":
            raise RequestError(
                "response_format='url' needs stored files; this server answers inline: send "
                "response_format='b64_json'",
                field="response_format",
            )
        width = height = None
        if self.size not in (None, "auto"):
            try:
                width, height = (int(v) for v in self.size.lower().split("x"))
            except ValueError:
                raise RequestError(
                    f"size must be '<width>x<height>' (e.g. '1024x1024') or 'auto', got {self.size!r}",
                    field="size",
                ) from None
        return GenerateParams(
            prompt=self.prompt,
            negative_prompt=self.negative_prompt,
            seed=self.seed,
            width=width,
            height=height,
            num_inference_steps=self.num_inference_steps,
            num_outputs_per_prompt=self.n,
            guidance_scale=self.guidance_scale,
            true_cfg_scale=self.true_cfg_scale,
            rollout=False,
            settings=RolloutSettings(record=False),
            output_dtype="uint8",
            request_id=request_id,
        )


def encode_image(image: torch.Tensor, fmt: str) -> str:
    """A ``[3, H, W]`` uint8 image as base64 of a ``fmt`` file."""
    from PIL import Image

    if image.ndim != 3:
        raise RequestError(
            f"{PATH} returns images; this model makes {image.ndim - 1}-d outputs (use /rollout/generate)",
            field="model",
        )
    buf = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).contiguous().numpy()).save(buf, format=FORMATS[fmt])
    return base64.b64encode(buf.getvalue()).decode("ascii")


@router.post(PATH, dependencies=[Depends(require_api_key)])
async def image_generations(body: ImageGenerationRequest, request: Request) -> dict:
    params = body.to_params(request.state.request_id)
    results = await get_engine(request).generate(params)
    data = [
        {"b64_json": encode_image(r.generated_output, body.output_format), "revised_prompt": body.prompt}
        for r in results
    ]
    height, width = results[0].generated_output.shape[-2:]
    out: dict[str, Any] = {
        "created": int(time.time()),
        "data": data,
        "output_format": body.output_format,
        "size": f"{width}x{height}",
    }
    if body._ignored:
        log_ignored_once(PATH, body._ignored)
        out["ignored_fields"] = body._ignored
    return out
