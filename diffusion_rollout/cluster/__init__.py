"""Replicas on Ray: one HTTP front over many engines, on one host or many (``serve --replicas N``).

Ray is imported only inside this subpackage, and only when a cluster starts; the single-process
server never imports it. Modules, one job each:

- ``engine``: ``ClusterEngine``, the single engine's interface (``server/engine_api.py``) over the
  replicas: start/join Ray, route rollouts (least outstanding work, one request on one replica),
  the dispatch gate, state, ``/server_info`` replicas and merged ``/metrics``.
- ``weights``: ``ClusterWeights``, the weight-manager facade that fans every update out to every
  replica (full weights in two phases: all or nothing), checks checksums agree, forms one update
  group of the trainer and every replica.
- ``replica``: ``ReplicaServer``, the actor body (one ``Engine`` + its ``WeightManager``), and
  ``replica_actor_class`` to make it a Ray actor with given resources.
- ``transactions``: prepare / commit / rollback / finish of a full-weight update on one replica.
- ``routing``: least-outstanding choice, IPC entry per replica GPU, update-group ranks (pure).
- ``metrics_merge``: totals plus per-replica series (a ``replica`` label) in one exposition text.
"""

from diffusion_rollout.cluster.engine import ClusterEngine, ray_session

__all__ = ["ClusterEngine", "ray_session"]
