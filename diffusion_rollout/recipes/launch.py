"""A recipe's process: its ranks, its server, its client, and the record it leaves.

:func:`launch` is what every recipe's ``main`` does around its ``run``: join torchrun's process
group (one rank without torchrun), bind this rank's GPU before the first collective, start or reach
the rollout server (none with ``--layout in-process``), wait until it is ready, run, and write the
record with the run's wall-clock seconds. Rank 0 prints the summary as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from diffusion_rollout.client import RolloutClient
from diffusion_rollout.recipes.ranks import Ranks
from diffusion_rollout.recipes.records import write_run
from diffusion_rollout.recipes.servers import client_timeout, rollout_server, wait_ready
from diffusion_rollout.recipes.trainer import trainer_device

# run(client or None, model folder, args, out path, ranks) -> the run's record
Run = Callable[[Any, Any, argparse.Namespace, Any, Ranks], dict[str, Any]]


def launch(args: argparse.Namespace, run: Run, *, always_group: bool = False) -> dict[str, Any]:
    """``run`` under torchrun's ranks against the server of ``args``; returns its record.

    ``always_group``: a process group even for one rank (FSDP2 needs one)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise here
    t0 = time.perf_counter()
    ranks = Ranks.from_env(always_group=always_group)
    finished = False
    try:
        trainer_device(args, ranks)  # binds this rank's GPU before the first collective
        with rollout_server(args, ranks=ranks) as server:
            if server.url is None:
                record = run(None, server.model_path, args, args.out, ranks)
            else:
                with RolloutClient(
                    server.url,
                    admin_key=server.admin_key,
                    max_concurrency=args.prompts,
                    **client_timeout(args),
                ) as client:
                    wait_ready(client, args.recover_timeout)
                    record = run(client, server.model_path, args, args.out, ranks)
        finished = True
    finally:
        ranks.close(finished=finished)
    record["wall_s"] = round(time.perf_counter() - t0, 2)
    if ranks.is_main:
        write_run(args.out, record)
        print(json.dumps(record["summary"]), flush=True)
    return record
