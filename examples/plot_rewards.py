"""Reward curves of recipe runs on one plot: ``python examples/plot_rewards.py RUN.json [RUN.json ...] --png OUT``.

Each ``RUN.json`` is what a recipe wrote with ``--out``; the label is the file's name unless given as
``LABEL=RUN.json``. Needs matplotlib (``pip install -e .[plot]``); the PNG holds no timestamp, so the
same JSON always draws the same file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from diffusion_rollout.recipes.records import plot_reward_curves


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="RUN.json or LABEL=RUN.json")
    p.add_argument("--png", required=True)
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    runs = {}
    for spec in args.runs:
        label, _, path = spec.rpartition("=")
        runs[label or Path(path).stem] = json.loads(Path(path).read_text())
    plot_reward_curves(runs, args.png, title=args.title)


if __name__ == "__main__":
    main()
