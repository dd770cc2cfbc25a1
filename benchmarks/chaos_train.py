"""A training run under injected faults: does it survive its servers, and end where a clean run ends?

    python -m benchmarks.chaos_train --out benchmarks/results/cpu          # CPU, tiny SD3, a few minutes

``examples/flow_grpo.py`` trains (a subprocess, ``--url`` and ``--checkpoint``) against a
``diffusion-rollout serve`` subprocess, through a TCP proxy of this benchmark's own on the loopback
(:class:`FaultProxy`). The benchmark is also the supervisor: it restarts whatever it kills, on the
same port, from the same checkpoint. Faults, each once, at a set count of matching requests
(:data:`FAULTS`):

- a connection reset mid-request (``/rollout/generate``: the request forwarded, then a reset);
- a connection reset mid-push (``/lora/load``: half the upload forwarded, then a reset: nothing applied);
- a push's answer lost (``/lora/load`` forwarded whole, applied, the answer replaced by a reset);
- an answer delayed past the trainer's ``--request-timeout``;
- the server SIGKILLed mid-rollout and restarted (a fresh process: base weights, version 0);
- the server restarted between a push and the next rollouts, which it answers from its base weights
  (an off-policy batch: rejected, counted, never trained on);
- the trainer SIGKILLed mid-push and restarted from its checkpoint;
- with ``--ray``, in a run of its own: a replica of a 2-replica Ray pool SIGKILLed mid-rollout
  (Ray restarts it; the front copies a peer's weights into it);
- a full disk during a checkpoint write (an ``OSError(ENOSPC)`` raised from inside the atomic
  checkpoint write of one iteration, after some bytes: the trainer exits and is restarted).

Then the same run without faults (same seeds, same sizes, its own server), and the two final
adapters (the checkpoints' ``trainer.pt``) compared with ``torch.equal``.

Design decisions:

- **The trainer is the recipe as a user runs it**; the benchmark only wraps its process start to
  inject the full disk (``trainer`` mode below patches ``recipes.checkpoint._write_atomically`` for one
  iteration), so the recipes carry no fault hooks.
- **A fault is matched to its recovery by time**: the recipe records each recovery with the
  wall-clock time it ended (``at``); a fault's recovery is the first unclaimed one ending after it
  was injected. A trainer restart's seconds lost run from the kill to the first iteration the
  restarted trainer completes.
- **Trained off-policy** counts iterations whose first replay pass was not exactly on-policy
  (``first_ratio_max_dev`` not 0) and not TIS-weighted: a batch from any other weights than the
  trainer's shows there (``--async-depth``'s stale batches are TIS-weighted and counted apart).
- Bounded: every wait has a deadline, and a run that does not finish in ``--deadline-s`` is stopped
  and reported as such.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import re
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import document, print_table, write_json
from diffusion_rollout.testing import free_port, stop_session

ROOT = Path(__file__).resolve().parent.parent
GENERATE, PUSH = b"POST /rollout/generate", b"POST /lora/load"
FULL_PART = b"POST /update_weights?"  # a part of a full-weight push over HTTP (--full-finetune)
LORA_LIST = b"GET /lora "  # the trainer's reads of the adapters it pushed (a push's check, the final one)


@dataclass
class Fault:
    """One injected fault, once: ``action`` on the first request of ``iteration`` whose request line
    starts with ``match`` (a rollout of the iteration, or the push that ends it), or, for
    ``disk_full``, during the checkpoint write after ``iteration``. Another ``match`` (``LORA_LIST``)
    fires on its ``nth`` request once the trainer has pushed ``iter-<iteration>``."""

    name: str
    # reset | reset_mid_body | drop_answer | delay | kill_server | kill_server_for_good |
    # restart_server_first | kill_replica | kill_trainer | disk_full
    action: str
    match: bytes | None
    iteration: int
    expect: str  # the recovery it should lead to: a recipe cause, or "trainer_restart"
    fired_at: float | None = None  # wall clock
    nth: int = 1
    seen: int = 0


def default_faults() -> list[Fault]:
    """One fault of each kind over an 8-iteration run. The trainer is killed in an iteration of its
    own: it would take the recovery records of that iteration (not yet checkpointed) with it."""
    return [
        Fault("connection reset mid-request", "reset", GENERATE, 1, "rollout_connection_lost"),
        Fault("connection reset mid-push", "reset_mid_body", PUSH, 1, "push_connection_lost"),
        Fault(
            "server SIGKILLed mid-rollout, restarted", "kill_server", GENERATE, 2, "rollout_connection_lost"
        ),
        Fault("push answer lost (push applied)", "drop_answer", PUSH, 2, "push_connection_lost"),
        Fault(
            "server restarted between push and rollouts",
            "restart_server_first",
            GENERATE,
            3,
            "off_policy_batch",
        ),
        Fault("answer delayed past the timeout", "delay", GENERATE, 4, "rollout_timeout"),
        Fault("trainer SIGKILLed mid-push, restarted", "kill_trainer", PUSH, 5, "trainer_restart"),
        Fault("disk full during a checkpoint write", "disk_full", None, 6, "trainer_restart"),
    ]


# ---------------------------------------------------------------------------------------------- proxy
def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), not a FIN: what a crashed peer or a middlebox sends."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        # Wakes the proxy's other thread out of its recv on this socket (a close alone would not);
        # its close then drops the last reference and the kernel sends the reset.
        sock.shutdown(socket.SHUT_RD)
    with contextlib.suppress(OSError):
        sock.close()


class FaultProxy:
    """A threaded TCP proxy ``127.0.0.1:port -> 127.0.0.1:upstream`` that injects :class:`Fault` s.

    Requests are recognised by their request line at the start of a chunk from the client (HTTP/1.1
    keep-alive sends one request after another on a connection). ``on_kill_server`` and
    ``on_kill_trainer`` are the supervisor's.
    """

    def __init__(
        self, upstream: int, faults: list[Fault], *, delay_s: float, on_kill_server, on_restart_server,
        on_kill_trainer, on_kill_replica,
    ):  # fmt: skip
        self.upstream = upstream
        self.faults = [f for f in faults if f.match is not None]
        self.delay_s = delay_s
        self.on_kill_server, self.on_restart_server = on_kill_server, on_restart_server
        self.on_kill_trainer, self.on_kill_replica = on_kill_trainer, on_kill_replica
        self.version = 0  # the last weight version pushed (iter-N)
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True, name="chaos-proxy").start()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.listener.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _fault_for(self, chunk: bytes) -> Fault | None:
        """The fault this request triggers. The iteration is read from the weight versions the
        trainer pushes (``iter-N``, in the push's query string): rollouts after a push of ``iter-N``
        are iteration N's, a push of ``iter-N`` ends iteration N - 1 (or starts the run at 0)."""
        line = chunk.split(b"\r\n", 1)[0]
        with self.lock:
            if line.startswith(PUSH):
                m = re.search(rb"weight_version=iter-(\d+)", line)
                pushed = int(m.group(1)) if m else None
                if pushed is None:
                    return None
                self.version = pushed
                for f in self.faults:
                    if f.match == PUSH and f.iteration == pushed - 1 and f.fired_at is None:
                        f.fired_at = time.time()
                        return f
            elif line.startswith(GENERATE):
                for f in self.faults:
                    if f.match == GENERATE and f.iteration == self.version and f.fired_at is None:
                        f.fired_at = time.time()
                        return f
            else:
                for f in self.faults:
                    if f.match in (GENERATE, PUSH) or f.fired_at is not None or f.iteration != self.version:
                        continue
                    if line.startswith(f.match):
                        f.seen += 1
                        if f.seen == f.nth:
                            f.fired_at = time.time()
                            return f
        return None

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            upstream.settimeout(None)
        except OSError:  # the server is down (restarting): the client sees the connection close
            _reset(client)
            return
        # answer: None | "drop" | seconds to delay; upstream: the one whose loss ends this connection.
        conn: dict[str, Any] = {"answer": None, "upstream": upstream}
        threading.Thread(target=self._answers, args=(upstream, client, conn), daemon=True).start()
        try:
            while True:
                chunk = client.recv(1 << 16)
                if not chunk:
                    break
                fault = self._fault_for(chunk)
                if fault is not None:
                    print(f"[chaos] injecting: {fault.name}", flush=True)
                    if fault.action == "reset":
                        conn["answer"] = "drop"  # the server has started on it when the reset comes
                        upstream.sendall(chunk)
                        time.sleep(0.02)
                        break
                    if fault.action == "reset_mid_body":
                        upstream.sendall(chunk[: len(chunk) // 2])
                        break
                    if fault.action == "drop_answer":
                        conn["answer"] = "drop"
                    elif fault.action == "delay":
                        conn["answer"] = self.delay_s
                    elif fault.action == "restart_server_first":
                        # A server restarted between the push and this rollout: it answers, from its
                        # base weights. The request goes to the new process on a new connection.
                        conn["upstream"] = None
                        self.on_restart_server()
                        upstream = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
                        upstream.settimeout(None)
                        conn["upstream"] = upstream
                        threading.Thread(
                            target=self._answers, args=(upstream, client, conn), daemon=True
                        ).start()
                    elif fault.action in ("kill_server", "kill_server_for_good"):
                        conn["answer"] = "drop"
                        upstream.sendall(chunk)
                        time.sleep(0.02)  # mid-rollout
                        self.on_kill_server(restart=fault.action == "kill_server")
                        break
                    elif fault.action == "kill_replica":
                        upstream.sendall(chunk)
                        time.sleep(0.02)  # mid-rollout
                        self.on_kill_replica()
                        continue
                    elif fault.action == "kill_trainer":
                        self.on_kill_trainer()
                        break
                upstream.sendall(chunk)
        except OSError:
            pass
        _reset(client)
        _reset(upstream)

    @staticmethod
    def _answers(upstream: socket.socket, client: socket.socket, conn: dict[str, Any]) -> None:
        try:
            while True:
                chunk = upstream.recv(1 << 16)
                if not chunk:
                    break
                if conn["answer"] == "drop":
                    break
                if isinstance(conn["answer"], float):
                    time.sleep(conn["answer"])
                    conn["answer"] = None
                client.sendall(chunk)
        except OSError:
            pass
        if conn["upstream"] is upstream:
            _reset(client)
        _reset(upstream)


# ---------------------------------------------------------------------------------------------- processes
class ServerSupervisor:
    """``diffusion-rollout serve`` on a fixed port, SIGKILLed and restarted on demand."""

    def __init__(self, model: Path, port: int, admin_key: str, group_size: int, log: Path, replicas: int = 1):
        self.cmd = [
            sys.executable, "-m", "diffusion_rollout.entrypoints.cli", "serve", "--model", str(model),
            "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
            "--max-batch-size", str(group_size), "--log-level", "warning", "--shutdown-grace-s", "2",
            *(["--replicas", str(replicas)] if replicas > 1 else []),
        ]  # fmt: skip
        self.admin_key = admin_key
        self.replicas_killed: list[dict[str, Any]] = []
        self.env = {**os.environ, "DIFFUSION_ROLLOUT_ADMIN_KEY": admin_key, "OMP_NUM_THREADS": "1"}
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    def start(self) -> None:
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(
                self.cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )

    def kill_and_restart(
        self, wait_ready: bool = False, timeout_s: float = 120.0, restart: bool = True
    ) -> None:
        """SIGKILL (no shutdown grace), then at once a new process on the same port, as a supervisor
        would (``restart`` false: an unsupervised server, gone for good); ``wait_ready``: return once
        it answers ``/health_generate``."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if not restart:
            return
        self.restarts += 1
        self.start()
        if wait_ready:
            self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Return once the server answers ``/health_generate`` (or after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/health_generate", timeout=5) as r,
            ):
                if r.status == 200:
                    return
            time.sleep(0.2)

    def kill_busy_replica(self) -> None:
        """SIGKILL the process of the replica serving a request now (else replica 1): Ray restarts
        it and the front copies a serving peer's weights into it (``cluster/recovery.py``)."""
        req = urllib.request.Request(
            f"{self.url}/server_info", headers={"Authorization": f"Bearer {self.admin_key}"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            replicas = json.loads(r.read())["replicas"]
        busy = [x for x in replicas if x.get("outstanding_requests")] or [
            x for x in replicas if x["replica_id"] == 1
        ]
        os.kill(busy[0]["pid"], signal.SIGKILL)
        self.replicas_killed.append(
            {"replica_id": busy[0]["replica_id"], "pid": busy[0]["pid"], "at": time.time()}
        )

    def stop(self) -> None:
        if self.proc is not None:
            stop_session(self.proc, signal.SIGTERM, timeout_s=20)


def trainer_command(args: argparse.Namespace, url: str, checkpoint: Path, out: Path) -> list[str]:
    """The recipe as a user runs it against ``url``; ``--ranks N`` under torchrun (rank 0 decides
    and pushes, every rank redoes its rollouts)."""
    launch = [sys.executable, "-m", "benchmarks.chaos_train"]
    if args.ranks > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                  str(args.ranks), str(Path(__file__).resolve())]  # fmt: skip
    return [
        *launch, "trainer", "--url", url, "--model", str(args.model),
        "--cpu", "--iterations", str(args.iterations), "--prompts", str(args.prompts),
        "--group-size", str(args.group_size), "--steps", "4", "--size", "32", "--lora-rank", "4",
        "--seed", str(args.seed), "--out", str(out),
        # (--full-finetune keeps no checkpoint yet: a killed trainer starts over)
        *([] if getattr(args, "full", False) else ["--checkpoint", str(checkpoint)]),
        "--request-timeout", str(args.request_timeout), "--recover-timeout", str(args.recover_timeout),
        *(["--async-depth", str(args.async_depth)] if args.async_depth else []),
        *(["--full-finetune", "--weight-sync", "http"] if getattr(args, "full", False) else []),
    ]  # fmt: skip


def _checkpointed(checkpoint: Path) -> int:
    try:
        return int(json.loads((checkpoint / "state.json").read_text())["next_iteration"])
    except (OSError, ValueError, KeyError):
        return 0


def _history_len(out: Path) -> int:
    try:
        return len(json.loads(out.read_text())["history"])
    except (OSError, ValueError, KeyError):
        return 0


def run_training(
    args: argparse.Namespace, work: Path, name: str, faults: list[Fault], admin_key: str, deadline: float,
    replicas: int = 1, max_trainer_restarts: int = 5,
) -> dict[str, Any]:  # fmt: skip
    """One supervised run: server, proxy, trainer (restarted after each death until it completes,
    at most ``max_trainer_restarts`` times)."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = ServerSupervisor(
        args.model, port, admin_key, args.group_size, work / f"{name}-server.log", replicas=replicas
    )
    trainer: dict[str, subprocess.Popen | None] = {"proc": None}
    trainer_deaths: list[dict[str, Any]] = []

    def kill_trainer() -> None:
        proc = trainer["proc"]
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    proxy = FaultProxy(
        port, faults, delay_s=args.request_timeout * 1.5,
        on_kill_server=server.kill_and_restart,
        on_restart_server=lambda: server.kill_and_restart(wait_ready=True),
        on_kill_trainer=kill_trainer, on_kill_replica=server.kill_busy_replica,
    )  # fmt: skip
    checkpoint, out = work / f"{name}-checkpoint", work / f"{name}.json"
    disk_full = next((f for f in faults if f.action == "disk_full"), None)
    env = {**os.environ, "DIFFUSION_ROLLOUT_ADMIN_KEY": admin_key, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    if disk_full is not None:
        env["CHAOS_DISK_FULL_AT"] = str(disk_full.iteration)
        env["CHAOS_DISK_FULL_MARK"] = str(work / f"{name}-disk-full.fired")
    cmd = trainer_command(args, f"http://127.0.0.1:{proxy.port}", checkpoint, out)
    t0 = time.monotonic()
    server.start()
    # The first trainer starts on a ready server: its start-up wait is --recover-timeout (seconds,
    # in the tests), and on a loaded 2-core CI machine the tiny server's load alone took longer.
    server.wait_ready()
    completed, stopped = False, None
    try:
        while time.monotonic() < deadline:
            with open(work / f"{name}-trainer.log", "ab") as log:
                proc = trainer["proc"] = subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            if proc.poll() is None:
                stopped = "deadline"
                stop_session(proc, signal.SIGKILL)
                break
            if proc.returncode == 0:
                completed = True
                break
            tail = (work / f"{name}-trainer.log").read_text(errors="replace")[-4000:]
            cause = "trainer_killed" if proc.returncode < 0 else "trainer_failed"
            if "No space left on device" in tail.rsplit("resumed from", 1)[-1]:
                cause = "checkpoint_disk_full"
            # Iterations recorded but not checkpointed are redone (the one in flight when the
            # checkpoint write failed); an iteration killed before its record is simply redone.
            death = {"cause": cause, "returncode": proc.returncode, "at": time.time(),
                     "iterations_recorded": _history_len(out), "iterations_checkpointed": _checkpointed(checkpoint)}  # fmt: skip
            trainer_deaths.append(death)
            print(
                f"[chaos] trainer exited ({cause}, {proc.returncode}); restarting from its checkpoint",
                flush=True,
            )
            if len(trainer_deaths) > max_trainer_restarts:
                stopped = "trainer kept dying"
                break
            # The first iteration the restarted trainer completes ends this death's seconds lost.
            threading.Thread(
                target=_time_resume, args=(death, out, checkpoint, deadline), daemon=True
            ).start()
    finally:
        proxy.close()
        server.stop()
    if disk_full is not None and Path(env["CHAOS_DISK_FULL_MARK"]).exists():
        disk_full.fired_at = Path(env["CHAOS_DISK_FULL_MARK"]).stat().st_mtime
    record = json.loads(out.read_text()) if out.exists() else {"history": []}
    return {
        "name": name, "completed": completed, "stopped": stopped, "wall_s": round(time.monotonic() - t0, 2),
        "record": record, "trainer_deaths": trainer_deaths, "server_restarts": server.restarts,
        "replicas_killed": server.replicas_killed,
        "checkpoint": checkpoint,
    }  # fmt: skip


def _time_resume(death: dict[str, Any], out: Path, checkpoint: Path, deadline: float) -> None:
    """Seconds from a trainer's death until its successor completed an iteration (the checkpoint's
    ``next_iteration`` passes the one the dead trainer had checkpointed)."""
    state = checkpoint / "state.json"
    try:
        start = json.loads(state.read_text())["next_iteration"] if state.exists() else 0
    except ValueError:
        start = 0
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            if json.loads(state.read_text())["next_iteration"] > start:
                death["seconds_lost"] = round(time.time() - death["at"], 3)
                return
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------- report
def adapters_equal(a: Path, b: Path) -> bool:
    sa = torch.load(a / "trainer.pt", weights_only=True)["adapters"]["default"]
    sb = torch.load(b / "trainer.pt", weights_only=True)["adapters"]["default"]
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def fault_rows(faults: list[Fault], chaos: dict[str, Any]) -> list[dict[str, Any]]:
    """Each fault with the recovery it led to: the first unclaimed recovery the recipe recorded after
    it was injected, or the trainer restart it caused."""
    events = sorted(chaos["record"].get("recoveries", []), key=lambda e: e["at"])
    deaths = sorted(chaos["trainer_deaths"], key=lambda d: d["at"])
    claimed: set[int] = set()
    rows = []
    for f in faults:
        row: dict[str, Any] = {"fault": f.name, "injected": f.fired_at is not None, "recovered": False,
                               "recovered_by": None, "seconds_lost": None}  # fmt: skip
        if f.fired_at is not None and f.expect == "trainer_restart":
            want = "checkpoint_disk_full" if f.action == "disk_full" else "trainer_killed"
            for d in deaths:
                if id(d) not in claimed and d["cause"] == want and d["at"] >= f.fired_at - 1:
                    claimed.add(id(d))
                    row.update(recovered=chaos["completed"] and "seconds_lost" in d,
                               recovered_by=f"restart from checkpoint ({want})", seconds_lost=d.get("seconds_lost"))  # fmt: skip
                    break
        elif f.fired_at is not None:
            for i, e in enumerate(events):
                if i not in claimed and e["at"] >= f.fired_at:
                    claimed.add(i)
                    row.update(recovered=chaos["completed"], recovered_by=f"{e['cause']} ({e['action']})",
                               seconds_lost=e["seconds"])  # fmt: skip
                    break
            else:
                if f.expect == "any" and chaos["completed"] and not chaos["trainer_deaths"]:
                    # The server absorbed it (a replica's request answered by its peer or retried).
                    row.update(
                        recovered=True, recovered_by="server side, no trainer recovery", seconds_lost=0.0
                    )
        rows.append(row)
    return rows


def scenario(
    args: argparse.Namespace, work: Path, name: str, faults: list[Fault], admin_key: str, deadline: float,
    replicas: int = 1,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """The run under ``faults`` and the same run without them: each fault's row, and the summary.
    With ``--async-depth`` there is no fault-free run: which batches come out stale, and so the
    final adapter, depends on timing (``None`` in the comparison fields)."""
    chaos = run_training(args, work, name, faults, admin_key, deadline, replicas)
    clean = (
        None
        if args.async_depth
        else run_training(args, work, f"{name}-fault-free", [], admin_key, deadline, replicas)
    )
    rows = fault_rows(faults, chaos)
    history = chaos["record"]["history"]
    equal = None
    if clean is not None:
        equal = bool(
            chaos["completed"]
            and clean["completed"]
            and adapters_equal(chaos["checkpoint"], clean["checkpoint"])
        )
    by_cause = chaos["record"].get("recoveries_by_cause", {})
    for d in chaos["trainer_deaths"]:
        c = by_cause.setdefault(d["cause"], {"count": 0, "seconds": 0.0})
        c["count"] += 1
        c["seconds"] = round(c["seconds"] + (d.get("seconds_lost") or 0.0), 3)
    summary = {
        "replicas": replicas,
        "completed": chaos["completed"],
        "iterations_completed": len(history),
        "iterations": args.iterations,
        "faults_injected": sum(r["injected"] for r in rows),
        "faults_recovered": sum(r["recovered"] for r in rows),
        "recoveries_by_cause": by_cause,
        "seconds_lost": round(sum(c["seconds"] for c in by_cause.values()), 3),
        "off_policy_rejected_groups": chaos["record"].get("off_policy_rejected", 0),
        # Not exactly on-policy and not TIS-weighted (a stale --async-depth batch is, and may differ).
        "trained_off_policy": sum(h["first_ratio_max_dev"] != 0 and not h.get("tis_weighted") for h in history),
        "trained_stale_with_tis": sum(bool(h.get("staleness")) for h in history),
        "server_restarts": chaos["server_restarts"],
        "replicas_killed": chaos["replicas_killed"],
        "trainer_restarts": len(chaos["trainer_deaths"]),
        # Per trainer restart: recorded iterations it redid (at most the one in flight).
        "iterations_redone": [d["iterations_recorded"] - d["iterations_checkpointed"] for d in chaos["trainer_deaths"]],
        "final_adapter_equals_fault_free": equal,
        "rewards_equal_fault_free": None if clean is None else [h["rewards"] for h in history] == [h["rewards"] for h in clean["record"]["history"]],
        "wall_s": chaos["wall_s"],
        "fault_free_wall_s": None if clean is None else clean["wall_s"],
    }  # fmt: skip
    summary["ok"] = bool(
        summary["completed"] and summary["faults_recovered"] == len(faults) and summary["trained_off_policy"] == 0
        and equal is not False
    )  # fmt: skip
    return rows, summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trainer"]:
        return trainer_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="folder for chaos_train.json (default: none)")
    p.add_argument("--work", default=None, help="folder for checkpoints and logs (default: a temporary one)")
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument(
        "--prompts", type=int, default=1, help="requests per iteration (restart_server_first assumes 1)"
    )
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks", type=int, default=1, help="trainer ranks (torchrun; gloo on the CPU)")
    p.add_argument(
        "--async-depth", type=int, default=0,
        help="the recipe's --async-depth (the final adapter then depends on the staleness each batch met)",
    )  # fmt: skip
    p.add_argument(
        "--request-timeout", type=float, default=10.0, help="the trainer's; the delay fault is 1.5x"
    )
    p.add_argument("--recover-timeout", type=float, default=120.0)
    p.add_argument("--deadline-s", type=float, default=600.0, help="every run together")
    p.add_argument("--faults", default=None, help="comma-separated actions to inject (default: all)")
    p.add_argument(
        "--ray", action="store_true",
        help="also: a replica SIGKILLed mid-rollout behind a 2-replica Ray pool (`serve --replicas 2`), "
        "3 iterations, with its own fault-free run",
    )  # fmt: skip
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.deadline_s
    with contextlib.ExitStack() as stack:
        import tempfile

        work = Path(args.work) if args.work else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        from diffusion_rollout.models import save_tiny_model

        args.model = save_tiny_model("sd3", work / "tiny-sd3")
        faults = default_faults()
        if args.faults:
            faults = [f for f in faults if f.action in args.faults.split(",")]
        admin_key = secrets.token_hex(16)
        rows: list[dict[str, Any]] = []
        summary: dict[str, Any] = {}
        if faults:  # (--faults none: only the --ray run)
            rows, summary = scenario(args, work, "chaos", faults, admin_key, deadline)
        ray_faults: list[Fault] = []
        if args.ray:
            ray_faults = [ray_fault()]
            ray_args = argparse.Namespace(**{**vars(args), "iterations": 3})
            ray_rows, ray_summary = scenario(
                ray_args, work, "ray", ray_faults, admin_key, deadline, replicas=2
            )
            rows += ray_rows
            summary["ray"] = ray_summary
    print_table("faults", rows, [("fault", "fault", ""), ("injected", "injected", ""), ("recovered", "recovered", ""),
                                 ("recovered_by", "recovered by", ""), ("seconds_lost", "s lost", ".3g")])  # fmt: skip
    print(json.dumps(summary, indent=1), flush=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "work", "model")}
    settings["faults"] = [{"name": f.name, "action": f.action, "iteration": f.iteration,
                           "match": f.match.decode() if f.match else "checkpoint write"} for f in faults + ray_faults]  # fmt: skip
    ok = summary.get("ok", True) and summary.get("ray", {}).get("ok", True)
    doc = document("chaos_train", "cpu", settings, rows, ok=bool(ok))
    doc["summary"] = summary
    write_json(args.out, "chaos_train", doc)
    return doc


def ray_fault() -> Fault:
    return Fault("replica SIGKILLed mid-rollout (Ray, 2 replicas)", "kill_replica", GENERATE, 1, "any")


# ---------------------------------------------------------------------------------------------- trainer
def trainer_main(argv: list[str]) -> dict[str, Any]:
    """The recipe's own ``main``, with the full-disk fault armed by ``$CHAOS_DISK_FULL_AT``: the
    checkpoint write of that iteration writes a few bytes and fails with ENOSPC (once per run)."""
    from diffusion_rollout.recipes import checkpoint as _checkpoint
    from diffusion_rollout.recipes import flow_grpo
    from diffusion_rollout.recipes import full as _full

    part_bytes = os.environ.get("CHAOS_MAX_PART_BYTES")
    if part_bytes:  # full pushes in many parts, so that a fault can land in the middle of one
        import functools

        _full.push_weights = functools.partial(_full.push_weights, max_part_bytes=int(part_bytes))

    at, mark = os.environ.get("CHAOS_DISK_FULL_AT"), os.environ.get("CHAOS_DISK_FULL_MARK")
    if at is not None and mark is not None and not Path(mark).exists():
        real_save = _checkpoint.Checkpoint.save

        def save(self, transformer, optimizer, adapters, state):
            if state["next_iteration"] == int(at) + 1 and not Path(mark).exists():
                Path(mark).touch()

                def full(f):
                    f.write(b"the first bytes of a checkpoint")
                    raise OSError(errno.ENOSPC, "No space left on device")

                _checkpoint._write_atomically(self.dir / "trainer.pt", full)
            return real_save(self, transformer, optimizer, adapters, state)

        _checkpoint.Checkpoint.save = save
    return flow_grpo.main(argv)


if __name__ == "__main__":
    main()
    sys.exit(0)
