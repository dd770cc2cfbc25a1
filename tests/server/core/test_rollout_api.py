"""``POST /rollout/generate`` on the tiny SD3 and FLUX models, through the real HTTP app.

Exactness is equality (``torch.equal``): the ODE path against the stock diffusers pipeline, repeats,
batched vs alone, replay vs server, msgpack vs JSON.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

from diffusion_rollout.client.replay import replay_log_prob, replay_model_output
from diffusion_rollout.protocol import wire
from tests.batch_helpers import generate_together

FAMILIES = ["sd3", "flux"]
BASE = {"prompt": "a red cat", "width": 32, "height": 32, "num_inference_steps": 4, "max_sequence_length": 16}
FLUX_CFG = {"negative_prompt": "blurry", "true_cfg_scale": 2.0}


def body(**kw) -> dict:
    return {**BASE, "seed": 7, **kw}


_stock_cache: dict = {}


def stock(path, family: str, *, seeds, n, output_type, sigmas=None, **kw):
    """The stock diffusers pipeline from the same folder, called the way a user would."""
    key = (str(path), sigmas is not None)
    if key not in _stock_cache:
        pipe = DiffusionPipeline.from_pretrained(str(path), dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        if sigmas is not None:  # the stock pipeline with its shift disabled uses sigmas unchanged
            pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
                pipe.scheduler.config, shift=1.0, use_dynamic_shifting=False
            )
        _stock_cache[key] = pipe
    pipe = _stock_cache[key]
    gens = [torch.Generator("cpu").manual_seed(s) for s in seeds]
    args = dict(prompt=BASE["prompt"], height=32, width=32, max_sequence_length=16, num_images_per_prompt=n)
    args.update(kw)
    if sigmas is not None:
        args["sigmas"] = sigmas
    else:
        args["num_inference_steps"] = BASE["num_inference_steps"]
    return pipe(generator=gens, output_type=output_type, **args).images


def stack(outs, key="generated_output"):
    return torch.stack([o[key] for o in outs])


# --------------------------------------------------------------------------- bit-exact ODE path
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "mode",
    [
        {"rollout": False},
        {"rollout_sde_type": "ode", "rollout_log_prob_no_const": True},
        {"rollout_sde_step_indices": [], "rollout_log_prob_no_const": True},
    ],
    ids=["rollout_false", "ode_kind", "no_sde_steps"],
)
def test_ode_path_is_bit_identical_to_stock_pipeline(served, tiny_model_path, family, mode):
    srv = served(family)
    extra = FLUX_CFG if family == "flux" else {}
    outs = srv.generate(body(num_outputs_per_prompt=2, return_generated_output=False, **extra, **mode))
    ref = stock(tiny_model_path(family), family, seeds=[7, 8], n=2, output_type="latent", **extra)
    assert torch.equal(stack(outs), ref)
    imgs = srv.generate(body(num_outputs_per_prompt=2, **extra, **mode))
    ref_img = stock(tiny_model_path(family), family, seeds=[7, 8], n=2, output_type="pt", **extra)
    assert torch.equal(stack(imgs), ref_img)
    if mode.get("rollout") is not False:
        for o in imgs:
            assert torch.equal(o["rollout_log_probs"], torch.zeros(4))


@pytest.mark.parametrize("family", FAMILIES)
def test_custom_sigmas_ode_bit_identical_to_unshifted_stock(served, tiny_model_path, family):
    sigmas = [1.0, 0.8, 0.45, 0.2]
    outs = served(family).generate(
        body(rollout=False, return_generated_output=False, extra_sampling_params={"sigmas": sigmas})
    )
    ref = stock(tiny_model_path(family), family, seeds=[7], n=1, output_type="latent", sigmas=sigmas)
    assert torch.equal(stack(outs), ref)


# --------------------------------------------------------------------------- SDE rollouts
@pytest.mark.parametrize("family", FAMILIES)
def test_sde_rollout_log_probs_trajectory_and_sigmas(served, family):
    sigmas = [1.0, 0.75, 0.5, 0.25]
    (out,) = served(family).generate(
        body(
            sigmas=sigmas,
            rollout_sde_step_indices=[1, 3],
            rollout_return_dit_trajectory=True,
            rollout_debug_mode=False,
        )
    )
    lp = out["rollout_log_probs"]
    assert lp.shape == (4,) and lp.dtype == torch.float32
    assert lp[0].item() == 0.0 and lp[2].item() == 0.0
    assert lp[1].item() != 0.0 and lp[3].item() != 0.0
    assert out["sde_step_indices"] == [1, 3]
    traj = out["dit_trajectory"]
    assert traj["latents"].shape[0] == 5 and traj["latent_step_indices"] == [0, 1, 2, 3, 4]
    assert torch.equal(traj["sigmas"], torch.tensor([*sigmas, 0.0], dtype=torch.float32))
    assert traj["timesteps"].shape == (5,) and traj["timesteps"][-1].item() == 0.0
    assert out["rollout_debug_tensors"] is None and out["weight_version"] == 0
    # the final trajectory entry is the generated latent
    (lat,) = served(family).generate(
        body(sigmas=sigmas, rollout_sde_step_indices=[1, 3], return_generated_output=False)
    )
    assert torch.equal(traj["latents"][4], lat["generated_output"])


def test_trajectory_filter_keeps_listed_entries(served):
    (out,) = served("sd3").generate(
        body(
            rollout_return_dit_trajectory=True,
            rollout_return_step_indices=[4, 0, 2],
            rollout_debug_mode=False,
        )
    )
    (full,) = served("sd3").generate(body(rollout_return_dit_trajectory=True, rollout_debug_mode=False))
    traj = out["dit_trajectory"]
    assert traj["latent_step_indices"] == [0, 2, 4]
    assert torch.equal(traj["latents"], full["dit_trajectory"]["latents"][[0, 2, 4]])
    assert torch.equal(traj["sigmas"], full["dit_trajectory"]["sigmas"])  # never filtered
    assert torch.equal(out["rollout_log_probs"], full["rollout_log_probs"])


@pytest.mark.parametrize("kind", ["sde", "dance", "cps"])
def test_each_kind_is_repeatable_and_seed_sensitive(served, kind):
    form = {"rollout_log_prob_no_const": True} if kind == "cps" else {}
    a = served("sd3").generate(body(rollout_sde_type=kind, **form))
    b = served("sd3").generate(body(rollout_sde_type=kind, **form))
    c = served("sd3").generate(body(rollout_sde_type=kind, seed=8, **form))
    assert torch.equal(a[0]["generated_output"], b[0]["generated_output"])
    assert torch.equal(a[0]["rollout_log_probs"], b[0]["rollout_log_probs"])
    assert not torch.equal(a[0]["generated_output"], c[0]["generated_output"])


# CPU GEMM kernels block differently for different batch sizes, so the transformer's output for one
# sample differs in the last bits between batch sizes (measured on the tiny models: model outputs
# up to 5.5e-6, images up to 2.6e-6, log-probs equal). Same batch shape: bit-identical. Different
# batch sizes: asserted within this bound instead.
BATCH_SIZE_BOUND = 1e-4


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.float() - b.float()).abs().max().item() <= BATCH_SIZE_BOUND


def test_seeds_and_shared_initial_noise(served):
    srv = served("sd3")
    per = srv.generate(body(seeds=[11, 5], num_outputs_per_prompt=2, rollout_return_dit_trajectory=True))
    other = srv.generate(body(seeds=[3, 5], num_outputs_per_prompt=2, rollout_return_dit_trajectory=True))
    alone = srv.generate(body(seed=5, rollout_return_dit_trajectory=True))
    assert [o["seed"] for o in per] == [11, 5]
    # A sample depends only on its own seed: bitwise at the same batch shape...
    assert torch.equal(per[1]["generated_output"], other[1]["generated_output"])
    assert torch.equal(per[1]["rollout_log_probs"], other[1]["rollout_log_probs"])
    assert not torch.equal(per[0]["generated_output"], other[0]["generated_output"])
    # ...and within the measured kernel bound at another batch size; its x_T is drawn identically.
    assert torch.equal(per[1]["dit_trajectory"]["latents"][0], alone[0]["dit_trajectory"]["latents"][0])
    assert close(per[1]["generated_output"], alone[0]["generated_output"])
    shared = srv.generate(
        body(num_outputs_per_prompt=3, initial_noise_seed=99, rollout_return_dit_trajectory=True)
    )
    x_t = [o["dit_trajectory"]["latents"][0] for o in shared]
    assert torch.equal(x_t[0], x_t[1]) and torch.equal(x_t[1], x_t[2])
    assert not torch.equal(shared[0]["generated_output"], shared[1]["generated_output"])  # own step noise


def test_seed_chosen_by_server_is_returned_and_repeats(served):
    first = served("sd3").generate({**BASE, "num_outputs_per_prompt": 2})
    s = first[0]["seed"]
    assert first[1]["seed"] == s + 1
    again = served("sd3").generate({**BASE, "seed": s, "num_outputs_per_prompt": 2})
    assert torch.equal(stack(first), stack(again))


# --------------------------------------------------------------------------- replay
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("form", ["gaussian", "no_const", "scaled"])
def test_replay_reproduces_model_output_and_log_prob(served, family, form):
    srv = served(family)
    extra = FLUX_CFG if family == "flux" else {}
    (out,) = srv.generate(
        body(
            rollout_return_dit_trajectory=True,
            rollout_return_denoising_env=True,
            rollout_debug_mode=True,
            rollout_log_prob_form=form,
            **extra,
        )
    )
    traj, env = out["dit_trajectory"], out["denoising_env"]
    recorded = out["rollout_debug_tensors"]["rollout_model_outputs"]
    transformer = srv.engine.pipe.transformer
    for step in range(4):
        x = traj["latents"][step : step + 1]
        with torch.no_grad():
            v = replay_model_output(transformer, x, traj["timesteps"][step], env, step=step)
        assert torch.equal(v[0], recorded[step]), f"model output differs at step {step}"
        res = replay_log_prob(
            "sde",
            x,
            v,
            traj["latents"][step + 1 : step + 2],
            traj["sigmas"],
            step,
            eta=0.7,
            log_prob_form=form,
        )
        assert torch.equal(res.log_prob[0], out["rollout_log_probs"][step]), (
            f"log-prob differs at step {step}"
        )


# --------------------------------------------------------------------------- batching
def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_outputs_do_not_depend_on_batching(fresh_server):
    srv = fresh_server("sd3", max_batch_size=16)
    reqs = [
        body(seed=100, num_outputs_per_prompt=2, rollout_return_dit_trajectory=True),
        body(prompt="a blue dog", seed=200, num_outputs_per_prompt=3, rollout_return_dit_trajectory=True),
        body(prompt="a red cat", seed=300, rollout_return_dit_trajectory=True),
    ]
    worker = srv.engine.worker
    start = worker.batches_run
    alone = [srv.generate(r) for r in reqs]
    # Results reach the caller (results thread) before the worker counts its batch: wait for the count.
    _wait_for(lambda: worker.batches_run == start + len(reqs) and not worker.busy)
    batches_before = worker.batches_run
    results = generate_together(srv, reqs)
    _wait_for(lambda: worker.batches_run > batches_before and not worker.busy)
    assert worker.batches_run == batches_before + 1, "the three requests should run as one batch"
    for a, b in zip(alone, results, strict=True):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            # Same noise (x_T bitwise), and the batch-size kernel bound for what the model computed.
            assert torch.equal(x["dit_trajectory"]["latents"][0], y["dit_trajectory"]["latents"][0])
            assert close(x["generated_output"], y["generated_output"])
            assert close(x["rollout_log_probs"], y["rollout_log_probs"])
            assert close(x["dit_trajectory"]["latents"], y["dit_trajectory"]["latents"])
            assert x["seed"] == y["seed"]


def test_a_call_is_not_grown_past_max_batch_pixels(fresh_server):
    """Queued requests that would take a call past ``max_batch_pixels`` run as calls of their own
    (each answer then leaves when its call ends); one request over the cap is never split."""
    px = BASE["width"] * BASE["height"]
    srv = fresh_server("sd3", max_batch_size=16, max_batch_pixels=3 * px)
    reqs = [
        body(seed=100, num_outputs_per_prompt=2),  # 2 outputs: fits under the cap
        body(seed=200),  # 1 more: exactly the cap, taken in
        body(seed=300),  # one more would pass it: next call
        body(seed=400, num_outputs_per_prompt=4),  # over the cap alone: a call of 4, not split
    ]
    worker = srv.engine.worker
    before = worker.batches_run
    results = generate_together(srv, reqs)
    _wait_for(lambda: worker.batches_run >= before + 3 and not worker.busy)
    assert worker.batches_run == before + 3
    sizes = [[o["batch_size"] for o in outs] for outs in results]
    assert sizes == [[3, 3], [3], [1], [4, 4, 4, 4]]
    ids = [{o["batch_id"] for o in outs} for outs in results]
    assert ids[0] == ids[1] and len({*ids[0], *ids[2], *ids[3]}) == 3


@pytest.mark.parametrize("cap_videos,calls", [(1, 2), (2, 1)])
def test_video_frames_count_toward_max_batch_pixels(fresh_server, cap_videos, calls):
    """A video's frames count: two one-video requests merge only when the cap holds both videos."""
    video = {"prompt": "a red cat", "width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 2,
             "max_sequence_length": 16}  # fmt: skip
    srv = fresh_server("wan", max_batch_size=16, max_batch_pixels=cap_videos * 32 * 32 * 5)
    worker = srv.engine.worker
    before = worker.batches_run
    results = generate_together(srv, [{**video, "seed": 1}, {**video, "seed": 2}])
    _wait_for(lambda: worker.batches_run >= before + calls and not worker.busy)
    assert worker.batches_run == before + calls
    assert [outs[0]["batch_size"] for outs in results] == [3 - calls] * 2
    assert srv.client.get("/server_info").json()["limits"]["max_batch_pixels"] == cap_videos * 32 * 32 * 5


# --------------------------------------------------------------------------- wire formats
def test_msgpack_and_json_decode_to_identical_tensors(served):
    srv = served("flux")
    req = body(rollout_return_dit_trajectory=True, rollout_return_denoising_env=True, output_dtype="uint8")
    a = srv.generate(req, accept="application/msgpack")
    b = srv.generate(req, accept="application/json")
    assert a[0]["generated_output"].dtype == torch.uint8

    def same(x, y):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        elif isinstance(x, dict):
            assert x.keys() == y.keys()
            for k in x:
                if k not in ("request_id", "inference_time_s", "batch_id"):
                    same(x[k], y[k])
        elif isinstance(x, list):
            assert len(x) == len(y)
            for p, q in zip(x, y, strict=True):
                same(p, q)
        else:
            assert x == y

    same(a, b)


def test_uint8_output_is_quantised_float_output(served):
    (f,) = served("sd3").generate(body())
    (u,) = served("sd3").generate(body(output_dtype="uint8"))
    assert torch.equal(
        u["generated_output"], (f["generated_output"] * 255).round().clamp(0, 255).to(torch.uint8)
    )


def test_request_id_header_and_field(served):
    r = served("sd3").client.post("/rollout/generate", json=body(), headers={"X-Request-Id": "rid-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "rid-42"
    assert wire.decode(r.content)[0]["request_id"] == "rid-42"


# --------------------------------------------------------------------------- errors
BAD_400 = [
    ({"rollout_sde_step_indices": [0, 4]}, "rollout_sde_step_indices"),
    ({"rollout_sde_step_indices": [1, 1]}, "rollout_sde_step_indices"),
    ({"rollout_return_step_indices": [5]}, "rollout_return_step_indices"),
    ({"rollout_sde_type": "ode"}, "rollout_log_prob_no_const"),
    ({"rollout_sde_step_indices": []}, "rollout_log_prob_no_const"),
    ({"rollout_noise_level": 0.0}, "rollout_noise_level"),
    ({"sigmas": [1.0, 0.5, 0.6, 0.2]}, "sigmas"),
    ({"sigmas": [1.2, 0.5, 0.3, 0.2]}, "sigmas"),
    ({"sigmas": [1.0, 0.5, 0.3]}, "sigmas"),
    ({"extra_sampling_params": {"sigmas": [1.0, 0.5, 0.0, -0.1]}}, "sigmas"),
    ({"width": 30}, "width"),
    ({"num_inference_steps": 100000}, "max_steps"),
    ({"seeds": [1, 2, 3]}, "seeds"),
    ({"num_outputs_per_prompt": 1000}, "max_outputs_per_request"),
    ({"sigmas": [1.0, 0.7, 0.4, 0.1], "flow_shift": 3.0}, "flow_shift"),
    ({"image_path": ["/etc/passwd"]}, "image_path"),
    # Beyond the transformer's position table (tiny SD3: 32 patches a side, 256 px): the pipeline
    # would raise inside the call, a 500; SGLang's OpenAI test asks 512x512 of whatever it serves.
    ({"width": 512, "height": 512}, "pos_embed_max_size"),
]


@pytest.mark.parametrize(("extra", "needle"), BAD_400, ids=[n + str(i) for i, (_, n) in enumerate(BAD_400)])
def test_unservable_requests_get_400_naming_the_field(served, extra, needle):
    r = served("sd3").generate(body(**extra), expect=400)
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request"
    assert needle in err["message"], err["message"]
    assert served("sd3").client.get("/health").status_code == 200


BAD_422 = [
    ({"rollout_sde_type": "langevin"}, "rollout_sde_type"),
    ({"rollout_noise_level": -1}, "rollout_noise_level"),
    ({"num_inference_steps": 0}, "num_inference_steps"),
]


UNKNOWN = {"rollout_sde_tpye": "sde", "extra_sampling_params": {"sigmsa": [1.0]}}


def test_unknown_fields_are_reported_and_refused_only_under_strict_fields(served, fresh_server):
    """Unknown keys are accepted, as SGLang accepts them, and every one is named in
    ``ignored_fields`` (a typo is visible, not silent); ``--strict-fields`` makes them a 422."""
    (out,) = served("sd3").generate(body(rollout=False, **UNKNOWN))
    assert out["ignored_fields"] == ["extra_sampling_params.sigmsa", "rollout_sde_tpye"]
    r = fresh_server("sd3", strict_fields=True).generate(body(**UNKNOWN), expect=422)
    js = r.json()
    assert js["error"]["code"] == 422 and "detail" in js
    assert "unknown field 'rollout_sde_tpye'" in js["error"]["message"]
    assert "unknown field 'extra_sampling_params.sigmsa'" in js["error"]["message"]


@pytest.mark.parametrize(("extra", "needle"), BAD_422, ids=[n for _, n in BAD_422])
def test_malformed_requests_get_422_naming_the_field(served, extra, needle):
    r = served("sd3").generate(body(**extra), expect=422)
    js = r.json()
    assert js["error"]["code"] == 422 and needle in js["error"]["message"]
    assert "detail" in js


def test_body_over_limit_gets_413(fresh_server):
    srv = fresh_server("sd3", max_body_bytes=2048)
    r = srv.client.post("/rollout/generate", json=body(prompt="x" * 5000))
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_queue_full_gets_429_with_retry_after(fresh_server):
    srv = fresh_server("sd3", max_queue_depth=1)
    srv.engine.worker.pause()
    queued: list = []
    t = threading.Thread(target=lambda: queued.extend(srv.generate(body())))
    t.start()
    try:
        deadline = time.monotonic() + 10
        while srv.engine.worker.depth < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = srv.client.post("/rollout/generate", json=body())
        assert r.status_code == 429 and "max_queue_depth" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) >= 1
    finally:  # a failed assertion must not leave the queued request (and the teardown) hanging
        srv.engine.worker.resume()
        t.join(30)
    # The queued request was held, not refused: it is answered once the worker resumes.
    assert [o["seed"] for o in queued] == [7]


def test_generation_failure_is_500_and_server_keeps_serving(fresh_server, monkeypatch):
    srv = fresh_server("sd3")
    pipe = srv.engine.pipe
    original = type(pipe).__call__

    def broken(self, *a, **k):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(type(pipe), "__call__", broken)
    r = srv.generate(body(), expect=500)
    assert "injected failure" in r.json()["error"]["message"]
    monkeypatch.setattr(type(pipe), "__call__", original)
    assert srv.generate(body())[0]["generated_output"].shape == (3, 32, 32)


def test_info_endpoints(served):
    c = served("flux").client
    info = c.get("/model_info").json()
    assert info["family"] == "flux" and info["pipeline_class"] == "FluxPipeline"
    server_info = c.get("/server_info").json()
    assert server_info["limits"]["max_steps"] == 200 and "diffusers" in server_info["versions"]
    assert c.get("/v1/models").json()["data"][0]["root"] == info["model_path"]
    assert c.get("/health_generate").json() == {"status": "ok"}
