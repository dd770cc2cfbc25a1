"""Every benchmark on the real architectures in one process: one device call, about 8 minutes on an H100.

Device time is scarce (the machine's start-up costs minutes), so the whole measurement set runs in
one process that builds each model once, on the GPU, and writes each benchmark's JSON as soon as it
is complete (a call stopped at its time limit still returns what was finished).

Phases, in priority order, each skipped and recorded when the remaining ``--budget-s`` is below
its estimate, each failure recorded without stopping the rest:

1. SD3.5-medium (512x512, 10 steps, CFG 4.5): ODE regression, rollout overhead, Flow-GRPO throughput
   (groups of 16, max batch 16 and 64), then the same throughput with regional ``torch.compile``
   (stock and server both compiled; in place, so after the eager measurements). Then SD3.5 is freed
   (FLUX needs the memory).
2. FLUX.1-dev (1024x1024): ODE regression (6 steps), rollout overhead (28 steps), weight sync (IPC
   of the whole 12B transformer, HTTP and disk of ``--http-gb``, LoRA rank 64), cuDNN attention.
3. FLUX regional ``torch.compile`` (ms/step, 10 steps).
4. Wan 2.1 1.3B (480x832, 17 frames, 4 steps): ODE regression (added to ``ode_regression.json``),
   when time is left.

Files under ``--out``: ``ode_regression.json``, ``rollout_overhead.json``, ``throughput.json``,
``weight_sync.json``, ``summary.json`` (targets met or not, phases run, skipped, failed). The exit
status is 1 when the ODE regression found a difference, 2 when a phase failed.

    BENCH_COMMIT=<sha> python -m benchmarks.gpu_suite --out $OUT
"""

from __future__ import annotations

import argparse
import gc
import sys
import traceback
from typing import Any

import torch

from benchmarks import ode_regression, rollout_overhead, throughput, weight_sync
from benchmarks.cli import quiet_libraries
from benchmarks.facts import facts
from benchmarks.model_builders import BenchModel, build
from benchmarks.report import document, log, print_table, write_json
from benchmarks.timing import Deadline


class Suite:
    def __init__(self, out_dir: str | None, budget_s: float, device: str) -> None:
        self.out = out_dir
        self.deadline = Deadline(budget_s)
        self.device = device
        self.phases: list[dict[str, Any]] = []
        self.models: dict[str, BenchModel] = {}
        self.ode_rows: list[dict[str, Any]] = []
        self.overhead_rows: list[dict[str, Any]] = []
        self.grpo_rows: list[dict[str, Any]] = []
        self.step_rows: list[dict[str, Any]] = []
        self.docs: dict[str, dict[str, Any]] = {}
        self.settings: dict[str, Any] = {}
        self.alias: dict[str, str] = {}  # --tiny: real name -> tiny zoo model (a CPU dry run)
        self.ode_steps = dict(ODE_STEPS)

    def phase(self, name: str, estimate_s: float, fn) -> Any:
        left = self.deadline.left()
        if left < estimate_s:
            log(f"SKIP {name}: {left:.0f} s left, needs ~{estimate_s:.0f} s")
            self.phases.append({"phase": name, "status": "skipped", "estimate_s": estimate_s, "left_s": left})
            return None
        log(f"START {name} (~{estimate_s:.0f} s, {left:.0f} s left)")
        t0 = self.deadline.elapsed()
        try:
            value = fn()
            status, error = "ok", None
        except Exception as exc:
            value, status = None, "failed"
            error = f"{type(exc).__name__}: {exc}"[:2000]
            log(f"FAILED {name}: {error}")
            traceback.print_exc()
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()
        took = self.deadline.elapsed() - t0
        row = {"phase": name, "status": status, "seconds": took, "estimate_s": estimate_s}
        if self.device.startswith("cuda"):
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        if error:
            row["error"] = error
        self.phases.append(row)
        log(f"END {name}: {status} in {took:.1f} s")
        self.write_summary()  # after every phase: a run stopped at its time limit keeps its summary
        return value

    def targets(self) -> dict[str, Any]:
        targets: dict[str, Any] = {}
        for name, doc in self.docs.items():
            for key, value in (doc.get("targets") or {}).items():
                targets[f"{name}.{key}"] = value
        ode_doc = self.docs.get("ode_regression")
        if ode_doc is not None:
            targets["ode_regression.exact"] = {"met": ode_doc["ok"], "rows": len(ode_doc["results"])}
        return targets

    def write_summary(self) -> dict[str, Any]:
        ok = all(ph["status"] != "failed" for ph in self.phases)
        summary = document("gpu_suite", self.device, self.settings, self.phases, ok=ok)
        summary["targets"] = self.targets()
        summary["elapsed_s"] = self.deadline.elapsed()
        write_json(self.out, "summary", summary)
        return summary

    def model(self, name: str) -> BenchModel:
        if name not in self.models:
            m = build(self.alias.get(name, name), self.device)
            log(f"built {name} in {m.build_s:.1f} s")
            self.models[name] = m
        return self.models[name]

    def free(self, name: str) -> None:
        m = self.models.pop(name, None)
        if m is not None:
            m.close()
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ reports
    def write_ode(self, models: list[str]) -> None:
        self.docs["ode_regression"] = ode_regression.report(
            self.ode_rows,
            settings={"models": models, "modes": ["rollout_false", "ode_rollout"], "steps": self.ode_steps},
            device=self.device,
            out_dir=self.out,
        )

    def write_overhead(self, settings: dict[str, Any]) -> None:
        self.docs["rollout_overhead"] = rollout_overhead.report(
            self.overhead_rows, settings=settings, device=self.device, out_dir=self.out
        )

    def write_throughput(self, settings: dict[str, Any]) -> None:
        self.docs["throughput"] = throughput.report(
            self.grpo_rows, self.step_rows, settings=settings, device=self.device, out_dir=self.out
        )


ODE_STEPS = {"sd3.5-medium": 10, "flux.1-dev": 6, "wan2.1-1.3b": 4}
OVERHEAD = {"sd3.5-medium": {"reps": 7, "steps": 10}, "flux.1-dev": {"reps": 2, "steps": 28}}
GRPO = {
    "group": 16,
    "requests": 8,
    "clients": 4,
    "batch_sizes": (16, 64),
    "stock_reps": 2,
    "uint8_variant": False,
}


def _ode(suite: Suite, name: str, modes=("rollout_false", "ode_rollout")) -> None:
    m = suite.model(name)
    saved = dict(m.defaults)
    if name in suite.ode_steps:
        m.defaults["num_inference_steps"] = suite.ode_steps[name]
    try:
        suite.ode_rows.extend(ode_regression.check_model(m, list(modes)))
    finally:
        m.defaults = saved


# The weight-sync phases of the tiny dry run: one HTTP push path and the in-process ones.
TINY_WEIGHT_SYNC_PHASES = ("h2d", "tcp", "http_stream", "finite", "disk", "lora")


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--budget-s", type=float, default=530.0, help="wall-clock budget for all phases")
    p.add_argument("--device", default="cuda")
    p.add_argument("--http-gb", type=float, default=4.0)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-wan", action="store_true")
    p.add_argument("--tiny", action="store_true", help="dry run of the whole suite on the tiny zoo models")
    args = p.parse_args(argv)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_suite: no CUDA device", file=sys.stderr)
        return 3
    suite = Suite(args.out, args.budget_s, device)
    suite.settings = vars(args)
    overhead, grpo_cfg = OVERHEAD, GRPO
    if args.tiny:
        suite.alias = {"sd3.5-medium": "tiny-sd3", "flux.1-dev": "tiny-flux", "wan2.1-1.3b": "tiny-wan"}
        suite.ode_steps = {}
        overhead = {k: {"reps": 2, "steps": None} for k in OVERHEAD}
        grpo_cfg = {**GRPO, "requests": 2, "clients": 2, "batch_sizes": (16,), "stock_reps": 1}
    info = facts(device)
    log(f"device {info['device_name']}, commit {info['commit']}, torch {info['versions']['torch']}, "
        f"diffusers {info['versions']['diffusers']}")  # fmt: skip
    overhead_settings = {"models": list(overhead), "per_model": overhead, "aliases": suite.alias}
    tp_settings: dict[str, Any] = {"grpo_model": "sd3.5-medium", "grpo": grpo_cfg, "step_model": "flux.1-dev"}

    # 1. SD3.5-medium ------------------------------------------------------------------------
    sd = "sd3.5-medium"
    suite.phase("build sd3.5-medium", 40, lambda: suite.model(sd))
    if sd in suite.models:
        suite.phase("ode sd3.5-medium", 30, lambda: _ode(suite, sd))
        suite.write_ode([sd])

        def overhead_sd():
            suite.overhead_rows.extend(rollout_overhead.measure_model(suite.model(sd), **overhead[sd]))
            suite.write_overhead(overhead_settings)

        suite.phase("overhead sd3.5-medium", 30, overhead_sd)

        def grpo():
            suite.grpo_rows.extend(throughput.grpo_throughput(suite.model(sd), **grpo_cfg))
            suite.write_throughput(tp_settings)

        suite.phase("throughput grpo sd3.5-medium", 90, grpo)

        def grpo_compiled():
            from diffusion_rollout.server.core.loader import apply_speed_options

            m = suite.model(sd)
            apply_speed_options(m.pipe, compile=True)
            cfg = {
                **grpo_cfg,
                "batch_sizes": grpo_cfg["batch_sizes"][:1],
                "stock_reps": 1,
                "tag": " compiled",
            }
            rows = throughput.grpo_throughput(m, **cfg)
            eager_stock = next(r for r in suite.grpo_rows if r["variant"] == "stock")
            for r in rows:
                r["ratio_vs_eager_stock"] = r["images_per_s"] / eager_stock["images_per_s"]
            suite.grpo_rows.extend(rows)
            suite.write_throughput(tp_settings)

        if not args.no_compile:
            suite.phase("throughput grpo sd3.5-medium compiled", 130, grpo_compiled)
        suite.free(sd)

    # 2. FLUX.1-dev --------------------------------------------------------------------------
    fx = "flux.1-dev"
    suite.phase("build flux.1-dev", 60, lambda: suite.model(fx))
    if fx in suite.models:
        suite.phase("ode flux.1-dev", 40, lambda: _ode(suite, fx))
        suite.write_ode([sd, fx])

        def overhead_fx():
            suite.overhead_rows.extend(rollout_overhead.measure_model(suite.model(fx), **overhead[fx]))
            suite.write_overhead(overhead_settings)

        suite.phase("overhead flux.1-dev", 60, overhead_fx)

        def weights():
            suite.docs["weight_sync"] = weight_sync.run(
                suite.model(fx),
                out_dir=args.out,
                device=device,
                http_gb=args.http_gb,
                disk_gb=args.http_gb,
                ipc_gb=None,
                lora_rank=4 if args.tiny else 64,
                lora_reps=5,
                # The dry run checks that the phase runs; test_weight_sync (tests/benchmarks/) runs every
                # transport (each HTTP one starts a trainer process: seconds apiece on a CPU).
                **({"phases": TINY_WEIGHT_SYNC_PHASES} if args.tiny else {}),
                deadline=suite.deadline,
            )

        suite.phase("weight sync flux.1-dev", 80, weights)

        def backends():
            suite.step_rows.extend(
                throughput.speed_options(
                    suite.model(fx), backends=("_native_cudnn",), compile=False, steps=10
                )
            )
            suite.write_throughput(tp_settings)

        suite.phase("attention backends flux.1-dev", 30, backends)

    # 3. FLUX regional compile (in place: last) -------------------------------------------------
    if fx in suite.models and not args.no_compile:

        def compiled():
            suite.step_rows.extend(
                throughput.speed_options(suite.model(fx), backends=(), compile=True, steps=10, deadline=None)
            )
            suite.write_throughput(tp_settings)

        suite.phase("regional compile flux.1-dev", 130, compiled)

    # 4. Wan 2.1 1.3B ------------------------------------------------------------------------
    wan = "wan2.1-1.3b"
    if not args.no_wan:

        def wan_ode():
            _ode(suite, wan)
            suite.write_ode([sd, fx, wan])
            suite.free(wan)

        suite.phase("ode wan2.1-1.3b", 45, wan_ode)

    # Summary --------------------------------------------------------------------------------
    summary = suite.write_summary()
    targets = summary["targets"]
    ode_doc = suite.docs.get("ode_regression")
    for doc in suite.docs.values():
        if doc.get("table"):
            print(doc["table"], flush=True)
    print_table("phases", suite.phases, [("phase", "phase", ""), ("status", "status", ""),
                ("seconds", "s", ".1f"), ("peak_gib", "peak GiB", ".1f")])  # fmt: skip
    print_table(
        "targets",
        [{"target": k, "met": v.get("met"), "value": _brief(v)} for k, v in targets.items()],
        [("target", "target", ""), ("met", "met", ""), ("value", "value", "")],
    )
    for m in list(suite.models):
        suite.free(m)
    if ode_doc is not None and not ode_doc["ok"]:
        return 1
    return 0 if summary["ok"] else 2


def _brief(v: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={x:.4g}" if isinstance(x, float) else f"{k}={x}" for k, x in v.items() if k != "met"
    )


if __name__ == "__main__":
    sys.exit(main())
