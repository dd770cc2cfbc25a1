"""Where a cluster's replica actors go: a resource check before any is created, and ``--placement``.

- Ray waits forever for an actor it cannot place; :meth:`Placement.check_resources` fails at once,
  naming what is short, when the Ray cluster has fewer GPUs or CPUs in total than the replicas ask.
- ``--placement spread|pack`` reserves a placement group of one bundle per replica (Ray's ``SPREAD``
  or ``PACK`` strategy) and hands each actor its bundle; the group is kept from the moment it is
  created, so a start that fails while waiting for it still removes it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from diffusion_rollout.config import ServerConfig

logger = logging.getLogger(__name__)

# How long ``--placement`` waits for Ray to reserve every replica's bundle.
PLACEMENT_TIMEOUT_S = 300.0


class Placement:
    """The replicas' placement for one ``ClusterEngine`` (``group``: its placement group, or None)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.group: Any = None

    def options(self, ray, n: int, gpus: float) -> list[dict[str, Any]]:
        """Each replica actor's ``.options``: none (Ray's default scheduling) unless
        ``config.placement`` asks for a placement group of one bundle per replica, with Ray's
        ``SPREAD`` (bundles on as many nodes as possible) or ``PACK`` (as few) strategy. Both are
        best effort: ``pack`` spreads what one node cannot hold, ``spread`` doubles up when there are
        fewer nodes than replicas. A replica restarted by Ray comes back in its own bundle (which Ray
        moves to another node if its node died)."""
        placement = self.config.placement
        if placement is None:
            return [{} for _ in range(n)]
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {k: v for k, v in (("CPU", self.config.cpus_per_replica), ("GPU", gpus)) if v > 0}
        if not bundle:
            raise ValueError(
                f"placement={placement} needs each replica to reserve a CPU or a GPU; "
                "set --cpus-per-replica or --gpus-per-replica above 0"
            )
        pg = placement_group([dict(bundle) for _ in range(n)], strategy=placement.upper())
        self.group = pg
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ValueError(
                f"Ray could not place {n} bundles of {bundle} ({placement}) within {PLACEMENT_TIMEOUT_S:g} s: "
                "no node has room for one replica's bundle; lower --gpus-per-replica or --cpus-per-replica"
            ) from None
        logger.info("replicas placed in a %s placement group of %d bundles %s", placement.upper(), n, bundle)
        return [
            {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)}
            for i in range(n)
        ]

    def remove(self) -> None:
        pg, self.group = self.group, None
        if pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(pg)

    def check_resources(self, ray, n: int, gpus: float) -> None:
        """Fail at once (instead of waiting forever for actors Ray cannot place) when the cluster
        has fewer GPUs or CPUs in total than the replicas ask for."""
        total = ray.cluster_resources()
        need = {"GPU": n * gpus, "CPU": n * self.config.cpus_per_replica}
        short = {k: v for k, v in need.items() if v > total.get(k, 0.0) + 1e-9}
        if short:
            have = ", ".join(f"{k} {total.get(k, 0.0):g}" for k in short)
            want = ", ".join(f"{k} {v:g}" for k, v in short.items())
            raise ValueError(
                f"{n} replicas need {want} but the Ray cluster has {have}; lower --replicas, "
                "--gpus-per-replica or --cpus-per-replica, or add hosts (ray start --address=...)"
            )
