"""Flow-GRPO from a trainer that is already on Ray: it places the rollout replicas itself, no HTTP.

    python examples/ray_colocated.py                       # 2 CPU replicas of a tiny SD3 model (~1 min)
    python examples/ray_colocated.py --replicas 4 --device cuda --gpus-per-replica 1 \\
        --ray-address auto --model /path/to/the/diffusers/folder

RL stacks such as verl or OpenRLHF already run their training ranks as Ray actors in placement
groups. Such a trainer does not need ``diffusion-rollout serve``: it creates the replica actors
(``replica_actor_class``) in bundles of its own placement group, so each replica lands next to the
training ranks it should share a node (or a GPU) with, and drives them through ``ClusterEngine``,
the same object the HTTP front serves. Each iteration:

1. **Rollouts.** One ``GenerateRequest`` per prompt (a GRPO group of ``--group-size`` outputs with
   SDE steps, the trajectory and the conditioning), all awaited together: the front spreads them
   over the replicas (least outstanding work; every output of a request on one replica, as one
   batch).
2. **Training.** The outputs become the client's ``RolloutOutput`` objects, so the same
   ``replay_steps`` and clipped loss as ``flow_grpo.py`` apply: the first pass is on-policy and the
   ratio is exactly 1 (``first_ratio_max_dev`` 0), whichever replica ran the group.
3. **Sync.** The adapter goes to every replica at once (``front.weights().load_lora``: one
   safetensors body, validated on all replicas before any applies) and each replica's adapter
   checksum is read back from its actor and compared with the trainer's.

A real trainer would put its own rank actors into the same bundles (``placement_group_bundle_index``)
and give each replica a GPU fraction; the example's driver process is the only trainer rank, and it
replays on the CPU. With ``--device cuda`` the replicas roll out on GPUs while the replay stays on
the CPU, so the first ratio is 1 within float rounding, not to the last bit: bit-exact replay needs
the trainer on the same kind of device as the replica (as in ``tests/client/test_client_gpu.py``).
Prints one JSON line per iteration and a summary; ``--out`` writes the summary as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from diffusion_rollout.client import group_advantages, lora_checksum
from diffusion_rollout.client.results import ReplaySettings, RolloutOutput
from diffusion_rollout.client.weights.lora import lora_config_dict, lora_state_dict
from diffusion_rollout.protocol.lora_options import LoraLoadOptions
from diffusion_rollout.protocol.safetensors_layout import SafetensorsBody
from diffusion_rollout.recipes.options import LORA_TARGETS, PROMPTS
from diffusion_rollout.recipes.policy_update import train_iteration
from diffusion_rollout.recipes.trainer import load_trainer_transformer
from diffusion_rollout.rewards import load_reward

logger = logging.getLogger("examples.ray_colocated")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="diffusers folder (default: a tiny random SD3 model made here)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--device", default="cpu", help="the replicas' device: cpu or cuda")
    p.add_argument("--gpus-per-replica", type=float, default=0.0)
    p.add_argument("--cpus-per-replica", type=float, default=1.0)
    p.add_argument("--ray-address", help="join this Ray cluster (default: start a local instance)")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4, help="prompts (groups) per iteration")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="num_inference_steps")
    p.add_argument("--size", type=int, default=32, help="image width and height")
    p.add_argument("--guidance-scale", type=float, default=4.5)
    p.add_argument("--noise-level", type=float, default=0.7, help="rollout_noise_level (eta)")
    p.add_argument("--inner-epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-2)
    p.add_argument("--clip-range", type=float, default=0.2)
    p.add_argument("--adv-clip-max", type=float, default=5.0)
    p.add_argument("--kl-beta", type=float, default=0.0)
    p.add_argument("--lora-rank", type=int, default=4)
    p.add_argument("--reward", default="brightness", help="a reward of rewards.py or module:callable")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the summary JSON here")
    return p.parse_args(argv)


def place_replicas(ray, config, args: argparse.Namespace):
    """One placement-group bundle per replica, the replica actor created inside it."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from diffusion_rollout.cluster import ClusterEngine, replica_actor_class

    bundle = {"CPU": args.cpus_per_replica}
    if args.gpus_per_replica:
        bundle["GPU"] = args.gpus_per_replica
    pg = placement_group([dict(bundle) for _ in range(args.replicas)], strategy="PACK")
    ray.get(pg.ready(), timeout=300)
    actor_cls = replica_actor_class(num_gpus=args.gpus_per_replica, num_cpus=args.cpus_per_replica)
    replica_config = ClusterEngine(config).replica_config()
    actors = [
        actor_cls.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
        ).remote(replica_config, i)
        for i in range(args.replicas)
    ]
    return pg, actors


def rollout_body(args: argparse.Namespace, prompt: str, seed: int) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "seed": seed,
        "num_outputs_per_prompt": args.group_size,
        "num_inference_steps": args.steps,
        "width": args.size,
        "height": args.size,
        "guidance_scale": args.guidance_scale,
        "rollout_sde_type": "sde",
        "rollout_noise_level": args.noise_level,
        "rollout_return_dit_trajectory": True,
        "rollout_return_denoising_env": True,
        "generator_device": "cpu",
    }


async def rollouts(front, bodies: list[dict[str, Any]], it: int) -> list[list[RolloutOutput]]:
    """Every group at once through the front; outputs as the client's typed results."""
    from diffusion_rollout.entrypoints.request_params import to_params
    from diffusion_rollout.protocol.requests import GenerateRequest

    async def one(k: int, body: dict[str, Any]) -> list[RolloutOutput]:
        results = await front.generate(to_params(GenerateRequest(**body), f"it{it}-g{k}"))
        settings = ReplaySettings.from_request(body)
        return [RolloutOutput.from_dict(r.to_dict(), settings) for r in results]

    return list(await asyncio.gather(*(one(k, b) for k, b in enumerate(bodies))))


async def push_adapter(front, transformer, version: str) -> dict[str, Any]:
    """The trainer's adapter to every replica in one all-or-nothing call (no HTTP)."""
    tensors = {n: t.detach().float().cpu().contiguous() for n, t in lora_state_dict(transformer).items()}
    config = lora_config_dict(transformer, adapter_name="default")
    body = bytes(SafetensorsBody(tensors, {"peft_config": json.dumps(config)}))
    return await front.weights().load_lora(
        data=body,
        target_module="transformer",
        name="default",
        options=LoraLoadOptions(activate=True),
        weight_version=version,
    )


def replica_adapter_checksums(ray, actors) -> list[str]:
    """Each replica's own view of the adapter, asked of its actor directly."""
    described = ray.get([a.manager_call.remote("describe_lora", {}) for a in actors])
    return [d["transformer"]["adapters"]["default"]["checksum"] for d in described]


def run(ray, model_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    from peft import LoraConfig

    from diffusion_rollout.cluster import ClusterEngine
    from diffusion_rollout.config import ServerConfig

    # max_batch_size = the group size: each request is one batch, so replaying a group as one batch
    # reproduces the replica's model outputs bit for bit.
    config = ServerConfig(
        model=str(model_path),
        device=args.device,
        dtype="float32",
        replicas=args.replicas,
        gpus_per_replica=args.gpus_per_replica,
        cpus_per_replica=args.cpus_per_replica,
        max_batch_size=args.group_size,
    )
    pg, actors = place_replicas(ray, config, args)
    front = ClusterEngine(config, actors=actors)
    loop = asyncio.new_event_loop()
    try:
        front.start()  # loads the model on every replica
        torch.manual_seed(args.seed)
        transformer = load_trainer_transformer(model_path, device=torch.device("cpu"), dtype=torch.float32)
        reward_fn = load_reward(args.reward)
        transformer.add_adapter(
            LoraConfig(
                r=args.lora_rank, lora_alpha=args.lora_rank, target_modules=LORA_TARGETS, lora_dropout=0.0
            )
        )
        params = [p for p in transformer.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(params, lr=args.lr)
        version = "iter-0"
        loop.run_until_complete(push_adapter(front, transformer, version))
        history: list[dict[str, Any]] = []
        first_dev_all, checksums_ok = 0.0, True
        for it in range(args.iterations):
            t0 = time.perf_counter()
            bodies = [
                rollout_body(args, PROMPTS[k % len(PROMPTS)], args.seed + 1000 * it + 100 * k)
                for k in range(args.prompts)
            ]
            groups = loop.run_until_complete(rollouts(front, bodies, it))
            versions = {o.weight_version for g in groups for o in g}
            if versions != {version}:
                raise RuntimeError(f"rollouts came from weight versions {versions}, expected {version!r}")
            images = torch.stack([o.generated_output for g in groups for o in g])
            as_bytes = (images.float() * 255).round().clamp(0, 255).to(torch.uint8)
            rewards = reward_fn(as_bytes, [o.prompt for g in groups for o in g])
            adv = group_advantages(rewards, args.group_size).view(len(groups), args.group_size)
            t_roll = time.perf_counter() - t0
            stats = train_iteration(transformer, optimizer, params, groups, adv, args)
            first_dev_all = max(first_dev_all, stats["first_ratio_max_dev"])
            version = f"iter-{it + 1}"
            loop.run_until_complete(push_adapter(front, transformer, version))
            local = lora_checksum(transformer, dtype=torch.float32)
            remote = replica_adapter_checksums(ray, actors)
            checksums_ok &= all(c == local for c in remote)
            served = [r["served_requests"] for r in loop.run_until_complete(front.replica_info())]
            record = {
                "iteration": it,
                "reward_mean": float(rewards.mean()),
                **stats,
                "weight_version": version,
                "replica_checksums_agree": all(c == local for c in remote),
                "served_requests_per_replica": served,
                "rollout_s": round(t_roll, 3),
                "iteration_s": round(time.perf_counter() - t0, 3),
            }
            history.append(record)
            print(json.dumps(record), flush=True)
        info = loop.run_until_complete(front.replica_info())
        return {
            "replicas": args.replicas,
            "iterations": args.iterations,
            "first_ratio_max_dev": first_dev_all,
            "checksums_ok": checksums_ok,
            "weight_versions": sorted({r["weight_version"] for r in info}),
            "served_requests_per_replica": [r["served_requests"] for r in info],
            "history": history,
        }
    finally:
        front.stop(grace_s=5)  # the actors are the trainer's: it ends them with its placement group
        for a in actors:
            ray.kill(a)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
        loop.close()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import ray

    if args.ray_address:
        ray.init(address=args.ray_address)
    else:
        need = args.replicas * args.cpus_per_replica
        ray.init(num_cpus=max(2, int(need + 0.999)), include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_path = Path(args.model) if args.model else None
            if model_path is None:
                from diffusion_rollout.models import save_tiny_model

                model_path = save_tiny_model("sd3", Path(tmp) / "tiny-sd3")
            summary = run(ray, model_path, args)
    finally:
        ray.shutdown()
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["checksums_ok"] else 1)
