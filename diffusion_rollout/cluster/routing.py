"""Where work goes: the replica a rollout runs on, the IPC entry each replica reads, group ranks.

Pure functions and a small bookkeeping class, no Ray, so the rules are tested directly.

Design decisions:

- **Least outstanding work.** A rollout goes to the serving replica with the fewest samples
  dispatched and not yet answered (a request's work is its number of outputs: the front cannot know
  the model's default steps or size without the model). Ties go to the replica picked least
  recently, so a burst of equal requests alternates instead of piling onto replica 0.
- **One request, one replica.** Every output of a request runs on the replica it was sent to, so
  its ``batch_id`` names one pipeline call there and replay stays exact.
- **Weight versions.** A request with ``min_weight_version`` goes only to a replica that holds it
  (``weight_versions.py``'s order, checked against the sequence the front knows for each
  replica: what it reported at start, re-sync and ``/server_info``, plus every update the front
  fanned out to it); the least outstanding rule picks among those. The replica checks again.
- **IPC payloads by GPU.** A colocated trainer sends one ``serialized_named_tensors`` entry per GPU
  with ``payload_gpu_uuids``; each replica receives exactly the entry on its own GPU. A replica on
  a GPU the payload does not name gets entry 0, as the single server does (CUDA IPC handles open on
  any GPU of the host, only slower).
- **Update-group ranks.** The trainer is rank 0 and gives this front a ``rank_offset``; replica
  ``i`` joins as ``rank_offset + i``, so one front takes as many ranks as it has replicas
  (``weight_update_ranks`` in ``/server_info``, which the project's ``WeightBroadcaster`` reads).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from diffusion_rollout.errors import ServiceUnavailableError, WeightUpdateError
from diffusion_rollout.protocol.weight_versions import Version, VersionHistory


@dataclass
class Load:
    """What the front knows of one replica's work: samples in flight, when it was last picked."""

    replica_id: int
    serving: bool = True
    outstanding: int = 0
    requests: int = 0
    served: int = 0
    last_pick: int = -1
    # The weight versions this replica has held, as far as the front knows (module docstring).
    versions: VersionHistory = field(default_factory=VersionHistory)


@dataclass
class LeastOutstanding:
    """Chooses the replica for each rollout and tracks what is in flight."""

    loads: list[Load]
    _ticks: itertools.count = field(default_factory=itertools.count)

    def holding(self, min_version: Version = None) -> list[Load]:
        """The serving replicas that hold ``min_version`` (all serving ones for ``None``)."""
        return [
            ld for ld in self.loads if ld.serving and (min_version is None or ld.versions.holds(min_version))
        ]

    def pick(self, work: int, min_version: Version = None) -> Load:
        """The serving replica with the least outstanding work among those holding ``min_version``;
        ``work`` is charged to it. The caller waits while none holds it (``holding``)."""
        if not any(ld.serving for ld in self.loads):
            raise ServiceUnavailableError("no replica is serving (all are starting, restarting or stopped)")
        candidates = self.holding(min_version)
        if not candidates:
            raise ServiceUnavailableError(f"no serving replica holds weight_version {min_version!r}")
        chosen = min(candidates, key=lambda ld: (ld.outstanding, ld.last_pick, ld.replica_id))
        chosen.outstanding += work
        chosen.requests += 1
        chosen.last_pick = next(self._ticks)
        return chosen

    def done(self, load: Load, work: int, ok: bool) -> None:
        load.outstanding -= work
        load.requests -= 1
        if ok:
            load.served += 1


def request_work(num_outputs: int | None, seeds: Sequence[int] | None) -> int:
    """A rollout's work for routing: its number of outputs."""
    if seeds:
        return len(seeds)
    return max(1, num_outputs or 1)


def ipc_entry_for(
    entries: Sequence[str], gpu_uuids: Sequence[str] | None, replica_uuids: Sequence[str]
) -> tuple[list[str], list[str] | None]:
    """The ``(serialized_named_tensors, payload_gpu_uuids)`` one replica receives.

    Without UUIDs every replica gets the payload as sent (each uses entry 0, like a single server).
    With UUIDs a replica gets only the entry on one of its GPUs, else entry 0 alone.
    """
    if not entries:
        raise WeightUpdateError("serialized_named_tensors is empty", field="serialized_named_tensors")
    if gpu_uuids is None:
        return list(entries), None
    if len(gpu_uuids) != len(entries):
        raise WeightUpdateError(
            f"payload_gpu_uuids has {len(gpu_uuids)} items but serialized_named_tensors has {len(entries)}",
            field="payload_gpu_uuids",
        )
    for uuid in replica_uuids:
        if uuid in gpu_uuids:
            i = list(gpu_uuids).index(uuid)
            return [entries[i]], [gpu_uuids[i]]
    return [entries[0]], None


def replica_ranks(rank_offset: int, world_size: int, num_replicas: int) -> list[int]:
    """Ranks of the replicas in a weight-update group: ``rank_offset .. rank_offset + n - 1``."""
    last = rank_offset + num_replicas - 1
    if rank_offset < 1 or last >= world_size:
        raise WeightUpdateError(
            f"this server has {num_replicas} replicas, which join as ranks rank_offset..rank_offset+"
            f"{num_replicas - 1}; with rank_offset {rank_offset} that needs world_size > {last}, got "
            f"{world_size} (read weight_update_ranks from /server_info)",
            field="world_size",
        )
    return list(range(rank_offset, last + 1))
