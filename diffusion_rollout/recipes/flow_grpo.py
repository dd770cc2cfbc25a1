"""Flow-GRPO (and DanceGRPO): one run, iteration by iteration (``examples/flow_grpo.py`` runs it).

Each iteration (:meth:`FlowGRPO.iteration`):

1. **Rollouts** (:mod:`~diffusion_rollout.recipes.flow_grpo_rollouts`): one GRPO group per prompt,
   stochastic steps only in the iteration's window, trajectory and conditioning returned for replay.
2. **Reward and advantages.** The ``--reward`` plug-in on the images (or on the server), normalised
   within each group (trees: per branch step).
3. **Training** (:func:`~diffusion_rollout.recipes.policy_update.train_iteration`): replay, clipped
   ratio loss, one optimizer step per inner epoch; the first pass is on-policy, ratio exactly 1.
4. **Sync** (:class:`~diffusion_rollout.recipes.weight_sync.ServedLora`): the weights pushed and their
   checksum read back from the server.

Then the record: per iteration the rewards, the ratio statistics, the checksums and the seconds of
each phase, written to ``--out`` after every iteration with the checkpoint (rank 0).

Design decisions:

- **One object per run.** :class:`FlowGRPO` holds what the iterations share (the model, the
  optimizer, the rollout source, the recovery, the history); its methods are the steps above, in
  the order they run, so that no step hides in a closure of another.
- **The layouts differ only in the rollout source** and in whether anything is pushed: in-process
  runs have no ``sync`` and no ``client``; ``--async-depth`` is a stream instead of a call.
- **A lost server** is waited for, the weights re-pushed and verified and the iteration's rollouts
  redone (:mod:`~diffusion_rollout.recipes.recovery`); rollouts from any other weight version are
  rejected, never trained on, and the record lists each recovery.
- **Several ranks** (``torchrun``): each rank makes and replays its block of the groups; the record
  gathers every rank's rewards, advantages, versions and seconds; rank 0 pushes, writes and saves.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from diffusion_rollout.client import RolloutClient, group_advantages, lora_checksum, tree_advantages
from diffusion_rollout.recipes.checkpoint import Checkpoint
from diffusion_rollout.recipes.flow_grpo_options import parse_args
from diffusion_rollout.recipes.flow_grpo_rollouts import Rollouts, guidance_record, request_fields
from diffusion_rollout.recipes.launch import launch
from diffusion_rollout.recipes.options import image_size
from diffusion_rollout.recipes.policy_update import train_iteration
from diffusion_rollout.recipes.ranks import Ranks
from diffusion_rollout.recipes.records import (
    environment,
    iteration_record,
    server_peak_gb,
    summarize,
    write_run,
)
from diffusion_rollout.recipes.recovery import Recovery
from diffusion_rollout.recipes.report import Report
from diffusion_rollout.recipes.reward import RecipeReward
from diffusion_rollout.recipes.timing import Phases
from diffusion_rollout.recipes.trainer import (
    add_lora,
    load_trainer_transformer,
    trainer_device,
    trainer_dtype,
)
from diffusion_rollout.recipes.weight_sync import ServedLora

EXACTNESS_KEY = "first_ratio_max_dev"


def check_layout(args: argparse.Namespace, in_process: bool) -> None:
    """The options that need the server layout (or synchronous rollouts) refused elsewhere."""
    if args.branch and (in_process or math.prod(p["factor"] for p in args.branch) != args.group_size):
        raise SystemExit(
            "--branch needs the server layout and --group-size equal to the product of its factors"
        )
    if args.screen and (in_process or args.async_depth > 0 or args.screen < args.group_size):
        raise SystemExit("--screen K needs the server layout, synchronous rollouts and K >= --group-size")


def trainable_model(
    args: argparse.Namespace, model_path: Path, device: torch.device, dtype: torch.dtype, ranks: Ranks
) -> tuple[torch.nn.Module, list[torch.nn.Parameter], Any]:
    """``(transformer, trainable parameters, FullFinetune or None)``: a LoRA on the frozen denoiser,
    the same on every rank, or with ``--full-finetune`` every weight, sharded with FSDP2."""
    if args.full_finetune:
        from diffusion_rollout.recipes.full import FullFinetune

        # A thread server shares this process, where a second group of the same name cannot be made.
        near = not args.url and args.server != "thread"
        sync = args.weight_sync if args.weight_sync != "auto" else ("broadcast" if near else "http")
        full = FullFinetune(model_path, device, dtype, ranks, args.gradient_checkpointing, sync)
        return full.transformer, full.params, full
    transformer = load_trainer_transformer(
        model_path, device=device, dtype=dtype, gradient_checkpointing=args.gradient_checkpointing
    )
    params = add_lora(transformer, args.lora_rank, dtype, alpha=args.lora_alpha, targets=args.lora_targets)
    ranks.broadcast_params(params)  # every rank starts from rank 0's adapter
    return transformer, params, None


class FlowGRPO:
    """One Flow-GRPO run: set up in the constructor, trained by :meth:`train`."""

    def __init__(
        self, client: RolloutClient | None, model_path: Path, args: argparse.Namespace, out_path: str | None,
        ranks: Ranks | None = None,
    ) -> None:  # fmt: skip
        self.client, self.args, self.out_path = client, args, out_path
        self.ranks = ranks = ranks or Ranks()
        self.device = device = trainer_device(args, ranks)
        self.dtype = dtype = trainer_dtype(args, device)
        torch.manual_seed(args.seed)
        self.in_process = in_process = client is None
        self.reward_fn = RecipeReward(args, client)
        check_layout(args, in_process)
        self.transformer, self.params, self.full = trainable_model(args, model_path, device, dtype, ranks)
        self.optimizer = torch.optim.AdamW(self.params, lr=args.lr, weight_decay=0.0)
        self.checkpoint = Checkpoint(args.checkpoint)
        state = self.checkpoint.load(self.transformer, self.optimizer) or {"next_iteration": 0, "history": []}
        self.start = state["next_iteration"]
        self.history: list[dict[str, Any]] = state["history"]
        sampler = client
        if in_process:
            from diffusion_rollout.recipes.in_process import in_process_sampler

            sampler = in_process_sampler(model_path, self.transformer, device, args.group_size)
        self.version = f"iter-{self.start}"
        self.sync = None if in_process else ServedLora(client, self.transformer, dtype, ranks, self.full)
        # A lost server (restarted, unreachable, answering late) is waited for, re-pushed and verified,
        # and the iteration's rollouts redone (recovery.py); every recovery is in the run record.
        self.recovery = Recovery(client, ranks, timeout_s=args.recover_timeout)
        self.recovery.restore(state)
        # lora_B starts at zero: the adapter changes nothing yet, so the first rollouts sample the base
        # policy with the adapter's structure in place, and later pushes reload it in place. Full
        # weights: the server already holds them; the push names the version and verifies the bytes.
        if not in_process:
            self.recovery.push(self.start, self.version, self.sync.push, self.sync.holds)
        width, height = image_size(args)
        self.record: dict[str, Any] = {
            "recipe": "flow_grpo", "layout": "in-process" if in_process else "server",
            "ranks": ranks.world, "trainable": "full" if self.full is not None else "lora",
            # Where everything ran: every rank's device, and the GPUs of a server started here.
            "trainer_devices": ranks.gather(str(device)), "server_gpus": None if in_process else args.server_gpu,
            "args": vars(args), "environment": environment(), "history": self.history,
        }  # fmt: skip
        shared = request_fields(args, width, height, device, self.reward_fn)
        self.rollouts = Rollouts(
            args, client, sampler, shared, ranks, self.recovery, self.sync, self.reward_fn,
            first_iteration=self.start, version=self.version,
        )  # fmt: skip

    # ---------------------------------------------------------------------------------- the run
    def train(self) -> dict[str, Any]:
        """Every iteration from the first not yet done, then the final check; returns the record."""
        # Rank 0's progress line per iteration, and --log-to's scalars and images.
        report = Report(self.args, "flow_grpo", EXACTNESS_KEY, enabled=self.ranks.is_main)
        # Closing the rollouts aborts what the stream has in flight.
        with contextlib.closing(self.rollouts), report:
            for it in range(self.start, self.args.iterations):
                record, outputs = self.iteration(it)
                self.history.append(record)
                report.iteration(record, outputs)
                if self.ranks.is_main:
                    self.save(it)
        return self.finish()

    def iteration(self, it: int) -> tuple[dict[str, Any], list[Any]]:
        """Rollouts, reward, training and push of iteration ``it``: its record and this rank's outputs."""
        args, ranks, client, in_process = self.args, self.ranks, self.client, self.in_process
        phases = Phases(self.device)
        t_iter = time.perf_counter()
        # Answer bytes received this iteration (with --async-depth: whatever arrived meanwhile).
        received = 0 if in_process else client.received_answer_bytes
        with phases("rollout"):
            batch = self.rollouts.make(it, self.version, phases)
        groups = batch.groups
        outputs = [o for g in groups for o in g]
        versions = self._check_versions(outputs, batch)
        if args.release_memory and not in_process:
            # Before the reward: a reward model on the trainer's GPU (the OCR judge) needs the
            # replica's memory as much as the replay does. Every rank waits for the release: the
            # replicas on the other ranks' GPUs are released by rank 0's one call.
            with phases("release"):
                if ranks.is_main:
                    client.release_memory_occupation()
                ranks.barrier()
        with phases("reward"):
            rewards = self.reward_fn(outputs)
            adv = group_advantages(rewards, args.group_size).view(len(groups), args.group_size)
            seen = ranks.gather(
                {"rewards": rewards, "advantages": adv, "version": versions.pop(), "regenerated": batch.regenerated,
                 "server_peak": server_peak_gb(outputs),
                 "answer_bytes": 0 if in_process else client.received_answer_bytes - received}
            )  # fmt: skip
        with phases("train"):
            stats = train_iteration(
                self.transformer, self.optimizer, self.params, groups, self._per_step(rewards, adv), args,
                batch.staleness, ranks,
            )  # fmt: skip
        if args.release_memory and not in_process and ranks.is_main:
            with phases("resume"):
                client.resume_memory_occupation()
        self.version = f"iter-{it + 1}"
        with phases("push"):
            checksum_ok = (
                None if in_process else self.recovery.push(it, self.version, self.sync.push, self.sync.holds)
            )
        self.rollouts.pushed(self.version)
        record = self._record(it, outputs, seen, phases, t_iter, stats, checksum_ok, batch.server_span)
        return record, outputs

    def _check_versions(self, outputs: Sequence[Any], batch: Any) -> set[Any]:
        """The batch's weight versions, refused where it is not one version or (trained on-policy)
        not the version pushed."""
        versions = {o.weight_version for o in outputs}
        streamed = self.rollouts.stream is not None
        if streamed and len(versions) != 1:
            raise RuntimeError(f"a batch mixed versions {versions}")
        # A regenerated batch is trained as on-policy (no TIS): it must come from the version pushed.
        if (not streamed or batch.regenerated) and not self.in_process and versions != {self.version}:
            raise RuntimeError(f"rollouts came from {versions}, expected {self.version!r}")
        return versions

    def _per_step(self, rewards: torch.Tensor, adv: torch.Tensor) -> Any:
        """The advantages the loss takes: per group, or for trees BranchGRPO's per branch step (its
        nodes' mean rewards normalised by depth)."""
        if not self.args.branch:
            return adv
        points = [(b["step"], b["factor"]) for b in self.args.branch]
        return [tree_advantages(r, points) for r in rewards.view(adv.shape)]

    def _record(
        self, it: int, outputs: list[Any], seen: list[dict[str, Any]], phases: Phases, t_iter: float,
        stats: dict[str, Any], checksum_ok: bool | None, server_span: list[float] | None,
    ) -> dict[str, Any]:  # fmt: skip
        """Iteration ``it``'s JSON record, with every rank's rewards, advantages and seconds."""
        args, ranks = self.args, self.ranks
        per_rank = ranks.gather(phases.record())
        extra: dict[str, Any] = {}
        if ranks.active:
            extra = {
                "rank_weight_versions": [q["version"] for q in seen],
                "regenerated_ranks": [r for r, q in enumerate(seen) if q["regenerated"]],
                "rank_seconds": [{k: v for k, v in q.items() if k.endswith("_s")} for q in per_rank],
                "rank_peak_gb": [q.get("trainer_peak_gb") for q in per_rank],
                "rank_device_used_max_gb": [q.get("device_used_max_gb") for q in per_rank],
            }
        all_rewards = torch.cat([q["rewards"] for q in seen])
        record = iteration_record(
            it, self.version, all_rewards, outputs, phases, t_iter,
            sde_steps=outputs[0].sde_step_indices, **stats, checksum_ok=checksum_ok,
            **({"shared_prefix_steps": outputs[0].extra.get("shared_prefix_steps")} if args.share_prefix else {}),
            guidance=guidance_record(outputs[0]), answer_bytes=sum(q["answer_bytes"] for q in seen),
            advantages=[float(a) for q in seen for a in q["advantages"].flatten()],
            **({"server_span": server_span} if server_span else {}), **extra,
            images=len(all_rewards), server_peak=max((q["server_peak"] for q in seen if q["server_peak"] is not None), default=None),
        )  # fmt: skip
        record["recovered"] = [e["cause"] for e in self.recovery.events if e["iteration"] == it]
        return record

    def save(self, it: int) -> None:
        """Rank 0, after iteration ``it``: the run record so far, then the checkpoint to resume from."""
        if self.full is not None:
            self.record["full_sync"] = self.full.record()
        where = "server_reward" if self.reward_fn.on_server else "trainer_reward"
        self.record[where] = self.reward_fn.record(self.client)
        self.record["summary"] = summarize(self.history, EXACTNESS_KEY)
        self.record.update(self.recovery.record())
        write_run(self.out_path, self.record)
        self.checkpoint.save(
            self.transformer, self.optimizer, ["default"],
            {"next_iteration": it + 1, "history": self.history, **self.recovery.state()},
        )  # fmt: skip

    def finish(self) -> dict[str, Any]:
        """The run's last word: the full sync's figures, or the server's adapter checked once more
        (a server lost after the last push is waited for and re-pushed, or the record says why its
        checksum could not be read); the summary; the record written."""
        record = self.record
        if self.full is not None:
            record["full_sync"] = self.full.record()
            self.full.close()
        if not self.in_process and self.full is None:
            sync = self.sync
            final = self.recovery.final(
                self.args.iterations, self.version, sync.push, sync.holds, sync.final_state
            )
            record["final_adapter_checksum"] = lora_checksum(self.transformer, dtype=self.dtype)
            record.update(final)
        record["summary"] = summarize(self.history, EXACTNESS_KEY)
        record.update(self.recovery.record())
        if self.ranks.is_main:
            write_run(self.out_path, record)
        return record


def run(
    client: RolloutClient | None, model_path: Path, args: argparse.Namespace, out_path: str | None,
    ranks: Ranks | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One Flow-GRPO run against ``client`` (None: ``--layout in-process``); returns its record."""
    return FlowGRPO(client, model_path, args, out_path, ranks).train()


def launch_flow_grpo(args: argparse.Namespace) -> dict[str, Any]:
    """``run`` in this process's rank, against the server ``args`` name or start."""
    return launch(args, run, always_group=args.full_finetune)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return launch_flow_grpo(parse_args(argv))
