#!/usr/bin/env bash
# Install the project with its test extras (CPU torch where the machine offers it) and run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# Prefer the CPU-only torch wheel when the local wheel folder or index has one (no CUDA download).
python3 -m pip install -q "torch==2.13.0+cpu" 2>/dev/null || python3 -m pip install -q torch
python3 -m pip install -q -e ".[test]"
# torchao for tests/server/speed/test_precompiled_blocks.py's FP8 test, beside the environment
# rather than in it: installed, diffusers imports it in every process (0.3-0.4 s each here). Without
# it that one test skips and says so.
python3 -m pip install -q --no-deps --upgrade --target .test-extras/torchao "torchao>=0.18" \
  || echo "torchao not installed under .test-extras: the FP8 precompile test will skip"
ruff check .
# Two workers (pytest-xdist), whole files each, the slowest files first (tests/conftest.py): the
# suite is mostly one busy core at a time, so this roughly halves it on two cores. `-n 0` runs it in
# one process.
python3 -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
