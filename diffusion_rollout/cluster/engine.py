"""``ClusterEngine``: the single engine's interface (``server/core/engine_api.py``) over replicas on Ray.

The FastAPI app and its routers are the single server's; only the engine behind them changes
(``create_app`` builds this one when ``config.replicas`` is set).

Design decisions:

- **Ray only here.** ``ray`` is imported when a ``ClusterEngine`` starts, never by the
  single-process server. ``start()`` joins ``config.ray_address`` (``auto`` = a cluster started
  with ``ray start``), else starts a local Ray instance, unless the process already runs Ray
  (tests, trainers), which it then leaves running on ``stop()``.
- **Replicas.** ``config.replicas`` actors of :class:`~diffusion_rollout.cluster.replica.ReplicaServer`,
  each with ``gpus_per_replica`` GPUs (default ``context_parallel`` on a CUDA machine, 0 on a CPU one) and
  ``cpus_per_replica`` cores. Ray places them on any node of the cluster (its default scheduling),
  or, with ``config.placement``, in a placement group of one bundle per replica with the ``SPREAD``
  or ``PACK`` strategy; the model path must be readable on every node.
- **Rollouts.** Each request goes whole to the replica with the least outstanding work
  (``routing.LeastOutstanding``) and its results come back as the actor call's return value,
  through Ray's object store. A client that leaves cancels the actor call, which drops its queued
  work on the replica.
- **Updates.** See ``cluster/weights.py``: fan-out to every replica, full weights in two phases,
  the dispatch gate below held while replicas switch versions.
- **Dispatch gate.** While a fan-out update commits, new rollouts wait at the front before being
  sent anywhere (the single engine's queue barrier, lifted to the front): a request sent after an
  update was accepted runs on the new weights whichever replica takes it, one sent before runs
  entirely on the old ones (each replica's worker finishes its batch before applying).
- **State the front owns.** ``weight_version`` (set after every update to the version all replicas
  reported), ``status``, its own ``Metrics`` (HTTP responses, disconnects); ``metrics_text`` adds
  every replica's series (``cluster/metrics_merge.py``) and ``replica_info`` lists the replicas.
- **Faults.** Ray restarts a replica whose process dies (``replica_max_restarts``). The front
  marks it ``restarting`` (no rollouts, no updates), retries each of its lost requests once on
  another replica (a request either produced all its outputs or none, so a retry loses nothing and
  never mixes versions), then ``recovery.recover`` loads the model on the new process and, under the admin
  lock, copies the current weights, adapters and version from a serving peer
  (``server/weights/replica_state.py``) before the replica serves again (``syncing`` -> ``serving``). A replica
  Ray gave up on is ``dead``; with no serving peer to copy from it stays ``stale``. Update groups
  (NCCL) do not survive a restart: the trainer joins a new group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from diffusion_rollout.cluster.placement import Placement
from diffusion_rollout.cluster.ray_support import (
    ReplicaRestartedError,
    import_ray,
    ray_init_kwargs,
    replica_lost,
    unwrap,
)
from diffusion_rollout.cluster.recovery import learn_versions, recover
from diffusion_rollout.cluster.routing import LeastOutstanding, Load, request_work
from diffusion_rollout.config import ServerConfig
from diffusion_rollout.errors import (
    NotReadyError,
    RequestError,
    ServiceUnavailableError,
)
from diffusion_rollout.protocol.weight_versions import VersionGate
from diffusion_rollout.server.core.engine_api import QueueStats
from diffusion_rollout.server.core.metrics import Metrics
from diffusion_rollout.server.core.params import GenerateParams, SampleResult

logger = logging.getLogger(__name__)


class ReplicaLostError(ServiceUnavailableError):
    """The replica running a call died; the call may be retried once elsewhere (503 if it escapes)."""


class DispatchGate:
    """Open: rollouts are dispatched. Closed while a fan-out update switches the replicas' weights."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()

    async def wait(self) -> None:
        await self._open.wait()

    @contextlib.asynccontextmanager
    async def closed(self):
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()


@dataclass
class Replica:
    """The front's handle on one replica actor."""

    replica_id: int
    actor: Any
    load: Load
    info: dict[str, Any] = field(default_factory=dict)
    state: str = "serving"  # serving | restarting | syncing | stale | dead


class ClusterEngine:
    """Replicas of ``Engine`` as Ray actors behind one front; see the module docstring."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        pipeline_factory: Any = None,
        actors: list[Any] | None = None,
        upload_listener: Any = None,
    ) -> None:
        """``pipeline_factory``: a picklable callable each replica calls to build its pipeline
        (instead of loading ``config.model``); see ``ReplicaServer``.

        ``upload_listener``: the class each replica opens its upload port with when
        ``config.upload_port`` is set (``entrypoints.upload_listener.UploadListener``; the HTTP app
        passes it).

        ``actors``: replica actors the caller created and placed itself (a trainer on Ray puts them
        in its own placement groups, next to its training ranks: ``replica_actor_class(...)
        .options(...).remote(engine.replica_config(), i)``). The front adopts them in this order,
        starts their engines, and on ``stop`` leaves them to their owner."""
        if not config.replicas:
            raise ValueError("ClusterEngine needs config.replicas >= 1")
        if actors is not None and len(actors) != config.replicas:
            raise ValueError(f"config.replicas is {config.replicas} but {len(actors)} actors were given")
        self.config = config
        self.pipeline_factory = pipeline_factory
        self.upload_listener = upload_listener
        self._adopted = list(actors) if actors is not None else None
        self.status = "loading"
        self.metrics = Metrics()
        self.model_path: str | None = config.model
        self.started_at = time.time()
        self.last_generate_ok_at: float | None = None
        self.replicas: list[Replica] = []
        self.router = LeastOutstanding([])
        self.gate = DispatchGate()
        self.module_names: list[str] = []
        self.updates_applied = 0
        self.user_paused = False
        self._weight_version: Any = 0
        self._owns_ray = False
        self.placement = Placement(config)  # config.placement's group, removed on stop
        self._shutdown_deadline: float | None = None
        self._admin_lock: asyncio.Lock | None = None
        self._model_info: dict[str, Any] = {}
        # Modules that full updates changed since start: what a restarted replica copies from a peer.
        self.touched_modules: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        # Requests wait at the front for a serving replica holding their min_weight_version.
        self.version_gate = VersionGate(
            lambda v: bool(self.router.holding(v)),
            lambda: [r.load.versions for r in self.replicas],
            lambda: (
                "serving replicas hold "
                + ", ".join(f"replica {r.replica_id}: {r.load.versions.current!r}" for r in self.serving())
            ),
            on_timeout=lambda: self.metrics.request_cancelled("timeout"),
        )
        from diffusion_rollout.cluster.weights import ClusterWeights

        self._weights = ClusterWeights(self)

    # ------------------------------------------------------------------ lifecycle
    def replica_config(self) -> ServerConfig:
        """What each replica's engine is configured with: the front's config on its own device."""
        gpus = self.config.resolved_gpus_per_replica()
        device = "cuda" if gpus > 0 else "cpu"
        return self.config.model_copy(update={"replicas": None, "device": device, "ray_address": None})

    def start(self) -> None:
        """Blocking: start or join Ray, create the replicas, load the model on each."""
        from diffusion_rollout.cluster.replica import replica_actor_class

        ray = import_ray()
        if not ray.is_initialized():
            # Best started by the caller in the main thread (``ray_session``); see there why.
            ray.init(**ray_init_kwargs(self.config))
            self._owns_ray = True
        gpus = self.config.resolved_gpus_per_replica()
        if gpus > self.config.context_parallel:
            # Only context parallelism spreads one engine over several GPUs (one per rank).
            logger.warning(
                "gpus_per_replica=%g > context_parallel=%d: each engine uses %d GPU(s) only",
                gpus,
                self.config.context_parallel,
                self.config.context_parallel,
            )
        actor_cls = replica_actor_class(
            num_gpus=gpus,
            num_cpus=self.config.cpus_per_replica,
            max_restarts=self.config.replica_max_restarts,
        )
        rcfg = self.replica_config()
        n = self.config.replicas
        logger.info(
            "starting %d replicas (%g GPU, %g CPU each) on Ray", n, gpus, self.config.cpus_per_replica
        )
        actors: list[Any] = list(self._adopted or [])
        try:
            if self._adopted is None:
                self.placement.check_resources(ray, n, gpus)
                options = self.placement.options(ray, n, gpus)
                actors = [
                    actor_cls.options(**options[i]).remote(
                        rcfg, i, self.pipeline_factory, self.upload_listener
                    )
                    for i in range(n)
                ]
            infos = ray.get([a.start.remote() for a in actors])
        except BaseException:
            # Nothing half-started stays behind (adopted actors stay their owner's).
            for actor in actors if self._adopted is None else []:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
            self.placement.remove()
            if self._owns_ray:
                ray.shutdown()
            raise
        self.replicas = [
            Replica(i, actor, Load(i), info)
            for i, (actor, info) in enumerate(zip(actors, infos, strict=True))
        ]
        for r in self.replicas:
            learn_versions(r)
        self.router = LeastOutstanding([r.load for r in self.replicas])
        self.module_names = list(infos[0]["module_names"])
        self._model_info = dict(infos[0]["model_info"])
        self.status = "ready"
        for info in infos:
            logger.info(
                "replica %d ready on %s (%s, pid %d)",
                info["replica_id"],
                info["node"],
                info["device"],
                info["pid"],
            )

    def begin_shutdown(self, grace_s: float | None = None) -> float:
        if self._shutdown_deadline is None:
            grace = self.config.shutdown_grace_s if grace_s is None else grace_s
            self._shutdown_deadline = time.monotonic() + grace
            self.status = "stopping"
        return self._shutdown_deadline

    def stop(self, grace_s: float | None = None) -> None:
        """Drain every replica until the shutdown deadline, end the actors (and Ray, if started here)."""
        deadline = self.begin_shutdown(grace_s)
        if not self.replicas:
            return
        ray = import_ray()
        for task in list(self._tasks):
            task.get_loop().call_soon_threadsafe(task.cancel)
        if self._adopted is not None:
            # The owner's actors: the front lets go of them and leaves them serving.
            self.replicas = []
            logger.info("cluster front stopped; %d adopted replicas left to their owner", len(self._adopted))
            return
        left = max(0.0, deadline - time.monotonic())
        refs = [r.actor.stop.remote(left) for r in self.replicas if r.state == "serving"]
        with contextlib.suppress(Exception):
            ray.get(refs, timeout=left + 10)
        for r in self.replicas:
            with contextlib.suppress(Exception):
                ray.kill(r.actor)
        self.replicas = []
        self.placement.remove()
        if self._owns_ray:
            ray.shutdown()
        logger.info("cluster stopped")

    # ------------------------------------------------------------------ state
    @property
    def weight_version(self) -> Any:
        return self._weight_version

    def set_weight_version(self, version: Any) -> None:
        """After an update every replica applied: the front's version is theirs."""
        self._weight_version = version
        for r in self.serving():  # they all applied it (cluster/weights.py calls this after a fan-out)
            r.load.versions.record(version)
        self.updates_applied += 1
        self.metrics.weight_updated()

    @property
    def admin_lock(self) -> asyncio.Lock:
        # Created on first use, inside the serving event loop.
        if self._admin_lock is None:
            self._admin_lock = asyncio.Lock()
        return self._admin_lock

    def serving(self) -> list[Replica]:
        return [r for r in self.replicas if r.state == "serving"]

    def replica_died(self, replica: Replica, exc: BaseException) -> None:
        """A call found the actor dead: no rollouts or updates for it until restarted and re-synced."""
        replica.load.serving = False
        if replica.state in ("restarting", "syncing", "dead") or self.status == "stopping":
            return
        logger.error(
            "replica %d died (%s); waiting for Ray to restart it", replica.replica_id, type(exc).__name__
        )
        self.start_recovery(replica)

    def start_recovery(self, replica: Replica) -> None:
        replica.state = "restarting"
        task = asyncio.get_running_loop().create_task(recover(self, replica))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def model_info(self) -> dict[str, Any]:
        return {
            **self._model_info,
            "devices": [r.info.get("device") for r in self.replicas],
            "weight_version": self.weight_version,
            "status": self.status,
            "num_replicas": len(self.replicas),
            # Ranks this front takes in a weight-update group (one per replica; WeightBroadcaster).
            "weight_update_ranks": len(self.replicas),
            "placement": self.config.placement,  # None: Ray's default scheduling
            "replica_upload_urls": self.replica_upload_urls(),
        }

    def replica_upload_urls(self) -> list[str] | None:
        """Every serving replica's own upload port (``--upload-port``): the client sends each
        full-weight part to all of them, then the final part here. None unless every serving
        replica has one (a replica without the parts would refuse the commit)."""
        live = self.serving()
        urls = [r.info.get("upload_url") for r in live]
        return urls if live and all(urls) else None

    def speed_info(self) -> dict[str, Any]:
        """The speed options in force on the replicas (all run the same config; replica 0's report)."""
        return dict(self.replicas[0].info.get("speed", {})) if self.replicas else {}

    def queue_stats(self) -> QueueStats:
        # The front's view: requests dispatched and not answered (waiting or running on a replica).
        outstanding = sum(r.load.requests for r in self.replicas)
        return QueueStats(depth=outstanding, busy=outstanding > 0, paused=self.user_paused)

    async def _each(self, replicas: list[Replica], call) -> list[Any]:
        """``call(replica)`` (an ObjectRef) on each replica at once; results or exceptions, in order."""
        refs = [call(r) for r in replicas]
        return await asyncio.gather(*refs, return_exceptions=True)

    async def replica_info(self) -> list[dict[str, Any]]:
        # Only serving replicas are asked: a call to a restarting one would wait for its model load.
        live = self.serving()
        answers = await self._each(live, lambda r: r.actor.info.remote())
        for r, a in zip(live, answers, strict=True):
            if isinstance(a, BaseException) and replica_lost(a):
                self.replica_died(r, a)
            elif isinstance(a, dict) and a.get("awaiting_resync"):
                # Ray restarted it and nothing the front sent failed yet: recover it now.
                self.replica_died(
                    r, ReplicaRestartedError(f"replica {r.replica_id} restarted (pid {a['pid']})")
                )
            elif not isinstance(a, BaseException):
                r.info = a
                learn_versions(r)
        return [
            {
                "replica_id": r.replica_id,
                "state": r.state,
                "node": r.info.get("node"),
                "node_id": r.info.get("node_id"),
                "pid": r.info.get("pid"),
                "device": r.info.get("device"),
                "gpu_uuids": r.info.get("gpu_uuids", []),
                "weight_version": r.info.get("weight_version"),
                "status": r.info.get("status") if r.state == "serving" else r.state,
                "queue_depth": r.info.get("queue_depth"),
                "outstanding_requests": r.load.requests,
                "served_requests": r.load.served,
                # The replica's own upload port: parts received, and where its time went.
                "upload_parts_received": r.info.get("upload_parts_received", 0),
                "upload_port_seconds": r.info.get("upload_port_seconds", {}),
            }
            for r in self.replicas
        ]

    async def metrics_text(self) -> str:
        from diffusion_rollout.cluster.metrics_merge import merge

        stats = self.queue_stats()
        front = self.metrics.render(
            queue_depth=stats.depth,
            busy=stats.busy,
            paused=stats.paused,
            status=self.status,
            weight_version=self.weight_version,
        )
        live = self.serving()
        texts = await self._each(live, lambda r: r.actor.metrics_text.remote())
        pairs = [(str(r.replica_id), t) for r, t in zip(live, texts, strict=True) if isinstance(t, str)]
        return merge(front, pairs)

    def weights(self):
        return self._weights

    # ------------------------------------------------------------------ rollouts
    def _check_ready(self) -> None:
        if self.status == "loading":
            raise NotReadyError("replicas are still loading", state="loading")
        if self.status == "released":
            raise NotReadyError(
                "model memory is released; POST /resume_memory_occupation first", state="released"
            )
        if self.status == "stopping":
            raise NotReadyError("server is shutting down", state="stopping")
        if self.status != "ready":
            raise ServiceUnavailableError(f"model is not ready ({self.status}); see the server log")

    async def _on_replica(self, work: int, call, params: GenerateParams | None = None) -> Any:
        """Dispatch ``call(replica)`` to the least loaded serving replica (holding the request's
        ``min_weight_version``) once the gate is open."""
        await self.gate.wait()
        wanted = None
        if params is not None and params.min_weight_version is not None:
            wanted = params.min_weight_version
            if self.serving():  # else pick() answers 503
                timeout = self.config.request_timeout_s
                await self.version_gate.admit(
                    params.request_id,
                    wanted,
                    params.min_weight_version_wait,
                    time.monotonic() + timeout,
                    timeout,
                )
            await self.gate.wait()  # an update may have started committing while this one waited
        replica = self.replicas[self.router.pick(work, wanted).replica_id]
        ref = call(replica)
        ok = False
        try:
            result = await ref
            ok = True
            return result
        except asyncio.CancelledError:
            # The client left: cancelling the actor call cancels the replica's wait, which drops
            # its queued work (a running batch finishes, as in one process).
            import_ray().cancel(ref)
            raise
        except Exception as exc:
            if replica_lost(exc):
                self.replica_died(replica, exc)
                raise ReplicaLostError(
                    f"replica {replica.replica_id} died while running this request; no output was produced"
                ) from None
            raise unwrap(exc) from None
        finally:
            self.router.done(replica.load, work, ok)

    async def _retried_once(
        self, work: int, call, request_id: str, params: GenerateParams | None = None
    ) -> Any:
        try:
            return await self._on_replica(work, call, params)
        except ReplicaLostError as exc:
            # Nothing of the request was produced (its outputs come back together or not at all):
            # run it again, whole, on a serving replica.
            logger.warning("request %s: %s; retrying once on another replica", request_id, exc.message)
            return await self._on_replica(work, call, params)

    async def generate(self, params: GenerateParams) -> list[SampleResult]:
        self._check_ready()
        work = request_work(params.num_outputs_per_prompt, params.seeds)
        results = await self._retried_once(
            work, lambda r: r.actor.generate.remote(params), params.request_id, params
        )
        self.last_generate_ok_at = time.time()
        return results

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> dict[str, Any]:
        """``/abort_request`` on every serving replica: each drops the queued work of ``rid`` (a
        request waits on exactly one replica); a batch already running finishes."""
        if not abort_all and not rid:
            raise RequestError("send the rid of the request to abort, or abort_all=true", field="rid")
        waiting = self.version_gate.abort(rid, abort_all)
        results = await self._each(self.serving(), lambda r: r.actor.abort.remote(rid, abort_all=abort_all))
        done = [res for res in results if isinstance(res, dict)]
        return {
            "rid": rid,
            "abort_all": abort_all,
            "dropped": waiting + sum(res["dropped"] for res in done),
            "running": sum(res["running"] for res in done),
        }

    async def readiness_probe(self) -> None:
        self._check_ready()
        await self._retried_once(1, lambda r: r.actor.readiness_probe.remote(), "health_generate")
        self.last_generate_ok_at = time.time()
