"""torchao's float8 on the CPU, for the fast tier's CPU tests.

torchao refuses float8 without a GPU of compute capability 8.9+; its kernels run on the CPU once that
check is bypassed. The bypass is process-wide, so each check runs in a process of its own:
``run_check("tests.server.speed.test_module", "function", *args)`` bypasses the check there and calls
that module's ``function(*args)`` (strings), and fails the calling test with the child's output.
scripts/test.sh installs torchao beside the environment (``.test-extras/torchao``): installed in it,
diffusers would import it in every process (0.3-0.7 s each). Without it the test skips and says so.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

TORCHAO_DIR = Path(__file__).resolve().parents[1] / ".test-extras" / "torchao"


def run_check(module: str, function: str, *args: str, timeout_s: float = 600) -> None:
    env = dict(os.environ)
    if importlib.util.find_spec("torchao") is None:
        if not TORCHAO_DIR.is_dir():
            pytest.skip("torchao is not installed (scripts/test.sh installs it under .test-extras/torchao)")
        env["PYTHONPATH"] = os.pathsep.join([str(TORCHAO_DIR), env.get("PYTHONPATH", "")])
    code = "import sys; sys.path.insert(0, sys.argv[1]); from tests import torchao_helpers as t; t._child(*sys.argv[2:])"
    argv = [sys.executable, "-c", code, str(Path(__file__).resolve().parents[1]), module, function, *args]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def _child(module: str, function: str, *args: str) -> None:
    import torchao.float8.inference as float8_inference
    import torchao.quantization.quant_api as quant_api

    float8_inference._check_hardware_support = lambda *a, **k: None  # (a process of its own)
    quant_api._check_hardware_support = lambda *a, **k: None
    getattr(importlib.import_module(module), function)(*args)
