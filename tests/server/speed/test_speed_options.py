"""Lean responses, the exactness contract and feature caching, through the real HTTP app (CPU).

- Lean form: the shared ``denoising_env`` travels once and is referenced; resolved, it equals the
  per-output form bit for bit, and replay from it is still exact. A client that does not ask for
  it gets the plain per-output form.
- ``exact``: true on the eager server, false with a non-exact attention backend or a feature cache.
- Feature cache: really changes the computation (outputs differ from eager), and the 400 rules.
- ``cuda_graphs`` on a CPU server is a clear start-up error.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from pydantic import ValidationError

from diffusion_rollout.client import RolloutClient, replay_steps
from diffusion_rollout.config import ServerConfig
from diffusion_rollout.entrypoints.request_params import to_params
from diffusion_rollout.protocol import lean, wire
from diffusion_rollout.protocol.requests import GenerateRequest
from tests.client.test_replay import REPLAY, call_defaults, trainer_copy

N = 3


def post(server, body: dict, expect: int = 200):
    r = server.client.post("/rollout/generate", json=body, headers={"Accept": "application/msgpack"})
    assert r.status_code == expect, r.text[:2000]
    return r


def sd3_body(**fields) -> dict:
    return {
        "prompt": "a red square on a table",
        "seed": 5,
        "num_outputs_per_prompt": N,
        **call_defaults("sd3"),
        **REPLAY,
        **fields,
    }


def assert_same_tree(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_tree(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_tree(x, y)
    else:
        assert a == b


# --------------------------------------------------------------------------- lean responses
@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_lean_form_sends_shared_env_once_and_resolves_to_the_plain_form(served, family):
    server = served(family)
    body = {**sd3_body(), **call_defaults(family)}
    plain_r = post(server, body)
    lean_r = post(server, {**body, "lean_response": True})
    plain = wire.decode(plain_r.content)
    raw = wire.decode(lean_r.content)

    # The plain form (what an SGLang client reads): a full env in every output, no references.
    assert all(isinstance(o["denoising_env"]["pos_cond_kwargs"], dict) for o in plain)
    # The lean form: output 0 carries it, the others refer to output 0.
    assert "pos_cond_kwargs" in raw[0]["denoising_env"]
    assert [o["denoising_env"] for o in raw[1:]] == [{lean.REF_KEY: 0}] * (N - 1)
    env_bytes = len(wire.encode(plain[0]["denoising_env"]))
    assert len(plain_r.content) - len(lean_r.content) >= (N - 1) * (env_bytes - 32)

    resolved = lean.from_lean(raw)
    for p, q in zip(plain, resolved, strict=True):
        for key in ("denoising_env", "rollout_log_probs", "dit_trajectory", "generated_output"):
            assert_same_tree(p[key], q[key])
    # Per-output views: each output owns its dicts (a trainer editing one does not edit another).
    assert resolved[1]["denoising_env"] is not resolved[2]["denoising_env"]
    assert (
        resolved[1]["denoising_env"]["pos_cond_kwargs"] is not resolved[0]["denoising_env"]["pos_cond_kwargs"]
    )


def test_client_asks_for_lean_form_and_replay_stays_bit_exact(served, tiny_model_path):
    server = served("sd3")
    client = RolloutClient("http://testserver", http_client=server.client)
    body = sd3_body()
    prompt = body.pop("prompt")
    outs = client.generate(prompt, **body)
    outs_plain = client.generate(prompt, lean_response=False, **body)
    for o, p in zip(outs, outs_plain, strict=True):
        assert_same_tree(o.denoising_env, p.denoising_env)
    trainer = trainer_copy(tiny_model_path("sd3"), "sd3")
    for s in replay_steps(trainer, outs):
        assert torch.equal(s.log_prob, s.old_log_prob)
        assert torch.equal(s.ratio, torch.ones(N))


def test_lean_references_are_validated():
    with pytest.raises(ValueError, match="refers to output"):
        lean.from_lean([{"denoising_env": {lean.REF_KEY: 0}}])
    with pytest.raises(ValueError, match="refers to output"):
        lean.from_lean([{"denoising_env": None}, {"denoising_env": {lean.REF_KEY: 0}}])


def test_share_equal_compares_bits_not_values():
    a = {"x": torch.tensor([0.0, 1.0])}
    b = {"x": torch.tensor([-0.0, 1.0])}  # equal values, different bits
    c = {"x": torch.tensor([0.0, 1.0])}
    shared = lean.share_equal([a, b, c])
    assert shared[0] is a and shared[1] is b and shared[2] is a


def test_results_are_compact_host_tensors(served):
    # Each output's tensors own exactly their bytes (no view of the batch): pickling one output (Ray)
    # does not carry the whole batch.
    server = served("sd3")
    outs = server.engine.generate_sync(
        to_params(GenerateRequest(**sd3_body()), "compact-test")
    )
    traj = outs[1].dit_trajectory["latents"]
    assert traj.untyped_storage().nbytes() == traj.numel() * traj.element_size()
    debug = outs[1].rollout_debug_tensors["rollout_model_outputs"]
    assert debug.untyped_storage().nbytes() == debug.numel() * debug.element_size()
    one = len(pickle.dumps(outs[1]))
    assert one < len(pickle.dumps(outs)) / (N - 0.5)


# --------------------------------------------------------------------------- exactness contract
def test_eager_server_reports_exact(served):
    server = served("sd3")
    outs = server.generate(sd3_body(rollout=False, num_outputs_per_prompt=1))
    assert outs[0]["exact"] is True
    info = server.client.get("/server_info").json()["speed"]
    assert info["exact"] is True
    assert info["cuda_graphs"] == {"enabled": False}
    assert info["compile"] is False
    assert info["feature_caches"] == ["taylorseer"]


def test_non_exact_attention_backend_reports_inexact(fresh_server):
    server = fresh_server("flux", attention_backend="_native_math")
    body = {"prompt": "a red square", "seed": 5, "num_outputs_per_prompt": 1, **call_defaults("flux")}
    outs = server.generate({**body, "rollout": False})
    assert outs[0]["exact"] is False
    assert server.client.get("/server_info").json()["speed"]["exact"] is False


def test_an_attention_backend_the_model_would_ignore_is_refused(tiny_model_path):
    """SD3's attention processors call SDPA themselves; diffusers would skip them silently, and the
    server would say ``exact: false`` while running the default kernel."""
    from diffusers import DiffusionPipeline

    from diffusion_rollout.server.core.loader import apply_speed_options

    pipe = DiffusionPipeline.from_pretrained(str(tiny_model_path("sd3")))
    with pytest.raises(ValueError) as exc:
        apply_speed_options(pipe, attention_backend="_native_math")
    assert str(exc.value) == (
        "attention_backend=_native_math would change nothing on transformer (SD3Transformer2DModel): "
        "its attention processors (JointAttnProcessor2_0) call PyTorch's SDPA directly, not diffusers' "
        "attention dispatcher"
    )
    # The default named changes nothing anywhere, and stays accepted.
    assert apply_speed_options(pipe, attention_backend="native").exact is True


def test_cuda_graphs_on_cpu_is_a_clear_startup_error():
    with pytest.raises(ValidationError, match="cuda_graphs needs a CUDA device"):
        ServerConfig(device="cpu", cuda_graphs=True)


def test_cuda_graphs_on_cpu_stops_the_cli_with_one_clear_line():
    from diffusion_rollout.entrypoints.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--cuda-graphs", "--device", "cpu"])
    assert (
        str(exc.value)
        == "diffusion-rollout serve: cuda_graphs needs a CUDA device; this server runs on 'cpu'"
    )


def test_cuda_graph_keys_separate_what_a_graph_would_freeze():
    from diffusion_rollout.server.speed.cuda_graphs import _UNKEYABLE, _key_of

    x = torch.zeros(2, 3)
    assert _key_of({"x": x, "scale": 1.0}) == _key_of({"x": torch.ones(2, 3), "scale": 1.0})
    assert _key_of({"x": x, "scale": 1.0}) != _key_of({"x": x, "scale": 0.5})  # a baked-in value
    assert _key_of(x) != _key_of(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert _key_of(x) != _key_of(torch.zeros(3, 2).t())  # same shape, other strides
    assert _key_of(torch.zeros(1).expand(4)) != _key_of(torch.zeros(4))
    assert _key_of({"x": x, "cb": object()}) is _UNKEYABLE  # runs eager


def test_cuda_graphs_flag_reaches_the_cli():
    from diffusion_rollout.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--cuda-graphs", "--cuda-graph-max-buckets", "3"])
    assert args.cuda_graphs is True and args.cuda_graph_max_buckets == 3


# --------------------------------------------------------------------------- feature caching
CACHE = {"kind": "taylorseer", "interval": 2, "warmup_steps": 1}


def test_feature_cache_changes_the_computation_and_is_reported_inexact(served):
    server = served("sd3")
    base = sd3_body(
        rollout=False, num_outputs_per_prompt=2, return_generated_output=False, num_inference_steps=6
    )
    eager = server.generate(base)
    cached = server.generate({**base, "feature_cache": CACHE})
    again = server.generate(base)
    for e, c, a in zip(eager, cached, again, strict=True):
        assert not torch.equal(e["generated_output"], c["generated_output"])  # the cache really skipped work
        assert torch.equal(e["generated_output"], a["generated_output"])  # and left no state behind
        assert e["exact"] is True and c["exact"] is False and a["exact"] is True


def test_feature_cache_with_stochastic_log_probs_needs_allow_inexact(served):
    server = served("sd3")
    body = sd3_body(num_outputs_per_prompt=1, feature_cache=CACHE, num_inference_steps=6)
    r = post(server, body, expect=400)
    assert "allow_inexact" in r.json()["error"]["message"]
    outs = server.generate({**body, "allow_inexact": True})
    assert outs[0]["exact"] is False and outs[0]["rollout_log_probs"].shape == (6,)
    # DiffusionNFT-style: no stochastic step, no log-prob to spoil.
    nft = {**body, "rollout_sde_step_indices": [], "rollout_log_prob_no_const": True}
    assert server.generate(nft)[0]["exact"] is False


@pytest.mark.parametrize(
    ("cache", "status", "needle"),
    [
        ({"kind": "first_block"}, 400, "not available for the sd3 family"),
        ({"kind": "nope"}, 422, "kind"),
        ({"kind": "taylorseer", "interval": 0}, 422, "interval"),
        ({"kind": "taylorseer", "colour": 1}, 422, "colour"),
    ],
)
def test_feature_cache_field_errors(served, cache, status, needle):
    r = post(served("sd3"), sd3_body(rollout=False, feature_cache=cache), expect=status)
    assert needle in r.text


@pytest.mark.parametrize(
    "cache", [{"kind": "first_block", "threshold": 0.5}, {"kind": "mag", "threshold": 1.0}]
)
def test_block_caches_on_flux(served, cache):
    server = served("flux")
    base = {
        **sd3_body(rollout=False, num_outputs_per_prompt=1, return_generated_output=False),
        **call_defaults("flux"),
        "num_inference_steps": 6,
    }
    eager = server.generate(base)[0]["generated_output"]
    cached = server.generate({**base, "feature_cache": cache})[0]
    assert cached["exact"] is False
    assert not torch.equal(eager, cached["generated_output"])


def test_the_readiness_probe_of_a_compiled_server_runs_eagerly(fresh_server):
    """The probe's small image would compile the blocks for a shape no request uses (minutes with
    FP8 on an H100): it runs under ``force_eager``, and the first real request is what compiles."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # so that the request below compiles even if another test compiled these blocks
    # No warm-up (nothing compiled yet) and no compile cache (nothing written under ~/.cache).
    server = fresh_server("sd3", compile=True, warmup_shapes="none", compile_cache="none")
    before = counters["stats"]["unique_graphs"]
    assert server.client.get("/health_generate").status_code == 200
    assert counters["stats"]["unique_graphs"] == before  # nothing compiled for the probe
    out = server.generate({"prompt": "a red square", "seed": 1, **call_defaults("sd3")})
    assert counters["stats"]["unique_graphs"] > before and out[0]["exact"] is False
