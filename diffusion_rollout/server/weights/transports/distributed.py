"""The NCCL (or gloo) transport: one announced broadcast from trainer rank 0 into an update group.

The group is formed beforehand (``init_weights_update_group``, ``server/weights/distributed.py``).
The broadcast is received first, whatever the announcement says: a trainer blocked in a broadcast
nobody posts would hang; validation follows once every byte is here. With several target modules
every name carries its module as prefix, which routes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.server.weights.transports.base import Payload, Staged, WeightTransport
from diffusion_rollout.server.weights.updater import describe_names


def route_by_prefix(received: list, targets: list[str]) -> Payload:
    """``[(name, tensor)]`` of a broadcast into ``{module: [(name, tensor)]}``."""
    if len(targets) == 1:
        return {targets[0]: received}
    payload: Payload = {t: [] for t in targets}
    unrouted = []
    for name, tensor in received:
        owner = next((t for t in targets if name.startswith(t + ".")), None)
        if owner is None:
            unrouted.append(name)
        else:
            payload[owner].append((name, tensor))
    if unrouted:
        raise WeightUpdateError(
            f"with several target_modules every name needs a '<module>.' prefix; "
            f"{len(unrouted)} do not: {describe_names(unrouted)}",
            field="names",
        )
    return {t: pairs for t, pairs in payload.items() if pairs}


class DistributedTransport(WeightTransport):
    """``{names, dtypes, shapes, group_name, target_modules?}``: the broadcast's announcement."""

    name = "distributed"

    async def prepare(self, manager: Any, request: Mapping[str, Any], data: Any = None) -> Staged:
        received = await asyncio.to_thread(
            manager.groups.receive,
            request["group_name"],
            request["names"],
            request["dtypes"],
            request["shapes"],
            manager.engine.device,
        )
        return Staged(route_by_prefix(received, manager.targets(request.get("target_modules"))))
