"""flow_grpo's training step on rollouts from the server-backed ``pipeline_with_logprob``.

    python examples/flow_grpo_dropin.py --cpu --server thread   # its own tiny SD3 server (CPU, seconds)

A flow_grpo script switches to the server by changing one import and passing a client where it
passed the pipeline (``diffusion_rollout/client/flow_grpo.py`` says what maps to what):

    from diffusion_rollout.client.flow_grpo import pipeline_with_logprob
    images, latents, log_probs = pipeline_with_logprob(client, prompt=prompts, output_type="pt", ...)

The rest keeps flow_grpo's shapes: latents stacked to ``[B, T+1, ...]``, a ``samples`` dict of
``latents[:, :-1]``, ``next_latents[:, 1:]``, ``log_probs`` and ``timesteps``, and per timestep the
trainer's guided model output (SD3's batched CFG ``[uncond; cond]``, by ``replay_model_output`` from
the server's ``denoising_env``), the log-prob of the stored transition (the shared ``transition``),
the clipped ratio loss and ``backward``. Each training batch is one group, the batch the server ran,
so the first pass is on-policy with a ratio of exactly 1; after the optimizer step it moves.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import torch
from _common import (
    PROMPTS,
    add_lora,
    base_parser,
    load_trainer_transformer,
    rollout_server,
    trainer_device,
    wait_ready,
)
from _config import parse_with_config

from diffusion_rollout.client import RolloutClient, group_advantages, replay_model_output, stack_envs
from diffusion_rollout.client.flow_grpo import pipeline_with_logprob
from diffusion_rollout.scheduler_mixins import transition


def flow_grpo_pass(transformer, samples, envs, sigmas, args, device) -> tuple[float, torch.Tensor]:
    """One pass over ``samples``: per group and timestep, the ratio loss and ``backward``."""
    batch, steps = samples["log_probs"].shape
    c, dev, ratios = args.clip_range, 0.0, []
    for rows in (slice(k, k + args.group_size) for k in range(0, batch, args.group_size)):
        env = stack_envs(envs[rows])
        for j in range(steps):
            x = samples["latents"][rows, j].to(device)
            v = replay_model_output(transformer, x, samples["timesteps"][0, j], env)
            step = transition(
                "sde", x, v, sigmas[j], sigmas[j + 1], eta=args.noise_level, sigma_max=sigmas[1],
                next_sample=samples["next_latents"][rows, j].to(device),
            )  # fmt: skip
            ratio = torch.exp(step.log_prob - samples["log_probs"][rows, j].to(device))
            adv = samples["advantages"][rows].to(device)
            loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - c, 1 + c)).mean()
            (loss / (steps * batch / args.group_size)).backward()
            dev = max(dev, float((ratio.detach() - 1).abs().max()))
            ratios.append(ratio.detach().cpu())
    return dev, torch.cat(ratios)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = base_parser(__doc__.splitlines()[0], reporting=False)  # one step: no per-iteration reporting
    p.add_argument("--guidance-scale", type=float, default=4.5)
    p.add_argument("--noise-level", type=float, default=0.7)
    p.add_argument("--clip-range", type=float, default=1e-4)
    p.set_defaults(prompts=2, group_size=4)
    args = parse_with_config(p, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    device = trainer_device(args)
    prompts = [PROMPTS[k % len(PROMPTS)] for k in range(args.prompts)]
    n = args.prompts * args.group_size
    with (
        rollout_server(args) as server,
        RolloutClient(server.url, admin_key=server.admin_key, max_concurrency=args.prompts) as client,
    ):
        wait_ready(client)
        # The trainer's copy in the server's dtype: the same bits on both sides.
        dtype = getattr(torch, client.model_info()["dtype"].removeprefix("torch."))
        transformer = load_trainer_transformer(server.model_path, device=device, dtype=dtype)
        optimizer = torch.optim.AdamW(add_lora(transformer, args.lora_rank, dtype), lr=args.lr)
        images, latents, log_probs, outputs = pipeline_with_logprob(
            client, prompt=prompts, height=args.size, width=args.size,
            num_inference_steps=args.steps, guidance_scale=args.guidance_scale,
            num_images_per_prompt=args.group_size, output_type="pt", noise_level=args.noise_level,
            generator=[torch.Generator().manual_seed(args.seed * 10_000 + k) for k in range(n)],
            extra_fields={"rollout_return_denoising_env": True}, return_outputs=True,
        )  # fmt: skip
    latents = torch.stack(latents, dim=1)  # [B, T + 1, C, h, w]
    log_probs = torch.stack(log_probs, dim=1)  # [B, T]
    trajectory = outputs[0].dit_trajectory
    sigmas = trajectory.sigmas.to(device)  # the schedule the server used (T + 1 values)
    rewards = images.float().mean(dim=(1, 2, 3))  # a toy reward: brightness
    samples = {
        "timesteps": trajectory.timesteps[:-1].repeat(n, 1),  # [B, T]
        "latents": latents[:, :-1],  # the latent entering each step
        "next_latents": latents[:, 1:],  # the stored latent after it
        "log_probs": log_probs,
        "advantages": group_advantages(rewards, args.group_size),
    }
    envs = [o.denoising_env for o in outputs]
    on_policy_dev, _ = flow_grpo_pass(transformer, samples, envs, sigmas, args, device)
    optimizer.step()
    optimizer.zero_grad()
    _, after = flow_grpo_pass(transformer, samples, envs, sigmas, args, device)
    summary = {
        "images": list(images.shape),
        "latents": list(latents.shape),
        "log_probs": list(log_probs.shape),
        "on_policy_ratio_max_dev": on_policy_dev,
        "ratio_after_update": [float(after.min()), float(after.max())],
    }
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
