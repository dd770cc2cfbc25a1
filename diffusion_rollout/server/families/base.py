"""What the engine needs to know about one model family.

A ``FamilyAdapter`` is the only place that knows a pipeline's argument names: how to encode a prompt
through the pipeline's own ``encode_prompt`` (batch 1, so a cached encoding is bit-identical to what
the stock pipeline computes), how to stack cached encodings into a pipeline call, how to draw one
sample's initial noise with the pipeline's own ``prepare_latents``, and how to cut the transformer
calls recorded during the first step into per-sample ``denoising_env`` entries.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from diffusion_rollout.errors import RequestError
from diffusion_rollout.models.family_names import REQUEST_DEFAULTS_FILE

# The most text tokens a request can ask an encoder for (the protocol bounds max_sequence_length so).
MAX_TEXT_TOKENS = 4096

# What a model folder's request_defaults.json may set: a request that omits one gets the folder's.
REQUEST_DEFAULT_KEYS = ("height", "width", "num_frames", "num_inference_steps")


def folder_request_defaults(folder: str | None) -> dict[str, int]:
    """The request defaults a model folder records in ``request_defaults.json`` (the tiny models
    write their own small sizes there, ``models.save_tiny_model``); ``{}`` without one. A file that
    is not a JSON object of positive integers under ``REQUEST_DEFAULT_KEYS`` is refused (load error)."""
    if not folder or not os.path.isdir(folder):
        return {}
    path = os.path.join(folder, REQUEST_DEFAULTS_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    bad = not isinstance(data, dict) or any(
        k not in REQUEST_DEFAULT_KEYS or isinstance(v, bool) or not isinstance(v, int) or v < 1
        for k, v in data.items()
    )
    if bad or ("height" in data) != ("width" in data):
        raise ValueError(
            f"{path}: expected a JSON object of positive integers, height and width together, under "
            f"{', '.join(REQUEST_DEFAULT_KEYS)}; got {data!r}"
        )
    return dict(data)


@dataclass(frozen=True)
class CallSettings:
    """The settings shared by every sample of one pipeline call (part of the batch key)."""

    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    true_cfg_scale: float | None
    guidance_scale_2: float | None
    num_frames: int | None
    max_sequence_length: int | None
    has_negative_prompt: bool


class FamilyAdapter:
    """Base class; subclasses fill in the family-specific names."""

    name: ClassVar[str]
    pipeline_classes: ClassVar[tuple[str, ...]]
    is_video: ClassVar[bool] = False
    # "batched": one transformer call on [uncond; cond] (SD3). "sequential": cond call, then uncond.
    cfg_layout: ClassVar[str] = "sequential"
    # Transformer forward kwargs that carry one row per sample (sliced per sample in denoising_env).
    batch_kwargs: ClassVar[tuple[str, ...]] = ()
    # Transformer forward kwargs that are per-sample python lists.
    batch_list_kwargs: ClassVar[tuple[str, ...]] = ()
    # Transformer forward kwargs left out of denoising_env (they are not conditioning).
    skip_kwargs: ClassVar[tuple[str, ...]] = ("hidden_states", "timestep", "return_dict")
    # Latent streams the pipeline steps jointly, one scheduler.step each per loop step, in order
    # (LTX-2: video then audio); empty for the usual single latent.
    streams: ClassVar[tuple[str, ...]] = ()
    # Kwargs that describe the image geometry rather than the prompt (denoising_env.image_kwargs).
    image_kwarg_names: ClassVar[tuple[str, ...]] = ()
    # True when prepare_latents draws [C, h, w] noise and packs 2x2 patches into tokens (FLUX and
    # Qwen-Image): a trainer's x_T recipe names the unpacked shape and is packed the same way.
    packs_latents_2x2: ClassVar[bool] = False
    # Input images the pipeline is conditioned on (image-conditioned families: 1; text-only: 0).
    image_inputs: ClassVar[int] = 0

    def setup_schedulers(self, loaded: Any) -> None:
        """Called once after loading; families with a non-Euler stock scheduler build the rollout one."""
        self.loaded = loaded

    def scheduler_for(self, rollout: bool) -> contextlib.AbstractContextManager:
        """Context in which the pipeline holds the right scheduler for this batch.

        ``rollout`` is true when the call needs the rollout scheduler: a rollout, or a plain generation
        with an exact schedule (only the rollout scheduler runs given sigmas exactly).
        """
        return contextlib.nullcontext()

    def call_context(self, settings: CallSettings) -> contextlib.AbstractContextManager:
        """Context around one pipeline call, for settings a pipeline takes from a component rather
        than from ``__call__`` (HunyuanVideo 1.5's guidance scale lives on its guider)."""
        return contextlib.nullcontext()

    def accepts_stock_sigmas(self) -> bool:
        """Whether the pipeline's ``__call__`` takes ``sigmas=`` (and shifts them itself)."""
        return True

    def shift_sigmas(self, sigmas: list[float]) -> list[float]:
        """The model's shift applied to given sigmas, for pipelines that cannot take them."""
        raise NotImplementedError

    def default_frames(self) -> int:
        raise NotImplementedError

    def has_experts(self) -> bool:
        return False

    def transformers(self) -> dict[str, torch.nn.Module]:
        """The denoisers the recorder watches, by component name."""
        return {"transformer": self.pipe.transformer}

    def encoding_cache_key(self, settings: CallSettings) -> tuple:
        return (self.uses_cfg(settings), settings.max_sequence_length)

    def pipeline_output_type(self, *, decoded: bool) -> str:
        """The ``output_type`` the pipeline is called with; a family that decodes outside the
        pipeline (one sample at a time) asks for latents and decodes in :meth:`output_tensor`."""
        return "pt" if decoded else "latent"

    def output_tensor(self, output: Any, *, decoded: bool = True) -> torch.Tensor | None:
        """The batch from the pipeline's output: images [B, C, H, W] or videos [B, C, F, H, W] when
        ``decoded``, else the latents (``output_type="latent"``)."""
        return output.images

    def to_uint8(self, x: torch.Tensor) -> torch.Tensor:
        """[0, 1] floats to 0..255 bytes: ``round(x * 255)`` clamped (api.md output_dtype)."""
        return (x.float() * 255.0).round().clamp(0, 255).to(torch.uint8)

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        #: The loaded folder's own request defaults (tiny models: their small sizes), else {}.
        self.request_defaults = folder_request_defaults(getattr(pipe, "name_or_path", None))

    # ---------------------------------------------------------------- geometry and defaults
    def spatial_factor(self) -> int:
        """Width and height must be multiples of this."""
        return int(self.pipe.vae_scale_factor) * 2

    def default_size(self) -> tuple[int, int]:
        """(height, width) the stock pipeline uses when none is given."""
        raise NotImplementedError

    def default_steps(self) -> int:
        return 28

    # What a request that omits a setting gets: the folder's request_defaults.json, else the
    # family's stock default (the default_* methods above, which subclasses override).
    def request_size(self, images: tuple = ()) -> tuple[int, int]:
        """(height, width) for a request that names neither."""
        d = self.request_defaults
        if "height" in d:
            return d["height"], d["width"]
        return (self.default_size_for_images(images) if images else None) or self.default_size()

    def request_frames(self) -> int:
        return self.request_defaults.get("num_frames") or self.default_frames()

    def request_steps(self) -> int:
        return self.request_defaults.get("num_inference_steps") or self.default_steps()

    def default_guidance(self) -> float:
        return 7.0

    def default_true_cfg(self) -> float | None:
        return None

    def validate(self, settings: CallSettings) -> None:
        """Family rules a request can break (400)."""
        f = self.spatial_factor()
        for name in ("height", "width"):
            v = getattr(settings, name)
            if v % f:
                raise RequestError(f"{name}={v} must be a multiple of {f} for {self.name}", field=name)

    def uses_cfg(self, settings: CallSettings) -> bool:
        raise NotImplementedError

    def guidance_info(self, settings: CallSettings) -> dict[str, Any]:
        """How a replayer combines the branches (docs/math.md: denoising_env.guidance)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- prompts
    def encode(
        self, prompt: str, negative_prompt: str | None, settings: CallSettings
    ) -> dict[str, torch.Tensor]:
        """Batch-1 prompt encodings under the pipeline's own argument names."""
        raise NotImplementedError

    def encoding_group_key(self, enc: dict[str, torch.Tensor]) -> tuple:
        """Encodings with different keys cannot share a call (e.g. different text lengths)."""
        return ()

    def stack_encodings(self, encs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        keys = encs[0].keys()
        return {k: torch.cat([e[k] for e in encs], dim=0) for k in keys if encs[0][k] is not None}

    def call_kwargs(self, settings: CallSettings) -> dict[str, Any]:
        """Pipeline ``__call__`` keyword arguments other than embeddings, generators and latents."""
        raise NotImplementedError

    # ---------------------------------------------------------------- precomputed conditioning
    def embedding_shapes(self) -> dict[str, tuple[int | None, ...]]:
        """One prompt's row shape per conditioning tensor a request may send instead of text, by
        the pipeline's argument name (``None``: any length, the tokens); empty: text only
        (server/core/prompt_embeds.py)."""
        return {}

    def max_embedding_tokens(self) -> int:
        """The most tokens one prompt's sent embeddings may hold (their ``None`` dimension) when
        ``max_prompt_tokens`` is unset: no more than a text encoding of this model can have, so that a
        sent tensor costs the worker no more than a prompt would. Families whose pipeline caps
        ``max_sequence_length`` lower say so."""
        return MAX_TEXT_TOKENS

    def embedding_dtype(self) -> torch.dtype:
        """The dtype sent embeddings must have: what the pipeline computes in."""
        return self.pipe.transformer.dtype

    def embeddings(self, embeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sent embeddings as :meth:`encode` would have returned them (on the pipeline's device)."""
        device = self.pipe._execution_device
        return {name: t.to(device) for name, t in embeds.items()}

    # ---------------------------------------------------------------- noise
    def initial_latents(
        self, settings: CallSettings, generator: torch.Generator, dtype, device
    ) -> torch.Tensor:
        """One sample's x_T drawn exactly as the stock pipeline draws it."""
        raise NotImplementedError

    def latent_reference(self, settings: CallSettings, dtype) -> torch.Tensor:
        """A meta tensor with the shape and dtype of one sample's x_T as the pipeline keeps it."""
        try:
            return self.initial_latents(settings, None, dtype, "meta")
        except Exception:  # a prepare_latents that cannot run on meta: one small real draw
            g = torch.Generator("cpu").manual_seed(0)
            return self.initial_latents(settings, g, dtype, "cpu").to("meta")

    def noise_shape(self, settings: CallSettings) -> tuple[int, ...]:
        """One sample's x_T before packing (``initial_noise_latent_shape``): [C, h, w] or [C, f, h, w]."""
        if self.packs_latents_2x2:
            f = int(self.pipe.vae_scale_factor) * 2
            channels = int(self.pipe.transformer.config.in_channels) // 4
            return (channels, 2 * (settings.height // f), 2 * (settings.width // f))
        return tuple(self.latent_reference(settings, torch.float32).shape[1:])

    def pack_noise(self, settings: CallSettings, noise: torch.Tensor) -> torch.Tensor:
        """Unpacked x_T of one sample (``noise_shape``) -> ``[1, ...]`` in the pipeline's layout."""
        if self.packs_latents_2x2:
            c, h, w = noise.shape
            return self.pipe._pack_latents(noise.reshape(1, c, h, w), 1, c, h, w)
        return noise.unsqueeze(0)

    # ---------------------------------------------------------------- replay conditioning
    def split_env(
        self,
        calls: list[dict[str, Any]],
        batch: int,
        settings: CallSettings,
        timestep_dtype: torch.dtype | None,
    ) -> list[dict[str, Any]]:
        """Per-sample ``denoising_env`` entries from the step-0 transformer calls.

        Each entry: ``image_kwargs`` (geometry kwargs shared by both branches), ``pos_cond_kwargs``,
        ``neg_cond_kwargs`` (None without CFG), ``guidance`` (the rule and scales), ``batch_kwargs``
        (which kwargs carry one row per sample, so a replayer can stack samples) and
        ``timestep_dtype`` (the dtype the pipeline handed the timestep in).
        """
        cfg = self.uses_cfg(settings)
        out = []
        for i in range(batch):
            if self.cfg_layout == "batched" and cfg:
                pos = self._slice(calls[0], batch + i)
                neg = self._slice(calls[0], i)
            else:
                pos = self._slice(calls[0], i)
                neg = self._slice(calls[1], i) if cfg and len(calls) > 1 else None
            image = {k: pos.pop(k) for k in self.image_kwarg_names if k in pos}
            if neg is not None:
                for k in self.image_kwarg_names:
                    neg.pop(k, None)
            out.append(
                {
                    "image_kwargs": image,
                    "pos_cond_kwargs": pos,
                    "neg_cond_kwargs": neg,
                    "guidance": self.guidance_info(settings),
                    "batch_kwargs": [k for k in (*self.batch_kwargs, *self.batch_list_kwargs) if k in pos],
                    "timestep_dtype": str(timestep_dtype or torch.float32),
                }
            )
        return out

    def _slice(self, kwargs: dict[str, Any], row: int) -> dict[str, Any]:
        env: dict[str, Any] = {}
        for k, v in kwargs.items():
            if k in self.skip_kwargs or v is None:
                continue
            if k in self.batch_kwargs and isinstance(v, torch.Tensor):
                env[k] = v[row : row + 1]
            elif k in self.batch_list_kwargs and isinstance(v, (list, tuple)):
                env[k] = [v[row]]
            elif isinstance(v, (torch.Tensor, int, float, str, bool, list, tuple, dict)):
                env[k] = v
        return env

    # ---------------------------------------------------------------- input images
    # Image-conditioned families (families/image_cond.py) override these; text-only ones never see
    # an image, because the planner refuses images for a family with ``image_inputs == 0``.
    def encode_with_images(
        self, prompt: str, negative_prompt: str | None, settings: CallSettings, images: tuple
    ) -> dict[str, torch.Tensor]:
        """Prompt encodings of a request with input images (the same as :meth:`encode` unless the
        text encoder sees the image too)."""
        return self.encode(prompt, negative_prompt, settings)

    def encoding_uses_images(self) -> bool:
        """Whether the prompt encoding depends on the input images (part of the cache key then)."""
        return False

    def image_call_kwargs(self, images: tuple) -> dict[str, Any]:
        """Pipeline ``__call__`` keyword arguments that carry the input images."""
        return {}

    def default_size_for_images(self, images: tuple) -> tuple[int, int] | None:
        """(height, width) the stock pipeline picks from the input images, or None for the default."""
        return None
