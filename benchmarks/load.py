"""Load test: many concurrent rollout clients plus periodic weight updates and LoRA switches.

    python -m benchmarks.load --duration 150 --clients 16 --out bench-out

starts ``diffusion-rollout serve`` on the tiny SD3 model (a subprocess on 127.0.0.1, API and admin
keys set, a small queue so backpressure happens), then for ``--duration`` seconds runs:

- ``--clients`` threads sending GRPO-like rollouts (1, 2 or 4 outputs, SDE, a few with trajectory
  or replay conditioning), retrying after ``Retry-After`` on 429; a fraction (``--abandon``) of the
  requests is abandoned on purpose after 50 ms (the client closes its socket), which exercises the
  disconnect path under load;
- one updater thread pushing full transformer weights (``POST /update_weights``, safetensors bytes)
  every ``--update-every`` s and switching the active LoRA adapter (``POST /lora/activate``, two
  adapters loaded once, or none) every ``--lora-every`` s. Every change carries a ``weight_version``
  that names the resulting state (``u<k>:b<base>:l<lora>``);
- one probe thread sending a deterministic ODE rollout at a size no client uses, so it always runs
  alone in its batch and its output is bit-identical to the reference of the state it claims. A
  probe output that matches no reference of its version is an output that mixed weight versions
  (an update landing mid-loop); a client response whose outputs carry different versions is too.
- a sampler of the server's RSS (``/proc/<pid>/status``) every ``--sample-every`` s.

Reported: requests sent, answered (200), refused with 429 (then retried), failed (any other
status), lost (no HTTP answer: connection error or client-side timeout on a request not meant to be
abandoned), abandoned on purpose, outputs, mixed-version outputs (must be 0), RSS over time (flat
means the last fifth's median is within a few MiB of the first fifth's after warm-up), and the
server's own ``/metrics`` at the end. ``--url`` runs against a server already started instead (give
``--pid`` for its RSS); the weights must then be the tiny SD3 model's at seed 0.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save

from benchmarks.report import document, write_json
from diffusion_rollout.protocol import wire
from diffusion_rollout.testing import free_port, start_cli_server

API_KEY = "load-api-key"
ADMIN_KEY = "load-admin-key"
PROMPTS = [
    "a red cat on a sofa", "a lighthouse at dusk", "two apples on a table", "a city street in rain",
    "an astronaut riding a horse", "a bowl of ramen", "a snowy mountain", "a watercolor fox",
]  # fmt: skip
# The probe: a size no client uses (its own batch key), ODE so it is deterministic.
PROBE = {
    "prompt": "the probe prompt",
    "seed": 1234,
    "width": 48,
    "height": 48,
    "num_inference_steps": 3,
    "max_sequence_length": 16,
    "rollout_sde_type": "ode",
    "rollout_log_prob_no_const": True,
    "rollout_debug_mode": False,
}
LORA_CONFIGS = {
    "style_a": {"r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]},
    "style_b": {"r": 2, "lora_alpha": 2, "target_modules": ["to_q", "to_v"]},
}


# ---------------------------------------------------------------------------------------------
# Server process and model payloads
# ---------------------------------------------------------------------------------------------
def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def start_server(model: Path, args) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="load-server-")) / "server.log"
    cmd = [
        sys.executable, "-m", "diffusion_rollout.entrypoints.cli", "serve",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--dtype", "float32",
        "--api-key", API_KEY, "--admin-key", ADMIN_KEY,
        "--max-batch-size", str(args.max_batch_size), "--max-queue-depth", str(args.max_queue_depth),
        "--request-timeout-s", "120", "--shutdown-grace-s", "20", "--log-level", "warning",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    return start_cli_server(cmd, log, url, 180), url, log


def payloads(model: Path, seed: int) -> tuple[list[dict[str, torch.Tensor]], dict[str, tuple[dict, dict]]]:
    """Two full transformer snapshots (the model's own, and a perturbed one) and two LoRA adapters."""
    from diffusers import DiffusionPipeline
    from peft import LoraConfig, get_peft_model_state_dict

    pipe = DiffusionPipeline.from_pretrained(str(model), dtype=torch.float32)
    transformer = pipe.transformer
    base = {n: p.detach().clone() for n, p in transformer.named_parameters()}
    g = torch.Generator().manual_seed(seed)
    other = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in base.items()}
    adapters = {}
    for name, cfg in LORA_CONFIGS.items():
        scratch = copy.deepcopy(transformer)
        scratch.add_adapter(LoraConfig(**cfg), adapter_name=name)
        with torch.no_grad():
            for n, p in scratch.named_parameters():
                if "lora_" in n:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
        tensors = {k: v.clone() for k, v in get_peft_model_state_dict(scratch, adapter_name=name).items()}
        adapters[name] = (cfg, tensors)
    return [base, other], adapters


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.c: collections.Counter[str] = collections.Counter()
        self.codes: collections.Counter[int] = collections.Counter()
        self.latencies: list[float] = []
        self.notes: list[str] = []

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.c[key] += n

    def note(self, text: str) -> None:
        with self.lock:
            if len(self.notes) < 20 and text not in self.notes:
                self.notes.append(text)


class Load:
    def __init__(self, url: str, args, snapshots, adapters) -> None:
        self.url = url
        self.args = args
        self.snapshots = snapshots
        self.adapters = adapters
        self.stats = Stats()
        self.stop = threading.Event()
        self.admin = httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        self.state = (0, None)  # (base snapshot, active LoRA) as last applied
        self.changes = 0
        self.references: dict[tuple[int, str | None], torch.Tensor] = {}
        self.update_times: list[float] = []

    # ---------------------------------------------------------------- admin side
    def _admin(self, path: str, **kw) -> dict:
        r = self.admin.post(path, **kw)
        if r.status_code != 200:
            raise RuntimeError(f"{path} -> {r.status_code} {r.text[:500]}")
        return r.json()

    def version(self, base: int, lora: str | None) -> str:
        self.changes += 1
        return f"u{self.changes}:b{base}:l{lora or '-'}"

    def set_base(self, base: int) -> None:
        t0 = time.perf_counter()
        v = self.version(base, self.state[1])
        self._admin(
            "/update_weights",
            content=save(self.snapshots[base]),
            params={"weight_version": v},
            headers={"Content-Type": "application/octet-stream"},
        )
        self.update_times.append(time.perf_counter() - t0)
        self.state = (base, self.state[1])
        self.stats.add("weight_updates")

    def set_lora(self, lora: str | None) -> None:
        v = self.version(self.state[0], lora)
        self._admin("/lora/activate", json={"name": lora, "weight_version": v})
        self.state = (self.state[0], lora)
        self.stats.add("lora_switches")

    def setup(self) -> None:
        for name, (cfg, tensors) in self.adapters.items():
            self._admin(
                "/lora/load",
                content=save(tensors, metadata={"peft_config": json.dumps(cfg)}),
                params={"name": name},
                headers={"Content-Type": "application/octet-stream"},
            )
        # One reference output per state, computed with nothing else running.
        for base in range(len(self.snapshots)):
            self.set_base(base)
            for lora in (None, *self.adapters):
                self.set_lora(lora)
                out, version = self.probe_once()
                assert version == f"u{self.changes}:b{base}:l{lora or '-'}", version
                self.references[(base, lora)] = out
        refs = list(self.references.values())
        distinct = {tuple(r.flatten()[:64].tolist()) for r in refs}
        assert len(distinct) == len(refs), "states must give distinct probe outputs to be told apart"
        self.stats.c.clear()

    def updater(self) -> None:
        rng = random.Random(1)
        next_update = time.monotonic() + self.args.update_every
        next_lora = time.monotonic() + self.args.lora_every
        while not self.stop.is_set():
            now = time.monotonic()
            try:
                if now >= next_update:
                    self.set_base(1 - self.state[0])
                    next_update = now + self.args.update_every
                if now >= next_lora:
                    choices = [x for x in (None, *self.adapters) if x != self.state[1]]
                    self.set_lora(rng.choice(choices))
                    next_lora = now + self.args.lora_every
            except Exception as exc:
                self.stats.add("admin_failures")
                self.stats.note(f"admin: {exc}")
            self.stop.wait(0.05)

    # ---------------------------------------------------------------- probe
    def probe_once(self, client: httpx.Client | None = None) -> tuple[torch.Tensor, str]:
        c = client or self.admin
        while True:
            r = c.post("/rollout/generate", json=PROBE, headers={"Accept": wire.MSGPACK})
            if r.status_code != 429:  # the probe is a client like the others: it waits its turn
                break
            self.stats.add("probe_429")
            time.sleep(0.05)
        if r.status_code != 200:
            raise RuntimeError(f"probe -> {r.status_code} {r.text[:300]}")
        [out] = wire.decode(r.content, r.headers["content-type"])
        return out["generated_output"], out["weight_version"]

    def prober(self) -> None:
        with httpx.Client(
            base_url=self.url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as c:
            while not self.stop.is_set():
                try:
                    img, version = self.probe_once(c)
                except Exception as exc:
                    self.stats.add("probe_failures")
                    self.stats.note(f"probe: {exc}")
                    continue
                self.stats.add("probes")
                _, b, lora = version.split(":")
                key = (int(b[1:]), None if lora == "l-" else lora[1:])
                if not torch.equal(img, self.references[key]):
                    self.stats.add("mixed_version_outputs")
                    self.stats.note(f"probe output does not match the reference of {version}")
                self.stop.wait(0.02)

    # ---------------------------------------------------------------- clients
    def body(self, rng: random.Random) -> dict[str, Any]:
        n = rng.choice([1, 2, 2, 4])
        b = {
            "prompt": rng.choice(PROMPTS),
            "seed": rng.randrange(2**31),
            "num_outputs_per_prompt": n,
            "width": 32,
            "height": 32,
            "num_inference_steps": rng.choice([4, 6]),
            "max_sequence_length": 16,
            "rollout_noise_level": 0.7,
            "rollout_debug_mode": False,
        }
        extra = rng.random()
        if extra < 0.1:
            b["rollout_return_dit_trajectory"] = True
        elif extra < 0.15:
            b["rollout_return_denoising_env"] = True
        return b

    def client(self, index: int) -> None:
        rng = random.Random(1000 + index)
        st = self.stats
        headers = {"Authorization": f"Bearer {API_KEY}", "Accept": wire.MSGPACK}
        with httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(120.0)) as c:
            while not self.stop.is_set():
                body = self.body(rng)
                abandon = rng.random() < self.args.abandon
                st.add("sent")
                t0 = time.perf_counter()
                try:
                    if abandon:
                        c.post("/rollout/generate", json=body, timeout=httpx.Timeout(120.0, read=0.05))
                    else:
                        r = c.post("/rollout/generate", json=body)
                except httpx.ReadTimeout:
                    st.add("abandoned" if abandon else "lost")
                    if not abandon:
                        st.note("client timeout on a request not meant to be abandoned")
                    continue
                except httpx.HTTPError as exc:
                    st.add("lost")
                    st.note(f"transport: {type(exc).__name__}: {exc}")
                    continue
                if abandon:  # answered before we gave up: an ordinary answer
                    st.add("abandoned_but_answered")
                    continue
                with st.lock:
                    st.codes[r.status_code] += 1
                if r.status_code == 429:
                    st.add("refused_429")
                    time.sleep(min(float(r.headers.get("retry-after", "1")), 1.0) * rng.random())
                    continue
                if r.status_code != 200:
                    st.add("failed")
                    st.note(f"{r.status_code}: {r.text[:300]}")
                    continue
                outs = wire.decode(r.content, r.headers["content-type"])
                with st.lock:
                    st.latencies.append(time.perf_counter() - t0)
                st.add("answered")
                st.add("outputs", len(outs))
                if len(outs) != body["num_outputs_per_prompt"]:
                    st.add("wrong_output_count")
                if len({o["weight_version"] for o in outs}) > 1:
                    st.add("mixed_version_outputs", len(outs))
                    st.note(f"one response with versions {[o['weight_version'] for o in outs]}")
                if any(o.get("nonfinite_output") for o in outs):
                    st.add("nonfinite_outputs")

    # ---------------------------------------------------------------- memory
    def sampler(self, pid: int | None, samples: list[tuple[float, float | None]], t_start: float) -> None:
        while not self.stop.is_set():
            samples.append((time.monotonic() - t_start, rss_mib(pid) if pid else None))
            self.stop.wait(self.args.sample_every)


def metrics_snapshot(url: str) -> dict[str, float]:
    wanted = (
        "diffusion_rollout_images_total", "diffusion_rollout_batches_total",
        "diffusion_rollout_batch_size_sum", "diffusion_rollout_batch_size_count",
        "diffusion_rollout_weight_updates_total", "diffusion_rollout_queue_depth",
        "diffusion_rollout_step_seconds_sum", "diffusion_rollout_step_seconds_count",
    )  # fmt: skip
    out: dict[str, float] = {}
    text = httpx.get(url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        if name in wanted or name.startswith(
            ("diffusion_rollout_requests_total", "diffusion_rollout_requests_cancelled_total",
             "diffusion_rollout_batch_failures_total")
        ):  # fmt: skip
            out[name] = float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=150.0, help="seconds of load")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--update-every", type=float, default=3.0, help="seconds between full weight updates")
    p.add_argument("--lora-every", type=float, default=2.0, help="seconds between LoRA switches")
    p.add_argument("--abandon", type=float, default=0.03, help="fraction of requests abandoned on purpose")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-queue-depth", type=int, default=12, help="below --clients, so 429 happens")
    p.add_argument("--url", default=None, help="use a running server (tiny SD3, seed 0, these keys)")
    p.add_argument("--pid", type=int, default=None, help="the running server's pid, for its RSS")
    p.add_argument("--out", default=None, help="folder for load.json")
    args = p.parse_args(argv)

    torch.set_num_threads(1)  # the client side must not starve the server of cores
    workdir = Path(tempfile.mkdtemp(prefix="load-"))
    from diffusion_rollout.models import save_tiny_model

    model = save_tiny_model("sd3", workdir / "tiny-sd3")
    proc = log = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        proc, url, log = start_server(model, args)
        pid = proc.pid
    print(f"server {url} pid {pid}; building payloads", flush=True)
    snapshots, adapters = payloads(model, seed=5)
    load = Load(url, args, snapshots, adapters)
    load.setup()
    print(f"references for {len(load.references)} states; running {args.duration:.0f} s", flush=True)

    samples: list[tuple[float, float | None]] = []
    t_start = time.monotonic()
    threads = [threading.Thread(target=load.client, args=(i,), daemon=True) for i in range(args.clients)]
    threads += [
        threading.Thread(target=load.updater, daemon=True),
        threading.Thread(target=load.prober, daemon=True),
        threading.Thread(target=load.sampler, args=(pid, samples, t_start), daemon=True),
    ]
    for t in threads:
        t.start()
    next_print = 30.0
    while time.monotonic() - t_start < args.duration:
        time.sleep(1.0)
        elapsed = time.monotonic() - t_start
        if elapsed >= next_print:
            next_print += 30.0
            c = load.stats.c
            print(
                f"  t={elapsed:5.0f}s sent={c['sent']} answered={c['answered']} 429={c['refused_429']} "
                f"failed={c['failed']} lost={c['lost']} updates={c['weight_updates']} "
                f"lora={c['lora_switches']} probes={c['probes']} rss={samples[-1][1] if samples else None}",
                flush=True,
            )
    load.stop.set()
    for t in threads:
        t.join(150)
    wall = time.monotonic() - t_start
    samples.append((wall, rss_mib(pid) if pid else None))

    # After the load: still healthy, and the probe still matches the current state.
    health = httpx.get(url + "/health_generate", timeout=60).status_code
    img, version = load.probe_once()
    base, lora = load.state
    final_ok = torch.equal(img, load.references[load.state]) and version.endswith(f":b{base}:l{lora or '-'}")
    server_metrics = metrics_snapshot(url)
    shutdown_s = exit_code = None
    if proc is not None:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            exit_code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = "killed"
        shutdown_s = time.monotonic() - t0

    c = load.stats.c
    rss = [m for _, m in samples if m is not None]
    fifth = max(1, len(rss) // 5)
    # The first sample is taken as the load starts; memory is judged from the first fifth on.
    first, last = (statistics.median(rss[:fifth]), statistics.median(rss[-fifth:])) if rss else (None, None)
    lat = sorted(load.stats.latencies)
    answered_outputs = c["outputs"]
    result = {
        "duration_s": round(wall, 1),
        "clients": args.clients,
        "requests_sent": c["sent"],
        "answered_200": c["answered"],
        "refused_429_then_retried": c["refused_429"],
        "failed_other_status": c["failed"],
        "lost_no_answer": c["lost"],
        "abandoned_on_purpose": c["abandoned"],
        "abandoned_but_answered_first": c["abandoned_but_answered"],
        "status_codes": dict(load.stats.codes),
        "outputs": answered_outputs,
        "outputs_per_s": round(answered_outputs / wall, 1),
        "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
        "latency_p99_s": round(lat[int(len(lat) * 0.99)], 3) if lat else None,
        "weight_updates": c["weight_updates"],
        "weight_update_mean_s": round(statistics.mean(load.update_times), 3) if load.update_times else None,
        "lora_switches": c["lora_switches"],
        "admin_failures": c["admin_failures"],
        "probes": c["probes"],
        "probe_failures": c["probe_failures"],
        "probe_429_then_retried": c["probe_429"],
        "mixed_version_outputs": c["mixed_version_outputs"],
        "wrong_output_count": c["wrong_output_count"],
        "nonfinite_outputs": c["nonfinite_outputs"],
        "health_generate_after": health,
        "final_probe_matches_state": final_ok,
        "rss_mib_samples": [[round(t, 1), round(m, 1) if m else None] for t, m in samples],
        "rss_mib_first_fifth_median": round(first, 1) if first else None,
        "rss_mib_last_fifth_median": round(last, 1) if last else None,
        "rss_mib_growth": round(last - first, 1) if rss else None,
        "server_metrics": server_metrics,
        "shutdown_s": round(shutdown_s, 2) if shutdown_s is not None else None,
        "server_exit_code": exit_code,
        "notes": load.stats.notes,
    }
    ok = (
        c["lost"] == 0
        and c["failed"] == 0
        and c["mixed_version_outputs"] == 0
        and c["wrong_output_count"] == 0
        and c["admin_failures"] == 0
        and c["probe_failures"] == 0
        and health == 200
        and final_ok
    )
    printable = {k: v for k, v in result.items() if k != "rss_mib_samples"}
    printable["rss_mib_samples"] = " ".join(f"{t:.0f}s:{m}" for t, m in result["rss_mib_samples"])
    print(json.dumps(printable, indent=1, default=str))
    print("OK" if ok else "NOT OK", flush=True)
    doc = document("load", "cpu", vars(args), [result], ok=ok)
    path = write_json(args.out, "load", doc)
    if path:
        print(f"wrote {path}")
    if log is not None and not ok:
        print(log.read_text()[-4000:])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
