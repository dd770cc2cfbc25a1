"""Weight-sync speed: full-transformer updates over HTTP parts, from disk, through CUDA IPC; LoRA push.

All through the real endpoints of a server on loopback (weights.md), against the host-to-device copy
rate measured in the same run (pinned and pageable, 1 GiB, ``torch.Tensor.to``):

- ``http``: ``POST /update_weights`` with safetensors bodies of ``part_mb`` each (``final=false``
  parts, then the final one, applied atomically), streamed by the client in 1 MiB slices (see
  ``LoopbackServer.post_bytes``: one large ``bytes`` body is quadratic in httpcore). The trainer side starts from CPU tensors already
  in the server dtype; timed: serialising each part, sending it, the server parsing, validating,
  staging and applying. The tensors sent are the model's own values (a no-op for the model).
- ``http_stream``: the same payload through the project client (``push_weights``, ``verify=False``:
  parts are views of the tensors, sent in slices, two in flight) into the server's streaming
  receiver (parts read into pooled, pinned-on-CUDA buffers and checked while the next arrives),
  twice: the first push allocates the receive buffers, the second is a trainer's steady state. Side
  by side in the same run and process: ``http_legacy``, the previous path (the whole part
  serialised by ``safetensors.torch.save``, sent one part at a time, and read on the server with
  ``request.body()`` then parsed, through a benchmark-only route into the same staging and apply),
  ``tcp_raw`` (one loopback socket, ``sendall`` into ``recv_into`` a reused buffer: what any HTTP
  stack on this host can reach) and ``finite_check`` (the old ``isfinite().all()`` and the new
  ``aminmax`` finiteness check over the payload).
- ``http_direct``: the same push (``push_weights``, same parts and concurrency) into a second front
  on the same engine started with ``upload_port=0``: the client finds the direct receive listener
  (``weight_upload_port``) and sends the parts there, where each body is read with ``recv_into``
  straight into a pooled buffer on a thread per connection (``entrypoints/upload_listener.py``)
  instead of through uvicorn's event loop. Twice (first, steady), side by side with ``http_stream``
  (the two run in the order, and as often, as ``--phases`` names them, so they can alternate);
  the phase fails if the listener did not receive every part.
- ``disk``: ``POST /update_weights_from_disk`` of a ``<dir>/transformer/*.safetensors`` folder just
  written (so read from the page cache: this is the server's read + validate + copy rate, not a
  disk's). Writing is timed separately.
- ``ipc``: ``POST /update_weights_from_tensor`` from a separate trainer process that holds the
  tensors on the same GPU (SGLang's payload: base64 ``ForkingPickler`` of CUDA IPC handles); on a
  CPU-only machine the same path runs over shared-memory file descriptors. Timed from the trainer:
  serialising the handles and the request until the answer (the server opens the handles, validates
  names/shapes/finiteness, backs up and copies every tensor in place).
- ``lora``: rank ``lora_rank`` on every attention projection of the transformer (``to_q/k/v``,
  ``to_out.0``, ``add_*_proj``, ``to_add_out``), pushed as one safetensors body to ``POST /lora/load``
  with ``activate=true``. The first push injects the PEFT layers (cold); later pushes to the same
  name replace the tensors in place, the trainer's steady state (target: push + activate < 100 ms).
- ``lora_ipc``: the same adapter from a same-host trainer process through
  ``update_weights_from_tensor`` with ``weight_update_mode="lora_merge"`` (CUDA IPC handles; loaded
  as adapter ``default`` and activated); the first call injects, later ones replace in place.

GB/s counts payload bytes (decimal GB). Targets: IPC and HTTP at least half the host-to-device rate.
Sizes: ``--http-gb``/``--disk-gb`` cap the payload (the first parameters in order, up to the cap;
GB/s is what is compared); IPC sends the whole transformer unless ``--ipc-gb`` caps it.

    python -m benchmarks.weight_sync --device cuda --models flux.1-dev --out bench_out
    python -m benchmarks.weight_sync --trainer SPEC.json   # (internal) the IPC trainer process
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.cli import base_parser, quiet_libraries, resolve_device
from benchmarks.facts import REPO_ROOT
from benchmarks.loopback import byte_slices
from benchmarks.model_builders import BenchModel, build
from benchmarks.report import document, log, print_table, write_json
from benchmarks.timing import median, push_phases, sync
from diffusion_rollout.client.weights.upload import DEFAULT_CONCURRENCY, DEFAULT_MAX_PART_BYTES

ATTENTION_PROJECTION = re.compile(
    r"(^|\.)attn\d*\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)$"
)
DEFAULT_PHASES = (
    "h2d", "tcp", "http_legacy", "http_stream", "http_direct", "finite", "disk", "ipc", "lora", "lora_ipc",
)  # fmt: skip
PHASE_HELP = {
    "h2d": "host-to-device copy rate, pinned and pageable (the reference)",
    "tcp": "one bare loopback socket, sendall into recv_into (the ceiling of any HTTP path)",
    "tcp_parallel": "the same bytes over 2, 4 and 8 loopback sockets at once (the ceiling for parts in "
    "flight and replicas on one host; not default)",
    "http_legacy": "the previous HTTP path: safetensors.save per part, request.body() on the server",
    "http_stream": "push_weights into the main port (uvicorn, streamed into pooled buffers)",
    "http_direct": "push_weights into the direct upload listener (upload_port: recv_into, thread per "
    "connection), side by side with http_stream (name both, several times, to alternate them)",
    "http_direct_verified": "http_direct with push_weights' default verify=True (per-tensor SHA-256 "
    "on both sides, checked after the commit); name it with http_direct to alternate them (not default)",
    "http_stream_h11": "http_stream through a front with uvicorn's h11 parser (not default)",
    "http_stream_httptools": "http_stream through a front with uvicorn's httptools parser (not default)",
    "finite": "the finiteness check over the payload, old vs new",
    "http": "the plain one-part-at-a-time HTTP upload from this process (not default)",
    "disk": "update_weights_from_disk from the page cache",
    "ipc": "update_weights_from_tensor from a trainer process (CUDA IPC; descriptors on CPU)",
    "lora": "a LoRA pushed over HTTP and activated",
    "lora_ipc": "a LoRA through update_weights_from_tensor lora_merge",
}
COLUMNS = [
    ("transport", "transport", ""),
    ("what", "what", ""),
    ("mb", "MB", ".1f"),
    ("seconds", "seconds", ".4f"),
    ("gb_per_s", "GB/s", ".2f"),
    ("transfer_gb_per_s", "GB/s w/o apply", ".2f"),
    ("vs_h2d", "vs H2D pinned", ".2f"),
    ("note", "note", ""),
]


def _gb(nbytes: int) -> float:
    return nbytes / 1e9


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------
# Host-to-device reference
# ---------------------------------------------------------------------------------------------
def h2d_rates(device: str, size: int = 2**30, reps: int = 5) -> list[dict[str, Any]]:
    rows = []
    if not device.startswith("cuda"):
        size = min(size, 64 * 2**20)
        src = torch.empty(size // 4, dtype=torch.float32).fill_(1.0)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            src.clone()
            times.append(time.perf_counter() - t0)
        s = median(times)
        return [{"transport": "memcpy", "what": "64 MiB CPU clone (no GPU)", "gb": _gb(size), "seconds": s,
                 "gb_per_s": _gb(size) / s}]  # fmt: skip
    for pinned in (True, False):
        src = torch.empty(size, dtype=torch.uint8)
        src.fill_(0x5A)  # a copy's speed does not depend on the bytes (random_() takes seconds here)
        if pinned:
            src = src.pin_memory()
        dst = torch.empty(size, dtype=torch.uint8, device=device)
        times = []
        for _ in range(reps + 1):
            sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=pinned)
            sync(device)
            times.append(time.perf_counter() - t0)
        s = median(times[1:])
        rows.append(
            {
                "transport": "h2d_pinned" if pinned else "h2d_pageable",
                "what": "1 GiB host->device copy",
                "gb": _gb(size),
                "seconds": s,
                "gb_per_s": _gb(size) / s,
            }
        )
        del src, dst
    return rows


# ---------------------------------------------------------------------------------------------
# Payload selection
# ---------------------------------------------------------------------------------------------
def first_params(module: torch.nn.Module, cap_bytes: float | None) -> list[tuple[str, torch.Tensor]]:
    out, total = [], 0
    for name, p in module.named_parameters():
        if cap_bytes is not None and total >= cap_bytes:
            break
        out.append((name, p))
        total += nbytes(p)
    return out


def _parts(named: list[tuple[str, torch.Tensor]], part_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    parts, cur, size = [], [], 0
    for name, t in named:
        if cur and size + nbytes(t) > part_bytes:
            parts.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += nbytes(t)
    if cur:
        parts.append(cur)
    return parts


# ---------------------------------------------------------------------------------------------
# Transports
# ---------------------------------------------------------------------------------------------
def http_update(
    srv, named_cpu: list[tuple[str, torch.Tensor]], part_bytes: int, tag: str, path: str = "/update_weights"
) -> dict[str, Any]:
    from safetensors.torch import save

    parts = _parts(named_cpu, part_bytes)
    total = sum(nbytes(t) for _, t in named_cpu)
    ser = send = 0.0
    t_all = time.perf_counter()
    for i, part in enumerate(parts):
        t0 = time.perf_counter()
        body = save(dict(part))
        t1 = time.perf_counter()
        srv.post_bytes(
            path,
            body,
            params={
                "target_module": "transformer",
                "upload_id": tag,
                "part": i,
                "final": "true" if i == len(parts) - 1 else "false",
                "weight_version": tag,
                "flush_cache": "false",
                "partial": "true",  # --http-gb may cap the payload below the whole module
            },
        )
        ser += t1 - t0
        send += time.perf_counter() - t1
        del body
    seconds = time.perf_counter() - t_all
    return {
        "transport": "http",
        "what": f"{len(named_cpu)} tensors in {len(parts)} parts",
        "gb": _gb(total),
        "seconds": seconds,
        "gb_per_s": _gb(total) / seconds,
        "serialize_s": ser,
        "request_s": send,
        "note": f"serialize {ser:.2f}s + requests {send:.2f}s",
    }


LEGACY_ROUTE = "/bench/legacy_update_weights"


def add_legacy_route(srv) -> None:
    """The receive path before the streaming receiver: ``request.body()``, then the bytes parsed."""
    from starlette.responses import JSONResponse

    from diffusion_rollout.server.weights import get_weight_manager

    if any(getattr(r, "path", None) == LEGACY_ROUTE for r in srv.app.router.routes):
        return

    async def legacy(request):
        q = request.query_params
        body = await request.body()
        out = await get_weight_manager(srv.engine).upload_part(
            body, target_module="transformer", weight_version=q["weight_version"],
            final=q["final"] == "true", upload_id=q["upload_id"], part=int(q["part"]), flush_cache=False,
            partial=True,
        )  # fmt: skip
        return JSONResponse(out)

    srv.app.router.add_route(LEGACY_ROUTE, legacy, methods=["POST"])


def http_push(
    srv,
    named: list[tuple[str, torch.Tensor]],
    part_bytes: int,
    *,
    mode: str,
    concurrency: int = 2,
    reps: int = 2,
    verify: bool = False,
) -> list[dict[str, Any]]:
    """A full-weight push over HTTP from a separate trainer process (as from another host).

    ``mode="stream"``: the project client (``push_weights``, ``verify=False``) into ``/update_weights``
    on the main port. ``mode="direct"``: the same, its parts sent to the direct upload listener that
    ``srv`` advertises (``weight_upload_port``).
    ``mode="legacy"``: the previous path, each part serialised whole by ``safetensors.torch.save`` and
    sent alone (1 MiB slices) to a benchmark route that reads ``request.body()``. The trainer makes
    its own tensors of the payload's names, shapes and dtypes. Besides the wall time, the server
    process's CPU time (every thread) is recorded: the figure that matters on a busy host.
    """
    if mode == "legacy":
        add_legacy_route(srv)
    pool = _receive_pool(srv)
    total = sum(nbytes(t) for _, t in named)
    spec = {
        "url": srv.url,
        "mode": mode,
        "path": LEGACY_ROUTE if mode == "legacy" else "/update_weights",
        "part_bytes": part_bytes,
        "concurrency": concurrency,
        "reps": reps,
        "verify": verify,
        "tensors": [[n, list(t.shape), str(t.dtype).replace("torch.", "")] for n, t in named],
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.weight_sync", "--http-trainer", str(spec_path)],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            for rep in range(reps):
                # The trainer announces each push ("ready": its tensors are made) and waits for "go",
                # so the server's CPU time is taken around that push alone.
                ready = proc.stdout.readline()
                if not ready.startswith("ready"):
                    raise RuntimeError(f"HTTP trainer failed: {ready}{proc.stderr.read()[-3000:]}")
                before = dataclasses.replace(pool.stats)
                cpu0 = time.process_time()
                proc.stdin.write("go\n")
                proc.stdin.flush()
                done = proc.stdout.readline()
                server_cpu = time.process_time() - cpu0
                if not done.startswith("{"):
                    raise RuntimeError(f"HTTP trainer failed: {done}{proc.stderr.read()[-3000:]}")
                report = json.loads(done)
                seconds = report["seconds"]
                new, reused = pool.stats.allocated - before.allocated, pool.stats.reused - before.reused
                what = {
                    "stream": f"{len(named)} tensors, {concurrency} parts in flight, client streams",
                    "direct": f"{len(named)} tensors, {concurrency} parts in flight, upload port (recv_into)",
                    "legacy": f"{len(named)} tensors, one part at a time, safetensors.save + body()",
                }[mode]
                rows.append(
                    {
                        "transport": f"http_{mode}" + ("_verified" if verify else ""),
                        "concurrency": concurrency,
                        "verified": verify,
                        "what": what
                        + (", verify=True" if verify else ", verify=False")
                        + (" (first)" if rep == 0 else ""),
                        "gb": _gb(total),
                        "seconds": seconds,
                        "gb_per_s": _gb(total) / seconds,
                        "server_cpu_s": server_cpu,
                        "server_cpu_s_per_gb": server_cpu / _gb(total),
                        "trainer_cpu_s": report["cpu_s"],
                        "trainer_seconds": report["trainer_seconds"],
                        "apply_s": report["apply_s"],
                        # Receiving, parsing, checking and staging every part, without the final copy.
                        "transfer_gb_per_s": _gb(total) / (seconds - (report["apply_s"] or 0.0)),
                        "rep": rep,
                        "buffers_allocated": new,
                        "buffers_reused": reused,
                        "note": f"apply {report['apply_s'] or 0:.2f}s; server CPU {server_cpu / _gb(total):.2f} s/GB"
                        + (f"; buffers {new} new, {reused} reused" if mode != "legacy" else ""),
                    }
                )
        finally:
            proc.stdin.close()
            proc.wait(60)
    return rows


def http_trainer_main(spec_path: str) -> int:
    """The HTTP trainer process: make the tensors, then push them on every "go" from stdin."""
    import httpx
    from safetensors.torch import save

    from diffusion_rollout.client import RolloutClient

    spec = json.loads(Path(spec_path).read_text())
    gen = torch.Generator().manual_seed(3)
    named = [
        (name, (torch.randn(shape, generator=gen) * 0.02).to(getattr(torch, dtype)))
        for name, shape, dtype in spec["tensors"]
    ]
    for rep in range(spec["reps"]):
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return 0
        tag = f"bench-{spec['mode']}-{rep}"
        phases: dict[str, float] = {}  # push_phases' split (stream and direct modes)
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        if spec["mode"] in ("stream", "direct"):
            direct = spec["mode"] == "direct"
            with RolloutClient(spec["url"], timeout=1200.0) as client:
                if direct and client.upload_url(0) == client.url:
                    print("the server advertises no upload port", flush=True)
                    return 2
                with push_phases() as (push, phases):
                    message = push(
                        client, named, dtype=None, max_part_bytes=spec["part_bytes"], weight_version=tag,
                        upload_id=tag, flush_cache=False, verify=spec.get("verify", False),
                        concurrency=spec["concurrency"],
                        partial=True,  # --http-gb may cap the payload below the whole module
                        direct=direct,
                    ).message  # fmt: skip
        else:
            parts = _parts(named, spec["part_bytes"])
            with httpx.Client(base_url=spec["url"], timeout=httpx.Timeout(1200.0)) as client:
                for i, part in enumerate(parts):
                    body = save(dict(part))
                    final = str(i == len(parts) - 1).lower()
                    r = client.post(
                        spec["path"],
                        content=byte_slices(body),
                        params={"upload_id": tag, "part": i, "final": final, "weight_version": tag},
                        headers={
                            "Content-Type": "application/octet-stream",
                            "Content-Length": str(len(body)),
                        },
                    )
                    if r.status_code != 200:
                        print(f"answered {r.status_code}: {r.text[:2000]}", flush=True)
                        return 2
                    message = r.json()["message"]
                    del body
        seconds = time.perf_counter() - t0
        # The final answer says how long the server's validate-and-copy on its worker took.
        applied = re.search(r"MiB in ([0-9.]+) s", message)
        report = {"seconds": seconds, "cpu_s": time.process_time() - cpu0}
        report["apply_s"] = float(applied.group(1)) if applied else None
        report["trainer_seconds"] = {k: round(v, 4) for k, v in phases.items()}
        print(json.dumps(report), flush=True)
    return 0


def _receive_pool(srv):
    from diffusion_rollout.server.weights import get_weight_manager

    return get_weight_manager(srv.engine).receive_buffers


def tcp_raw(size: int = 2**30, reps: int = 3, streams: int = 1) -> dict[str, Any]:
    """Loopback TCP, ``sendall`` of 1 MiB views into ``recv_into`` a reused buffer (a ceiling):
    ``size`` bytes in all per round, split over ``streams`` connections received at once (the
    ceiling for parts in flight, and for replicas on one host)."""
    import socket
    import threading

    per = size // streams
    listener = socket.create_server(("127.0.0.1", 0), backlog=streams)
    port = listener.getsockname()[1]
    src = memoryview(bytearray(b"\x5a") * per)

    def sender() -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            for _ in range(reps + 1):
                for i in range(0, per, 2**20):
                    s.sendall(src[i : i + 2**20])
                s.recv(1)

    threads = [threading.Thread(target=sender, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    conns = [listener.accept()[0] for _ in range(streams)]
    views = [memoryview(bytearray(per)) for _ in range(streams)]

    def receive(k: int) -> None:
        pos = 0
        while pos < per:
            pos += conns[k].recv_into(views[k][pos:], min(per - pos, 4 << 20))

    times = []
    try:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            receivers = [threading.Thread(target=receive, args=(k,)) for k in range(streams)]
            for r in receivers:
                r.start()
            for r in receivers:
                r.join()
            times.append(time.perf_counter() - t0)
            for c in conns:
                c.sendall(b"k")
    finally:
        for t in threads:
            t.join(30)
        for c in conns:
            c.close()
        listener.close()
    s = median(times[1:])
    what = f"{size >> 20} MiB loopback socket, no HTTP"
    if streams > 1:
        what = f"{size >> 20} MiB over {streams} loopback sockets at once, no HTTP"
    return {"transport": "tcp_raw" if streams == 1 else f"tcp_raw_x{streams}", "what": what, "gb": _gb(size),
            "seconds": s, "gb_per_s": _gb(size) / s, "streams": streams, "note": f"median of {reps}"}  # fmt: skip


def finite_check(named_cpu: list[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """The upload's finiteness check over the payload: ``isfinite().all()`` (old) vs ``aminmax`` (new)."""
    from diffusion_rollout.server.weights.updater import finite_flags

    tensors = [t for _, t in named_cpu if t.is_floating_point()]
    total = sum(nbytes(t) for t in tensors)
    rows = []
    for label, fn in (
        ("isfinite().all() per tensor (old)", lambda: [bool(torch.isfinite(t).all()) for t in tensors]),
        ("aminmax per tensor (new)", lambda: finite_flags(tensors)),
    ):
        t0 = time.perf_counter()
        fn()
        s = time.perf_counter() - t0
        rows.append({"transport": "finite_check", "what": label, "gb": _gb(total), "seconds": s,
                     "gb_per_s": _gb(total) / s})  # fmt: skip
    return rows


def disk_update(srv, named_cpu: list[tuple[str, torch.Tensor]], part_bytes: int, root: Path) -> list[dict]:
    from safetensors.torch import save_file

    folder = root / "transformer"
    folder.mkdir(parents=True, exist_ok=True)
    total = sum(nbytes(t) for _, t in named_cpu)
    t0 = time.perf_counter()
    for i, part in enumerate(_parts(named_cpu, part_bytes)):
        save_file(dict(part), str(folder / f"diffusion_pytorch_model-{i:05d}.safetensors"))
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    srv.post_json(
        "/update_weights_from_disk",
        {"model_path": str(root), "target_modules": ["transformer"], "flush_cache": False},
    )
    seconds = time.perf_counter() - t0
    return [
        {"transport": "disk_write", "what": "trainer writes safetensors", "gb": _gb(total), "seconds": write_s,
         "gb_per_s": _gb(total) / write_s, "note": "not part of the server's time"},
        {"transport": "disk", "what": "update_weights_from_disk", "gb": _gb(total), "seconds": seconds,
         "gb_per_s": _gb(total) / seconds, "note": "files in the page cache"},
    ]  # fmt: skip


def ipc_update(
    srv,
    model: BenchModel,
    cap_bytes: float | None,
    reps: int,
    load_format: str | None,
    *,
    lora_rank: int | None = None,
) -> list[dict]:
    """Full weights (default) or, with ``lora_rank``, a LoRA through ``weight_update_mode="lora_merge"``."""
    if lora_rank is None:
        spec = [
            [name, list(p.shape), str(p.dtype).replace("torch.", "")]
            for name, p in first_params(model.pipe.transformer, cap_bytes)
        ]
    else:
        dtype = str(model.dtype).replace("torch.", "")
        spec = []
        for path, in_f, out_f in attention_projections(model.pipe.transformer):
            spec.append([f"{path}.lora_A.weight", [lora_rank, in_f], dtype])
            spec.append([f"{path}.lora_B.weight", [out_f, lora_rank], dtype])
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(
            json.dumps(
                {
                    "url": srv.url,
                    "device": model.device,
                    "reps": reps,
                    "load_format": load_format,
                    "tensors": spec,
                    "lora_rank": lora_rank,
                    # CPU tensors travel as file descriptors through multiprocessing's resource
                    # sharer, which only serves processes that know this process's authkey.
                    "authkey": bytes(multiprocessing.current_process().authkey).hex(),
                }
            )
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.weight_sync", "--trainer", str(spec_path)],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"IPC trainer failed ({proc.returncode}): {proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    total = report["bytes"]
    rows = []
    transport = "ipc" if lora_rank is None else "lora_ipc"
    for i, rep in enumerate(report["reps"]):
        what = f"{len(spec)} tensors, {load_format or 'direct'}"
        if lora_rank is not None:
            what = f"rank {lora_rank}, {len(spec) // 2} layers, lora_merge + activate"
            what += ", inject (first)" if i == 0 else ", in place"
        elif i == 0:
            what += " (first)"
        rows.append(
            {
                "transport": transport,
                "what": what,
                "gb": _gb(total),
                "seconds": rep["total_s"],
                "gb_per_s": _gb(total) / rep["total_s"],
                "serialize_s": rep["serialize_s"],
                "request_s": rep["request_s"],
                "note": f"serialize {rep['serialize_s']:.3f}s + request {rep['request_s']:.3f}s",
            }
        )
    return rows


def trainer_main(spec_path: str) -> int:
    """The IPC trainer process: make the tensors on the device, send handles, time, print JSON."""
    import httpx

    from diffusion_rollout.server.weights import ipc

    spec = json.loads(Path(spec_path).read_text())
    multiprocessing.current_process().authkey = bytes.fromhex(spec["authkey"])
    device = spec["device"]
    gen = torch.Generator(device).manual_seed(1)
    pairs = []
    total = 0
    with torch.no_grad():
        for name, shape, dtype in spec["tensors"]:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            if name.endswith("lora_B.weight"):
                t.normal_(0.0, 1e-3, generator=gen)  # a small update, as a trained adapter's B is
            elif len(shape) >= 2:
                t.normal_(0.0, 1.0 / math.sqrt(max(1, math.prod(shape[1:]))), generator=gen)
            elif name.endswith("weight") or "scale" in name:
                t.fill_(1.0)
            else:
                t.zero_()
            pairs.append((name, t))
            total += nbytes(t)
    sync(device)
    reps = []
    with httpx.Client(base_url=spec["url"], timeout=httpx.Timeout(900.0)) as client:
        for i in range(spec["reps"]):
            t0 = time.perf_counter()
            payload = ipc.serialize_named_tensors(pairs, load_format=spec["load_format"])
            t1 = time.perf_counter()
            body = {
                "serialized_named_tensors": [payload],
                "load_format": spec["load_format"],
                "target_modules": ["transformer"],
                "weight_version": f"ipc-{i}",
                "flush_cache": False,
            }
            if spec.get("lora_rank"):
                body.update(
                    weight_update_mode="lora_merge", lora_rank=spec["lora_rank"], lora_alpha=spec["lora_rank"]
                )
            r = client.post("/update_weights_from_tensor", json=body)
            t2 = time.perf_counter()
            if r.status_code != 200:
                print(r.text[:3000], file=sys.stderr)
                return 2
            reps.append({"serialize_s": t1 - t0, "request_s": t2 - t1, "total_s": t2 - t0})
    print(json.dumps({"bytes": total, "reps": reps}))
    return 0


# ---------------------------------------------------------------------------------------------
# LoRA
# ---------------------------------------------------------------------------------------------
def attention_projections(module: torch.nn.Module) -> list[tuple[str, int, int]]:
    """(path, in_features, out_features) of every attention projection a LoRA benchmark targets."""
    return [
        (path, layer.in_features, layer.out_features)
        for path, layer in module.named_modules()
        if isinstance(layer, torch.nn.Linear) and ATTENTION_PROJECTION.search(path)
    ]


def lora_payload(
    module: torch.nn.Module, rank: int, device: str, dtype: torch.dtype
) -> tuple[bytes, int, int]:
    from safetensors.torch import save

    gen = torch.Generator("cpu").manual_seed(2)
    tensors = {}
    layers = 0
    for path, in_f, out_f in attention_projections(module):
        a = torch.randn(rank, in_f, generator=gen) / math.sqrt(in_f)
        b = torch.randn(out_f, rank, generator=gen) * 1e-3
        tensors[f"{path}.lora_A.weight"] = a.to(dtype)
        tensors[f"{path}.lora_B.weight"] = b.to(dtype)
        layers += 1
    if not tensors:
        raise RuntimeError("no attention projections found for the LoRA payload")
    size = sum(nbytes(t) for t in tensors.values())
    return save(tensors), layers, size


def lora_push(srv, model: BenchModel, rank: int, reps: int) -> list[dict[str, Any]]:
    body, layers, size = lora_payload(model.pipe.transformer, rank, model.device, model.dtype)
    params = {"name": "bench", "target_module": "transformer", "activate": "true", "lora_alpha": rank}
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        srv.post_bytes("/lora/load", body, params=params)
        times.append(time.perf_counter() - t0)
    act = []
    for name in (None, "bench") * 2:
        t0 = time.perf_counter()
        srv.post_json("/lora/activate", {"name": name, "target_module": "transformer"})
        act.append(time.perf_counter() - t0)
    srv.post_json("/lora/unload", {"name": None, "target_module": "transformer"})
    what = f"rank {rank}, {layers} layers"
    steady = median(times[1:])
    return [
        {"transport": "lora_load_cold", "what": what + ", inject + activate", "gb": _gb(size),
         "seconds": times[0], "gb_per_s": _gb(size) / times[0]},
        {"transport": "lora_push_activate", "what": what + ", in place + activate", "gb": _gb(size),
         "seconds": steady, "gb_per_s": _gb(size) / steady, "times_s": times[1:],
         "note": f"median of {reps}"},
        {"transport": "lora_activate", "what": "switch adapter (none <-> bench)", "gb": 0.0,
         "seconds": median(act), "gb_per_s": None, "times_s": act},
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
def run(
    model: BenchModel,
    *,
    out_dir=None,
    device: str = "cpu",
    http_gb: float | None = 4.0,
    disk_gb: float | None = 4.0,
    ipc_gb: float | None = None,
    part_mb: int = DEFAULT_MAX_PART_BYTES // 2**20,
    ipc_reps: int = 2,
    ipc_format: str | None = None,
    lora_rank: int = 64,
    lora_reps: int = 5,
    deadline=None,
    phases: tuple[str, ...] = DEFAULT_PHASES,
    concurrency: tuple[int, ...] = (DEFAULT_CONCURRENCY,),
) -> dict[str, Any]:
    # A CPU run's trainer process shares tensors by descriptor (it is given this process's authkey),
    # which the server accepts only when told to; a GPU run sends CUDA IPC handles.
    # The legacy-upload route of the http_legacy phase is not an upload path: it needs the upload limit.
    srv = model.server(allow_cpu_ipc=True, max_body_bytes=16 * 2**30)
    transformer = model.pipe.transformer
    total_bytes = sum(nbytes(p) for p in transformer.parameters())
    rows: list[dict[str, Any]] = []
    notes = [f"transformer: {total_bytes / 1e9:.2f} GB in {model.dtype}"]

    def phase(name: str, fn, estimate_s: float = 0.0) -> None:
        if name not in phases:
            return
        if deadline is not None and not deadline.allows(estimate_s):
            notes.append(f"{name}: skipped (time budget)")
            return
        log(f"weight_sync: {name}")
        try:
            out = fn()
            rows.extend(out if isinstance(out, list) else [out])
        except Exception as exc:
            notes.append(f"{name}: failed: {type(exc).__name__}: {str(exc)[:500]}")
            log(f"weight_sync: {name} failed: {exc!r}"[:800])

    phase("h2d", lambda: h2d_rates(device))
    pinned = next((r["gb_per_s"] for r in rows if r["transport"] in ("h2d_pinned", "memcpy")), None)
    part_bytes = part_mb * 2**20

    def cpu_copies(cap_gb):
        return [
            (n, p.detach().to("cpu", copy=True))
            for n, p in first_params(transformer, cap_gb * 1e9 if cap_gb else None)
        ]

    def do_http():
        named = cpu_copies(http_gb)
        return http_update(srv, named, part_bytes, "bench-http")

    # The HTTP trainer process makes its own tensors: only names, shapes and dtypes are needed here.
    http_payload = first_params(transformer, http_gb * 1e9 if http_gb else None)

    def payload():
        return http_payload

    def finite_payload():
        # The check runs on host copies (where uploaded parts are checked), of at most 2 GB.
        return cpu_copies(min(http_gb or 2.0, 2.0))

    def do_push(mode: str):
        # The streaming push twice: the first allocates the receive buffers, the second is a
        # trainer's steady state. The legacy path (the baseline) once.
        reps = 2 if mode == "stream" else 1
        return http_push(srv, payload(), part_bytes, mode=mode, concurrency=concurrency[0], reps=reps)

    def push_with_parser(parser: str):
        # The same streaming push into a second front on the same engine, its HTTP parser named
        # (the default front uses uvicorn's "auto": httptools when installed, else h11).
        from benchmarks.loopback import LoopbackServer

        if parser == "httptools" and importlib.util.find_spec("httptools") is None:
            raise RuntimeError("httptools is not installed")
        front = LoopbackServer(srv.engine, srv.config.model_copy(update={"http_parser": parser}))
        try:
            out = http_push(front, payload(), part_bytes, mode="stream", concurrency=concurrency[0], reps=2)
        finally:
            front.close()
        for r in out:
            r["transport"] = f"http_stream_{parser}"
        return out

    def push_direct(verify: bool = False):
        # The same push into a second front on the same engine that runs the direct receive
        # listener; the trainer finds its port through /model_info, as any client does. Once per
        # --concurrency value, in the order given.
        from benchmarks.loopback import LoopbackServer

        front = LoopbackServer(srv.engine, srv.config.model_copy(update={"upload_port": 0}))
        try:
            listener = front.app.state.upload_listener
            out = []
            for c in concurrency:
                before = dataclasses.replace(listener.stats)
                rows_c = http_push(
                    front, payload(), part_bytes, mode="direct", concurrency=c, reps=2, verify=verify
                )
                # Where the upload port's time went over both pushes, summed over connections.
                spent = {k: round(getattr(listener.stats, k) - getattr(before, k), 3)
                         for k in ("lease_s", "recv_s", "apply_s")}  # fmt: skip
                for r in rows_c:
                    r["upload_port_seconds_both_reps"] = spent
                out += rows_c
            n = len(_parts(payload(), part_bytes))
            # push_weights: an empty part 0 opens a multi-part upload and an empty part commits it.
            expected = 2 * len(concurrency) * (n + 2 if n > 1 else 1)
            if listener.stats.parts != expected:
                raise RuntimeError(f"the upload port received {listener.stats.parts} of {expected} parts")
        finally:
            front.close()
        for r in out:
            r["note"] += f"; upload port {listener.port}"
        return out

    def do_disk():
        named = cpu_copies(disk_gb)
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
            return disk_update(srv, named, part_bytes, Path(tmp))

    tcp_bytes = 2**30 if device.startswith("cuda") else 256 * 2**20
    phase("tcp", lambda: tcp_raw(tcp_bytes), 10)
    phase("tcp_parallel", lambda: [tcp_raw(tcp_bytes, streams=n) for n in (2, 4, 8)], 20)
    phase("http_legacy", lambda: do_push("legacy"), 30)
    # http_stream / http_direct: in the order (and as often) as --phases names them, so a run can
    # alternate the two receive paths on a noisy machine.
    pushes = {
        "http_stream": lambda: do_push("stream"),
        "http_direct": push_direct,
        "http_direct_verified": lambda: push_direct(verify=True),
    }
    for name in [p for p in phases if p in pushes]:
        phase(name, pushes[name], 30)
    # http_stream_h11 / http_stream_httptools: in the order (and as often) as --phases names them,
    # so a run can alternate them.
    for name in [p for p in phases if p in ("http_stream_h11", "http_stream_httptools")]:
        parser = name.removeprefix("http_stream_")
        phase(name, lambda parser=parser: push_with_parser(parser), 30)
    phase("finite", lambda: finite_check(finite_payload()), 10)
    phase("http", do_http, 30)
    phase("disk", do_disk, 30)
    if device.startswith("cuda"):
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    phase("ipc", lambda: ipc_update(srv, model, ipc_gb * 1e9 if ipc_gb else None, ipc_reps, ipc_format), 40)
    phase("lora", lambda: lora_push(srv, model, lora_rank, lora_reps), 20)
    phase(
        "lora_ipc", lambda: ipc_update(srv, model, None, lora_reps + 1, ipc_format, lora_rank=lora_rank), 20
    )
    for r in rows:
        r["mb"] = r["gb"] * 1000
        if pinned and r.get("gb_per_s") and not r["transport"].startswith("h2d"):
            r["vs_h2d"] = r["gb_per_s"] / pinned
    table = print_table(f"Weight sync on {model.name} (loopback)", rows, COLUMNS)

    def best(kind):
        vals = [r["gb_per_s"] for r in rows if r["transport"] == kind and r.get("gb_per_s")]
        return max(vals) if vals else None

    targets = {}
    stream = best("http_stream")
    legacy = best("http_legacy")
    if stream is not None:
        targets["http_stream"] = {"gb_per_s": stream, "target_gb_per_s": 2.0, "met": stream >= 2.0}
        if legacy:
            targets["http_stream"]["vs_legacy"] = stream / legacy
        tcp = best("tcp_raw")
        if tcp:
            targets["http_stream"]["vs_tcp_raw"] = stream / tcp
    verified = [r for r in rows if r["transport"] == "http_direct_verified" and "(first)" not in r["what"]]
    for c in concurrency:
        vals = [r["gb_per_s"] for r in verified if r["concurrency"] == c]
        if vals:
            targets[f"http_direct_verified_c{c}"] = {
                "gb_per_s": max(vals), "target_gb_per_s": 2.5, "met": max(vals) >= 2.5,
                "default": c == DEFAULT_CONCURRENCY, "part_mb": part_mb,
            }  # fmt: skip
    direct = best("http_direct")
    if direct is not None:
        targets["http_direct"] = {"gb_per_s": direct, "target_gb_per_s": 2.0, "met": direct >= 2.0}
        if stream:
            targets["http_direct"]["vs_http_stream"] = direct / stream
        tcp = best("tcp_raw")
        if tcp:
            targets["http_direct"]["vs_tcp_raw"] = direct / tcp
    for kind in ("ipc", "http"):
        v = best(kind)
        if v is not None and pinned:
            targets[kind] = {"gb_per_s": v, "h2d_pinned_gb_per_s": pinned, "target_ratio": 0.5,
                             "met": v >= 0.5 * pinned}  # fmt: skip
    lora = next((r for r in rows if r["transport"] == "lora_push_activate"), None)
    if lora:
        targets["lora_push_activate"] = {
            "ms": 1000 * lora["seconds"],
            "target_ms": 100,
            "met": lora["seconds"] < 0.1,
        }
        targets["lora_http_push_activate"] = {
            "ms": 1000 * lora["seconds"],
            "target_ms": 300,
            "met": lora["seconds"] < 0.3,
        }
    lora_ipc = [r["seconds"] for r in rows if r["transport"] == "lora_ipc"][1:]  # in place, after the first
    if lora_ipc:
        steady = median(lora_ipc)
        targets["lora_ipc_push_activate"] = {"ms": 1000 * steady, "target_ms": 100, "met": steady < 0.1}
    doc = document(
        "weight_sync",
        device,
        {
            "model": model.name,
            "http_gb": http_gb,
            "disk_gb": disk_gb,
            "ipc_gb": ipc_gb,
            "part_mb": part_mb,
            "ipc_reps": ipc_reps,
            "ipc_format": ipc_format or "direct",
            "lora_rank": lora_rank,
            "lora_reps": lora_reps,
            "concurrency": concurrency,
        },
        rows,
        ok=not any("failed" in n for n in notes),
        notes=notes,
    )
    doc["targets"] = targets
    doc["table"] = table
    write_json(out_dir, "weight_sync", doc)
    return doc


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--trainer"]:
        return trainer_main(argv[1])
    if argv[:1] == ["--http-trainer"]:
        return http_trainer_main(argv[1])
    quiet_libraries()
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--http-gb", type=float, default=4.0)
    p.add_argument("--disk-gb", type=float, default=4.0)
    p.add_argument("--ipc-gb", type=float, default=None, help="cap on the IPC payload (default: all)")
    p.add_argument(
        "--part-mb", type=int, default=DEFAULT_MAX_PART_BYTES // 2**20, help="push_weights' default"
    )
    p.add_argument("--lora-rank", type=int, default=64)
    p.add_argument("--lora-reps", type=int, default=5)
    p.add_argument(
        "--phases",
        default=",".join(DEFAULT_PHASES),
        help="comma-separated phases to run (default: all but those marked 'not default'): "
        + "; ".join(f"{name}: {what}" for name, what in PHASE_HELP.items()),
    )
    p.add_argument(
        "--concurrency",
        default=str(DEFAULT_CONCURRENCY),
        help="upload parts in flight, push_weights' default; a comma list runs the http_direct "
        "phases once per value (http_stream takes the first)",
    )
    p.add_argument(
        "--ipc-format", default=None, choices=["direct", "flattened_bucket"], help="IPC load_format"
    )
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    name = args.models or ("flux.1-dev" if device.startswith("cuda") else "tiny-flux")
    model = build(name, device)
    try:
        doc = run(
            model,
            out_dir=args.out,
            device=device,
            http_gb=args.http_gb,
            disk_gb=args.disk_gb,
            ipc_gb=args.ipc_gb,
            part_mb=args.part_mb,
            lora_rank=args.lora_rank,
            lora_reps=args.lora_reps,
            phases=tuple(args.phases.split(",")),
            concurrency=tuple(int(c) for c in args.concurrency.split(",")),
            ipc_format=None if args.ipc_format in (None, "direct") else args.ipc_format,
        )
    finally:
        model.close()
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
