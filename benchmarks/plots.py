"""Plots of the committed benchmark JSON: ``python -m benchmarks.plots [--out DIR]``.

Draws PNGs into ``benchmarks/results/plots/`` from the JSON under ``benchmarks/results/`` only, so
a plot always shows what a RESULTS.md row cites. The files carry no date and no library version
(``metadata`` cleared, Agg backend, fixed size and dpi): the same JSON draws the same bytes.
Reward curves use the recipes' own ``plot_reward_curves`` (``diffusion_rollout.recipes.records``). Needs
matplotlib (``pip install -e .[plot]``).

Ray replica scaling is not drawn: its run (2026-11-22) committed no JSON, only the journal's table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
METADATA = {"Software": None}  # no matplotlib version in the PNG: output depends on the JSON alone
DPI = 110


def _load(rel: str) -> dict[str, Any]:
    return json.loads((RESULTS / rel).read_text())


def _pick(rows: list[dict], **want: Any) -> dict:
    hits = [r for r in rows if all(r.get(k) == v for k, v in want.items())]
    if len(hits) != 1:
        raise ValueError(f"{len(hits)} rows match {want}")
    return hits[0]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, metadata=METADATA)
    _plt().close(fig)


def _speedup(row: dict) -> float:
    """Throughput relative to stock, > 1 faster, whichever way the benchmark expressed its ratio."""
    return row["ratio"] if row["ratio_kind"].startswith("throughput") else 1.0 / row["ratio"]


def speed_vs_stock(out: Path) -> Path:
    it = _load("h200/speed_options_grpo_iteration_lanes_codec.json")["speed"]
    comp = _load("h200/speed_options_grpo_iteration_compiled.json")["speed"]
    sd35 = _load("h200/speed_options_sd35.json")["speed"]
    flux = _load("h200/speed_options_flux_codec.json")["speed"]
    bars = [
        ("Flow-GRPO iteration, eager, 1 lane", _pick(it, variant="server_lean_uint8_4_in_flight")),
        ("Flow-GRPO iteration, eager, 2 lanes", _pick(it, variant="server_lean_uint8_2_lanes_4_in_flight")),
        (
            "Flow-GRPO iteration, --cuda-graphs",
            _pick(it, variant="server_lean_uint8_cuda_graphs_4_in_flight"),
        ),
        ("Flow-GRPO iteration, compiled", _pick(comp, variant="server_lean_uint8_compiled_4_in_flight")),
        ("Flow-GRPO request, plain float32", _pick(sd35, phase="grpo", variant="server_plain_float32")),
        ("Flow-GRPO request, lean uint8", _pick(sd35, phase="grpo", variant="server_lean_uint8")),
        ("SD3.5 batch 1, eager", _pick(sd35, phase="batch1", variant="server_eager")),
        ("SD3.5 batch 1, --cuda-graphs", _pick(sd35, phase="batch1", variant="server_cuda_graphs")),
        ("FLUX.1-dev 1024², eager float32", _pick(flux, variant="server_eager")),
        ("FLUX.1-dev 1024², eager uint8", _pick(flux, variant="server_eager_uint8")),
        ("FLUX.1-dev 1024², --cuda-graphs uint8", _pick(flux, variant="server_cuda_graphs_uint8")),
    ]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    labels = [b[0] for b in bars][::-1]
    values = [_speedup(b[1]) for b in bars][::-1]
    ax.barh(labels, values, color=["tab:green" if v >= 1 else "tab:orange" for v in values])
    ax.axvline(1.0, color="black", linewidth=1)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.3f}x", va="center", fontsize=8)
    ax.set_xlabel("speed vs the stock diffusers pipeline (> 1 is faster), one H200")
    ax.set_xlim(0, max(values) * 1.15)
    ax.set_title("Server vs stock, side by side (SD3.5-medium 512² unless named)", fontsize=10)
    path = out / "speed_vs_stock.png"
    _save(fig, path)
    return path


# (JSON under h200x4/cp_scaling/, model, size, legend) for the context-parallel scaling plot.
CP_SCALING_CASES = [
    ("cp_scaling_wan_t2v_ti2v.json", "wan2.1-1.3b", "832x480x81", "Wan 2.1 1.3B 480p"),
    ("cp_scaling_wan_t2v_ti2v.json", "wan2.1-14b", "832x480x81", "Wan 14B 480p"),
    ("cp_scaling_wan_t2v_ti2v.json", "wan2.1-14b", "1280x720x81", "Wan 14B 720p (A14B expert)"),
    ("cp_scaling_wan_t2v_ti2v.json", "wan2.2-ti2v-5b", "1280x704x121", "TI2V-5B 704p x121"),
    ("cp_scaling_wan_i2v.json", "wan2.1-i2v-14b-480p", "832x480x81", "Wan 2.1 I2V 14B"),
    ("cp_scaling_wan_i2v.json", "wan2.2-i2v-a14b", "832x480x81", "Wan 2.2 I2V-A14B"),
    (
        "cp_scaling_hunyuanvideo15_ltx2.json",
        "hunyuanvideo-1.5-480p",
        "1280x720x33",
        "HunyuanVideo 1.5 720p x33",
    ),
    ("cp_scaling_hunyuanvideo15_ltx2.json", "ltx-2", "1280x704x121", "LTX-2 704p x121"),
]


# (JSON under h200x4/, model, legend) for the served panel: one whole request at k = 1, 2, 4.
CP_SERVED_CASES = [
    ("cp_served/cp_served_video3.json", "wan2.2-ti2v-5b", "TI2V-5B 704p x121, 1 video"),
    ("cp_served/cp_served_video3.json", "ltx-2", "LTX-2 704p x121, 1 video"),
    ("cp_served/cp_served_video3.json", "hunyuanvideo-1.5-480p", "HunyuanVideo 1.5 720p x33, 1 video"),
]

# (JSON under results/, model, legend): served at k = 1 and 2 only, on a 2x H200 host (dashed).
CP_SERVED_K2_CASES = [
    ("h200x2/cp_served/cp_served_wan14b_k2.json", "wan2.1-14b", "Wan 14B 480p x81, 1 video (2x H200)"),
    (
        "h200x2/cp_served/cp_served_wan14b_k2.json",
        "wan2.1-i2v-14b-480p",
        "Wan 2.1 I2V 14B, 1 video (2x H200)",
    ),
    ("h200x2/cp_served/cp_served_a14b_i2v_k2.json", "wan2.2-i2v-a14b", "Wan 2.2 I2V-A14B, 1 video (2x H200)"),
]


def scaling(out: Path) -> Path:
    """Speedup over k = 1 against k (Ulysses), 4x H200: one transformer call of every video family
    (left), and one whole served request (right: ``cp_served``, the 14B-class models at k = 1 and 2
    on 2x H200 dashed, and Wan 2.1 1.3B's group of 4 from ``cp_tradeoff``'s layouts)."""
    plt = _plt()
    fig, (ax, served) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    ks = [1, 2, 4]
    for rel, model, size, name in CP_SCALING_CASES:
        rows = _load(f"h200x4/cp_scaling/{rel}")["results"]
        layouts = ["k1", "ulysses2", "ulysses4"]
        speedups = [_pick(rows, model=model, size=size, layout=lay)["speedup_vs_k1"] for lay in layouts]
        ax.plot(ks, speedups, "-o", label=name)
    for rel, model, name in CP_SERVED_CASES:
        rows = _load(f"h200x4/{rel}")["results"]
        served.plot(ks, [_pick(rows, model=model, k=k)["speedup_vs_k1"] for k in ks], "-o", label=name)
    for rel, model, name in CP_SERVED_K2_CASES:
        rows = _load(rel)["results"]
        served.plot(
            [1, 2], [_pick(rows, model=model, k=k)["speedup_vs_k1"] for k in (1, 2)], "--o", label=name
        )
    tradeoff = _load("h200x4/cp_tradeoff/cp_tradeoff_wan2.1-1.3b_x4.json")["results"]
    latency = [_pick(tradeoff, layout=lay)["latency_s"] for lay in ("4x1", "2x2", "1x4")]
    served.plot(ks, [latency[0] / x for x in latency], "-o", label="Wan 2.1 1.3B 480p x81, group of 4")
    for a, title in (
        (ax, "one transformer call (cp_scaling.py)"),
        (served, "one served request (cp_served.py)"),
    ):
        a.plot([1, 4], [1, 4], ":", color="gray", label="linear")
        a.set_xticks(ks)
        a.set_xlabel("GPUs for one video (context parallel k, Ulysses)")
        a.set_title(f"{title}, 4x H200" + (" (dashed: 2x H200)" if a is served else ""), fontsize=10)
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    ax.set_ylabel("speedup vs one GPU")
    path = out / "scaling.png"
    _save(fig, path)
    return path


def weight_sync(out: Path) -> Path:
    panels = [
        ("h100/weight_sync.json", "FLUX.1-dev transformer, H100", ["ipc", "http", "disk"]),
        (
            "h200/weight_sync_sd35_direct.json",
            "SD3.5-medium transformer, H200",
            ["http_stream", "http_direct"],
        ),
    ]
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (rel, title, transports) in zip(axes, panels, strict=True):
        rows = _load(rel)["results"]
        names, values = [], []
        for t in transports:
            # the steady state: the last push of each transport (the first allocates or injects)
            best = [r for r in rows if r["transport"] == t][-1]
            names.append(t)
            values.append(best["gb_per_s"])
        ax.bar(names, values, color="tab:blue")
        for x, v in enumerate(values):
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
        for t, style, label in [
            ("h2d_pinned", "-", "pinned host-to-device"),
            ("tcp_raw", "--", "bare loopback socket"),
        ]:
            lim = [r for r in rows if r["transport"] == t]
            if lim:
                ax.axhline(
                    lim[0]["gb_per_s"],
                    linestyle=style,
                    color="black",
                    label=f"{label} {lim[0]['gb_per_s']:.1f}",
                )
        ax.set_yscale("log")
        ax.set_ylim(0.1, 200)
        ax.set_ylabel("GB/s (log)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("Weight sync per transport (last push of each), loopback")
    path = out / "weight_sync.png"
    _save(fig, path)
    return path


def drift(out: Path) -> Path:
    panels = [
        ("h200/speed_options_drift_lanes.json", "SD3.5-medium"),
        ("h200/speed_options_flux.json", "FLUX.1-dev"),
    ]
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (rel, title) in zip(axes, panels, strict=True):
        rows = _load(rel)["drift"]
        names = [r["option"] for r in rows]
        lat = [r["latent_max_abs_diff"] for r in rows]
        ratio = [r["replay_ratio_max_dev"] for r in rows]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], lat, width=0.4, label="latents max |diff| vs eager")
        ax.bar([x + 0.2 for x in xs], ratio, width=0.4, label="max |ratio - 1| on eager replay")
        for x, r in zip(xs, rows, strict=True):
            if r["latent_max_abs_diff"] == 0 and r["replay_ratio_max_dev"] == 0:
                ax.text(x, 0, "exact", ha="center", va="bottom", fontsize=8, color="tab:green")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{title}, one H200", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle("Drift per speed option (0 = bit-identical to the eager server)")
    path = out / "drift.png"
    _save(fig, path)
    return path


def reward_curves(out: Path) -> list[Path]:
    from diffusion_rollout.recipes.records import plot_reward_curves

    train = RESULTS / "h100" / "training"

    def run(name: str) -> dict:
        return json.loads((train / name).read_text())

    figures = [
        (
            "reward_sd35.png",
            "SD3.5-medium, JPEG compressibility, one H100",
            {
                "Flow-GRPO colocated": run("sd35-flow-grpo.json"),
                "Flow-GRPO in-process": run("sd35-in-process.json"),
                "Flow-GRPO released": run("sd35-flow-grpo-released.json"),
                "DanceGRPO": run("sd35-dance-grpo.json"),
                "DiffusionNFT (EMA decay ramped from 0)": run("sd35-diffusion-nft.json"),
                "DiffusionNFT (EMA decay 0.5, before)": run("sd35-diffusion-nft-decay05.json"),
            },
        ),
        (
            "reward_wan.png",
            "Wan 2.1 1.3B, JPEG compressibility, one H100",
            {
                "Flow-GRPO, CFG 5, 1-step window": run("wan-flow-grpo.json"),
                "CFG 5, 2-step window, fp32 trainer adapter (bug)": run("wan-flow-grpo-fp32-adapter.json"),
                "Flow-GRPO, no CFG, 2-step window": run("wan-flow-grpo-nocfg.json"),
            },
        ),
        (
            "reward_wan_brightness.png",
            "Wan 2.1 1.3B, brightness (target 0.8), no CFG, one H100",
            {"Flow-GRPO, 2-step window": run("wan-flow-grpo-bright.json")},
        ),
        (
            "reward_async.png",
            "SD3.5-medium Flow-GRPO, colocated on one H100: sync vs --async-depth 1",
            {"synchronous": run("sd35-sync.json"), "--async-depth 1": run("sd35-async1.json")},
        ),
    ]
    h200 = RESULTS / "h200" / "training"
    figures.append((
        "reward_share_prefix.png",
        "SD3.5-medium Flow-GRPO 4 x 8, JPEG, same seeds, one H200: shared prefixes on vs off",
        {"rollout_share_prefix on": json.loads((h200 / "sd35-prefix-on.json").read_text()),
         "off": json.loads((h200 / "sd35-prefix-off.json").read_text())},
    ))  # fmt: skip
    paths = [async_timeline(out, run("sd35-sync.json"), run("sd35-async1.json"))]
    for name, title, runs in figures:
        plot_reward_curves(runs, str(out / name), title=title)
        paths.append(out / name)
    return paths


TIMELINE_ITERATIONS = range(5, 9)  # warm iterations; the first pays allocation and compilation
LANES = {"rollout": ("server", "tab:blue"), "reward": ("trainer", "tab:olive"),
         "train": ("trainer", "tab:red"), "push": ("trainer", "tab:purple")}  # fmt: skip


def async_timeline(out: Path, sync: dict, async_: dict) -> Path:
    """Which process uses the GPU when: the server's rollouts and the trainer's phases, per
    iteration, from the recipes' recorded spans (``Phases.spans``, the stream's ``server_span``)."""
    plt = _plt()
    fig, axes = plt.subplots(2, 1, figsize=(10, 4.2), sharex=True)
    for ax, (title, run) in zip(axes, [("synchronous", sync), ("--async-depth 1", async_)], strict=True):
        rows = [h for h in run["history"] if h["iteration"] in TIMELINE_ITERATIONS]
        t0 = rows[0]["spans"][0][1]
        bars: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for h in rows:
            for name, a, b in h["spans"]:
                lane, _ = LANES.get(name, ("trainer", "gray"))
                if name == "rollout" and "server_span" in h:
                    continue  # async: the trainer only picked up a finished batch; drawn below
                bars.setdefault((lane, name), []).append((a - t0, b - a))
            if "server_span" in h:
                a, b = h["server_span"]
                bars.setdefault(("server", "rollout"), []).append((a - t0, b - a))
        for (lane, name), spans in bars.items():
            y = 1 if lane == "server" else 0
            ax.broken_barh(spans, (y - 0.35, 0.7), color=LANES.get(name, ("", "gray"))[1], label=name)
        mean = sum(h["iteration_s"] for h in run["history"][1:]) / max(len(run["history"]) - 1, 1)
        ax.set_yticks([0, 1])
        ax.set_yticklabels(["trainer", "server"])
        ax.set_title(f"{title}: {mean:.2f} s per iteration (mean of iterations 2..)", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=True))
    axes[0].legend(uniq.values(), uniq.keys(), fontsize=8, loc="upper right", ncol=4)
    axes[1].set_xlabel(
        f"seconds from iteration {TIMELINE_ITERATIONS.start}'s start (both processes on one H100)"
    )
    fig.suptitle("Flow-GRPO on SD3.5-medium, 4 prompts x 8: who works when", fontsize=10)
    path = out / "timeline_async.png"
    _save(fig, path)
    return path


def fast_tier_curves(
    out: Path, fast: str = "sd35-fast-fp8.json", exact: str = "sd35-flow-grpo.json"
) -> list[Path]:
    """The fast tier's reward next to the exact tier's (issue #26), per iteration, per wall-clock
    second of training, and per second after the first iteration (which carries the fast tier's
    compilation); nothing until the fast run's JSON is committed."""
    train = RESULTS / "h100" / "training"
    if not (train / fast).exists():
        return []
    runs = {"exact tier (bf16 eager server)": json.loads((train / exact).read_text()),
            "fast tier (FP8 + compile server, TIS)": json.loads((train / fast).read_text())}  # fmt: skip
    plt = _plt()
    fig, (by_it, by_s, warm) = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for label, run in runs.items():
        hist = run["history"]
        rewards = [h["reward_mean"] for h in hist]
        clock, t = [], 0.0
        for h in hist:
            t += h["iteration_s"]
            clock.append(t)
        by_it.plot(range(len(rewards)), rewards, label=label)
        by_s.plot(clock, rewards, label=label)
        first = hist[0]["iteration_s"]
        warm.plot([c - first for c in clock[1:]], rewards[1:], label=f"{label}, first {first:.0f} s")
    by_it.set_xlabel("iteration")
    by_s.set_xlabel("seconds of training (sum of iteration times)")
    warm.set_xlabel("seconds after the first iteration")
    by_it.set_ylabel("mean reward")
    for ax in (by_it, by_s, warm):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        "SD3.5-medium Flow-GRPO, JPEG compressibility, same seeds (recipe seed 0), one H100: fast tier vs "
        "exact tier (commits: RESULTS.md#train-fast-tier)",
        fontsize=10,
    )
    path = out / "reward_fast_tier.png"
    _save(fig, path)
    return [path]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=RESULTS / "plots")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    paths = [speed_vs_stock(args.out), scaling(args.out), weight_sync(args.out), drift(args.out)]
    paths += reward_curves(args.out) + fast_tier_curves(args.out)
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
