"""The trainer client against the real app: every call, typed results, errors, retries, keys, servers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import httpx
import pytest
import torch
from safetensors.torch import save

import diffusion_rollout.client as client_pkg
from diffusion_rollout.client import (
    AsyncRolloutClient,
    DitTrajectory,
    ReplaySettings,
    RequestValidationError,
    RetryPolicy,
    RolloutClient,
    RolloutConnectionError,
    RolloutHTTPError,
    RolloutOutput,
    RolloutTimeoutError,
    UpdateResult,
)
from diffusion_rollout.client.exceptions import (
    BadRequestError,
    ServerAuthenticationError,
    ServerNotFoundError,
    ServerPermissionDeniedError,
    ServerQueueFullError,
    ServerRequestTimeoutError,
    ServerUnavailableError,
    ServerValidationError,
    ServerWeightUpdateError,
)
from diffusion_rollout.errors import (
    AuthenticationError,
    NotFoundError,
    PermissionDeniedError,
    QueueFullError,
    RequestError,
    RequestTimeoutError,
    ServiceUnavailableError,
    WeightUpdateError,
)

SMALL = {"num_inference_steps": 2, "width": 32, "height": 32, "max_sequence_length": 16}
EXPECTED_ALL = [
    "AsyncRolloutClient", "AsyncRolloutStream", "ChecksumMismatchError", "DitTrajectory", "ReplayBatch", "ReplaySettings",
    "ReplayedStep", "RequestValidationError", "RetryPolicy", "RolloutClient", "RolloutConnectionError", "RolloutHTTPError",
    "RolloutOutput", "RolloutStream", "RolloutTimeoutError", "StreamBatch", "StreamStats", "UpdateResult",
    "WeightBroadcaster",
    "build_update_weights_from_tensor_request", "clipped_policy_loss", "gaussian_kl", "group_advantages",
    "group_by_server_batch",
    "lora_checksum", "lora_config_dict", "lora_state_dict", "push_lora", "push_weights", "push_weights_ipc",
    "ratio_stats_by_staleness", "replay_log_prob", "replay_model_output", "replay_step", "replay_steps", "replay_stream_model_outputs",
    "safetensors_parts",
    "stack_envs", "tis_policy_loss", "trainable_steps", "tree_advantages", "verify_lora", "verify_weights_checksum",
]  # fmt: skip


def sync_client(server, **kw) -> RolloutClient:
    """Our client over the served app's TestClient (the real HTTP stack, no socket)."""
    return RolloutClient("http://testserver", http_client=server.client, **kw)


# ---------------------------------------------------------------------------- the package
def test_public_names_are_pinned():
    assert sorted(client_pkg.__all__) == sorted(EXPECTED_ALL)
    for name in EXPECTED_ALL:
        assert getattr(client_pkg, name) is not None


def test_import_and_construction_start_nothing():
    code = textwrap.dedent(
        """
        import sys, threading
        import diffusion_rollout.client as c
        made = c.RolloutClient("http://127.0.0.1:9", api_key="k")  # nothing listens on port 9
        amade = c.AsyncRolloutClient(["http://127.0.0.1:9", "http://127.0.0.1:10"])
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("fastapi", "uvicorn", "peft")
                        or m.startswith("diffusion_rollout.server") or m.startswith("diffusion_rollout.entrypoints"))
        print(threading.active_count(), loaded, made.urls, amade.urls)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "1"  # no thread started
    assert "[]" in out.stdout  # no server, HTTP framework or peft module imported
    assert "['http://127.0.0.1:9', 'http://127.0.0.1:10']" in out.stdout


def test_urls_and_keys_come_from_arguments_or_environment(monkeypatch):
    monkeypatch.setenv("DIFFUSION_ROLLOUT_URL", "http://a:1/, http://b:2")
    monkeypatch.setenv("DIFFUSION_ROLLOUT_API_KEY", "env-api")
    monkeypatch.setenv("DIFFUSION_ROLLOUT_ADMIN_KEY", "env-admin")
    c = RolloutClient()
    assert (c.urls, c.api_key, c.admin_key) == (["http://a:1", "http://b:2"], "env-api", "env-admin")
    c = RolloutClient("http://c:3", api_key="arg", admin_key="adm")
    assert (c.urls, c.api_key, c.admin_key) == (["http://c:3"], "arg", "adm")
    monkeypatch.delenv("DIFFUSION_ROLLOUT_URL")
    assert RolloutClient().url == "http://127.0.0.1:30000"
    with pytest.raises(ValueError, match="http://"):
        RolloutClient("localhost:30000")


# ---------------------------------------------------------------------------- rollouts
def test_info_calls(served):
    server = served("sd3")
    c = sync_client(server)
    assert c.health() == {"status": "ok", "state": "ready"}
    assert c.health_generate() == {"status": "ok"}
    c.wait_until_ready(timeout_s=30)
    info = c.model_info()
    assert info["family"] == "sd3" and info["dtype"] == "float32"
    assert c.server_info()["limits"]["max_steps"] >= 1
    assert c.list_models()["data"][0]["object"] == "model"
    assert "# TYPE" in c.metrics()


def test_generate_returns_typed_tensors_in_both_wire_formats(served):
    server = served("sd3")
    body = dict(
        seed=7,
        num_outputs_per_prompt=2,
        rollout_return_dit_trajectory=True,
        rollout_return_denoising_env=True,
        rollout_debug_mode=True,
        rollout_sde_type="dance",
        extra_sampling_params={"rollout_noise_level": 0.5},
        **SMALL,
    )
    outs = sync_client(server).generate("a red square", **body)
    json_outs = sync_client(server, wire_format="json").generate("a red square", **body)
    assert [o.seed for o in outs] == [7, 8]
    for o, j in zip(outs, json_outs, strict=True):
        assert isinstance(o, RolloutOutput) and isinstance(o.dit_trajectory, DitTrajectory)
        assert o.prompt == "a red square" and o.request_id and o.weight_version == 0
        assert o.generated_output.shape == (3, 32, 32) and o.generated_output.dtype == torch.float32
        assert o.rollout_log_probs.shape == (2,) and o.sde_step_indices == [0, 1]
        assert o.dit_trajectory.latents.shape[0] == 3 and o.dit_trajectory.num_steps == 2
        assert torch.equal(o.dit_trajectory.latent(2), o.dit_trajectory.latents[2])
        assert set(o.rollout_debug_tensors) >= {"rollout_model_outputs", "rollout_noise_std_devs"}
        assert o.denoising_env["guidance"]["rule"] == "cfg_batched"
        # The request's step math rides along (extra_sampling_params merged last, as the server does).
        assert o.replay_settings == ReplaySettings(kind="dance", eta=0.5, log_prob_form="gaussian")
        # msgpack and JSON decode to identical tensors.
        assert torch.equal(o.generated_output, j.generated_output)
        assert torch.equal(o.rollout_log_probs, j.rollout_log_probs)
        assert torch.equal(o.dit_trajectory.latents, j.dit_trajectory.latents)


def test_plain_generation_and_filtered_trajectory(served):
    server = served("sd3")
    c = sync_client(server)
    [plain] = c.generate("x", seed=1, rollout=False, output_dtype="uint8", **SMALL)
    assert plain.rollout_log_probs is None and plain.dit_trajectory is None
    assert plain.generated_output.dtype == torch.uint8
    [o] = c.generate(
        "x",
        seed=1,
        rollout_return_dit_trajectory=True,
        rollout_return_step_indices=[2],
        rollout_sde_step_indices=[],
        rollout_log_prob_no_const=True,
        sigmas=torch.tensor([1.0, 0.5]),  # a tensor schedule is sent as a list
        **{k: v for k, v in SMALL.items() if k != "num_inference_steps"},
    )
    assert o.dit_trajectory.latent_step_indices == [2] and not o.dit_trajectory.has(0)
    assert o.replay_settings.log_prob_form == "no_const"
    assert torch.equal(o.dit_trajectory.sigmas, torch.tensor([1.0, 0.5, 0.0]))
    assert torch.equal(o.rollout_log_probs, torch.zeros(2))
    with pytest.raises(KeyError, match="was not returned"):
        o.dit_trajectory.latent(0)


def _refuse_any_request(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"the client sent {request.method} {request.url.path}")


def test_a_bad_rollout_field_fails_in_the_client_naming_it():
    # The server's own request model checks the body first: nothing is sent (the transport fails
    # on any request), and the error is a RequestError naming the field, as the server's 422 is.
    transport = httpx.MockTransport(_refuse_any_request)
    with RolloutClient("http://testserver", transport=transport) as c:
        with pytest.raises(RequestValidationError) as info:
            c.generate("x", rollout_noise_level=-1.0, seed=0)
        err = info.value
        assert isinstance(err, RequestError) and not isinstance(err, RolloutHTTPError)
        assert err.field == "rollout_noise_level" and "rollout_noise_level" in str(err)
        assert err.detail and err.detail[0]["loc"] == ("rollout_noise_level",)
        with pytest.raises(RequestValidationError, match=r"feature_cache\.kind"):
            c.generate("x", feature_cache={"kind": "no-such-cache"})
        with pytest.raises(RequestValidationError, match="rollout_sde_type"):
            c.generate("x", rollout_sde_type="langevin")

    async def go():
        async with AsyncRolloutClient("http://testserver", transport=transport) as ac:
            with pytest.raises(RequestValidationError, match="width"):
                await ac.generate("x", width=0)

    asyncio.run(go())


def test_request_errors_carry_status_type_and_message(served, monkeypatch):
    c = sync_client(served("sd3"))
    # The server's 422 as the client maps it: the client's own check of the body is left out here.
    monkeypatch.setattr("diffusion_rollout.client.calls._check_generate_body", lambda body: None)
    with pytest.raises(ServerValidationError) as info:
        c.generate("x", rollout_sde_type="langevin")
    err = info.value
    assert isinstance(err, RolloutHTTPError) and isinstance(err, RequestError)
    assert err.status_code == 422 and err.error_type == "validation_error"
    assert "rollout_sde_type" in err.message and err.detail and err.request_id
    assert "422" in str(err) and "rollout_sde_type" in str(err)

    with pytest.raises(BadRequestError) as info:
        c.generate("x", rollout_sde_type="ode", **SMALL)  # all-ODE with the gaussian form
    assert info.value.status_code == 400 and "no_const" in info.value.message
    with pytest.raises(BadRequestError, match="rollout_sde_step_indices"):
        c.generate("x", rollout_sde_step_indices=[5], **SMALL)
    with pytest.raises(BadRequestError, match="width"):
        c.generate("x", width=33, height=32, num_inference_steps=1)


def test_generate_many_keeps_order_and_bounds_concurrency(served):
    server = served("sd3")

    class Counting(httpx.AsyncBaseTransport):
        def __init__(self, inner):
            self.inner, self.now, self.peak, self.calls = inner, 0, 0, 0

        async def handle_async_request(self, request):
            self.now += 1
            self.calls += 1
            self.peak = max(self.peak, self.now)
            try:
                await asyncio.sleep(0.01)  # let the others start if they may
                return await self.inner.handle_async_request(request)
            finally:
                self.now -= 1

    transport = Counting(httpx.ASGITransport(app=server.app))

    async def go():
        async with AsyncRolloutClient("http://test", transport=transport, max_concurrency=2) as c:
            items = ["p0", {"prompt": "p1", "seed": 100}, "p2", "p3", {"prompt": "p4", "seeds": [5, 6]}]
            return await c.generate_many(items, num_outputs_per_prompt=2, rollout_debug_mode=False, **SMALL)

    groups = asyncio.run(go())
    assert [g[0].prompt for g in groups] == ["p0", "p1", "p2", "p3", "p4"]
    assert [o.seed for o in groups[1]] == [100, 101] and [o.seed for o in groups[4]] == [5, 6]
    assert transport.calls == 5 and transport.peak == 2

    sync_groups = sync_client(server).generate_many(
        ["a", {"prompt": "b", "seed": 3}], max_concurrency=2, rollout=False, **SMALL
    )
    assert [g[0].prompt for g in sync_groups] == ["a", "b"] and sync_groups[1][0].seed == 3
    with pytest.raises(ValueError, match="prompt"):
        sync_client(server).generate_many([{"seed": 1}])


def test_async_client_reads_and_errors(served, monkeypatch):
    server = served("sd3")
    monkeypatch.setattr("diffusion_rollout.client.calls._check_generate_body", lambda body: None)

    async def go():
        async with AsyncRolloutClient("http://test", transport=httpx.ASGITransport(app=server.app)) as c:
            assert await c.health() == {"status": "ok", "state": "ready"}
            assert await c.health_generate() == {"status": "ok"}
            await c.wait_until_ready(timeout_s=10)
            assert (await c.model_info())["family"] == "sd3"
            assert "versions" in await c.server_info()
            assert (await c.list_models())["object"] == "list"
            assert "# TYPE" in await c.metrics()
            [o] = await c.generate("x", seed=3, rollout_debug_mode=False, **SMALL)
            with pytest.raises(ServerValidationError, match="rollout_noise_level"):
                await c.generate("x", rollout_noise_level=-1.0)
            return o

    o = asyncio.run(go())
    assert o.seed == 3 and o.rollout_log_probs.shape == (2,)


# ---------------------------------------------------------------------------- admin calls
def test_keys_and_auth_errors(fresh_server, monkeypatch):
    server = fresh_server("sd3", api_key="gen-key", admin_key="admin-key")
    with pytest.raises(ServerAuthenticationError) as info:
        sync_client(server).generate("x", **SMALL)
    assert info.value.status_code == 401 and isinstance(info.value, AuthenticationError)
    with pytest.raises(ServerPermissionDeniedError) as info:
        sync_client(server, api_key="wrong").generate("x", **SMALL)
    assert info.value.status_code == 403 and isinstance(info.value, PermissionDeniedError)
    assert sync_client(server, api_key="gen-key").generate("x", rollout=False, **SMALL)
    # The admin key alone is enough for generation; the API key is not enough for admin calls.
    assert sync_client(server, admin_key="admin-key").generate("x", rollout=False, **SMALL)
    with pytest.raises(ServerPermissionDeniedError, match="admin"):
        sync_client(server, api_key="gen-key", admin_key="wrong").get_weights_checksum()
    monkeypatch.setenv("DIFFUSION_ROLLOUT_ADMIN_KEY", "admin-key")
    assert "transformer" in sync_client(server).get_weights_checksum(["transformer"])


def test_every_admin_call_against_the_real_app(fresh_server, tiny_model_path, tmp_path):
    server = fresh_server("sd3", allow_cpu_ipc=True)
    c = sync_client(server, retry=RetryPolicy(max_retries=0))
    before = c.get_weights_checksum(["transformer"])["transformer"]
    assert c.get_weights_checksum(algorithm="v2")["transformer"] != before

    # Pause and continue; release and resume (rollouts answer 503 while released).
    paused = c.pause_generation()
    assert isinstance(paused, UpdateResult) and paused.success and server.engine.worker.paused
    assert c.continue_generation().success and not server.engine.worker.paused
    c.release_memory_occupation()
    with pytest.raises(ServerUnavailableError) as info:
        c.generate("x", **SMALL)
    assert info.value.status_code == 503 and isinstance(info.value, ServiceUnavailableError)
    with pytest.raises(ServerUnavailableError):
        c.health_generate()
    c.resume_memory_occupation()
    assert c.get_weights_checksum(["transformer"])["transformer"] == before

    # Full weights: from disk (the model's own folder: same bytes), then an upload and the checker.
    res = c.update_weights_from_disk(str(tiny_model_path("sd3")), weight_version="disk")
    assert res.success and res.weight_version == "disk"
    assert c.get_weights_checksum(["transformer"])["transformer"] == before
    name, param = next(iter(server.engine.pipe.transformer.named_parameters()))
    new = {name: torch.full_like(param, 0.25)}
    res = c.update_weights(save(new), weight_version="up-1", partial=True)
    assert res.weight_version == "up-1" and c.model_info()["weight_version"] == "up-1"
    from diffusion_rollout.protocol.checksums import tensor_sha256

    assert c.check_weights("transformer", {name: tensor_sha256(new[name])})["success"]
    with pytest.raises(ServerWeightUpdateError) as info:
        c.check_weights("transformer", {name: "0" * 64})
    assert info.value.status_code == 400 and isinstance(info.value, WeightUpdateError)
    assert "mismatch" in info.value.message
    with pytest.raises(ServerWeightUpdateError, match=r"no\.such"):
        c.update_weights(save({"no.such.weight": torch.zeros(1)}))
    with pytest.raises(ServerNotFoundError) as info:
        c.get_weights_checksum(["no_such_module"])
    assert isinstance(info.value, NotFoundError)

    # SGLang's tensor payload (CPU shared memory in one process) and the update-group errors.
    from diffusion_rollout.client import build_update_weights_from_tensor_request

    body = build_update_weights_from_tensor_request(
        [(name, torch.full_like(param, 0.5))], weight_version="ipc"
    )
    res = c.update_weights_from_tensor(
        body["serialized_named_tensors"], load_format=body["load_format"], weight_version="ipc"
    )
    assert res.weight_version == "ipc"
    assert torch.equal(
        dict(server.engine.pipe.transformer.named_parameters())[name], torch.full_like(param, 0.5)
    )
    with pytest.raises(BadRequestError, match="rank_offset"):
        c.init_weights_update_group(
            master_address="127.0.0.1", master_port=29999, rank_offset=2, world_size=2, backend="gloo"
        )
    with pytest.raises(ServerNotFoundError):
        c.update_weights_from_distributed(names=["a"], dtypes=["float32"], shapes=[[1]], group_name="nope")
    with pytest.raises(ServerNotFoundError):
        c.destroy_weights_update_group("nope")

    # LoRA: load bytes and a server path, activate, list, unload; unknown names are 404.
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    from diffusion_rollout.client import lora_state_dict
    from tests.client.test_client_weights import trainer_transformer

    trainer = trainer_transformer(tiny_model_path("sd3"))
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"]), trainer)
    sd = lora_state_dict(get_peft_model_state_dict(trainer))
    res = c.lora_load("a", data=save(sd), activate=True, weight_version="lora-a")
    assert res.weight_version == "lora-a" and "'a' loaded" in res.message
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "b.safetensors"))
    assert c.lora_load("b", path=str(tmp_path / "b.safetensors"), lora_alpha=4.0).success
    listing = c.lora_list()
    assert listing["modules"]["transformer"]["active"] == "a"
    assert set(listing["modules"]["transformer"]["adapters"]) == {"a", "b"}
    assert listing["modules"]["transformer"]["adapters"]["b"]["alpha"] == 4.0
    res = c.lora_activate("b", mode="merged")
    assert c.lora_list()["modules"]["transformer"]["merged"] and res.success
    c.lora_activate(None)
    assert c.lora_list()["modules"]["transformer"]["active"] is None
    with pytest.raises(ServerNotFoundError, match="zzz"):
        c.lora_activate("zzz")
    assert c.lora_unload("a").success and c.lora_unload().success
    assert c.lora_list()["modules"].get("transformer", {}).get("adapters", {}) == {}
    with pytest.raises(ValueError, match="exactly one"):
        c.lora_load("c")


def test_several_servers_round_robin_rollouts_and_broadcast_updates(fresh_server):
    one, two = fresh_server("sd3"), fresh_server("sd3")
    mounts = {"http://one": httpx.ASGITransport(app=one.app), "http://two": httpx.ASGITransport(app=two.app)}

    async def go():
        http = httpx.AsyncClient(mounts=mounts)
        c = AsyncRolloutClient(["http://one", "http://two"], http_client=http)
        # Pin one server to a version, then see rollouts alternate between the two.
        name, param = next(iter(one.engine.pipe.transformer.named_parameters()))
        await c.update_weights(
            save({name: param.detach().clone()}), weight_version="only-one", server=0, partial=True
        )
        seen = [(await c.generate("x", rollout=False, **SMALL))[0].weight_version for _ in range(4)]
        both = await c.update_weights(
            save({name: param.detach().clone()}), weight_version="both", partial=True
        )
        versions = [(await c.model_info(server=i))["weight_version"] for i in (0, 1)]
        sums = [await c.get_weights_checksum(["transformer"], server=i) for i in (0, 1)]
        # Async admin calls: pause/continue, LoRA listing, activation of nothing, release/resume.
        await c.pause_generation()
        await c.continue_generation()
        await c.release_memory_occupation(server=1)
        await c.resume_memory_occupation(server=1)
        listing = await c.lora_list(server=1)
        await http.aclose()
        return seen, both, versions, sums, listing

    seen, both, versions, sums, listing = asyncio.run(go())
    assert sorted(map(str, seen)) == ["0", "0", "only-one", "only-one"] and seen[0] != seen[1]
    assert set(both.responses) == {"http://one", "http://two"} and both.weight_version == "both"
    assert versions == ["both", "both"] and sums[0] == sums[1]
    assert "modules" in listing


# ---------------------------------------------------------------------------- retries
class Scripted(httpx.BaseTransport):
    """Answers from a script of responses or exceptions, counting requests per path."""

    def __init__(self, script):
        self.script = list(script)
        self.paths: list[str] = []

    def handle_request(self, request):
        self.paths.append(request.url.path)
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        status, body, headers = item
        return httpx.Response(status, json=body, headers=headers)


def scripted(script, **kw) -> tuple[RolloutClient, Scripted, list[float]]:
    transport = Scripted(script)
    c = RolloutClient("http://s", transport=transport, retry=RetryPolicy(max_retries=2, backoff_s=0.1), **kw)
    slept: list[float] = []
    c._sleep = slept.append  # no real waiting in tests
    return c, transport, slept


def _err(status, kind="x"):
    return (status, {"error": {"message": f"failed {status}", "type": kind, "code": status}}, {})


def test_reads_are_retried_on_unavailable_and_transport_errors():
    c, t, slept = scripted([_err(503), httpx.ReadTimeout("slow"), (200, {"status": "ok"}, {})])
    assert c.health() == {"status": "ok"}
    assert t.paths == ["/health"] * 3 and slept == [0.1, 0.2]
    c, t, _ = scripted([_err(503)] * 3)
    with pytest.raises(ServerUnavailableError):
        c.model_info()
    assert len(t.paths) == 3  # 1 + max_retries
    c, t, _ = scripted([_err(400, "invalid_request")])
    with pytest.raises(BadRequestError):
        c.get_weights_checksum()
    assert len(t.paths) == 1  # a 400 is an answer, not a hiccup


def test_rollouts_are_retried_only_when_the_server_did_no_work():
    body = [{"request_id": "r", "prompt": "x", "seed": 1, "weight_version": 0}]
    c, t, slept = scripted(
        [(429, {"error": {"message": "full", "type": "queue_full", "code": 429}}, {"Retry-After": "3"}),
         httpx.ConnectError("refused"), (200, body, {})],
    )  # fmt: skip
    [o] = c.generate("x")
    assert o.seed == 1 and slept == [3.0, 0.2] and len(t.paths) == 3
    # A read timeout may mean the batch is still running: not repeated.
    c, t, _ = scripted([httpx.ReadTimeout("slow")])
    with pytest.raises(RolloutTimeoutError):
        c.generate("x")
    assert len(t.paths) == 1
    c, t, _ = scripted([_err(504, "request_timeout")])
    with pytest.raises(ServerRequestTimeoutError) as info:
        c.generate("x")
    assert isinstance(info.value, RequestTimeoutError) and len(t.paths) == 1
    c, t, _ = scripted([_err(500, "generation_error")])
    with pytest.raises(RolloutHTTPError) as info:
        c.generate("x")
    assert info.value.status_code == 500 and len(t.paths) == 1
    c, t, _ = scripted([(429, {"error": {"message": "full", "type": "queue_full", "code": 429}}, {})] * 3)
    with pytest.raises(ServerQueueFullError) as info:
        c.generate("x")
    assert isinstance(info.value, QueueFullError)


def test_updates_are_never_retried():
    for call in (
        lambda c: c.pause_generation(),
        lambda c: c.update_weights(b"x"),
        lambda c: c.lora_activate("a"),
        lambda c: c.update_weights_from_disk("/m"),
    ):
        c, t, _ = scripted([_err(503)])
        with pytest.raises(ServerUnavailableError):
            call(c)
        assert len(t.paths) == 1
        c, t, _ = scripted([httpx.ConnectError("refused")])
        with pytest.raises(RolloutConnectionError) as info:
            call(c)
        assert info.value.status_code is None and len(t.paths) == 1


def test_non_json_error_bodies_still_map():
    class Plain(httpx.BaseTransport):
        def handle_request(self, request):
            return httpx.Response(502, text="bad gateway from the proxy", headers={"X-Request-Id": "rid"})

    c = RolloutClient("http://s", transport=Plain(), retry=RetryPolicy(max_retries=0))
    with pytest.raises(RolloutHTTPError) as info:
        c.update_weights(b"x")
    err = info.value
    assert err.status_code == 502 and "bad gateway" in err.message and err.request_id == "rid"


def test_async_admin_calls_against_the_real_app(fresh_server, tiny_model_path):
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    from diffusion_rollout.client import build_update_weights_from_tensor_request, lora_state_dict
    from diffusion_rollout.protocol.checksums import tensor_sha256
    from tests.client.test_client_weights import trainer_transformer

    server = fresh_server("sd3", allow_cpu_ipc=True)
    name, param = next(iter(server.engine.pipe.transformer.named_parameters()))
    trainer = trainer_transformer(tiny_model_path("sd3"))
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"]), trainer)
    adapter = save(lora_state_dict(get_peft_model_state_dict(trainer)))

    async def go():
        transport = httpx.ASGITransport(app=server.app)
        async with AsyncRolloutClient("http://t", transport=transport, retry=RetryPolicy(max_retries=0)) as c:
            base = (await c.get_weights_checksum(["transformer"]))["transformer"]
            res = await c.update_weights_from_disk(str(tiny_model_path("sd3")), weight_version="disk")
            assert res.weight_version == "disk"
            assert (await c.get_weights_checksum(["transformer"]))["transformer"] == base
            new = torch.full_like(param, 0.125)
            body = build_update_weights_from_tensor_request([(name, new)], load_format=None)
            res = await c.update_weights_from_tensor(body["serialized_named_tensors"], weight_version="ipc")
            assert res.weight_version == "ipc"
            assert (await c.check_weights("transformer", {name: tensor_sha256(new)}))["success"]
            with pytest.raises(ServerWeightUpdateError, match="mismatch"):
                await c.check_weights("transformer", {name: "f" * 64})
            res = await c.update_weights(
                save({name: param.detach().clone()}), weight_version="upload", partial=True
            )
            assert res.weight_version == "upload"
            assert (await c.lora_load("a", data=adapter, activate=True)).success
            assert (await c.lora_list())["modules"]["transformer"]["active"] == "a"
            assert (await c.lora_activate(None)).success
            assert (await c.lora_unload("a")).success
            with pytest.raises(ServerWeightUpdateError, match="rank_offset"):
                await c.init_weights_update_group(
                    master_address="127.0.0.1", master_port=29998, rank_offset=3, world_size=2, backend="gloo"
                )
            with pytest.raises(ServerNotFoundError):
                await c.update_weights_from_distributed(
                    names=["a"], dtypes=["float32"], shapes=[[1]], group_name="x"
                )
            with pytest.raises(ServerNotFoundError):
                await c.destroy_weights_update_group("x")

    asyncio.run(go())
