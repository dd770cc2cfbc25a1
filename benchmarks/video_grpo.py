"""The video GRPO request against the stock pipeline, per video family, on one GPU (issue #27).

For each model (built one at a time, ``per_model.each_model``), the same two phases as the image
families' (``speed_options``), side by side in one process, interleaved repeats, median:

- ``grpo``: one request of ``--group`` videos (HunyuanVideo 1.5: one, with proportionally more
  requests in flight; its stock pipeline decodes one video per call) as a replaying trainer sends it (SDE window,
  log-probs, ``dit_trajectory`` and ``denoising_env``) decoded by a client in another process: the
  plain per-output float32 form, the lean form, and lean with uint8 videos, against the stock
  pipeline at batch ``--group`` (precomputed embeddings, videos left on the device);
- ``grpo_iteration``: ``--iteration-groups`` such requests in flight (lean, uint8), on one lane and
  on two (``--pipeline-lanes 2``), against the stock pipeline running the same batches back to back
  (each request is its own pipeline call: the server's ``max_batch_pixels`` keeps queued videos of
  this size from merging, as a served model does);
- with ``--profile``, that iteration once more for stock and the server under the CUDA profiler
  (``grpo_profile``): GPU busy seconds against wall seconds and the largest idle gaps;
- ``grpo_fast`` (issue #43): the fast tier, FP8 linears by the family's rule + regional compile
  (``speed_options.grpo_fast``), one request and the iteration, against stock eager timed first in
  the same process; where FP8 cannot run (a CPU) the compiled server alone (``grpo_compiled``), and
  the JSON says why;
- ``drift``: the fast tier's rollouts and ODE outputs against the eager server's (``speed_options
  .drift``, only the compiled and FP8 + compiled options beside eager): how far the tier moves a
  video. ``--fp8-all`` adds, to both, every linear not kept by name in FP8 (``fast_tier
  .EVERY_LINEAR``) beside the family's rule: the measurement that settles a provisional size
  threshold.

Not in the default phases: the fast tier compiles first (minutes on a GPU). One device call each::

    python -m benchmarks.video_grpo --device cuda --models wan2.1-1.3b --phases grpo_fast,drift --out $OUT

The image families run through it too, as a Flow-GRPO iteration (``--size`` sets a square size)::

    python -m benchmarks.video_grpo --device cuda --models flux.1-dev --size 512 --steps 10 --group 8 --phases grpo_fast --out $OUT

Ratios are throughput against stock (videos per second; higher is faster). Writes
``video_grpo.json`` under ``--out`` after every model.

    python -m benchmarks.video_grpo --device cuda --out $OUT                   # the default set below
    python -m benchmarks.video_grpo --device cuda --models wan2.1-1.3b --out $OUT
    python -m benchmarks.video_grpo --device cpu --tiny --out /tmp/vg          # the CPU dry run
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks import (
    model_builders_scale,  # noqa: F401  (registers wan2.2-ti2v-5b)
    per_model,
    speed_options,
)
from benchmarks.cli import quiet_libraries
from benchmarks.report import document, print_table, write_json
from benchmarks.timing import Deadline

PHASES = ("grpo", "grpo_iteration")
FAST_PHASES = ("grpo_fast", "drift")
TINY = ("tiny-wan", "tiny-wan2.2", "tiny-ltx2", "tiny-hunyuanvideo15")
# Each builder's default size. They do not all fit one 10-minute device call. On an H200, with
# --phases grpo_iteration: Wan 2.1 with --profile took 3.3 minutes, LTX-2 about 3 (its --profile did
# not finish in what the call had left), HunyuanVideo 1.5's 2 one-video requests (--group 1
# --iteration-groups 2 --reps 1) about 3; Wan 2.2 TI2V-5B at 1280x704x81 did not finish its first
# phase in 5 (--frames makes it shorter).
DEFAULT = ("wan2.1-1.3b", "wan2.2-ti2v-5b", "ltx-2", "hunyuanvideo-1.5-480p")


def fast_tier_gap(model) -> str | None:
    """Why ``--quantize fp8`` cannot run on ``model``'s device, or None."""
    from diffusion_rollout.fast_tier_checks import unsupported_reason

    return unsupported_reason(quantize="fp8", attention_backend=None, device=model.device)


def run(args) -> int:
    device, names, dtype = per_model.choice(args, TINY, DEFAULT)
    phases = args.phases.split(",")
    unknown = set(phases) - set(PHASES) - set(FAST_PHASES)
    if unknown:
        raise SystemExit(
            f"unknown phase(s) {', '.join(sorted(unknown))}; expected {', '.join(PHASES + FAST_PHASES)}"
        )
    rows: list[dict[str, Any]] = []
    failures: list[dict[str, str]] = []

    def measure(model) -> None:
        if args.steps:
            model.defaults["num_inference_steps"] = args.steps
        if args.frames:  # e.g. TI2V-5B's 81 frames at 1280x704 do not fit one device call
            model.defaults["num_frames"] = args.frames
        if args.size:  # e.g. FLUX.1-dev at flow_grpo's 512x512 rather than the builder's 1024x1024
            model.defaults["height"] = model.defaults["width"] = args.size
        # HunyuanVideo 1.5's stock pipeline decodes one video per call (its VAE's attention mask):
        # its requests hold one video each, and the iteration keeps more of them in flight.
        group = 1 if model.decodes_one_video_per_call else args.group
        groups = args.iteration_groups * args.group // group
        model.server(max_batch_size=max(16, group))
        # Saved after each phase: a large model's phases can outlast what is left of a device call.
        if "grpo" in phases:
            rows.extend(speed_options.grpo(model, group=group, reps=args.reps))
            save()
        if "grpo_iteration" in phases:
            rows.extend(
                speed_options.grpo_iteration(
                    model,
                    group=group,
                    groups=groups,
                    reps=args.reps,
                    equal_priority=False,
                    whole_messages=args.whole_messages,
                    fresh_memory=args.fresh_memory,
                    socket_answers=args.socket_answers,
                )
            )
            save()
        if args.profile:
            rows.extend(speed_options.grpo_profile(model, group=group, groups=groups))
        fp8_missing = fast_tier_gap(model)
        if "grpo_fast" in phases:
            if fp8_missing is None:
                fast = speed_options.grpo_fast(
                    model, group=group, groups=groups, reps=args.reps, fp8_all=args.fp8_all
                )
            else:  # what --speed fast serves here: the compiled blocks alone
                fast = speed_options.grpo_compiled(model, group=group, groups=groups, reps=args.reps)
                for row in fast:
                    row["note"] = "; ".join(filter(None, [row.get("note"), f"FP8 left out: {fp8_missing}"]))
            rows.extend(fast)
            save()
        if "drift" in phases:
            fp8 = fp8_missing is None
            only = ["regional compile", *(["quantize fp8 + regional compile"] if fp8 else [])]
            if fp8 and args.fp8_all:
                only.append(speed_options.FP8_ALL_OPTION)
            rows.extend(
                speed_options.drift(
                    model, reps=1, backends=(), caches=(), with_compile=True, deadline=Deadline(None),
                    fp8=fp8, only=only, fp8_all=args.fp8_all,
                )
            )  # fmt: skip
            save()

    def save() -> dict[str, Any]:
        doc = document(
            "video_grpo",
            device,
            {"models": names, "group": args.group, "iteration_groups": args.iteration_groups,
             "reps": args.reps, "steps": args.steps, "frames": args.frames, "size": args.size,
             "phases": phases},
            rows,
            ok=not failures,
            notes=per_model.failure_notes(failures),
        )  # fmt: skip
        drift_rows = [r for r in rows if "option" in r]  # speed_options.drift's rows
        doc["table"] = print_table(
            "Video GRPO request vs the stock pipeline",
            [r for r in rows if "option" not in r],
            speed_options.THROUGHPUT_COLUMNS,
        )
        if drift_rows:
            doc["table"] += "\n" + print_table(
                "Drift against the eager server", drift_rows, speed_options.DRIFT_COLUMNS
            )
        write_json(args.out, "video_grpo", doc)
        return doc

    per_model.each_model(
        "video_grpo", names, device=device, dtype=dtype, measure=measure, save=save, failures=failures
    )
    return 2 if failures else 0


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    p = per_model.parser(__doc__.splitlines()[0], TINY, "denoising steps (default: each builder's)")
    p.add_argument("--group", type=int, default=2, help="videos per request")
    # 4, as the image families' iteration: the last answer's transfer and decode overlaps no pipeline
    # call, and with 2 in flight (the H100 run at 33f829c) it weighs twice as much.
    p.add_argument("--iteration-groups", type=int, default=4, help="requests in flight")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--frames", type=int, default=None, help="frames per video (default: each builder's)")
    p.add_argument("--size", type=int, default=None, help="height and width (default: each builder's)")
    p.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES + FAST_PHASES)}"
    )
    # Where the server's GPU idles that stock's does not: the iteration once more, under the profiler.
    p.add_argument(
        "--whole-messages",
        action="store_true",
        help="grpo_iteration: also the one-lane server sending each answer buffer whole (no slices)",
    )
    p.add_argument(
        "--fresh-memory",
        action="store_true",
        help="grpo_iteration: also one and two lanes read by a trainer decoding into fresh memory, as "
        "the clients did before the receive pool",
    )
    p.add_argument(
        "--socket-answers",
        action="store_true",
        help="grpo_iteration: also one and two lanes read by a trainer taking every answer through the "
        "socket, as before same-host answers",
    )
    p.add_argument("--profile", action="store_true", help="add the iteration's GPU idle gaps (grpo_profile)")
    # To settle a family's provisional FP8 size threshold (fast_tier.FP8_RULES): the family rule against
    # every linear not kept by name, in speed (grpo_fast) and in drift.
    p.add_argument(
        "--fp8-all",
        action="store_true",
        help="grpo_fast and drift: also every linear not kept by name in FP8 (fast_tier.EVERY_LINEAR)",
    )
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
