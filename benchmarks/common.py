"""Plumbing shared by the benchmarks: the facts header, timing, tables, JSON, a real loopback server.

Design decisions:

- Every benchmark writes one JSON object: ``{"benchmark", "facts", "settings", "results", "ok",
  "notes"}``. ``facts`` holds the device (and its name), the commit, the library versions and the
  host; ``settings`` everything the run was told. RESULTS.md copies figures from these files.
- The commit is ``$BENCH_COMMIT`` when set (the device machine receives a copy of the working tree
  without ``.git``), else ``git rev-parse HEAD``, with ``+dirty`` when the tree has local changes.
- Timing is wall clock around a synchronised region (``torch.cuda.synchronize`` before each clock
  read), after a warm-up, as the median of *interleaved* repeats (stock, server, stock, server...),
  so both sides see the same clocks and caches. Speed claims are ratios from one run.
- The server under test is the real stack: the FastAPI app served by uvicorn on 127.0.0.1 in a
  thread of the benchmark process, and an ``httpx`` client that reads and decodes the msgpack body.
  What is timed is what a trainer waits for. Stock pipelines run in the same process while the
  server is idle.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from diffusion_rollout.testing import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
_VERSIONED = (
    "torch", "diffusers", "transformers", "accelerate", "peft", "safetensors", "fastapi", "starlette",
    "uvicorn", "pydantic", "httpx", "msgpack", "numpy", "triton", "diffusion-rollout",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Facts
# ---------------------------------------------------------------------------------------------
def commit() -> str:
    env = os.environ.get("BENCH_COMMIT")
    if env:
        return env
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["cudnn"] = str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None
    return out


_FACTS: dict[str, Any] | None = None


def facts(device: str) -> dict[str, Any]:
    """Device, commit, versions, host: collected once per process."""
    from diffusion_rollout.entrypoints.cli import missing_bytecode

    global _FACTS
    if _FACTS is None or _FACTS["device"] != device:
        info: dict[str, Any] = {
            "device": device,
            "device_name": platform.processor() or platform.machine(),
            "commit": commit(),
            "versions": versions(),
            "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "torch_threads": torch.get_num_threads(),
            # Start-up figures depend on it (RESULTS fast-start-bytecode): None when byte code is fine.
            "python_bytecode": missing_bytecode(),
        }
        if device.startswith("cuda"):
            props = torch.cuda.get_device_properties(device)
            info["device_name"] = props.name
            info["gpu"] = {
                "memory_gib": round(props.total_memory / 2**30, 1),
                "multiprocessors": props.multi_processor_count,
                "capability": f"{props.major}.{props.minor}",
            }
        _FACTS = info
    return _FACTS


def document(
    benchmark: str,
    device: str,
    settings: dict[str, Any],
    results: list[dict[str, Any]],
    *,
    ok: bool = True,
    notes: Sequence[str] = (),
) -> dict[str, Any]:
    return {
        "benchmark": benchmark,
        "written_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "facts": facts(device),
        "settings": settings,
        "results": results,
        "ok": ok,
        "notes": list(notes),
    }


def write_json(out_dir: str | Path | None, name: str, doc: dict[str, Any]) -> Path | None:
    if out_dir is None:
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    return path


def _json_default(o: Any) -> Any:
    if isinstance(o, (torch.dtype, torch.device, Path)):
        return str(o)
    if isinstance(o, float) and o != o:
        return None
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    """``fn()`` and its wall time, the device synchronised before both clock reads."""
    sync(device)
    t0 = time.perf_counter()
    value = fn()
    sync(device)
    return value, time.perf_counter() - t0


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def spread(xs: Iterable[float]) -> float:
    """(max - min) / median of repeats: the noise a difference must beat."""
    xs = list(xs)
    if len(xs) < 2:
        return 0.0
    m = statistics.median(xs)
    return (max(xs) - min(xs)) / m if m else 0.0


def reset_peak(device: str) -> None:
    """Start counting the peak of CUDA memory allocated from here (nothing off CUDA)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    """The CUDA memory allocated at the most since ``reset_peak``, GiB; None off CUDA."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


class Deadline:
    """A time budget shared by the phases of one run; a phase that would overrun is skipped."""

    def __init__(self, budget_s: float | None) -> None:
        self.budget_s = budget_s
        self.start = time.monotonic()

    def left(self) -> float:
        if self.budget_s is None:
            return float("inf")
        return self.budget_s - (time.monotonic() - self.start)

    def allows(self, estimate_s: float) -> bool:
        return self.left() >= estimate_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------
def fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:
            return "nan"
        return format(value, spec or ".4g")
    return str(value)


def print_table(title: str, rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """Print (and return) a plain text table; ``columns`` are ``(key, header, format spec)``."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append([fmt(row.get(key), spec) for key, _, spec in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = [f"== {title}"]
    for n, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if n else c.ljust(w) for c, w in zip(r, widths, strict=True)))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=None, help="folder for the JSON result (default: none)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument(
        "--models",
        default=None,
        help="comma-separated model names (tiny-<family> or sd3.5-medium, flux.1-dev, wan2.1-1.3b); "
        "default: tiny models on CPU, real architectures on CUDA",
    )
    return p


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


# ---------------------------------------------------------------------------------------------
# A real server on loopback (free ports, CLI servers: diffusion_rollout.testing)
# ---------------------------------------------------------------------------------------------
class LoopbackServer:
    """The app for ``engine`` served by uvicorn on 127.0.0.1 in a daemon thread, plus a client."""

    def __init__(self, engine, config) -> None:
        import httpx
        import uvicorn

        from diffusion_rollout.entrypoints.app import create_app

        self.engine = engine
        self.config = config
        self.app = create_app(config, engine=engine)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        uv_config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            access_log=False,
            http=config.http_parser,
        )
        self._server = uvicorn.Server(uv_config)
        self._thread = threading.Thread(target=self._server.run, name="bench-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(1200.0))
        self._remotes: dict[str, RemoteClients] = {}

    def new_client(self):
        import httpx

        return httpx.Client(base_url=self.url, timeout=httpx.Timeout(1200.0))

    def generate(self, body: dict[str, Any], client=None) -> tuple[list[dict[str, Any]], int]:
        """POST /rollout/generate (msgpack) and decode; returns (results, response bytes)."""
        return post_rollout(client or self.client, body)

    def post_json(self, path: str, body: Any = None, **kw) -> dict[str, Any]:
        r = self.client.post(path, json=body, **kw)
        if r.status_code != 200:
            raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:2000]}")
        return r.json()

    def post_bytes(self, path: str, data: bytes, params: dict[str, Any] | None = None) -> dict[str, Any]:
        # Streamed in 1 MiB slices with an explicit length: httpcore writes a single ``bytes`` body
        # with ``buffer = buffer[n:]`` after every ``send``, which copies the rest each time
        # (quadratic: a 1 GiB body took about 50 s on loopback; streamed, about 3 s).
        r = self.client.post(
            path,
            content=_slices(data),
            params=params,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(len(data))},
        )
        if r.status_code != 200:
            raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:2000]}")
        return r.json()

    def remote(self, trainer: str = "default") -> RemoteClients:
        """HTTP clients in another process (started on first use), as a trainer would be; another
        ``trainer`` of :data:`TRAINERS` is a second such process reading answers otherwise, for
        side-by-side rows."""
        if trainer not in self._remotes:
            self._remotes[trainer] = RemoteClients(self.url, env=TRAINERS[trainer])
        return self._remotes[trainer]

    def close(self) -> None:
        for remote in self._remotes.values():
            remote.close()
        self._remotes.clear()
        with contextlib.suppress(Exception):
            self.client.close()
        self._server.should_exit = True
        self._thread.join(timeout=10)


# Set in a RemoteClients process: answers are read into fresh memory and decoded by msgpack.unpackb
# into new tensors, as the clients did before client/receive.py's pool (the side-by-side baseline).
FRESH_MEMORY_ENV = "DIFFUSION_ROLLOUT_BENCH_FRESH_MEMORY"
# The trainer processes of side-by-side rows, by the environment they differ in: the default client;
# answers by the socket only (no same-host files, client/segments.py); and, as before the receive
# pool (and before the files), answers read and decoded into fresh memory.
TRAINERS: dict[str, dict[str, str]] = {
    "default": {},
    "socket": {"DIFFUSION_ROLLOUT_SAME_HOST_ANSWERS": "0"},
    "fresh_memory": {
        FRESH_MEMORY_ENV: "1",
        "DIFFUSION_ROLLOUT_RECEIVE_POOL_MB": "0",
        "DIFFUSION_ROLLOUT_SAME_HOST_ANSWERS": "0",
    },
}


class RemoteClients:
    """A client process that sends requests on command and reports what it waited.

    Timed rollouts are sent from here, not from the benchmark process: a trainer is another process,
    and a client thread in the server's own process would compete with the worker thread for the
    GIL while it reads and decodes 100 MB responses. The line protocol on stdin/stdout is
    ``{"bodies": [...], "clients": k}`` -> ``@@{"seconds", "times", "bytes", "inference_s", "pipeline_s"}``
    (each response's ``inference_time_s``, the server's seconds in its pipeline call, and their sum
    over the distinct calls); ``k`` threads send the
    bodies (each its share, in order), and ``seconds`` runs from their common start until the last
    response is decoded.
    """

    def __init__(self, url: str, env: dict[str, str] | None = None) -> None:
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.common", "--clients-for", url],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._read()  # "ready"

    def _read(self) -> dict[str, Any]:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"client process ended (exit {self.proc.poll()})")
            if line.startswith("@@"):
                reply = json.loads(line[2:])
                if "error" in reply:
                    raise RuntimeError(f"client process: {reply['error']}")
                return reply

    def run(self, bodies: list[dict[str, Any]], clients: int = 1) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"bodies": bodies, "clients": clients}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def time_one(self, body: dict[str, Any]) -> tuple[float, int]:
        reply = self.run([body], 1)
        return reply["times"][0], reply["bytes"][0]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()


def post_rollout(client, body: dict[str, Any]) -> tuple[Any, int]:
    """``POST /rollout/generate`` read as the project's clients read it (the msgpack body into one
    buffer of its Content-Length, ``client/receive.py``), then decoded; (decoded body, bytes)."""
    from diffusion_rollout import wire
    from diffusion_rollout.client.receive import decode_answer, read_body
    from diffusion_rollout.client.segments import SEGMENTS

    with SEGMENTS.lease(str(client.base_url)) as answer:
        headers = {"Accept": wire.MSGPACK, **answer.headers}
        with client.stream("POST", "/rollout/generate", json=body, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"/rollout/generate answered {r.status_code}: {r.text[:2000]}")
            data = answer.body(r.headers, read_body(r))
        if os.environ.get(FRESH_MEMORY_ENV):  # as before the pool: unpackb's bytes, then new tensors
            return wire.decode(data, r.headers["content-type"]), len(data)
        return decode_answer(data, r.headers["content-type"]), len(data)


def _send_concurrently(clients: list, bodies: list[dict[str, Any]], send) -> dict[str, Any]:
    k = len(clients)
    times: list[float] = [0.0] * len(bodies)
    sizes: list[int] = [0] * len(bodies)
    inference: list[tuple[float, str]] = [(0.0, "")] * len(bodies)
    errors: list[BaseException] = []
    start = threading.Barrier(k + 1)

    def worker(client, share: list[int]) -> None:
        start.wait()
        for i in share:
            try:
                times[i], sizes[i], inference[i] = send(client, bodies[i])
            except BaseException as exc:  # reported after the join
                errors.append(exc)
                return

    shares = [list(range(len(bodies)))[i::k] for i in range(k)]
    threads = [threading.Thread(target=worker, args=(clients[i], shares[i])) for i in range(k)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        return {"error": f"{type(errors[0]).__name__}: {errors[0]}"}
    # Requests that shared a pipeline call report the same call: count each call once.
    calls = {batch or f"request {i}": s for i, (s, batch) in enumerate(inference)}
    return {
        "seconds": seconds,
        "times": times,
        "bytes": sizes,
        "inference_s": [s for s, _ in inference],
        "pipeline_s": sum(calls.values()),
    }


def _clients_main(url: str) -> int:
    """The client process of :class:`RemoteClients`."""
    import httpx

    from diffusion_rollout import lean

    # post_rollout's own imports (they pull in diffusers): a trainer has them loaded before its first
    # request, so the first answer's seconds must not include them.
    from diffusion_rollout.client import receive  # noqa: F401

    pool: list[httpx.Client] = []

    def reply(obj: dict[str, Any]) -> None:
        print("@@" + json.dumps(obj), flush=True)

    def send(client, body) -> tuple[float, int]:
        t0 = time.perf_counter()
        decoded, size = post_rollout(client, body)
        # The trainer's whole decode: tensors, then lean references back to per-output dicts.
        results = lean.from_lean(decoded)
        # The server's own time for the pipeline call (denoising and decode, by the worker's clock):
        # the rest of the wait is queueing, copies, serialization, transfer and this decode.
        inference = max((float(d.get("inference_time_s") or 0.0) for d in results), default=0.0)
        batch = results[0].get("batch_id", "") if results else ""
        return time.perf_counter() - t0, size, (inference, batch)

    reply({"ready": True})
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            bodies, k = cmd["bodies"], max(1, int(cmd.get("clients", 1)))
            while len(pool) < k:
                pool.append(httpx.Client(base_url=url, timeout=httpx.Timeout(1200.0)))
            reply(_send_concurrently(pool[:k], bodies, send))
        except Exception as exc:
            reply({"error": f"{type(exc).__name__}: {exc}"})
    from diffusion_rollout.client.segments import SEGMENTS

    # How this trainer's answers came (the log of a run says which rows read files).
    why_not = SEGMENTS.status(str(pool[0].base_url)) if pool else None
    print(
        f"trainer process ({SEGMENTS.mode=}): {SEGMENTS.written} answers read from same-host files"
        + (f"; the server declined them: {why_not}" if why_not else ""),
        file=sys.stderr,
    )
    return 0


@contextlib.contextmanager
def push_phases() -> Any:
    """Where a ``push_weights`` call's time goes, from the trainer's side: patches the upload module
    for the duration and fills the yielded dict with ``parts_s`` (from the call to the start of the
    commit), ``commit_s``, ``hash_wait_s`` (after the commit, waiting for the trainer's own
    hashes) and ``check_s`` (the server's tensor checker). Timing only: nothing else changes."""
    from diffusion_rollout.client.weights import upload

    marks: dict[str, float] = {}
    real_check = upload._check_manifest

    def check(*args: Any, **kwargs: Any) -> Any:
        marks["check_start"] = time.perf_counter()
        try:
            return real_check(*args, **kwargs)
        finally:
            marks["check_end"] = time.perf_counter()

    real_push = upload.push_weights

    def push(client, *args: Any, **kwargs: Any) -> Any:
        real_update = client.update_weights

        def update(*a: Any, **kw: Any) -> Any:
            if kw.get("final"):
                marks["commit_start"] = time.perf_counter()
            try:
                return real_update(*a, **kw)
            finally:
                if kw.get("final"):
                    marks["commit_end"] = time.perf_counter()

        client.update_weights = update
        marks.clear()
        marks["start"] = time.perf_counter()
        try:
            return real_push(client, *args, **kwargs)
        finally:
            marks["end"] = time.perf_counter()
            del client.update_weights
            out.clear()
            if "commit_start" in marks:
                out["parts_s"] = marks["commit_start"] - marks["start"]
                out["commit_s"] = marks["commit_end"] - marks["commit_start"]
                after = marks.get("check_start", marks["end"])
                out["hash_wait_s"] = after - marks["commit_end"]
                out["check_s"] = marks.get("check_end", after) - after

    out: dict[str, float] = {}
    upload._check_manifest = check
    try:
        yield push, out
    finally:
        upload._check_manifest = real_check


def quiet_libraries() -> None:
    """Silence the libraries' per-call warnings (truncated prompts, experimental attention backends)."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()


def _slices(data: bytes, size: int = 2**20):
    view = memoryview(data)
    for i in range(0, len(view), size):
        yield view[i : i + size]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--clients-for"]:
        sys.exit(_clients_main(sys.argv[2]))
    sys.exit("usage: python -m benchmarks.common --clients-for URL")
