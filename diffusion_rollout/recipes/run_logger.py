"""``--log-to tensorboard,wandb``: each iteration's scalars and a grid of its first images.

:class:`RunLogger` is what the recipes' :class:`~diffusion_rollout.recipes.report.Report` calls on rank 0 once per iteration
with the iteration's JSON record (the one ``--out`` keeps) and a few of its uint8 images. The
scalars are the record's numbers, named by kind so that the dashboards group them:

- ``reward/mean``, ``reward/std``;
- ``train/*``: the ratio statistics and the recipe's exactness key (``first_ratio_max_dev``,
  ``old_policy_max_dev``), ``loss``, ``clip_frac``, ``kl``, ``ema_decay``, ``checksum_ok`` (1 or 0), ...;
- ``time/*``: seconds per phase (``rollout_s``, ``train_s``, ``push_s``, ...) and ``iteration_s``;
- ``throughput/images_per_second``, ``throughput/images``; ``memory/*``: the ``*_gb`` fields.

The step is the record's ``iteration`` (a resumed run continues its curves). Images go in as one
grid (``samples``); a video's first frame stands for it.

TensorBoard writes event files into the log directory (``torch.utils.tensorboard``, which needs the
``tensorboard`` package); W&B starts a run (``wandb.init``) whose mode, project and directory come
from the environment as usual (``WANDB_MODE=offline``, ``WANDB_PROJECT``, ``WANDB_DIR``; without
``WANDB_DIR`` its files go into the log directory). Both packages are imported only when asked for.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

TARGETS = ("tensorboard", "wandb")
SAMPLE_IMAGES = 8  # images per grid (the iteration's first ones)
GRID_COLUMNS = 4


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's numbers (and booleans, as 0 or 1), named ``kind/field``; lists and strings are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "iteration" or value is None or not isinstance(value, (bool, int, float)):
            continue
        if key in ("reward_mean", "reward_std"):
            name = f"reward/{key.removeprefix('reward_')}"
        elif key.endswith("_s"):
            name = f"time/{key}"
        elif key in ("images_per_second", "images"):
            name = f"throughput/{key}"
        elif key.endswith("_gb"):
            name = f"memory/{key}"
        else:
            name = f"train/{key}"
        out[name] = float(value)
    return out


def image_grid(images: torch.Tensor | Sequence[torch.Tensor], columns: int = GRID_COLUMNS) -> torch.Tensor:
    """``[N, C, H, W]`` images (or ``[N, C, F, H, W]`` videos: their first frame) as one uint8
    ``[3, rows * H, columns * W]`` grid with 2-pixel gaps. Float images are taken to be in [0, 1]."""
    x = torch.stack(list(images)) if not isinstance(images, torch.Tensor) else images
    x = x.detach().cpu()
    if x.ndim == 5:
        x = x[:, :, 0]
    if x.ndim != 4:
        raise ValueError(f"expected [N, C, H, W] images or [N, C, F, H, W] videos, got {list(x.shape)}")
    if x.dtype != torch.uint8:
        x = (x.float().clamp(0, 1) * 255).round().to(torch.uint8)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    x = x[:, :3]
    n, c, h, w = x.shape
    cols = min(columns, n)
    rows = math.ceil(n / cols)
    pad = 2
    grid = torch.zeros(c, rows * (h + pad) + pad, cols * (w + pad) + pad, dtype=torch.uint8)
    for i in range(n):
        top, left = pad + (i // cols) * (h + pad), pad + (i % cols) * (w + pad)
        grid[:, top : top + h, left : left + w] = x[i]
    return grid


class RunLogger:
    """Scalars and a sample grid per iteration to TensorBoard and/or W&B (``targets``)."""

    def __init__(
        self, targets: Sequence[str], log_dir: str | Path, *, recipe: str, config: Mapping[str, Any]
    ) -> None:
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise SystemExit(f"--log-to: unknown target(s) {unknown}; choose from {list(TARGETS)}")
        self.log_dir = Path(log_dir)
        self.tensorboard = None
        self.wandb_run = None
        self._wandb = None
        if "tensorboard" in targets:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise SystemExit(
                    f"--log-to tensorboard needs the tensorboard package (pip install tensorboard): {e}"
                ) from None
            self.tensorboard = SummaryWriter(log_dir=str(self.log_dir))
            # Indented: TensorBoard's text tab renders markdown, and this keeps the JSON as code.
            text = json.dumps({"recipe": recipe, **config}, indent=1, default=str)
            self.tensorboard.add_text("config", "\n".join("    " + line for line in text.splitlines()))
        if "wandb" in targets:
            try:
                import wandb
            except ImportError as e:
                raise SystemExit(f"--log-to wandb needs the wandb package (pip install wandb): {e}") from None
            self._wandb = wandb
            kwargs: dict[str, Any] = {}
            if not os.environ.get("WANDB_DIR"):
                self.log_dir.mkdir(parents=True, exist_ok=True)
                kwargs["dir"] = str(self.log_dir)
            self.wandb_run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or "diffusion-rollout",
                job_type=recipe,
                config={"recipe": recipe, **config},
                **kwargs,
            )

    def log_iteration(self, record: Mapping[str, Any], images: torch.Tensor | None = None) -> None:
        """One iteration: its scalars at step ``record["iteration"]``, and ``images``' first few as a grid."""
        step = int(record["iteration"])
        values = scalars(record)
        grid = image_grid(images[:SAMPLE_IMAGES]) if images is not None and len(images) else None
        if self.tensorboard is not None:
            for name, value in values.items():
                self.tensorboard.add_scalar(name, value, step)
            if grid is not None:
                self.tensorboard.add_image("samples", grid, step, dataformats="CHW")
            self.tensorboard.flush()  # a run cut short keeps its curves
        if self.wandb_run is not None:
            logged: dict[str, Any] = dict(values)
            if grid is not None:
                caption = f"iteration {step}: the first {min(len(images), SAMPLE_IMAGES)} images"
                logged["samples"] = self._wandb.Image(grid.permute(1, 2, 0).numpy(), caption=caption)
            self.wandb_run.log(logged, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
