"""DiffusionNFT with UniRL's EMA pattern: the server samples from ``old`` (EMA), the trainer trains ``default``.

    python examples/diffusion_nft.py                      # CPU: a tiny SD3 model and its own server
    python examples/diffusion_nft.py --model /models/sd35m --server-gpu 0 --trainer-gpu 0 \
        --steps 10 --size 512 --group-size 8 --lora-rank 32 --iterations 30 --out run.json
    python examples/diffusion_nft.py --url http://gpu-host:30000 --model /same/diffusers/folder

DiffusionNFT (Zheng et al., 2025) trains on the forward process, so rollouts need no log-probs and
no SDE: any ODE sampler will do. Each iteration:

1. **Rollouts under ``old``.** The server holds both adapters with ``old`` active. Requests send
   ``rollout_sde_step_indices=[]`` (every step ODE, no noise drawn) with
   ``rollout_log_prob_no_const=true`` (an all-ODE request in the ``gaussian`` form is a 400: an ODE step
   has no density), and keep only two trajectory entries (a parity check, below) and the final latent,
   plus the conditioning and uint8 images.
2. **Reward -> optimality.** ``r = 0.5 + 0.5 * clip(A / max|A|, -1, 1)`` from group advantages.
3. **Forward-process loss.** For the final latent ``x0``, a schedule point ``(sigma, timestep)`` of
   the rollout and fresh noise: ``x_t = (1 - sigma) x0 + sigma eps``, target ``v = eps - x0``;
   ``v_old`` from the trainer's ``old`` adapter (no grad), ``v_theta`` from ``default``;
   ``L = r |(1 - b) v_old + b v_theta - v|^2 + (1 - r) |(1 + b) v_old - b v_theta - v|^2``.
   The model is called through ``replay_model_output`` with the rollout's ``denoising_env``
   (conditional branch only: DiffusionNFT is CFG-free).
4. **EMA and sync.** ``old <- decay * old + (1 - decay) * default`` on the trainer; both adapters are
   pushed (``push_lora``, checksums verified, and read back) and ``old`` stays active. The decay
   ramps up from 0 by ``--ema-ramp`` per iteration to at most ``--ema-decay``: a constant 0.5 from
   the start left ``old`` lagging ``default`` and did not learn (SD3.5-medium, 30 iterations on an
   H100: -232.7 -> -233.5); the ramp did, in the same run (-229.7 -> -179.4 kB, 29.7 standard
   errors over iteration means; benchmarks/RESULTS.md#train-nft).

A lost server (restarted, unreachable, late) is waited for, both adapters re-pushed and verified
and the rollouts redone (``diffusion_rollout.recipes.recovery``); rollouts from another version are never trained on.

**Parity check** (the counterpart of Flow-GRPO's ratio of exactly 1 for deterministic rollouts): the
trainer's ``old`` adapter recomputes one ODE step of every group from the returned trajectory entry,
as one batch, and the result must equal the server's next entry bit for bit (``old_policy_max_dev``
is 0): the trainer holds exactly the policy the server sampled from.

The machinery is the package's ``diffusion_rollout.recipes.diffusion_nft``; this script is its command line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from diffusion_rollout.recipes import diffusion_nft
from diffusion_rollout.recipes.launch import launch


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return diffusion_nft.parse_args(argv, __doc__.splitlines()[0])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return launch(parse_args(argv), diffusion_nft.run)


if __name__ == "__main__":
    main()
    sys.exit(0)
