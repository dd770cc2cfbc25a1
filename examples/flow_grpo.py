"""Flow-GRPO (and DanceGRPO) with a LoRA, rollouts from a diffusion-rollout server.

    python examples/flow_grpo.py                          # CPU: a tiny SD3 model and its own server
    python examples/flow_grpo.py --step-kind dance        # DanceGRPO: the same trainer, `dance` steps
    python examples/flow_grpo.py --model /models/sd35m --server-gpu 0 --trainer-gpu 0 \
        --steps 10 --size 512 --group-size 8 --lora-rank 32 --iterations 40 --out run.json
    python examples/flow_grpo.py --model /models/sd35m --layout in-process     # no server: the baseline
    python examples/flow_grpo.py --url http://gpu-host:30000 --model /same/diffusers/folder
    torchrun --standalone --nproc-per-node 4 examples/flow_grpo.py --model /models/sd35m --prompts 16 \
        --server-gpus 0,1,2,3 --trainer-gpus 0,1,2,3           # 4 trainer ranks, a 4-replica pool

Each iteration:

1. **Rollouts.** One request per prompt with ``num_outputs_per_prompt = G`` (a GRPO group, one
   shared x_T per group as in Flow-GRPO-Fast), stochastic steps only in a window of ``--sde-window``
   steps whose start is drawn per iteration from the first ``--sde-window-range`` steps (the other
   steps are ODE and draw no noise); the trajectory and the conditioning come back for replay, the
   images as uint8.
2. **Reward and advantages.** The ``--reward`` plug-in (``diffusion_rollout.rewards``; JPEG compressibility by
   default) on the images, normalised within each group.
3. **Training.** For ``--inner-epochs`` passes: replay each group's stochastic steps with the
   trainer's PEFT-wrapped transformer (``replay_steps``: the family's guidance rule, the shared step
   math), Flow-GRPO's clipped ratio loss (optionally plus ``--kl-beta`` times the KL to the base
   model, i.e. the adapter disabled), backward per step, one optimizer step per pass. The first pass is
   on-policy: the trainer holds exactly the server's weights and replays each group as the batch the
   server ran, so the ratio is exactly 1 (``first_ratio_max_dev``, which must be 0).
4. **Sync.** The adapter is pushed (``push_lora``: reloaded in place, activated, checksum verified)
   and the server's checksum read back and compared with the trainer's.

**A lost server** (restarted with its base weights, a dropped connection, an answer later than
``--request-timeout``) is waited for, the adapter re-pushed and verified and the iteration's
rollouts redone (``diffusion_rollout.recipes.recovery``); rollouts from any other weight version are rejected, never
trained on, and the record lists each recovery (``recoveries``).

``--async-depth k`` (k > 0) makes the rollouts of the next k iterations while the trainer trains
(``RolloutClient.rollout_stream``): a batch is at most k pushes behind the trainer (older ones are
regenerated), is trained with the truncated importance weight of ``tis_policy_loss`` when stale,
and each iteration records its ``staleness`` and the first-step ratio statistics per staleness
(``ratio_by_staleness``; |ratio - 1| is exactly 0 at staleness 0). ``0`` (the default) is the
synchronous loop above, unchanged.

``--layout in-process`` samples in the trainer's process on its own transformer instead
(``recipes.in_process``: the stock pipeline for SD3, this project's engine for the other families): same
seeds, same requests, nothing to push. ``--release-memory``
has a colocated server release its GPU memory while the trainer trains.

**Several ranks** (``torchrun``; ``recipes.ranks``): each rank takes its block of the ``--prompts``
groups, replays them, and the LoRA gradients are summed over the ranks before one optimizer step;
rank 0 starts the server (``--server-gpus 0,1``: a pool of Ray replicas), pushes, and writes the
record with every rank's rewards. ``--full-finetune`` trains every weight instead, sharded with
FSDP2, and syncs the full weights after each step (``recipes.full``). One rank is the plain run.

The run is written to ``--out`` as JSON after every iteration: per iteration the rewards, the ratio
statistics, the checksums and the seconds of each phase; at the end the learning statistics.

The machinery (the iteration, recovery, ranks, checkpoints, phases) is the package's
``diffusion_rollout.recipes.flow_grpo``; this script is its command line. For the loop alone, in one
file on the public client, read ``flow_grpo_minimal.py``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from diffusion_rollout.recipes import flow_grpo, flow_grpo_options


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return flow_grpo_options.parse_args(argv, __doc__.splitlines()[0])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return flow_grpo.launch_flow_grpo(parse_args(argv))


if __name__ == "__main__":
    main()
    sys.exit(0)
