"""What a warm-up's stack samples show, by phase: ``--warmup-profile``'s ``warmup_stacks.txt`` summed up.

A file cut off by a ready timeout has no closing tally; this reads the samples themselves and puts
each in the first phase whose marker one of its frames carries (innermost first), so a run that
never finished still says where its time went (issue #43):

- ``kernel_compile_at_first_run``: Triton compiling, and its ptxas runs, under inductor's
  ``CachingAutotuner`` at a kernel's first launch (``_precompile_config``, ``benchmark_one_config``),
  on the worker thread: what inductor does when its compile workers were not ready;
- ``autotune_benchmark``: timing the configs of a kernel (``kernel_call``, ``bench``);
- ``inductor``: codegen, scheduling, lowering, AOTAutograd;
- ``dynamo``: tracing;
- ``other``: the rest (the pipeline's own Python, kernels running).

    python -m benchmarks.investigations.warmup_stacks STACKS.txt --out summary.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kernel_compile_at_first_run", ("_precompile_config", "triton/compiler/compiler.py")),
    ("autotune_benchmark", ("benchmark_one_config", "kernel_call", "benchmarker.py")),
    ("inductor", ("torch/_inductor/", "torch/_functorch/", "aot_autograd")),
    ("dynamo", ("torch/_dynamo/",)),
)
SAMPLE = re.compile(r"^=== (\S+) \+([\d.]+) s: (.*)$", re.M)


def classify(frames: list[str]) -> str:
    for phase, markers in PHASES:
        if any(m in f for f in frames for m in markers):
            return phase
    return "other"


def summarize(text: str) -> dict[str, Any]:
    heads = list(SAMPLE.finditer(text))
    phases: Counter[str] = Counter()
    offsets = [float(h.group(2)) for h in heads]
    for i, head in enumerate(heads):
        body = text[head.end() : heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        frames = re.findall(r'File "([^"]+)", line \d+, in (\S+)', body)
        phases[classify([f"{path}:{fn}" for path, fn in frames])] += 1
    interval = (offsets[-1] - offsets[0]) / (len(offsets) - 1) if len(offsets) > 1 else None
    return {
        "samples": len(heads),
        "interval_s": round(interval, 3) if interval else None,
        "last_sample_s": offsets[-1] if offsets else None,
        "samples_by_phase": dict(phases.most_common()),
        "share_by_phase": {k: round(v / max(1, len(heads)), 3) for k, v in phases.most_common()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("stacks", type=Path)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    summary = {"source": args.stacks.name, **summarize(args.stacks.read_text())}
    text = json.dumps(summary, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
