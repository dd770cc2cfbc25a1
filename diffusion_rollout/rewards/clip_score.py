"""A CLIP-style preference score: PickScore's formula over any transformers CLIP folder.

``score = logit_scale.exp() * cos(image embedding, prompt embedding)``, one value per (image, its
prompt). PickScore is a CLIP ViT-H/14 fine-tuned on preferences and scored this way; HPS-style
scorers are CLIP folders too. A video is scored on its first frame, as the VLM judge reads it.

Design decisions:

- **The folder's own preprocessing.** The image processor and the tokenizer are read from the folder
  (``preprocessor_config.json``, the tokenizer files), so a downloaded checkpoint is scored exactly as
  its authors preprocess; without torchvision transformers falls back to its PIL image processor,
  which is deterministic.
- **Batched, deterministic.** ``batch_size`` images per forward, under ``torch.no_grad``; float32 on a
  CPU, bfloat16 by default on CUDA. The same call on the same images, device and dtype gives the same
  bits, in the trainer or on the server; a different batch split may change the last bits (as for any
  batched model).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from diffusion_rollout.rewards.simple import Reward, first_frames, model_placement


def _embedding(out: Any) -> torch.Tensor:
    # transformers 5 answers get_*_features with a ModelOutput whose pooler_output is the projection.
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class ClipScore:
    """PickScore-style reward over the CLIP folder ``model`` (``clip:FOLDER`` or ``clip_score?model=``)."""

    def __init__(
        self, model: str, batch_size: int = 32, device: str | None = None, dtype: str | None = None
    ) -> None:
        from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

        path = Path(str(model))
        if not (path / "config.json").is_file():
            raise ValueError(f"clip: {model!r} is not a transformers CLIP folder (no config.json)")
        if batch_size < 1:
            raise ValueError(f"clip: batch_size must be >= 1, got {batch_size}")
        self.device, self.dtype = model_placement(device, dtype)
        self.batch_size = int(batch_size)
        self.model = CLIPModel.from_pretrained(str(path), dtype=self.dtype).to(self.device).eval()
        self.processor = CLIPImageProcessor.from_pretrained(str(path))
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.max_length = int(self.model.config.text_config.max_position_embeddings)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        from PIL import Image

        frames = first_frames(images, prompts, "clip")
        scale = self.model.logit_scale.exp().float()
        out = []
        for lo in range(0, frames.shape[0], self.batch_size):
            chunk = frames[lo : lo + self.batch_size]
            pil = [Image.fromarray(f.permute(1, 2, 0).contiguous().numpy()) for f in chunk]
            pixels = self.processor(images=pil, return_tensors="pt")["pixel_values"]
            text = self.tokenizer(
                list(prompts[lo : lo + self.batch_size]), padding=True, truncation=True,
                max_length=self.max_length, return_tensors="pt",
            )  # fmt: skip
            img = _embedding(self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype)))
            txt = _embedding(
                self.model.get_text_features(
                    input_ids=text["input_ids"].to(self.device),
                    attention_mask=text["attention_mask"].to(self.device),
                )
            )
            img = torch.nn.functional.normalize(img.float(), dim=-1)
            txt = torch.nn.functional.normalize(txt.float(), dim=-1)
            out.append(scale * (img * txt).sum(dim=-1))
        return torch.cat(out).cpu()


def clip_score(model: str | None = None, **options: Any) -> Reward:
    """``clip_score?model=/path`` (also ``batch_size``, ``device``, ``dtype``): :class:`ClipScore`."""
    if model is None:
        raise ValueError(
            "clip_score needs model=/path/to/folder: a CLIP folder (PickScore, HPS...), e.g. one written "
            "by benchmarks.judge_builders.save_clip_scorer"
        )
    return ClipScore(model, **options)
