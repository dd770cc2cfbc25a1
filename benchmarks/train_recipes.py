"""The training recipes run as a user runs them, on real architectures: the runs behind RESULTS.md.

    python -m benchmarks.train_recipes --out DIR sd35-flow-grpo sd35-in-process ...   # on a GPU
    python -m benchmarks.train_recipes --out DIR tiny-flow-grpo tiny-in-process        # CPU smoke run

Each named run (``RUNS``) is one recipe command (``examples/flow_grpo.py`` or ``diffusion_nft.py``)
started in its own process: the recipe starts ``diffusion-rollout serve`` itself on the saved model
folder (colocated: ``--server-gpu 0 --trainer-gpu 0``) or samples in process, and writes its JSON to
``DIR/<run>.json`` after every iteration. The model folder is a real architecture with random weights
(``model_builders``), built once per machine in a process of its own (so its GPU memory is returned)
and saved with ``save_pretrained``: the server then loads it with the ordinary ``from_pretrained``.

Design decisions:

- **Continue, never restart.** Every run keeps a checkpoint (adapters, optimizer, history) under
  ``--work``; a run that does not fit one command continues from it in the next, with the same seeds.
- **Budgeted.** ``--deadline-s`` stops starting runs that would not finish in the time left, and
  gives the running one a ``SIGTERM`` before the command's own limit, so its JSON and checkpoint
  (written after every iteration) come back.
- The sizes are the issue's: SD3.5-medium at 512², 10 steps, 4 prompts x 8, an SDE window of 2 of the
  first 5 steps, LoRA rank 32; Wan 2.1 1.3B at 480x832, 33 frames, 2 prompts x 4.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from diffusion_rollout.testing import stop_session

ROOT = Path(__file__).resolve().parent.parent

_SD35 = ["--steps", "10", "--size", "512", "--prompts", "4", "--group-size", "8", "--lora-rank", "32",
         "--lr", "1e-3"]  # fmt: skip
_CFG = ["--guidance-scale", "4.5"]  # Flow-GRPO samples with CFG; DiffusionNFT is CFG-free
_WAN = ["--steps", "10", "--width", "832", "--height", "480", "--frames", "33", "--prompts", "1",
        "--group-size", "4", "--lora-rank", "32", "--guidance-scale", "5.0", "--lr", "1e-3",
        "--gradient-checkpointing"]  # fmt: skip
_TINY = ["--cpu", "--steps", "4", "--size", "32", "--prompts", "2", "--group-size", "4", "--lora-rank", "4"]
_SCALE = ["--steps", "10", "--size", "512", "--prompts", "16", "--group-size", "8", "--lora-rank", "32",
          "--lr", "1e-3", "--guidance-scale", "4.5", "--iterations", "20"]  # fmt: skip
_COLOCATED = ["--server-gpus", "0,1,2,3", "--trainer-gpus", "0,1,2,3"]  # a replica and a trainer rank per GPU
_DISAGG = ["--server-gpus", "0,1", "--trainer-gpus", "2,3"]  # a 2-replica pool, 2 trainer ranks
_FAST = ["--recompute-old-log-probs", "--server-args=--quantize fp8 --compile"]

# verl-omni's Qwen-Image OCR Flow-GRPO recipe (examples/flowgrpo_trainer/run_qwen_image_ocr_lora.sh in
# verl-project/verl-omni, v0.3): 32 prompts x 16 images at 512², 10 steps, true CFG 4 with a negative
# prompt, 256 text tokens, an SDE window of 2 within steps 0..5 at noise level 1.2, LoRA rank 64 alpha
# 128 on both streams' attention and MLPs, lr 3e-4, a VLM judge's OCR score as the reward. The judge
# (Qwen3-VL-8B's architecture, random weights; JUDGE) runs on every trainer rank, 32 new tokens each.
JUDGE = "judge-qwen3-vl-8b"
_PEER_QWEN = ["--steps", "10", "--size", "512", "--group-size", "16", "--lora-rank", "64", "--lora-alpha", "128",
              "--lora-targets", "qwen-image", "--lr", "3e-4", "--true-cfg-scale", "4", "--negative-prompt", " ",
              "--max-sequence-length", "256", "--noise-level", "1.2", "--sde-window", "2", "--sde-window-range", "6",
              "--prompt-set", "ocr", "--gradient-checkpointing", "--iterations", "4",
              "--reward", f"vlm_ocr_judge?model={{work}}/models/{JUDGE}&max_new_tokens=32"]  # fmt: skip


# Where the reward is scored: Flow-GRPO on SD3.5-medium, 4 prompts x 16 at 512², 10 steps, CFG 4.5, the
# trainer and the server colocated on one GPU, the reward scored in the trainer or on the server. The
# "free" reward (brightness, scored on the server) is the iteration with nothing to score; the scorers
# are random-weight architectures built beside the model: CLIP ViT-H/14 (PickScore's) and Qwen3-VL-8B
# reading 32 tokens per image, its weights resident on the GPU (offload=0) in both places.
_REWARD_SD35 = ["--steps", "10", "--size", "512", "--prompts", "4", "--group-size", "16", "--lora-rank", "32",
                "--lr", "1e-3", "--guidance-scale", "4.5", "--iterations", "8"]  # fmt: skip
_CLIP = ["--reward", "pickscore=clip:{work}/models/clip-large"]
_VLM = ["--prompt-set", "ocr",
        "--reward", f"ocr=vlm_ocr_judge?model={{work}}/models/{JUDGE}&max_new_tokens=32&offload=0"]  # fmt: skip
_ON_SERVER = ["--reward-on", "server"]
_JUDGE_GPU1 = ["--server-gpus", "0,1", "--replicas", "1", "--trainer-gpu", "0", "--server-args=--reward-gpus 1"]  # fmt: skip


def _without_cfg(args: list[str]) -> list[str]:
    """``args`` less true CFG's two options and their values."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("--true-cfg-scale", "--negative-prompt"):
            skip = True
        else:
            out.append(a)
    return out


# run name -> (model, recipe, arguments); "{work}" in an argument is --work.
RUNS: dict[str, tuple[str, str, list[str]]] = {
    "sd35-flow-grpo": ("sd3.5-medium", "flow_grpo", [*_SD35, *_CFG, "--iterations", "40"]),
    "sd35-in-process": (
        "sd3.5-medium",
        "flow_grpo",
        [*_SD35, *_CFG, "--iterations", "5", "--layout", "in-process"],
    ),
    "sd35-flow-grpo-released": (
        "sd3.5-medium",
        "flow_grpo",
        [*_SD35, *_CFG, "--iterations", "5", "--release-memory"],
    ),
    "sd35-dance-grpo": (
        "sd3.5-medium",
        "flow_grpo",
        [*_SD35, *_CFG, "--iterations", "5", "--step-kind", "dance"],
    ),
    "sd35-diffusion-nft": ("sd3.5-medium", "diffusion_nft", [*_SD35, "--iterations", "30"]),
    # One stochastic step per rollout: 15 iterations of 33-frame videos then fit one 10-minute stretch
    # (the committed run). It learned less than the 2-step window (wan-flow-grpo-w2, ~37 s per
    # iteration on an H100: two stretches, continued from the checkpoint on the same machine).
    "wan-flow-grpo": (
        "wan2.1-1.3b",
        "flow_grpo",
        [*_WAN, "--iterations", "15", "--sde-window", "1", "--sde-window-range", "5"],
    ),
    "wan-flow-grpo-w2": (
        "wan2.1-1.3b",
        "flow_grpo",
        [*_WAN, "--iterations", "15", "--sde-window-range", "5"],
    ),
    # DiffusionNFT with more forward-process samples per rollout (its loss is noisier per sample than
    # Flow-GRPO's; 2 timesteps per sample did not move the reward in 30 iterations).
    "sd35-diffusion-nft-t8": (
        "sd3.5-medium",
        "diffusion_nft",
        [*_SD35, "--iterations", "30", "--timesteps-per-sample", "8"],
    ),
    # Asynchronous rollouts (#24) next to the synchronous loop, both colocated on one GPU, same seeds.
    "sd35-async1": ("sd3.5-medium", "flow_grpo", [*_SD35, *_CFG, "--iterations", "18", "--async-depth", "1"]),
    "sd35-sync": ("sd3.5-medium", "flow_grpo", [*_SD35, *_CFG, "--iterations", "18"]),
    # The fast tier (#26): rollouts from an FP8 + compiled server, trained in bf16 eager against the
    # trainer's own recomputed log-probs with a TIS cap; beside sd35-flow-grpo (the exact tier).
    "sd35-fast-fp8": (
        "sd3.5-medium",
        "flow_grpo",
        [
            *_SD35,
            *_CFG,
            "--iterations",
            "40",
            "--recompute-old-log-probs",
            "--server-args=--quantize fp8 --compile",
        ],
    ),
    # Wan sampled without CFG (half the transformer passes in rollout and replay): ~2x the
    # iterations of the CFG runs in one stretch, with the 2-step window that learned faster.
    "wan-flow-grpo-nocfg": (
        "wan2.1-1.3b",
        "flow_grpo",
        [*_WAN, "--guidance-scale", "1.0", "--iterations", "25", "--sde-window-range", "5"],
    ),
    # The same with the brightness reward: JPEG size of random-weight Wan videos barely varies within
    # a group (std ~0.1 kB of ~376), so its curve drifts with the adapter instead of learning.
    "wan-flow-grpo-bright": (
        "wan2.1-1.3b",
        "flow_grpo",
        [
            *_WAN,
            "--guidance-scale",
            "1.0",
            "--iterations",
            "25",
            "--sde-window-range",
            "5",
            "--reward",
            "brightness",
        ],
    ),
    # Scale (#40): one 4-GPU machine, 16 prompts x 8 per iteration (4 per GPU in process), same
    # seeds in every layout; `torchrun` ranks per RANKS below. GPU flags are the run's own.
    "scale-in-process": (
        "sd3.5-medium",
        "flow_grpo",
        [*_SCALE, "--layout", "in-process", "--trainer-gpus", "0,1,2,3"],
    ),
    "scale-colocated": ("sd3.5-medium", "flow_grpo", [*_SCALE, *_COLOCATED]),
    "scale-colocated-fast": ("sd3.5-medium", "flow_grpo", [*_SCALE, *_COLOCATED, *_FAST]),
    "scale-colocated-fast-async": (
        "sd3.5-medium",
        "flow_grpo",
        [*_SCALE, *_COLOCATED, *_FAST, "--async-depth", "1"],
    ),
    "scale-disagg": ("sd3.5-medium", "flow_grpo", [*_SCALE, *_DISAGG]),
    "scale-disagg-async": ("sd3.5-medium", "flow_grpo", [*_SCALE, *_DISAGG, "--async-depth", "1"]),
    "scale-disagg-fast-async": (
        "sd3.5-medium",
        "flow_grpo",
        [*_SCALE, *_DISAGG, *_FAST, "--async-depth", "1"],
    ),
    # Full parameters: FSDP2 over 2 trainer GPUs, NCCL sync to a 2-replica pool.
    "scale-full": (
        "sd3.5-medium",
        "flow_grpo",
        [*_SCALE, *_DISAGG, "--full-finetune", "--lr", "1e-5", "--iterations", "4"],
    ),
    # The two-GPU disaggregated layout of #24/#40 (4 prompts x 8), synchronous and async depth 1.
    "two-gpu-disagg": (
        "sd3.5-medium",
        "flow_grpo",
        [*_SD35, *_CFG, "--server-gpu", "0", "--trainer-gpu", "1", "--iterations", "12"],
    ),
    "two-gpu-disagg-async": (
        "sd3.5-medium",
        "flow_grpo",
        [
            *_SD35,
            *_CFG,
            "--server-gpu",
            "0",
            "--trainer-gpu",
            "1",
            "--iterations",
            "12",
            "--async-depth",
            "1",
        ],
    ),
    # The peer's step on 4 GPUs, colocated (a replica and a trainer rank per GPU), and on 2 GPUs with
    # half the prompts (the same work per GPU) where no 4-GPU machine is lent. The replicas give their
    # GPU memory back while the trainer replays: a 41 GB transformer each for replica and trainer, the
    # judge and the replay's activations would not fit one H200 together.
    "peer-qwen-image-lora": (
        "qwen-image",
        "flow_grpo",
        [*_PEER_QWEN, "--prompts", "32", *_COLOCATED, "--release-memory"],
    ),
    # The reward on the server in the peer's workload: the judge scored by each replica (its weights in pinned host
    # memory between calls), the trainer ranks receiving values and no pixels. Not run on a GPU yet.
    "peer-qwen-image-lora-server-reward": (
        "qwen-image",
        "flow_grpo",
        [*_PEER_QWEN, "--prompts", "32", *_COLOCATED, "--release-memory", "--reward-on", "server"],
    ),
    # verl-omni's own layout, the baseline: every rank samples its 8 groups in its own process.
    "peer-qwen-image-in-process": (
        "qwen-image",
        "flow_grpo",
        [*_PEER_QWEN, "--prompts", "32", "--layout", "in-process", "--trainer-gpus", "0,1,2,3"],
    ),
    # verl-omni's full-parameter row (250 s on 4 H200s): no CFG, lr 3e-5, clip 1e-5, FSDP2 with a
    # float32 master; full weights to the colocated replicas over NCCL. Not run yet: 20B of float32
    # master and Adam state is about 80 GB per GPU over 4, beside a 41 GB replica (see HISTORY).
    "peer-qwen-image-full": (
        "qwen-image",
        "flow_grpo",
        [
            *_without_cfg(_PEER_QWEN),
            "--full-finetune",
            "--lr",
            "3e-5",
            "--clip-range",
            "1e-5",
            "--prompts",
            "32",
            *_COLOCATED,
            "--release-memory",
        ],
    ),
    "peer-qwen-image-lora-2gpu": (
        "qwen-image",
        "flow_grpo",
        [*_PEER_QWEN, "--prompts", "16", "--server-gpus", "0,1", "--trainer-gpus", "0,1", "--release-memory"],
    ),
    # The 4-GPU step's layout per GPU (a replica, a trainer rank and the judge on each) on 2 GPUs with 2
    # of each GPU's 8 groups: every phase's per-group rate in steady state, for the bound.
    "peer-qwen-image-rates": (
        "qwen-image",
        "flow_grpo",
        [
            *_PEER_QWEN,
            "--prompts",
            "4",
            "--iterations",
            "8",
            "--server-gpus",
            "0,1",
            "--trainer-gpus",
            "0,1",
            "--release-memory",
        ],
    ),
    # Shared ODE prefixes (rollout_share_prefix) on and off, the same seeds: the reward curves side by
    # side (two runs may share one GPU: their curves count, their seconds do not).
    "sd35-prefix-on": ("sd3.5-medium", "flow_grpo", [*_SD35, *_CFG, "--iterations", "20", "--share-prefix"]),
    "sd35-prefix-off": ("sd3.5-medium", "flow_grpo", [*_SD35, *_CFG, "--iterations", "20"]),
    "reward-free-server": ("sd3.5-medium", "flow_grpo", [*_REWARD_SD35, "--reward", "brightness", *_ON_SERVER]),
    "reward-clip-trainer": ("sd3.5-medium", "flow_grpo", [*_REWARD_SD35, *_CLIP]),
    "reward-clip-server": ("sd3.5-medium", "flow_grpo", [*_REWARD_SD35, *_CLIP, *_ON_SERVER]),
    "reward-vlm-trainer": ("sd3.5-medium", "flow_grpo", [*_REWARD_SD35, *_VLM]),
    "reward-vlm-server": ("sd3.5-medium", "flow_grpo", [*_REWARD_SD35, *_VLM, *_ON_SERVER]),
    # The judge on a GPU of its own (2 GPUs): the server sees both, rolls out on the first
    # (--replicas 1) and scores on the second; the trainer stays on the first.
    "reward-vlm-server-gpu1": (
        "sd3.5-medium",
        "flow_grpo",
        [*_REWARD_SD35, *_VLM, *_ON_SERVER, *_JUDGE_GPU1],
    ),
    # The placement rows at CPU size (tiny SD3, tiny CLIP), run by the suite's smoke test.
    "tiny-reward-server": (
        "tiny-sd3",
        "flow_grpo",
        [*_TINY, "--iterations", "2", "--reward", "pickscore=clip:{work}/models/clip-tiny?device=cpu", *_ON_SERVER],
    ),
    # The same path at CPU size: a tiny Qwen-Image and a tiny judge, two ranks.
    "tiny-peer-qwen-image": (
        "tiny-qwenimage",
        "flow_grpo",
        [
            *_TINY,
            "--iterations",
            "1",
            "--lora-alpha",
            "8",
            "--lora-targets",
            "qwen-image",
            "--true-cfg-scale",
            "4",
            "--negative-prompt",
            " ",
            "--max-sequence-length",
            "32",
            "--noise-level",
            "1.2",
            "--sde-window-range",
            "3",
            "--prompt-set",
            "ocr",
            "--reward",
            "vlm_ocr_judge?model={work}/models/judge-tiny&max_new_tokens=4&device=cpu",
        ],
    ),
    "tiny-scale-2": ("tiny-sd3", "flow_grpo", [*_TINY, "--iterations", "2"]),
    "tiny-flow-grpo": ("tiny-sd3", "flow_grpo", [*_TINY, "--iterations", "2"]),
    "tiny-async1": ("tiny-sd3", "flow_grpo", [*_TINY, "--iterations", "3", "--async-depth", "1"]),
    "tiny-recompute": ("tiny-sd3", "flow_grpo", [*_TINY, "--iterations", "2", "--recompute-old-log-probs"]),
    "tiny-in-process": ("tiny-sd3", "flow_grpo", [*_TINY, "--iterations", "2", "--layout", "in-process"]),
    "tiny-diffusion-nft": ("tiny-sd3", "diffusion_nft", [*_TINY, "--iterations", "2"]),
}


# Runs launched with `torchrun --nproc-per-node N` (the others are one plain process).
RANKS: dict[str, int] = {
    "scale-in-process": 4, "scale-colocated": 4, "scale-colocated-fast": 4, "scale-colocated-fast-async": 4,
    "scale-disagg": 2, "scale-disagg-async": 2, "scale-disagg-fast-async": 2, "scale-full": 2,
    "tiny-scale-2": 2, "peer-qwen-image-lora": 4, "peer-qwen-image-lora-server-reward": 4, "peer-qwen-image-in-process": 4, "peer-qwen-image-full": 4, "peer-qwen-image-lora-2gpu": 2, "tiny-peer-qwen-image": 2, "peer-qwen-image-rates": 2,
}  # fmt: skip


def model_folder(name: str, work: Path) -> Path:
    """The saved diffusers folder of ``name`` (built here on first use, in a process of its own)."""
    path = work / "models" / name
    if (path / ("config.json" if name.startswith(("judge-", "clip-")) else "model_index.json")).exists():
        return path
    code = (
        "import sys, torch; from pathlib import Path\n"
        "name, path = sys.argv[1], Path(sys.argv[2])\n"
        "if name.startswith('judge-'):\n"
        "    from benchmarks.judge_builders import save_vlm_judge; print(save_vlm_judge(path, name[6:]))\n"
        "elif name.startswith('clip-'):\n"
        "    from benchmarks.judge_builders import save_clip_scorer; print(save_clip_scorer(path, name[5:]))\n"
        "elif name.startswith('tiny-'):\n"
        "    from diffusion_rollout.models import save_tiny_model; save_tiny_model(name[5:], path)\n"
        "else:\n"
        "    from benchmarks import model_builders_scale  # noqa: F401  (registers the large models)\n"
        "    from benchmarks.model_builders import build_real_pipeline\n"
        "    build_real_pipeline(name, 'cuda', torch.bfloat16, 0).save_pretrained(path)\n"
    )
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, name, str(path)], check=True, cwd=ROOT)
    print(f"[train_recipes] built and saved {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


def run_one(name: str, args: argparse.Namespace, deadline: float) -> int:
    model, recipe, extra = RUNS[name]
    path = model_folder(model, args.work)
    # The reward models a run names ({work}/models/judge-..., clip-...), built beside the model.
    for reward_model in sorted({m for a in extra for m in re.findall(r"\{work\}/models/([\w.-]+)", a)}):
        model_folder(reward_model, args.work)
    extra = [a.replace("{work}", str(args.work)) for a in extra]
    out = Path(args.out) / f"{name}.json"
    launch = [sys.executable]
    if RANKS.get(name, 1) > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS[name])]
    cmd = [*launch, str(ROOT / "examples" / f"{recipe}.py"), "--model", str(path), *extra, "--out", str(out)]
    if "--full-finetune" not in extra:  # (full-parameter checkpoints are not written yet)
        cmd += ["--checkpoint", str(args.work / "checkpoints" / name)]
    if args.iterations is not None:
        cmd += ["--iterations", str(args.iterations)]
    if not model.startswith("tiny-") and not any(
        a.startswith(("--server-gpu", "--trainer-gpu")) for a in extra
    ):
        cmd += ["--server-gpu", str(args.server_gpu), "--trainer-gpu", str(args.trainer_gpu)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    print(f"[train_recipes] {name}: {' '.join(cmd)}", flush=True)
    t0, t0_mono = time.perf_counter(), time.monotonic()
    # A session of its own, so that stopping it stops the server it started too (its GPU memory).
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        cap = deadline if args.cap_s is None else min(deadline, t0_mono + args.cap_s)
        rc = proc.wait(timeout=max(cap - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        print(f"[train_recipes] {name}: out of time, stopping it (its checkpoint continues it)", flush=True)
        rc = stop_session(proc, signal.SIGTERM, timeout_s=20)
    print(f"[train_recipes] {name}: exit {rc} after {time.perf_counter() - t0:.1f} s", flush=True)
    if out.exists():
        summary = json.loads(out.read_text()).get("summary", {})
        print(f"[train_recipes] {name} summary: {json.dumps(summary)}", flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", choices=sorted(RUNS))
    p.add_argument("--out", required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/train_recipes"), help="models and checkpoints")
    p.add_argument("--server-gpu", type=int, default=0)
    p.add_argument("--trainer-gpu", type=int, default=0)
    p.add_argument("--deadline-s", type=float, default=None, help="stop everything after this many seconds")
    p.add_argument("--cap-s", type=float, default=None, help="stop each run after this many seconds")
    p.add_argument("--iterations", type=int, default=None, help="override each run's --iterations")
    args = p.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (args.deadline_s or 10**9)
    worst = 0
    for name in args.runs:
        if time.monotonic() >= deadline:
            print(f"[train_recipes] {name}: not started (no time left)", flush=True)
            continue
        worst = max(worst, run_one(name, args, deadline))
    return worst


if __name__ == "__main__":
    sys.exit(main())
