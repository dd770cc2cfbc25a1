"""The trainer as another process: a client process that sends rollouts on command and reports
what it waited, and the one way a benchmark reads a rollout answer.

Timed rollouts are sent from a process of their own, not from the benchmark's: a trainer is another
process, and a client thread in the server's own process would compete with the worker thread for
the GIL while it reads and decodes 100 MB answers. :func:`post_rollout` reads an answer as the
project's clients read it, so the seconds are a trainer's. The process is this module run as
``python -m benchmarks.remote_clients --clients-for URL``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


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

    The line protocol on stdin/stdout is ``{"bodies": [...], "clients": k}`` ->
    ``@@{"seconds", "times", "bytes", "inference_s", "pipeline_s"}`` (each response's
    ``inference_time_s``, the server's seconds in its pipeline call, and their sum over the distinct
    calls); ``k`` threads send the bodies (each its share, in order), and ``seconds`` runs from their
    common start until the last response is decoded.
    """

    def __init__(self, url: str, env: dict[str, str] | None = None) -> None:
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.remote_clients", "--clients-for", url],
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
    from diffusion_rollout.client.receive import decode_answer, read_body
    from diffusion_rollout.client.segments import SEGMENTS
    from diffusion_rollout.protocol import wire

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

    # post_rollout's own imports (they pull in diffusers): a trainer has them loaded before its first
    # request, so the first answer's seconds must not include them.
    from diffusion_rollout.client import receive  # noqa: F401
    from diffusion_rollout.protocol import lean

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


if __name__ == "__main__":
    if sys.argv[1:2] == ["--clients-for"]:
        sys.exit(_clients_main(sys.argv[2]))
    sys.exit("usage: python -m benchmarks.remote_clients --clients-for URL")
