"""``--cuda-graphs``: the graphed denoiser is the eager one, bit for bit (GPU only; CPU: a clear error).

On the GPU, with the tiny models in bf16:

- ODE gate: ``rollout=false`` outputs of a graphed server equal the stock diffusers pipeline's with
  ``torch.equal``, on the first call (eager, then captured) and on later calls (replayed). FLUX with
  true CFG calls the model twice per step in one bucket, which checks that replay outputs are copied
  out before the next replay.
- Replay ratio: the trainer's eager transformer replays a graphed SDE rollout to the server's model
  outputs and log-probs bit for bit (ratio exactly 1).
- The bucket bound: shapes beyond ``cuda_graph_max_buckets`` run eager, still exact.
"""

from __future__ import annotations

import pytest
import torch

from diffusion_rollout.client import ReplayBatch, RolloutClient, replay_steps
from diffusion_rollout.models import TINY_CALL_DEFAULTS

CASES = {
    "sd3": {},
    "flux": {"negative_prompt": "blurry", "true_cfg_scale": 2.0},
}


def _body(family: str, **fields) -> dict:
    return {
        "prompt": "a red square on a table",
        "seed": 11,
        "generator_device": "cuda",
        **TINY_CALL_DEFAULTS[family],
        **CASES[family],
        **fields,
    }


def _stock_latents(path, family: str, body: dict, n: int) -> torch.Tensor:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(path), dtype=torch.bfloat16).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    gens = [torch.Generator("cuda").manual_seed(body["seed"] + i) for i in range(n)]
    keys = (
        "prompt", "negative_prompt", "height", "width", "num_inference_steps", "guidance_scale",
        "true_cfg_scale", "max_sequence_length",
    )  # fmt: skip
    kwargs = {k: body[k] for k in keys if body.get(k) is not None}
    with torch.inference_mode():
        return pipe(**kwargs, num_images_per_prompt=n, generator=gens, output_type="latent").images


def _graphed(fresh_server, family: str, **config):
    return fresh_server(family, device="cuda", dtype="bfloat16", cuda_graphs=True, **config)


def test_cuda_graph_runner_refuses_a_cpu_process():
    if torch.cuda.is_available():
        pytest.skip("this process has CUDA")
    from diffusion_rollout.server.speed.cuda_graphs import CudaGraphRunner

    with pytest.raises(ValueError, match="needs a CUDA device"):
        CudaGraphRunner({"transformer": torch.nn.Linear(2, 2)})


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(CASES))
def test_ode_gate_graphed_server_equals_stock_eager(fresh_server, tiny_model_path, family):
    server = _graphed(fresh_server, family)
    body = _body(family, rollout=False, return_generated_output=False, num_outputs_per_prompt=2)
    ref = _stock_latents(tiny_model_path(family), family, body, 2)
    for _ in range(3):  # call 1: eager + capture; calls 2 and 3: replays
        outs = server.generate(body)
        assert torch.equal(torch.stack([o["generated_output"] for o in outs]).to(ref.device), ref)
        assert all(o["exact"] is True for o in outs)
    graphs = server.client.get("/server_info").json()["speed"]["cuda_graphs"]
    assert graphs["enabled"] is True and graphs["captured"] >= 1 and graphs["replays"] > 0
    assert graphs["capture_failures"] == 0


@pytest.mark.gpu
def test_replay_ratio_of_a_graphed_rollout_is_exactly_one(fresh_server, tiny_model_path):
    from diffusers import AutoModel

    server = _graphed(fresh_server, "sd3")
    client = RolloutClient("http://testserver", http_client=server.client)
    body = _body(
        "sd3",
        num_outputs_per_prompt=2,
        rollout_return_dit_trajectory=True,
        rollout_return_denoising_env=True,
        rollout_debug_mode=True,
    )
    prompt = body.pop("prompt")
    client.generate(prompt, **body)  # capture
    outs = client.generate(prompt, **body)  # replayed
    path = tiny_model_path("sd3")
    trainer = AutoModel.from_pretrained(str(path), subfolder="transformer", dtype=torch.bfloat16).to("cuda")
    with torch.inference_mode():
        for s in replay_steps(trainer, ReplayBatch(outs, device="cuda")):
            server_v = torch.stack([o.rollout_debug_tensors["rollout_model_outputs"][s.step] for o in outs])
            assert torch.equal(s.model_output.cpu(), server_v)
            assert torch.equal(s.log_prob.cpu(), s.old_log_prob.cpu())
            assert torch.equal(s.ratio.cpu(), torch.ones(len(outs)))
    assert server.client.get("/server_info").json()["speed"]["cuda_graphs"]["replays"] > 0


@pytest.mark.gpu
def test_shapes_beyond_the_bucket_bound_run_eager_and_exact(fresh_server, tiny_model_path):
    server = _graphed(fresh_server, "sd3", cuda_graph_max_buckets=1)
    for n in (1, 2, 2):
        body = _body("sd3", rollout=False, return_generated_output=False, num_outputs_per_prompt=n)
        outs = server.generate(body)
        ref = _stock_latents(tiny_model_path("sd3"), "sd3", body, n)
        assert torch.equal(torch.stack([o["generated_output"] for o in outs]).to(ref.device), ref)
    graphs = server.client.get("/server_info").json()["speed"]["cuda_graphs"]
    assert graphs["captured"] == 1 and graphs["eager_calls"] > 0
