#!/usr/bin/env bash
# Install the project with its test extras (CPU torch where the machine offers it) and run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# Prefer the CPU-only torch wheel when the local wheel folder or index has one (no CUDA download).
python3 -m pip install -q "torch==2.13.0+cpu" 2>/dev/null || python3 -m pip install -q torch
python3 -m pip install -q -e ".[test]"
ruff check .
python3 -m pytest -q "$@"
