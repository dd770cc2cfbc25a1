"""flow_grpo's train_sd3 loop with its sampling answered by the rollout server (``ServedPipeline``).

    python examples/flow_grpo_dropin.py --cpu --server thread     # its own tiny SD3 server (CPU, seconds)
    python examples/flow_grpo_dropin.py --model SD35_DIR --server-gpu 0 --trainer-gpu 1 \\
        --size 512 --steps 10 --iterations 5 --out dropin.json   # SD3.5-medium, bf16, two GPUs

flow_grpo's script switches to the server with one import and one wrapping line
(``diffusion_rollout/client/flow_grpo.py`` says what maps to what):

    from diffusion_rollout.client.flow_grpo import pipeline_with_logprob
    pipeline = ServedPipeline(pipeline, RolloutClient(url))

Everything else here is train_sd3's shape, in miniature: the trainer's own pipeline encodes the
prompts (128 T5 tokens, ``""`` as the negative), each prompt repeated ``--group-size`` times (its
K-repeat sampler) with one seed per prompt (``same_latent``: a group shares ``x_T``); the call is
train_sd3's, unchanged; latents are stacked to ``[B, T+1, ...]``, the timesteps read from
``pipeline.scheduler``; and per timestep the trainer's transformer on its own embeddings (SD3's
batched CFG ``[uncond; cond]``), the log-prob of the stored transition (the shared ``transition``),
the clipped ratio loss and ``backward``, then the optimizer step. The next call pushes the updated
LoRA before sampling (the wrapper compares checksums), so every iteration's first pass is on-policy:
its ratio's deviation from 1 is what each iteration records (``first_step_ratio_max_dev``).

One change to flow_grpo's recomputation: rows are replayed in the batches the server ran them in
(``group_by_server_batch``), because a transformer's last bits depend on the batch it ran in; so
the ratio is 1 to the bit, not to 1e-3. The trainer computes in the server's dtype (bf16 on CUDA):
flow_grpo's float32 transformer would be a different policy from the bf16 one that sampled.
``--no-sync-weights`` leaves the server on its first weights: the ratio then drifts, which is what
the weights following the trainer prevents. ``--compare-replay`` asks for the ``denoising_env`` too and
records, per iteration, which inputs of the recompute (timesteps, latents, embeddings) differ from
those the server recorded, whether its model output equals the recipes' replay of the same rows
(``replay_step``) and the server's own model output (its debug tensors), and that replay's ratio:
where a drift comes from.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from diffusion_rollout.client import RolloutClient, group_advantages, group_by_server_batch, replay_step
from diffusion_rollout.client.flow_grpo import pipeline_with_logprob
from diffusion_rollout.client.served_pipeline import ServedPipeline
from diffusion_rollout.recipes.config_file import parse_with_config
from diffusion_rollout.recipes.options import PROMPTS, base_parser
from diffusion_rollout.recipes.records import environment, write_run
from diffusion_rollout.recipes.servers import rollout_server, wait_ready
from diffusion_rollout.recipes.trainer import add_lora, trainer_device, trainer_dtype
from diffusion_rollout.scheduler_mixins import transition


def encode(pipe, prompts: list[str], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """train_sd3's compute_text_embeddings: the trainer's text encoders, ``tokens`` T5 tokens."""
    with torch.no_grad():
        pe, _, ppe, _ = pipe.encode_prompt(
            prompts, None, None, do_classifier_free_guidance=False, max_sequence_length=tokens,
            device=pipe._execution_device,
        )  # fmt: skip
    return pe, ppe


def flow_grpo_pass(pipe, samples, batches, args, outs=None) -> tuple[float, dict[str, Any]]:
    """One pass over the batch: per server batch and timestep, the ratio loss and ``backward``.
    Returns the largest ``|ratio - 1|``, and with ``outs`` (``--compare-replay``) how flow_grpo's
    recompute compares with the project's replay of the same rows from the server's record."""
    sched, dtype, g, c = pipe.scheduler, pipe.transformer.dtype, args.guidance_scale, args.clip_range
    steps, total = samples["log_probs"].shape[1], samples["log_probs"].shape[0]
    dev = 0.0
    cmp: dict[str, Any] = {"replay_ratio_max_dev": 0.0, "model_output_mismatches": 0, "timestep_mismatches": 0,
                           "embeds_mismatches": 0, "latent_mismatches": 0, "compared": 0}  # fmt: skip
    for rows in batches:
        cond = torch.cat([samples["negative_prompt_embeds"][rows], samples["prompt_embeds"][rows]])
        pooled = torch.cat(
            [samples["negative_pooled_prompt_embeds"][rows], samples["pooled_prompt_embeds"][rows]]
        )
        for j in range(steps):
            x = samples["latents"][rows, j]
            t = samples["timesteps"][rows, j]
            pred = pipe.transformer(
                hidden_states=torch.cat([x, x]).to(dtype), timestep=torch.cat([t, t]), encoder_hidden_states=cond,
                pooled_projections=pooled, return_dict=False,
            )[0]  # fmt: skip
            uncond, text = pred.chunk(2)
            v = uncond + g * (text - uncond)
            if outs is not None:
                compare_with_replay(
                    pipe, [outs[r] for r in rows], j, x, t, cond, v, samples["log_probs"][rows, j], cmp
                )
            step = transition(
                "sde", x, v, sched.sigmas[j], sched.sigmas[j + 1], eta=args.noise_level, sigma_max=sched.sigmas[1],
                next_sample=samples["next_latents"][rows, j],
            )  # fmt: skip
            ratio = torch.exp(step.log_prob - samples["log_probs"][rows, j])
            adv = samples["advantages"][rows]
            loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - c, 1 + c)).mean()
            (loss * len(rows) / (steps * total)).backward()
            dev = max(dev, float((ratio.detach() - 1).abs().max()))
    return dev, (cmp if outs is not None else {})


def compare_with_replay(pipe, rows_outs, j, x, t, cond, v, old_log_prob, cmp: dict[str, Any]) -> None:
    """Which input of flow_grpo's recompute differs from what the server recorded it ran with
    (its trajectory and ``denoising_env``), and the ratio of the project's replay of the same rows."""
    with torch.no_grad():
        step = replay_step(pipe.transformer, rows_outs, j)
    server_t = torch.stack([torch.as_tensor(o.dit_trajectory.timesteps[j]) for o in rows_outs])
    envs = [o.denoising_env or {} for o in rows_outs]
    try:
        server_cond = torch.cat(
            [torch.stack([e[k]["encoder_hidden_states"] for e in envs]) for k in ("neg_cond_kwargs", "pos_cond_kwargs")]
        ).to(cond.device)  # fmt: skip
        embeds_equal = torch.equal(server_cond.reshape(cond.shape), cond)
    except (KeyError, TypeError, RuntimeError):
        embeds_equal = False
    cmp["compared"] += 1
    cmp["timestep_mismatches"] += int(not torch.equal(server_t.to(t), t.float()))
    cmp["latent_mismatches"] += int(not torch.equal(step.latents.float(), x.float()))
    cmp["embeds_mismatches"] += int(not embeds_equal)
    cmp["model_output_mismatches"] += int(not torch.equal(step.model_output.to(v.dtype), v.detach()))
    # The server's own model output for this step (rollout_debug_mode): the forward itself compared.
    debug = [o.rollout_debug_tensors for o in rows_outs]
    if all(d is not None and "rollout_model_outputs" in d for d in debug):
        server_v = torch.stack([torch.as_tensor(d["rollout_model_outputs"][j]) for d in debug]).to(v.device)
        diff = (server_v.float() - v.detach().float()).abs().max().item()
        cmp["server_model_output_mismatches"] = cmp.get("server_model_output_mismatches", 0) + int(
            not torch.equal(server_v.to(v.dtype), v.detach())
        )
        cmp["server_model_output_max_abs_diff"] = max(cmp.get("server_model_output_max_abs_diff", 0.0), diff)
    ratio = torch.exp(step.log_prob - old_log_prob)
    cmp["replay_ratio_max_dev"] = max(cmp["replay_ratio_max_dev"], float((ratio - 1).abs().max()))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from diffusers import StableDiffusion3Pipeline

    p = base_parser(__doc__.splitlines()[0], reporting=False)
    p.add_argument("--guidance-scale", type=float, default=4.5)
    p.add_argument("--noise-level", type=float, default=0.7)
    p.add_argument("--clip-range", type=float, default=1e-4)
    p.add_argument("--max-sequence-length", type=int, default=128, help="T5 tokens of the trainer's encoding")
    p.add_argument(
        "--no-sync-weights",
        dest="sync_weights",
        action="store_false",
        help="leave the server's weights alone",
    )
    p.add_argument(
        "--compare-replay",
        action="store_true",
        help="also replay each step from the server's trajectory and denoising_env (the recipes' replay) "
        "and record which inputs of the recompute differ from the server's (a diagnosis of ratio drift)",
    )
    p.set_defaults(prompts=2, group_size=4, iterations=3)
    args = parse_with_config(p, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    device = trainer_device(args)
    dtype = trainer_dtype(args, device)
    width = args.width or args.size
    height = args.height or args.size
    history: list[dict[str, Any]] = []
    run: dict[str, Any] = {"recipe": "flow_grpo_dropin", "settings": vars(args), "environment": environment()}
    with (
        rollout_server(args) as server,
        RolloutClient(
            server.url, admin_key=server.admin_key, max_concurrency=args.prompts * args.group_size
        ) as client,
    ):
        wait_ready(client)
        pipe = StableDiffusion3Pipeline.from_pretrained(str(server.model_path), dtype=dtype).to(device)
        pipe.set_progress_bar_config(disable=True)
        pipe.transformer.requires_grad_(False)
        if args.gradient_checkpointing:
            pipe.transformer.enable_gradient_checkpointing()
        optimizer = torch.optim.AdamW(add_lora(pipe.transformer, args.lora_rank, dtype), lr=args.lr)
        pipeline = ServedPipeline(pipe, client, sync_weights=args.sync_weights)  # the wrapping line
        neg_pe, neg_ppe = encode(pipe, [""], args.max_sequence_length)
        for it in range(args.iterations):
            group_prompts = [PROMPTS[(it * args.prompts + k) % len(PROMPTS)] for k in range(args.prompts)]
            prompts = [q for q in group_prompts for _ in range(args.group_size)]
            n = len(prompts)
            pe, ppe = encode(pipe, prompts, args.max_sequence_length)
            npe, nppe = neg_pe.repeat(n, 1, 1), neg_ppe.repeat(n, 1)
            # same_latent: one generator seed per prompt, repeated over its group.
            generator = [
                torch.Generator().manual_seed(args.seed * 100_003 + it * 1_000 + k // args.group_size)
                for k in range(n)
            ]
            t0 = time.perf_counter()
            with torch.no_grad():
                images, latents, log_probs, outs = pipeline_with_logprob(
                    pipeline, prompt_embeds=pe, pooled_prompt_embeds=ppe, negative_prompt_embeds=npe,
                    negative_pooled_prompt_embeds=nppe, num_inference_steps=args.steps,
                    guidance_scale=args.guidance_scale, output_type="pt", height=height, width=width,
                    noise_level=args.noise_level, generator=generator, return_outputs=True,
                    extra_fields=(
                        {"rollout_return_denoising_env": True, "rollout_debug_mode": True}
                        if args.compare_replay
                        else None
                    ),
                )  # fmt: skip
            rollout_s = time.perf_counter() - t0
            latents = torch.stack(latents, dim=1)  # [B, T + 1, C, h, w]
            log_probs = torch.stack(log_probs, dim=1)  # [B, T]
            timesteps = pipeline.scheduler.timesteps.repeat(n, 1)  # [B, T], as train_sd3 reads them
            rewards = images.float().mean(dim=(1, 2, 3))  # a toy reward: brightness
            samples = {
                "prompt_embeds": pe, "pooled_prompt_embeds": ppe, "negative_prompt_embeds": npe,
                "negative_pooled_prompt_embeds": nppe, "timesteps": timesteps, "latents": latents[:, :-1],
                "next_latents": latents[:, 1:], "log_probs": log_probs,
                "advantages": group_advantages(rewards, args.group_size).to(device),
            }  # fmt: skip
            index = {id(o): k for k, o in enumerate(outs)}
            batches = [[index[id(o)] for o in group] for group in group_by_server_batch(outs)]
            t0 = time.perf_counter()
            dev, compared = flow_grpo_pass(
                pipe, samples, batches, args, outs if args.compare_replay else None
            )
            optimizer.step()
            optimizer.zero_grad()
            record = {
                "iteration": it,
                "first_step_ratio_max_dev": dev,
                **({"compare_replay": compared} if compared else {}),
                "weight_pushes": pipeline.follower.pushes if pipeline.follower else 0,
                "server_batches": [len(b) for b in batches],
                "reward_mean": float(rewards.mean()),
                "rollout_s": rollout_s,
                "train_s": time.perf_counter() - t0,
            }
            history.append(record)
            print(json.dumps(record), flush=True)
            write_run(args.out, {**run, "history": history})
    summary = {
        "images": list(images.shape),
        "latents": list(latents.shape),
        "log_probs": list(log_probs.shape),
        "first_step_ratio_max_dev": [r["first_step_ratio_max_dev"] for r in history],
        "weight_pushes": history[-1]["weight_pushes"],
    }
    write_run(args.out, {**run, "history": history, "summary": summary})
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
