"""Tiny offline model zoo: complete, randomly initialised diffusers pipelines of every family.

Nothing here touches a model hub. ``build_tiny_pipeline`` makes a pipeline in memory,
``save_tiny_model`` writes it as an ordinary diffusers folder (loadable with
``DiffusionPipeline.from_pretrained``), and ``ensure_demo_model`` keeps the cached demo model the
server uses when it is started without ``--model``. ``REAL_SCHEDULER_CONFIGS`` holds the scheduler
configuration each real checkpoint ships, for the zoo and for benchmarks on real architectures.
"""

from .demo import DEMO_FAMILY, ensure_demo_model
from .scheduler_configs import REAL_SCHEDULER_CONFIGS, WAN22_A14B_BOUNDARY_RATIO, make_real_scheduler
from .tiny import (
    FAMILIES,
    IMAGE_FAMILIES,
    TINY_CALL_DEFAULTS,
    build_tiny_pipeline,
    family_of,
    save_tiny_model,
)

__all__ = [
    "DEMO_FAMILY",
    "FAMILIES",
    "IMAGE_FAMILIES",
    "REAL_SCHEDULER_CONFIGS",
    "TINY_CALL_DEFAULTS",
    "WAN22_A14B_BOUNDARY_RATIO",
    "build_tiny_pipeline",
    "ensure_demo_model",
    "family_of",
    "make_real_scheduler",
    "save_tiny_model",
]
