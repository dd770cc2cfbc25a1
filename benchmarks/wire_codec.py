"""Wire codec: the previous msgpack encode, decode and HTTP read vs the copy-free ones (CPU).

The payload is a synthetic Flow-GRPO answer shaped as SD3.5-medium's at 512x512, 10 steps, in the
lean form a trainer asks for: per output a uint8 image ``[3, 512, 512]``, a bf16 trajectory
``[11, 16, 64, 64]``, float32 log-probs ``[10]``, timesteps and sigmas; the float32 prompt
conditioning of both CFG branches (``[1, 333, 4096]`` and ``[1, 2048]`` each) once, referenced by
the other outputs. Random values: the codec does not look at them.

- ``previous``: the codec as it was: ``safetensors.torch.save`` per tensor, ``msgpack.packb`` of
  the whole, one ``bytes`` body; the client joins httpx's reads (``resp.content``), ``unpackb``s and
  ``safetensors.torch.load``s every tensor. Kept here, plainly written, as the baseline (the tests
  check the current codec against it byte for byte).
- ``current``: ``wire.encode_chunks`` (packed pieces and views of the tensors' memory), sent by the
  router's own ``wire_response`` under a Content-Length; the client reads into one pooled buffer of
  that length (``client/receive.py``) and decodes in place (``msgpack_views``) with one copy per
  tensor into pooled memory. The decode phase adds ``unpackb``: the decode before the pool
  (``msgpack.unpackb`` copies every tensor into a new ``bytes``, then into a new tensor). Each call
  drops what it decoded, as a trainer drops an iteration's results, so the pool hands it out again.

Phases, each interleaved (previous, current, then current, previous...) after a warm-up, median of
the repeats and spread = (max - min) / median: ``encode`` and ``decode`` in this process, and
``http_round_trip``: a request to a uvicorn server in another process (the product's parser choice,
``http="auto"``) until the body is decoded here, as a trainer waits for it. On a CPU VM only the
ratios mean something.

    python -m benchmarks.wire_codec --out bench_out
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from benchmarks.cli import base_parser
from benchmarks.facts import REPO_ROOT
from benchmarks.remote_clients import post_rollout
from benchmarks.report import document, log, print_table, write_json
from benchmarks.timing import median, spread
from diffusion_rollout.client.receive import decode_answer
from diffusion_rollout.protocol import lean, wire
from diffusion_rollout.testing import free_port, start_cli_server, stop_session

SHAPES = {  # SD3.5-medium, 512x512, 10 steps, groups of 16
    "outputs": 16,
    "size": 512,
    "steps": 10,
    "text_tokens": 333,
    "text_width": 4096,
    "pooled_width": 2048,
}
TINY = {"outputs": 2, "size": 64, "steps": 2, "text_tokens": 16, "text_width": 64, "pooled_width": 32}
PHASES = ("encode", "decode", "http_round_trip")
COLUMNS = [
    ("phase", "phase", ""),
    ("variant", "variant", ""),
    ("median_ms", "median ms", ".2f"),
    ("spread", "spread", ".3f"),
    ("speedup", "previous / current", ".2f"),
]


# ---------------------------------------------------------------------------- the payload
def flow_grpo_answer(shapes: dict[str, int], seed: int = 0) -> list[dict[str, Any]]:
    """One lean /rollout/generate answer of ``shapes["outputs"]`` outputs (random values)."""
    gen = torch.Generator().manual_seed(seed)
    steps, latent = shapes["steps"], shapes["size"] // 8

    def cond() -> dict[str, torch.Tensor]:
        return {
            "encoder_hidden_states": torch.randn(
                1, shapes["text_tokens"], shapes["text_width"], generator=gen
            ),
            "pooled_projections": torch.randn(1, shapes["pooled_width"], generator=gen),
        }

    env = {
        "image_kwargs": {},
        "pos_cond_kwargs": cond(),
        "neg_cond_kwargs": cond(),
        "guidance": {"rule": "cfg_batched", "guidance_scale": 4.5},
        "batch_kwargs": ["encoder_hidden_states", "pooled_projections"],
        "timestep_dtype": "torch.float32",
    }
    timesteps = torch.linspace(1000, 0, steps + 1)
    outputs = []
    for i in range(shapes["outputs"]):
        outputs.append(
            {
                "request_id": "bench",
                "prompt": "a watercolor painting of a lighthouse at dusk",
                "seed": i,
                "weight_version": 0,
                "generated_output": torch.randint(
                    0, 256, (3, shapes["size"], shapes["size"]), generator=gen
                ).to(torch.uint8),
                "rollout_log_probs": torch.randn(steps, generator=gen),
                "rollout_debug_tensors": None,
                "denoising_env": env,
                "dit_trajectory": {
                    "latents": torch.randn(steps + 1, 16, latent, latent, generator=gen).to(torch.bfloat16),
                    "timesteps": timesteps,
                    "sigmas": timesteps / 1000,
                    "latent_step_indices": list(range(steps + 1)),
                },
                "sde_step_indices": list(range(steps)),
                "inference_time_s": 1.0,
                "peak_memory_mb": None,
            }
        )
    return lean.to_lean(outputs)


# ---------------------------------------------------------------------------- the previous codec
def _previous_to_wire(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        return {
            wire.TENSOR_KEY: True,
            "data": st_save({"t": t.contiguous()}),
            "shape": list(t.shape),
            "dtype": str(t.dtype),
        }
    if isinstance(obj, dict):
        return {k: _previous_to_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_previous_to_wire(v) for v in obj]
    return obj


def _previous_from_wire(obj: Any) -> Any:
    if isinstance(obj, dict):
        if obj.get(wire.TENSOR_KEY) is True:
            return st_load(bytes(obj["data"]))["t"]
        return {k: _previous_from_wire(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_previous_from_wire(v) for v in obj]
    return obj


def previous_encode(obj: Any) -> bytes:
    return msgpack.packb(_previous_to_wire(obj), use_bin_type=True)


def previous_decode(body: bytes) -> Any:
    return _previous_from_wire(msgpack.unpackb(body, raw=False))


def same(a: Any, b: Any) -> bool:
    """Equal structures, tensors equal in dtype, shape and value."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


# ---------------------------------------------------------------------------- the server process
def _serve(port: int, shapes: dict[str, int]) -> int:
    """A uvicorn server answering the payload: ``/rollout/generate`` through the router's own
    ``wire_response``, ``/previous`` as the router answered before (one ``bytes`` body)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from diffusion_rollout.entrypoints.routers.common import wire_response

    answer = flow_grpo_answer(shapes)

    async def current(request: Request) -> Response:
        return await wire_response(request, answer)

    async def previous(request: Request) -> Response:
        body = await asyncio.to_thread(previous_encode, answer)
        return Response(content=body, media_type=wire.MSGPACK)

    async def model_info(request: Request) -> Response:  # the readiness the harness waits for
        return JSONResponse({"status": "ready"})

    routes = [
        Route("/rollout/generate", current, methods=["POST"]),
        Route("/previous", previous, methods=["POST"]),
        Route("/model_info", model_info, methods=["GET"]),
    ]
    uvicorn.run(Starlette(routes=routes), host="127.0.0.1", port=port, log_level="warning", access_log=False)
    return 0


@contextlib.contextmanager
def answer_server(shapes: dict[str, int]):
    """The answer server in a process of its own, started and stopped by the project's harness."""
    port = free_port()
    args = [f"--{k.replace('_', '-')}={v}" for k, v in shapes.items()]
    cmd = [sys.executable, "-m", "benchmarks.wire_codec", "--serve", str(port), *args]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="wire_codec_") as tmp:
        proc = start_cli_server(cmd, Path(tmp) / "server.log", url, 120, new_session=True, env=env)
        try:
            yield url
        finally:
            stop_session(proc, signal.SIGTERM, timeout_s=20)


# ---------------------------------------------------------------------------- timing
def interleaved(
    variants: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds per call of each variant; the order alternates every round so neither always goes first."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def rows_for(phase: str, times: dict[str, list[float]]) -> list[dict[str, Any]]:
    base = median(times["previous"])
    return [
        {
            "phase": phase,
            "variant": name,
            "median_ms": median(xs) * 1e3,
            "spread": spread(xs),
            "speedup": base / median(xs),
            "times_ms": [x * 1e3 for x in xs],
        }
        for name, xs in times.items()
    ]


def run(shapes: dict[str, int], repeats: int, out_dir=None) -> dict[str, Any]:
    answer = flow_grpo_answer(shapes)
    body = previous_encode(answer)
    expected = previous_decode(body)
    exact = (
        b"".join(wire.encode_chunks(answer)[0]) == body
        and same(wire.decode(body), expected)
        and same(decode_answer(memoryview(body), wire.MSGPACK), expected)
    )
    log(f"wire_codec: {len(body) / 1e6:.1f} MB answer, current bytes and tensors equal previous: {exact}")
    rows = rows_for(
        "encode",
        interleaved(
            {"previous": lambda: previous_encode(answer), "current": lambda: wire.encode_chunks(answer)},
            repeats,
        ),
    )
    view = memoryview(body)
    rows += rows_for(
        "decode",
        interleaved(
            {
                "previous": lambda: previous_decode(body),
                "unpackb": lambda: wire.decode(body),
                "current": lambda: decode_answer(view, wire.MSGPACK),
            },
            repeats,
        ),
    )

    import httpx

    with answer_server(shapes) as url, httpx.Client(base_url=url, timeout=httpx.Timeout(600.0)) as client:

        def previous_trip() -> Any:
            r = client.post("/previous", json={}, headers={"Accept": wire.MSGPACK})
            r.raise_for_status()
            return previous_decode(r.content)

        received = {"previous": previous_trip(), "current": post_rollout(client, {})[0]}
        exact = exact and same(received["current"], received["previous"])
        trips = {"previous": previous_trip, "current": lambda: post_rollout(client, {})}
        rows += rows_for("http_round_trip", interleaved(trips, repeats))

    table = print_table(f"Wire codec, {len(body) / 1e6:.1f} MB Flow-GRPO answer (CPU)", rows, COLUMNS)
    settings = {"shapes": shapes, "repeats": repeats, "answer_bytes": len(body), "http": _parser()}
    notes = [
        f"{r['phase']}: previous/current = {r['speedup']:.2f}" for r in rows if r["variant"] == "current"
    ]
    doc = document("wire_codec", "cpu", settings, rows, ok=exact, notes=notes)
    doc["table"] = table
    write_json(out_dir, "wire_codec", doc)
    return doc


def _parser() -> str:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--tiny", action="store_true", help="a two-output 64x64 answer (the smoke test)")
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the server process
    for key, value in SHAPES.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    args = p.parse_args(argv)
    shapes = dict(TINY) if args.tiny else {k: getattr(args, k) for k in SHAPES}
    if args.serve is not None:
        return _serve(args.serve, shapes)
    doc = run(shapes, args.repeats, args.out)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
