"""One replica: an ``Engine`` and its ``WeightManager`` inside a Ray actor.

Design decisions:

- :class:`ReplicaServer` is a plain class (no Ray import): the actor is made from it by
  :func:`replica_actor_class`, which sets the resources (``num_gpus``, ``num_cpus``). Ray gives the
  actor its GPU(s) through ``CUDA_VISIBLE_DEVICES``, so the engine's device is plain ``cuda``.
  Trainers that place actors themselves (placement groups, colocated with training ranks) can use
  the same class with their own ``.options(...)``.
- It is an async actor: ``generate`` awaits the engine in the actor's event loop, so many rollouts
  are in flight on one replica at once and the engine batches them exactly as in one process.
  Blocking work (model load, shutdown) runs in threads so the loop keeps answering.
- Results travel back as the method's return value, i.e. through Ray's object store; tensors are
  returned as they are (CPU tensors), so the front's HTTP encoding is the single server's.
- Weight operations: everything but full-weight updates is a plain call on the manager
  (:meth:`ReplicaServer.manager_call`, a fixed list of names); full-weight updates go through
  the weight-sync interface, ``server.weights.transports`` (a transport's prepare, then commit /
  rollback / finish, one call each) so the front can apply them on all replicas or on none; LoRA
  changes go through :class:`~diffusion_rollout.server.weights.LoraTransactions` (``lora_change`` /
  ``lora_rollback`` / ``lora_finish``) for the same reason. Bytes the front put in
  the object store once (HTTP uploads) arrive as the ``data`` argument: Ray resolves a top-level
  ``ObjectRef`` argument to its value in this process.
- Restarts: Ray re-runs ``__init__`` in a new process; the front calls ``start`` again and then
  ``import_state`` with a serving peer's ``export_state`` (``server/weights/replica_state.py``) and ``mark_synced``.
  Until then a restarted process (Ray says so: ``was_current_actor_reconstructed``) refuses rollouts
  and weight calls with ``ReplicaRestartedError``: Ray routes calls to it as soon as it is up, maybe
  before the front learnt of the death, and it holds the model folder's weights, not the cluster's.
- Errors are the project's exceptions; Ray carries them to the front wrapped in ``RayTaskError``
  and the front re-raises the original (``cluster.ray_support.unwrap``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from diffusion_rollout.cluster.ray_support import ReplicaRestartedError
from diffusion_rollout.config import ServerConfig
from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.server.core.engine import Engine
from diffusion_rollout.server.core.params import GenerateParams, SampleResult
from diffusion_rollout.server.weights import (
    Lease,
    LoraTransactions,
    export_state,
    get_weight_manager,
    import_state,
    unpooled,
)

logger = logging.getLogger(__name__)

# Manager methods the front may call on every replica as they are (no two-phase needed).
MANAGER_CALLS = frozenset(
    {
        "upload_part",  # non-final parts only: they stage, they do not apply
        "refuse_part",  # a part cut short at the front: its upload is dropped, nothing staged
        "update_from_tensor",  # lora_merge payloads only (full weights go through prepare/commit)
        "load_lora_tensors",  # set_lora_from_tensor: the decoded adapter tensors travel in kwargs
        "init_group",
        "destroy_group",
        "checksums",
        "check_tensors",
        "load_lora",
        "activate_lora",
        "set_lora_mode",
        "unload_lora",
        "describe_lora",
        "pause_generation",
        "continue_generation",
        "release_memory",
        "resume_memory",
    }
)
# Which keyword a ``data`` argument fills, per method.
DATA_KEYWORD = {"upload_part": "body", "load_lora": "data"}


def _gpu_uuids() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # not inside Ray
        return socket.gethostbyname(socket.gethostname())


def _restarted() -> bool:
    """Whether Ray re-created this actor after its process died (False outside Ray)."""
    try:
        import ray

        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # not inside a Ray actor (a plain ReplicaServer in a test)
        return False


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # not inside Ray (a plain ReplicaServer in a test)
        return None


class ReplicaServer:
    """The body of a replica actor: one engine, its weight manager, two-phase full updates."""

    def __init__(
        self,
        config: ServerConfig,
        replica_id: int,
        pipeline_factory: Callable[[], Any] | None = None,
        upload_listener: Callable[..., Any] | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.config = config
        # Builds the pipeline in this process instead of loading config.model (benchmarks with
        # random-weight architectures, trainers that hold a pipeline object); must be picklable.
        self.pipeline_factory = pipeline_factory
        # What opens this replica's upload port (config.upload_port): the HTTP layer hands its
        # listener class down (Ray pickles it by name), so the cluster imports nothing above it.
        self.upload_listener_class = upload_listener
        self.engine = Engine(config)
        self.manager = get_weight_manager(self.engine)
        self.transactions = self.manager.transactions
        self.lora_transactions = LoraTransactions(self.manager)
        self._lora_fault = False  # inject_lora_fault
        self.upload_listener = None  # this replica's own upload port (with --upload-port)
        # A restarted process takes no work until the front has copied the cluster's state into it.
        self.awaiting_resync = _restarted()

    def _admit(self, what: str) -> None:
        if self.awaiting_resync:
            raise ReplicaRestartedError(
                f"replica {self.replica_id} was restarted (pid {os.getpid()}) and is not re-synced yet; "
                f"it takes no {what}"
            )

    def mark_synced(self) -> None:
        """The front's recovery copied the cluster's state here (or there was none to copy)."""
        self.awaiting_resync = False

    # ------------------------------------------------------------------ lifecycle and state
    async def start(self) -> dict[str, Any]:
        """Load the model and start the worker; returns :meth:`info`."""
        if self.engine.status == "loading":
            if self.pipeline_factory is not None and self.engine.loaded is None:
                await asyncio.to_thread(self._build_pipeline)
            await asyncio.to_thread(self.engine.start)
        self._open_upload_port()
        return self.info()

    def _open_upload_port(self) -> None:
        """With ``--upload-port``, every replica receives full-weight parts on a port of its own
        (a free one: replicas may share a host), straight into its staging area; the front only
        commits. Trainers find the ports in the front's ``/model_info`` (``replica_upload_urls``)."""
        if self.config.upload_port is None or self.upload_listener is not None:
            return
        if self.upload_listener_class is None:
            raise ValueError(
                "upload_port is set but this replica was given no upload listener: pass "
                "upload_listener=UploadListener (diffusion_rollout.entrypoints.upload_listener) to "
                "ClusterEngine, or as the replica actor's fourth argument"
            )
        listener = self.upload_listener_class(
            self.config, self.engine, asyncio.get_running_loop(), 0, stage_only=True, host=self.config.host
        )
        listener.start()
        self.upload_listener = listener

    def upload_url(self) -> str | None:
        """Where trainers reach this replica's upload port (the node's address when bound to all)."""
        listener = self.upload_listener
        if listener is None or not listener.running:
            return None
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = _node_ip()
        return f"http://{'[' + host + ']' if ':' in host else host}:{listener.port}"

    def _build_pipeline(self) -> None:
        from diffusion_rollout.server.core.loader import prepare_pipeline

        cfg = self.config
        self.engine.loaded = prepare_pipeline(
            self.pipeline_factory(),
            device=self.engine.device,
            compile=cfg.compile,
            attention_backend=cfg.attention_backend,
            quantize=cfg.quantize,
            cuda_graphs=cfg.cuda_graphs,
            cuda_graph_max_buckets=cfg.cuda_graph_max_buckets,
        )

    async def stop(self, grace_s: float | None = None) -> None:
        if self.upload_listener is not None:
            await asyncio.to_thread(self.upload_listener.stop)
            self.upload_listener = None
        await asyncio.to_thread(self.engine.stop, grace_s)

    def info(self) -> dict[str, Any]:
        stats = self.engine.queue_stats()
        ready = self.engine.adapter is not None
        return {
            "replica_id": self.replica_id,
            "node": socket.gethostname(),
            "node_id": _node_id(),
            "pid": os.getpid(),
            "device": self.engine.device,
            "gpu_uuids": _gpu_uuids() if self.engine.device.startswith("cuda") else [],
            "weight_version": self.engine.weight_version,
            "weight_versions": self.engine.versions.as_list(),
            "status": self.engine.status,
            "queue_depth": stats.depth,
            "busy": stats.busy,
            "paused": stats.paused,
            "model_info": self.engine.model_info(),
            "speed": self.engine.speed_info(),
            "module_names": self.manager.module_names() if ready else [],
            "upload_url": self.upload_url(),
            "upload_parts_received": self.upload_listener.stats.parts if self.upload_listener else 0,
            "upload_port_seconds": self._upload_seconds(),
            "awaiting_resync": self.awaiting_resync,
        }

    def _upload_seconds(self) -> dict[str, float]:
        """Where this replica's upload port spent its time, summed over connections."""
        stats = self.upload_listener.stats if self.upload_listener else None
        return {k: round(getattr(stats, k), 4) if stats else 0.0 for k in ("lease_s", "recv_s", "apply_s")}

    async def metrics_text(self) -> str:
        return await self.engine.metrics_text()

    # ------------------------------------------------------------------ rollouts
    async def generate(self, params: GenerateParams) -> list[SampleResult]:
        self._admit("rollouts")
        return await self.engine.generate(params)

    async def readiness_probe(self) -> None:
        self._admit("rollouts")
        await self.engine.readiness_probe()

    async def abort(self, rid: str | None, abort_all: bool = False) -> dict[str, Any]:
        return await self.engine.abort(rid, abort_all=abort_all)

    # ------------------------------------------------------------------ weights
    def _lease(self, data: Any) -> Lease:
        """Object-store bytes copied once into this replica's receive pool (pinned on CUDA)."""
        view = memoryview(data).cast("B")
        if not view.nbytes:
            return unpooled(b"")
        lease = self.manager.receive_buffers.lease(view.nbytes)
        lease.writable()[:] = view
        return lease

    async def manager_call(self, method: str, kwargs: dict[str, Any], data: Any = None) -> Any:
        if method not in MANAGER_CALLS:
            raise WeightUpdateError(f"replica method {method!r} is not a fan-out operation")
        self._admit("weight calls")
        if data is not None:
            kwargs = {**kwargs, DATA_KEYWORD[method]: self._lease(data)}
        return await getattr(self.manager, method)(**kwargs)

    async def prepare(self, txn: str, source: str, kwargs: dict[str, Any], data: Any = None) -> str:
        """Receive a full-weight update through the transport ``source`` and validate it; nothing
        is applied."""
        self._admit("weight updates")
        kwargs = dict(kwargs)
        flush_cache = kwargs.pop("flush_cache", True)
        lease = self._lease(data) if data is not None else None
        return await self.transactions.prepare(txn, source, kwargs, data=lease, flush_cache=flush_cache)

    async def commit(self, txn: str, weight_version: Any) -> Any:
        return await self.transactions.commit(txn, weight_version)

    async def rollback(self, txn: str) -> bool:
        return await self.transactions.rollback(txn)

    def finish(self, txn: str) -> None:
        self.transactions.finish(txn)

    async def lora_change(self, txn: str, method: str, kwargs: dict[str, Any], data: Any = None) -> Any:
        """A LoRA change (``manager_call``) that :meth:`lora_rollback` can undo until :meth:`lora_finish`."""
        self._admit("LoRA changes")

        async def change() -> Any:
            if self._lora_fault:
                self._lora_fault = False
                raise RuntimeError(f"injected LoRA fault in {method}")
            return await self.manager_call(method, kwargs, data)

        return await self.lora_transactions.apply(txn, method, kwargs, change)

    async def lora_rollback(self, txn: str) -> bool:
        return await self.lora_transactions.rollback(txn)

    def lora_finish(self, txn: str) -> None:
        self.lora_transactions.finish(txn)

    async def export_state(self, modules: list[str]) -> dict[str, Any]:
        """This replica's weights, adapters and version, for a restarted peer (``resync``)."""
        self._admit("state exports (it holds the model folder's weights, not the cluster's)")
        return await self.engine.run_exclusive(lambda: export_state(self.manager, modules))

    async def import_state(self, state: dict[str, Any]) -> Any:
        """Take a serving peer's weights, adapters and version (after a restart)."""
        return await self.engine.run_exclusive(lambda: import_state(self.manager, state))

    def inject_copy_fault(self) -> None:
        """Fault injection for tests: the next in-place weight copy on this replica raises once."""

        def fail_once(module: str, name: str) -> None:
            self.manager.before_copy = None
            raise RuntimeError(f"injected copy fault at {module}.{name}")

        self.manager.before_copy = fail_once

    def inject_lora_fault(self) -> None:
        """Fault injection for tests: the next LoRA change on this replica fails once (before it
        applies, after its undo state was captured)."""
        self._lora_fault = True


def replica_actor_class(*, num_gpus: float, num_cpus: float, max_restarts: int = 0):
    """``ReplicaServer`` as a Ray actor class with these resources (``.remote(config, replica_id)``).

    ``max_restarts``: how often Ray restarts a replica whose process died (it comes back with the
    model from disk; the front re-syncs its weights from a peer). Calls in flight when it died fail
    (no automatic task retries: the front decides what may be retried)."""
    import ray

    return ray.remote(num_gpus=num_gpus, num_cpus=num_cpus, max_restarts=max_restarts, max_task_retries=0)(
        ReplicaServer
    )
