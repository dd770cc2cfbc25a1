"""A replica whose process died and Ray restarted: load the model again, copy a serving peer's state.

The front (``engine.py``) notices the death (``replica_died``) and starts :func:`recover` as a task.
Under the front's admin lock, so that no update runs meanwhile, the new process copies the current
weights, adapters and version history from a serving peer (``server/weights/replica_state.py``), takes the front's
pause and memory state, and serves again (``mark_synced``: until then the new process refuses
work, even work Ray hands it before the front heard of the death). A replica with no peer to copy from after updates were
applied stays out of service (``stale``) rather than serve old weights.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from diffusion_rollout.cluster.ray_support import import_ray

if TYPE_CHECKING:
    from diffusion_rollout.cluster.engine import ClusterEngine, Replica

logger = logging.getLogger(__name__)

# How often a restarting replica is asked whether its new process is up.
RESTART_POLL_S = 0.5


async def recover(front: ClusterEngine, replica: Replica) -> None:
    """Load the model on the restarted process, copy a serving peer's weights, serve again."""
    ray = import_ray()
    try:
        while True:
            try:
                info = await replica.actor.start.remote()
                break
            except ray.exceptions.ActorUnavailableError:
                # Still restarting (Ray refuses calls until the new process is up): ask again.
                await asyncio.sleep(RESTART_POLL_S)
    except ray.exceptions.RayActorError as exc:
        logger.error("replica %d will not come back: %s", replica.replica_id, exc)
        replica.state = "dead"
        return
    except Exception:
        logger.exception("replica %d failed to load after its restart", replica.replica_id)
        replica.state = "dead"
        return
    replica.state = "syncing"
    async with front.admin_lock:
        peers = front.serving()
        try:
            if front.updates_applied and not peers:
                logger.error(
                    "replica %d restarted but no serving replica holds the current weights to copy; "
                    "it stays out of service until restarted again",
                    replica.replica_id,
                )
                replica.state = "stale"
                return
            if peers:
                state = peers[0].actor.export_state.remote(sorted(front.touched_modules))
                await replica.actor.import_state.remote(state)
            if front.status == "released":
                await replica.actor.manager_call.remote("release_memory", {})
            if front.user_paused:
                await replica.actor.manager_call.remote("pause_generation", {})
            await replica.actor.mark_synced.remote()  # from here the new process takes work
            info = await replica.actor.info.remote()
        except ray.exceptions.RayActorError:
            logger.error("replica %d died again while re-syncing", replica.replica_id)
            front.start_recovery(replica)
            return
        except Exception:
            logger.exception("replica %d could not be re-synced; it stays out of service", replica.replica_id)
            replica.state = "stale"
            return
        replica.info = info
        learn_versions(replica)
        replica.state = "serving"
        replica.load.serving = True
    logger.info(
        "replica %d serves again (pid %s, weight_version %s)",
        replica.replica_id,
        info["pid"],
        info["weight_version"],
    )


def learn_versions(replica: Replica) -> None:
    """The front's knowledge of a replica's versions, from what it reported (``info``)."""
    info = replica.info
    if "weight_version" in info:
        replica.load.versions.replace(info.get("weight_versions") or [info["weight_version"]])
