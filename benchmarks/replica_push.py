"""Full-weight pushes to replicas as a user makes them: each replica's own port against the object store.

    python -m benchmarks.replica_push --out DIR                                   # GPU: SD3.5-medium, 2 x 0.5 GPU
    python -m benchmarks.replica_push --out DIR --model tiny-sd3 --cpu --rounds 1  # CPU dry run

The model is a real architecture with random weights saved as a diffusers folder
(``train_recipes.model_folder``), served by the CLI as a user runs it: ``diffusion-rollout serve
--replicas N --gpus-per-replica G --upload-port 0`` in a process of its own. This process is the
trainer: it holds the transformer's tensors on the CPU (read from the folder) and pushes them with
``push_weights`` and its defaults (``verify=True``, ``DEFAULT_CONCURRENCY`` parts in flight, 512 MiB parts), alternating
the two paths in the same run:

- ``replica_ports``: ``direct=True`` (the default). Every replica advertises its own upload port
  (``replica_upload_urls``); each part goes to all of them at once and the front commits.
- ``object_store``: ``direct=False``. The parts go to the front's main port, which puts each in
  Ray's object store once; every replica reads it from there.

GB/s is the payload (decimal GB) over the push's wall time, per replica: every replica receives
the whole payload. Each push is verified (per-tensor SHA-256 against the trainer's tensors).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from diffusion_rollout.testing import free_port, start_cli_server, stop_session

ROOT = Path(__file__).resolve().parent.parent


def transformer_tensors(folder: Path) -> dict:
    """The served transformer's tensors as a trainer on another host would hold them (CPU)."""
    from safetensors.torch import load_file

    tensors: dict = {}
    for f in sorted((folder / "transformer").glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def environment() -> dict:
    import diffusers
    import torch

    info = {"torch": torch.__version__, "diffusers": diffusers.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    info["commit"] = (
        os.environ.get("RECIPE_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    )
    return info


def port_seconds(client) -> list[dict[str, float]]:
    """Per replica: the seconds its upload port spent leasing buffers, receiving and applying parts."""
    return [r.get("upload_port_seconds", {}) for r in client.server_info().get("replicas", [])]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.timing import push_phases
    from benchmarks.train_recipes import model_folder
    from diffusion_rollout.client import RolloutClient

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="sd3.5-medium", help="a model_builders name, or tiny-sd3")
    p.add_argument("--work", type=Path, default=Path("/tmp/train_recipes"))
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--gpus-per-replica", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=3, help="pushes per path, alternating the paths")
    p.add_argument("--cpu", action="store_true", help="CPU replicas (a dry run of the commands)")
    p.add_argument(
        "--also-concurrency", default="", help="comma list: also replica_ports_c<N> with N parts in flight"
    )
    args = p.parse_args(argv)
    # (name, direct, concurrency): None is push_weights' default; rotated in every round.
    paths = [("replica_ports", True, None), ("object_store", False, None)] + [
        (f"replica_ports_c{c}", True, int(c)) for c in args.also_concurrency.split(",") if c
    ]

    folder = model_folder(args.model, args.work)
    port = free_port()
    cmd = [
        sys.executable, "-m", "diffusion_rollout.entrypoints.cli", "serve", "--model", str(folder),
        "--replicas", str(args.replicas), "--upload-port", "0", "--port", str(port), "--host", "127.0.0.1",
        "--gpus-per-replica", "0" if args.cpu else str(args.gpus_per_replica),
        *(["--device", "cpu", "--dtype", "float32"] if args.cpu else ["--dtype", "bfloat16"]),
    ]  # fmt: skip
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    url = f"http://127.0.0.1:{port}"
    log = args.work / "logs" / "replica_push_server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print("[replica_push]", " ".join(cmd), f"(log: {log})", flush=True)
    t0 = time.perf_counter()
    server = start_cli_server(cmd, log, url, 900, new_session=True, env=env)
    ready_s = time.perf_counter() - t0
    rows = []
    try:
        with RolloutClient(url, timeout=1800.0) as client:
            info = client.model_info()
            if not info.get("replica_upload_urls"):
                raise RuntimeError(f"the front advertises no replica upload ports: {info}")
            tensors = transformer_tensors(folder)
            gb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9
            last_ports = port_seconds(client)
            for rnd in range(args.rounds):
                for path, direct, concurrency in paths:
                    version = f"{path}-{rnd}"
                    extra = {} if concurrency is None else {"concurrency": concurrency}
                    with push_phases() as (push, phases):
                        t0 = time.perf_counter()
                        result = push(client, tensors, weight_version=version, direct=direct, **extra)
                        seconds = time.perf_counter() - t0
                    assert result.weight_version == version, result
                    ports = port_seconds(client)
                    row = {
                        "path": path, "round": rnd, "gb": gb, "seconds": seconds,
                        "gb_per_s_per_replica": gb / seconds, "verified": True,
                        "replicas": args.replicas,
                        "trainer_seconds": {k: round(v, 3) for k, v in phases.items()},
                        # Summed over each replica port's connections during this push.
                        "replica_port_seconds": [
                            {k: round(v - before.get(k, 0.0), 3) for k, v in now.items()}
                            for now, before in zip(ports, last_ports, strict=True)
                        ],
                    }  # fmt: skip
                    last_ports = ports
                    rows.append(row)
                    print("[replica_push]", json.dumps(row), flush=True)
    finally:
        stop_session(server)

    def best(path: str) -> float:
        """The best steady push (the first round allocates receive buffers) of ``path``."""
        steady = [r for r in rows if r["path"] == path and (r["round"] > 0 or args.rounds == 1)]
        return max(r["gb_per_s_per_replica"] for r in steady)

    doc = {
        "benchmark": "replica_push",
        "environment": environment(),
        "settings": {**vars(args), "work": str(args.work), "model_folder": str(folder), "server": cmd},
        "server_ready_s": ready_s,
        "results": rows,
        "summary": {f"{path}_gb_per_s": best(path) for path, _, _ in paths},
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "replica_push.json").write_text(json.dumps(doc, indent=1))
    print("[replica_push] summary", json.dumps(doc["summary"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
