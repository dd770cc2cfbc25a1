"""Cluster scaling: Flow-GRPO throughput with 1, 2, ... replicas, and full weights reaching every replica.

One command runs the whole set on the GPU machine (``nvidia-h200-x2``: replicas 1 and 2):

    python -m benchmarks.cluster_scaling --device cuda --model sd3.5-medium --replicas 1,2 --out $OUT

For each replica count ``n`` a cluster of ``n`` replicas (one GPU each; every replica builds the
architecture with random weights in its own process, same seed: ``ClusterEngine``'s
``pipeline_factory``) serves the normal app on a loopback port, and:

- ``throughput``: ``requests_per_replica * n`` Flow-GRPO group requests (16 outputs, SDE rollout
  with log-probs and the trajectory, float32 images) from ``clients_per_replica * n`` concurrent
  clients in another process (``RemoteClients``), after one warm-up request per replica; images
  per second and the ratio to the first replica count. Target: 2 replicas >= 1.9x one.
- ``update_http``: the transformer as one safetensors body posted to ``/update_weights`` once; the
  front puts it in the object store once and every replica applies it (two phases): seconds, GB/s.
- ``broadcast``: the project's ``WeightBroadcaster`` (trainer rank 0 in this process) broadcasting
  the transformer once to every replica (NCCL on GPUs, gloo on the CPU): seconds, GB/s. NCCL needs
  one GPU per rank, so the trainer needs a GPU that no replica holds: with ``n`` equal to the GPU
  count the row says it was skipped (on two GPUs the NCCL figure comes from ``n=1``).

``--tiny`` runs the same on the CPU with the tiny SD3 and CPU replicas (a dry run: the numbers mean
nothing). Results: a table and ``cluster_scaling.json`` under ``--out``.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

import torch

from benchmarks.cli import base_parser, quiet_libraries, resolve_device
from benchmarks.loopback import LoopbackServer
from benchmarks.report import document, log, print_table, write_json

PROMPT = "a watercolor painting of a lighthouse at dusk"
GRPO = {
    "rollout": True,
    "rollout_sde_type": "sde",
    "rollout_noise_level": 0.7,
    "rollout_return_dit_trajectory": True,
    "rollout_debug_mode": False,
}
COLUMNS = [  # (key, header, format)
    ("phase", "phase", ""),
    ("replicas", "replicas", ""),
    ("images_per_s", "images/s", ".2f"),
    ("ratio", "ratio", ".3f"),
    ("seconds", "seconds", ".3f"),
    ("gb", "GB", ".3f"),
    ("gb_per_s", "GB/s", ".2f"),
    ("note", "note", ""),
]


def build_pipeline(name: str, dtype: str, seed: int = 0) -> Any:
    """Runs in each replica process: the pipeline on that replica's device (``cuda`` = its GPU)."""
    dt = getattr(torch, dtype)
    if name.startswith("tiny-"):
        from diffusion_rollout.models import build_tiny_pipeline

        pipe = build_tiny_pipeline(name.removeprefix("tiny-"), seed)
        return pipe.to(dtype=dt) if dt != torch.float32 else pipe
    from benchmarks.model_builders import build_real_pipeline

    return build_real_pipeline(name, "cuda", dt, seed)


def request_defaults(name: str) -> dict[str, Any]:
    from benchmarks.model_builders import REAL_DEFAULTS, _tiny_defaults

    return dict(
        _tiny_defaults(name.removeprefix("tiny-")) if name.startswith("tiny-") else REAL_DEFAULTS[name]
    )


def _throughput(srv: LoopbackServer, body: dict[str, Any], n: int, args) -> dict[str, Any]:
    remote = srv.remote()
    remote.run([{**body, "seed": 10_000 + i} for i in range(n)], n)  # warm-up: one per replica
    count = args.requests_per_replica * n
    bodies = [{**body, "prompt": f"{PROMPT}, variation {i}", "seed": 1000 * i} for i in range(count)]
    reply = remote.run(bodies, args.clients_per_replica * n)
    images = count * args.group
    served = [r["served_requests"] for r in srv.client.get("/server_info").json()["replicas"]]
    return {
        "phase": "throughput",
        "replicas": n,
        "images": images,
        "seconds": reply["seconds"],
        "images_per_s": images / reply["seconds"],
        "served_requests": served,
    }


def _update_http(srv: LoopbackServer, engine, n: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    import ray
    from safetensors.torch import save

    state = ray.get(engine.replicas[0].actor.export_state.remote(["transformer"]))
    tensors = {name: t.contiguous() for name, t in state["modules"]["transformer"]}
    data = save(tensors)
    t0 = time.perf_counter()
    srv.post_bytes(
        "/update_weights", data, params={"target_module": "transformer", "weight_version": f"http-{n}"}
    )
    seconds = time.perf_counter() - t0
    gb = len(data) / 1e9
    return {
        "phase": "update_http",
        "replicas": n,
        "seconds": seconds,
        "gb": gb,
        "gb_per_s": gb / seconds,
    }, tensors


def _broadcast(
    srv: LoopbackServer, engine, n: int, tensors: dict[str, torch.Tensor], device: str
) -> dict[str, Any]:
    from diffusion_rollout.client import RolloutClient, WeightBroadcaster
    from diffusion_rollout.protocol.weight_transport import join_group  # noqa: F401  (fails early if torch lacks it)

    row: dict[str, Any] = {"phase": "broadcast", "replicas": n}
    backend, trainer_device = "gloo", "cpu"
    if device.startswith("cuda"):
        taken = {u for r in engine.replicas for u in r.info.get("gpu_uuids", [])}
        free = [
            i
            for i in range(torch.cuda.device_count())
            if str(torch.cuda.get_device_properties(i).uuid) not in taken
        ]
        if not free:
            row["note"] = "skipped: every GPU holds a replica (NCCL needs one GPU per rank)"
            return row
        backend, trainer_device = "nccl", f"cuda:{free[0]}"
        torch.cuda.set_device(free[0])
    on_device = {name: t.to(trainer_device) for name, t in tensors.items()}
    gb = sum(t.numel() * t.element_size() for t in on_device.values()) / 1e9
    from diffusion_rollout.testing import free_port

    with RolloutClient(srv.url, timeout=1200.0) as client, WeightBroadcaster(
        client, master_address="127.0.0.1", master_port=free_port(), backend=backend, timeout_s=600,
        device=trainer_device,
    ) as b:  # fmt: skip
        b.broadcast(on_device, weight_version=f"bcast-{n}", verify=False)  # warm-up: communicators
        if trainer_device.startswith("cuda"):
            torch.cuda.synchronize(trainer_device)
        t0 = time.perf_counter()
        b.broadcast(on_device, weight_version=f"bcast2-{n}", verify=False)
        seconds = time.perf_counter() - t0
    sums = srv.client.post("/get_weights_checksum", json={"module_names": ["transformer"]})
    row.update(
        seconds=seconds,
        gb=gb,
        gb_per_s=gb / seconds,
        note=f"{backend}, trainer on {trainer_device}; replicas agree: {sums.status_code == 200}",
    )
    return row


def run_count(n: int, args, device: str, factory, body: dict[str, Any]) -> list[dict[str, Any]]:
    from diffusion_rollout.cluster import ClusterEngine
    from diffusion_rollout.config import ServerConfig

    config = ServerConfig(
        device=device,
        dtype=args.dtype,
        replicas=n,
        gpus_per_replica=1 if device.startswith("cuda") else 0,
        max_outputs_per_request=64,
        max_batch_size=args.group,
        log_level="warning",
        pipeline_lanes=1,  # the baseline its rows were measured with (before --speed exact's lanes)
    )
    engine = ClusterEngine(config, pipeline_factory=factory)
    t0 = time.perf_counter()
    engine.start()
    log(f"{n} replica(s) up in {time.perf_counter() - t0:.1f} s")
    srv = LoopbackServer(engine, config)
    rows = []
    try:
        rows.append(_throughput(srv, body, n, args))
        row, tensors = _update_http(srv, engine, n)
        rows.append(row)
        rows.append(_broadcast(srv, engine, n, tensors, device))
    finally:
        srv.close()
        engine.stop(grace_s=10)
    return rows


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="sd3.5-medium (default on CUDA) or tiny-sd3 (CPU)")
    p.add_argument("--replicas", default="1,2", help="replica counts to measure, e.g. 1,2")
    p.add_argument("--group", type=int, default=16, help="outputs per request (a GRPO group)")
    p.add_argument("--requests-per-replica", type=int, default=8)
    p.add_argument("--clients-per-replica", type=int, default=4)
    p.add_argument("--steps", type=int, default=None, help="override the model's default steps")
    p.add_argument("--tiny", action="store_true", help="CPU dry run with tiny-sd3 and CPU replicas")
    args = p.parse_args(argv)
    device = "cpu" if args.tiny else resolve_device(args.device)
    name = args.model or ("tiny-sd3" if device == "cpu" else "sd3.5-medium")
    args.dtype = "float32" if device == "cpu" else "bfloat16"
    counts = [int(c) for c in args.replicas.split(",")]
    if args.tiny:
        args.requests_per_replica, args.clients_per_replica, args.group = 2, 2, 2
    body = {"prompt": PROMPT, "generator_device": "cuda" if device.startswith("cuda") else "cpu"}
    body.update(request_defaults(name), **GRPO, num_outputs_per_prompt=args.group)
    if args.steps:
        body["num_inference_steps"] = args.steps
    factory = functools.partial(build_pipeline, name, args.dtype)

    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    kwargs: dict[str, Any] = {"include_dashboard": False}
    if device == "cpu":
        kwargs.update(num_cpus=max(2, max(counts)), object_store_memory=300 * 2**20)
    ray.init(**kwargs)
    rows: list[dict[str, Any]] = []
    try:
        for n in counts:
            rows.extend(run_count(n, args, device, factory, body))
    finally:
        ray.shutdown()
    base = next((r["images_per_s"] for r in rows if r["phase"] == "throughput"), None)
    for r in rows:
        if r["phase"] == "throughput" and base:
            r["ratio"] = r["images_per_s"] / base
    print_table(f"cluster scaling: {name} on {device}", rows, COLUMNS)
    two = [r for r in rows if r["phase"] == "throughput" and r["replicas"] == 2]
    notes = []
    if two and not args.tiny:
        notes.append(f"2 replicas / 1 replica throughput = {two[0]['ratio']:.3f} (target >= 1.9)")
    settings = {
        "model": name,
        "replicas": counts,
        "group": args.group,
        "requests_per_replica": args.requests_per_replica,
        "clients_per_replica": args.clients_per_replica,
        "body": body,
        "tiny": args.tiny,
    }
    write_json(args.out, "cluster_scaling", document("cluster_scaling", device, settings, rows, notes=notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
