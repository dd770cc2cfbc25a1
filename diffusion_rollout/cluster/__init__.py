"""Replicas on Ray: one HTTP front over many engines, on one host or many (``serve --replicas N``).

Ray is imported only inside this subpackage, and only when a cluster starts; the single-process
server never imports it. Modules, one job each:

- ``engine``: ``ClusterEngine``, the single engine's interface (``server/core/engine_api.py``) over the
  replicas: start/join Ray, route rollouts (least outstanding work, one request on one replica),
  the dispatch gate, state, ``/server_info`` replicas and merged ``/metrics``.
- ``weights``: ``ClusterWeights``, the weight-manager facade that fans every update out to every
  replica (full weights in two phases, LoRA changes with undo: all or nothing), checks checksums
  agree, forms one update group of the trainer and every replica; ``lora_fanout`` holds its LoRA
  changes (all or nothing, with undo) and ``fanout`` the plumbing both share (serving replicas,
  gathering answers, bytes in the object store once).
- ``replica``: ``ReplicaServer``, the actor body (one ``Engine`` + its ``WeightManager``), and
  ``replica_actor_class`` to make it a Ray actor with given resources.
- ``placement``: the resource check before replicas are created, and ``--placement``'s group.
- ``routing``: least-outstanding choice, IPC entry per replica GPU, update-group ranks (pure).
- ``metrics_merge``: totals plus per-replica series (a ``replica`` label) in one exposition text.

Weight sync itself (transports, prepare / commit / rollback on one replica, LoRA undo, a restarted
replica's copy of a peer's state) is the server's weights subsystem; the cluster reaches it only
through its facade, ``diffusion_rollout.server.weights`` and ``server.weights.transports``.

Trainers already on Ray place the replicas themselves and call them without HTTP::

    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from diffusion_rollout.cluster import ClusterEngine, replica_actor_class
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.request_params import to_params
    from diffusion_rollout.protocol.requests import GenerateRequest

    config = ServerConfig(model=path, replicas=len(bundles))
    front = ClusterEngine(config, actors=[
        replica_actor_class(num_gpus=1, num_cpus=1)
        .options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
        .remote(ClusterEngine(config).replica_config(), i)
        for i in range(len(bundles))
    ])
    front.start()                                       # loads the model on every replica
    outputs = await front.generate(to_params(GenerateRequest(prompt="...", seed=0), "rid-0"))
    await front.weights().update_from_distributed(...)  # every weight operation, fanned out

``front`` is what the HTTP app serves (``create_app(config, engine=front)`` gives the same endpoint);
each actor can also be called alone (``actor.generate.remote(params)``).
"""

from diffusion_rollout.cluster.engine import ClusterEngine
from diffusion_rollout.cluster.ray_support import ray_session
from diffusion_rollout.cluster.replica import ReplicaServer, replica_actor_class

__all__ = ["ClusterEngine", "ReplicaServer", "ray_session", "replica_actor_class"]
