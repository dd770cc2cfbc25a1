"""Loading a diffusers pipeline folder and fitting it with the rollout scheduler.

The pipeline is loaded with the ordinary ``DiffusionPipeline.from_pretrained`` (so any diffusers
folder of a supported family works), then its flow-match Euler scheduler is replaced by the
rollout-mixin subclass built from the same config: with no rollout attached it is the stock
scheduler bit for bit, so ``rollout=false`` stays identical to the stock pipeline.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from diffusion_rollout.scheduler_mixins import RolloutFlowMatchEulerScheduler

logger = logging.getLogger(__name__)


@dataclass
class LoadedPipeline:
    pipe: Any
    stock_scheduler: Any
    rollout_scheduler: Any
    load_time_s: float


def load_pipeline(path: str, *, dtype: torch.dtype, device: str) -> LoadedPipeline:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

    t0 = time.perf_counter()
    logger.info("loading pipeline from %s (dtype %s, device %s)", path, dtype, device)
    pipe = DiffusionPipeline.from_pretrained(path, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device)
    stock = pipe.scheduler
    if isinstance(stock, FlowMatchEulerDiscreteScheduler):
        rollout = RolloutFlowMatchEulerScheduler.from_config(stock.config)
        pipe.scheduler = rollout
    else:
        # Families whose stock scheduler has no transition density (Wan's UniPC) run rollouts on a
        # flow-match Euler scheduler at the model's shift; the family adapter builds it.
        rollout = None
    dt = time.perf_counter() - t0
    logger.info("loaded %s in %.1f s", type(pipe).__name__, dt)
    return LoadedPipeline(pipe=pipe, stock_scheduler=stock, rollout_scheduler=rollout, load_time_s=dt)
