"""Issue #41: where does the served forward part from the trainer's once a rank-4 adapter has moved?

``benchmarks/investigations/lora_bits.py`` found a trainer's transformer and a copy given the same adapter by the
server's ``LoraManager`` bit-identical, while ``examples/flow_grpo_dropin.py`` found the *served*
model output off the trainer's (``server_model_output_mismatches``). This runs the real server (the
HTTP app, its loader, engine and lanes, default options) in a thread of this process, so that both
forwards can be watched:

1. the trainer's SD3 pipeline gets a PEFT adapter (``diffusion_rollout.recipes.trainer.add_lora``) moved off zero, and
   one group is sampled through ``ServedPipeline`` (which pushes the adapter first), with the debug
   tensors on;
2. forward hooks record, during the server's own first transformer call, every LoRA layer's input
   (with its shape, strides and alignment), its ``lora_A`` output and its output;
3. the trainer's transformer runs the same step on the same inputs (grad mode, as flow_grpo's
   recompute), and the server's transformer is called directly from this thread too;
4. the JSON says which of the three agree, the first LoRA layer where they part and what differs
   there (input, ``lora_A`` output, layer output), and whether the server's adapter tensors equal
   the trainer's (values, dtype, strides).

    python -m benchmarks.investigations.lora_bits_served --device cuda --model SD35_DIR --out $OUT
    python -m benchmarks.investigations.lora_bits_served --device cpu --out /tmp/x   # tiny SD3, float32 (a check)
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import document, log, write_json
from diffusion_rollout.testing import free_port, serve_in_thread


def meta(t: torch.Tensor) -> dict[str, Any]:
    return {
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "dtype": str(t.dtype),
        "contiguous": t.is_contiguous(),
        "offset": t.storage_offset(),
        "ptr_mod_256": t.data_ptr() % 256,
        "requires_grad": t.requires_grad,
    }


class Recorder:
    """Per LoRA layer of one model: input, ``lora_A`` output, layer output, for one transformer call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.armed = False
        self.layers: dict[str, dict[str, Any]] = {}
        self.a_outs: dict[str, dict[str, Any]] = {}  # per layer: its lora_A output (runs inside it)
        self.output: torch.Tensor | None = None
        self.inputs: dict[str, Any] | None = None
        self._hooks: list[Any] = []

    def __enter__(self) -> Recorder:
        self.armed = True

        def pre(mod, args, kwargs):
            if self.armed and self.inputs is None:
                self.inputs = {
                    k: v.detach().clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)
                }

        def post(mod, args, kwargs, out):
            if self.armed and self.output is None:
                self.output = (out[0] if isinstance(out, tuple) else out.sample).detach().clone()
                self.armed = False  # one call only

        self._hooks.append(self.model.register_forward_pre_hook(pre, with_kwargs=True))
        self._hooks.append(self.model.register_forward_hook(post, with_kwargs=True))
        for name, mod in self.model.named_modules():
            if not hasattr(mod, "lora_A"):
                continue

            def layer_hook(m, args, out, name=name):
                if self.armed and name not in self.layers:
                    x = args[0]
                    self.layers[name] = {
                        "x": x.detach().clone(),
                        "x_meta": meta(x),
                        "out": out.detach().clone(),
                    }

            self._hooks.append(mod.register_forward_hook(layer_hook))
            for sub in mod.lora_A.values():

                def a_hook(m, args, out, name=name):
                    if self.armed and name not in self.a_outs:
                        self.a_outs[name] = {"a_out": out.detach().clone(), "a_in_meta": meta(args[0])}

                self._hooks.append(sub.register_forward_hook(a_hook))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "lora_A"):
            for key in mod.lora_A:
                out[f"{name}.A"] = mod.lora_A[key].weight
                out[f"{name}.B"] = mod.lora_B[key].weight
    return out


def compare(a: Recorder, b: Recorder) -> dict[str, Any]:
    """First LoRA layer (in call order) whose output differs, and what differs there."""
    row: dict[str, Any] = {
        "outputs_equal": a.output is not None and b.output is not None and torch.equal(a.output, b.output),
        "output_max_abs_diff": float((a.output.float() - b.output.float()).abs().max())
        if a.output is not None and b.output is not None
        else None,
        "layers_recorded": [len(a.layers), len(b.layers)],
        "layers_differing": 0,
    }
    first = None
    for name, la in a.layers.items():
        lb = b.layers.get(name)
        if lb is None:
            continue
        if not torch.equal(la["out"], lb["out"]):
            row["layers_differing"] += 1
            if first is None:
                first = name
                row["first_layer"] = {
                    "name": name,
                    "input_equal": torch.equal(la["x"], lb["x"]),
                    "a_out_equal": (
                        "a_out" in la and "a_out" in lb and torch.equal(la["a_out"], lb["a_out"])
                    ),
                    "out_max_abs_diff": float((la["out"].float() - lb["out"].float()).abs().max()),
                    "x_meta": [la["x_meta"], lb["x_meta"]],
                    "a_in_meta": [r.a_outs.get(name, {}).get("a_in_meta") for r in (a, b)],
                }
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default=None, help="an SD3 diffusers folder (default: the tiny SD3, CPU)")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument(
        "--server-options", default="", help="ServerConfig fields, k=v,k=v (e.g. pipeline_lanes=1)"
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from diffusers import StableDiffusion3Pipeline

    from diffusion_rollout.client import RolloutClient
    from diffusion_rollout.client.flow_grpo import pipeline_with_logprob
    from diffusion_rollout.client.served_pipeline import ServedPipeline
    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.app import create_app
    from diffusion_rollout.entrypoints.http_server import make_server
    from diffusion_rollout.recipes.trainer import add_lora

    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    tmp = tempfile.TemporaryDirectory(prefix="lora-bits-served-")
    folder = args.model
    if folder is None:
        from diffusion_rollout.models import save_tiny_model

        folder = str(save_tiny_model("sd3", Path(tmp.name) / "tiny-sd3"))
        args.size = 32
    extra: dict[str, Any] = {}
    for item in filter(None, args.server_options.split(",")):
        k, v = item.split("=", 1)
        extra[k.strip()] = int(v) if v.strip().isdigit() else v.strip()
    port, key = free_port(), secrets.token_hex(8)
    config = ServerConfig(
        model=folder, device=args.device, dtype="bfloat16" if cuda else "float32", host="127.0.0.1", port=port,
        admin_key=key, max_batch_size=args.group, log_level="warning", **extra,
    )  # fmt: skip
    app = create_app(config)
    server = make_server(app, config)
    serving = contextlib.ExitStack()
    serving.enter_context(serve_in_thread(server, name="rollout-server"))
    row: dict[str, Any] = {"rank": args.rank, "group": args.group, "size": args.size, "server_options": extra}
    try:
        with RolloutClient(f"http://127.0.0.1:{port}", admin_key=key) as client:
            client.wait_until_ready(timeout_s=900)
            pipe = StableDiffusion3Pipeline.from_pretrained(folder, dtype=dtype).to(args.device)
            pipe.set_progress_bar_config(disable=True)
            pipe.transformer.requires_grad_(False)
            params = add_lora(pipe.transformer, args.rank, dtype)
            g = torch.Generator().manual_seed(args.rank)
            with torch.no_grad():
                for q in params:  # an adapter moved off zero, as after an optimizer step
                    q.copy_((torch.randn(q.shape, generator=g) * 1e-2).to(q.dtype))
            served = ServedPipeline(pipe, client)
            served.sync_weights()  # the push first: the server's LoRA layers exist before the hooks go on
            engine = app.state.engine
            server_tr = engine.loaded.pipe.transformer
            row["server_speed"] = (
                engine.loaded.speed.report() if hasattr(engine.loaded.speed, "report") else None
            )
            with torch.no_grad():
                pe, _, ppe, _ = pipe.encode_prompt(
                    ["a red bicycle"] * args.group, None, None, do_classifier_free_guidance=False,
                    max_sequence_length=128, device=pipe._execution_device,
                )  # fmt: skip
                npe, _, nppe, _ = pipe.encode_prompt(
                    [""], None, None, do_classifier_free_guidance=False, max_sequence_length=128,
                    device=pipe._execution_device,
                )  # fmt: skip
            npe, nppe = npe.repeat(args.group, 1, 1), nppe.repeat(args.group, 1)
            rec_server = Recorder(server_tr)
            with rec_server, torch.no_grad():
                _, latents, _, outs = pipeline_with_logprob(
                    served, prompt_embeds=pe, pooled_prompt_embeds=ppe, negative_prompt_embeds=npe,
                    negative_pooled_prompt_embeds=nppe, num_inference_steps=args.steps, guidance_scale=4.5,
                    output_type="pt", height=args.size, width=args.size, noise_level=0.7,
                    generator=[torch.Generator().manual_seed(0) for _ in range(args.group)], return_outputs=True,
                    extra_fields={"rollout_debug_mode": True},
                )  # fmt: skip
            row["server_batches"] = len({o.batch_id for o in outs})
            row["weight_pushes"] = served.follower.pushes if served.follower else 0
            # The adapter the server holds against the trainer's.
            mine, theirs = adapter_tensors(pipe.transformer), adapter_tensors(server_tr)
            diffs = [
                n for n in mine if n not in theirs or not torch.equal(mine[n], theirs[n].to(mine[n].device))
            ]
            row["adapter_tensors"] = len(mine)
            row["adapter_tensors_differing"] = diffs[:5]
            name0 = next(iter(mine))
            row["adapter_meta"] = {"trainer": meta(mine[name0]), "server": meta(theirs[name0])}
            row["adapter_dtypes"] = sorted({str(t.dtype) for t in theirs.values()})
            row["adapter_noncontiguous"] = sum(not t.is_contiguous() for t in theirs.values())
            # The same step in the trainer (grad mode, flow_grpo's recompute) and the server's model here.
            x = latents[0].to(args.device, dtype)
            t = pipe.scheduler.timesteps[0].to(args.device).expand(args.group)
            kw = {
                "hidden_states": torch.cat([x, x]), "timestep": torch.cat([t, t]),
                "encoder_hidden_states": torch.cat([npe, pe]), "pooled_projections": torch.cat([nppe, ppe]),
            }  # fmt: skip
            if rec_server.inputs is not None:
                row["inputs_equal"] = {
                    k: torch.equal(rec_server.inputs[k].to(v.dtype), v) if k in rec_server.inputs else None
                    for k, v in kw.items()
                }
            rec_trainer = Recorder(pipe.transformer)
            with rec_trainer:
                pipe.transformer(**kw, return_dict=False)
            rec_direct = Recorder(server_tr)
            with rec_direct, torch.inference_mode():
                server_tr(**kw, return_dict=False)
            row["served_vs_trainer"] = compare(rec_server, rec_trainer)
            row["direct_server_vs_trainer"] = compare(rec_direct, rec_trainer)
            row["served_vs_direct_server"] = compare(rec_server, rec_direct)
            debug = outs[0].rollout_debug_tensors or {}
            if "rollout_model_outputs" in debug and rec_trainer.output is not None:
                uncond, text = rec_trainer.output.chunk(2)
                v = uncond + 4.5 * (text - uncond)
                server_v = torch.as_tensor(debug["rollout_model_outputs"][0]).to(v.device)
                row["debug_model_output_equal_trainer"] = torch.equal(server_v.to(v.dtype), v[0])
    finally:
        serving.close()
        tmp.cleanup()
    log(str(row))
    write_json(args.out, "lora_bits_served", document("lora_bits_served", args.device, vars(args), [row]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
