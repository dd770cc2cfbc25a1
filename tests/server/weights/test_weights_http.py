"""Full-weight updates through the real app: uploads, disk, checksums, errors, versions, memory."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save, save_file

from diffusion_rollout.protocol.checksums import trainer_named_tensors_sha256, trainer_weights_checksum
from diffusion_rollout.server.weights import get_weight_manager

WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
ODE = {
    "prompt": "a red cube on a table",
    "seed": 11,
    "width": 32,
    "height": 32,
    "max_sequence_length": 16,
    "num_inference_steps": 3,
    "rollout_sde_type": "ode",
    "rollout_debug_mode": False,
    "rollout_log_prob_no_const": True,
}


def new_weights(server, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A float32 'trainer master' for every transformer parameter, away from the current values."""
    g = torch.Generator().manual_seed(seed)
    return {
        n: p.detach().float() + scale * torch.randn(p.shape, generator=g)
        for n, p in server.engine.pipe.transformer.named_parameters()
    }


def checksum(server, module: str = "transformer", algorithm: str = "sglang") -> str:
    r = server.client.post("/get_weights_checksum", json={"module_names": [module], "algorithm": algorithm})
    assert r.status_code == 200, r.text
    return r.json()[module]


def upload(server, tensors: dict[str, torch.Tensor], expect: int = 200, **query):
    r = server.client.post(
        "/update_weights",
        content=save(tensors),
        params=query,
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == expect, r.text
    return r.json()


def error_of(r, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == status
    return body["message"]


def ode_image(server, **overrides) -> tuple[torch.Tensor, object]:
    [out] = server.generate({**ODE, **overrides})
    return out["generated_output"], out["weight_version"]


def stock_image(folder: Path, **overrides) -> torch.Tensor:
    """The stock diffusers pipeline from ``folder``, called the way a user would, for ``ODE``."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(folder), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    args = {**ODE, **overrides}
    out = pipe(
        prompt=args["prompt"],
        height=args["height"],
        width=args["width"],
        max_sequence_length=args["max_sequence_length"],
        num_inference_steps=args["num_inference_steps"],
        generator=[torch.Generator("cpu").manual_seed(args["seed"])],
        output_type="pt",
    )
    return out.images[0]


def folder_with(base: Path, dest: Path, tensors: dict[str, torch.Tensor], dtype=torch.float32) -> Path:
    """A copy of the model folder whose transformer holds ``tensors`` (cast like the server)."""
    shutil.copytree(base, dest)
    sd = load_file(str(base / "transformer" / WEIGHTS_FILE))
    sd.update({n: t.to(dtype) for n, t in tensors.items()})
    save_file(sd, str(dest / "transformer" / WEIGHTS_FILE), metadata={"format": "pt"})
    return dest


# ---------------------------------------------------------------------------- success paths
def test_upload_matches_client_checksum_and_stock_pipeline(fresh_server, tiny_model_path, tmp_path):
    server = fresh_server("sd3")
    before_img, v0 = ode_image(server)
    master = new_weights(server, seed=1)

    out = upload(server, master, weight_version="step-1")
    assert out["success"] is True and out["weight_version"] == "step-1"
    assert checksum(server) == trainer_weights_checksum(master.items(), torch.float32)
    assert checksum(server, algorithm="v2") == trainer_weights_checksum(
        master.items(), torch.float32, algorithm="v2"
    )

    after_img, v1 = ode_image(server)
    assert v0 == 0 and v1 == "step-1"
    assert not torch.equal(before_img, after_img)

    # The stock diffusers pipeline loaded with the same weights gives the same image, bit for bit.
    stock_img = stock_image(folder_with(tiny_model_path("sd3"), tmp_path / "updated", master))
    assert torch.equal(after_img, stock_img)

    # The per-tensor checker agrees with the trainer's manifest, and catches a wrong one.
    manifest = trainer_named_tensors_sha256(master.items(), torch.float32)
    r = server.client.post(
        "/update_weights_from_tensor_checker",
        json={"target_module": "transformer", "expected_named_tensors_sha256": [manifest]},
    )
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    wrong = dict(manifest, **{"pos_embed.proj.bias": "0" * 64, "ghost.weight": "0" * 64})
    msg = error_of(
        server.client.post(
            "/update_weights_from_tensor_checker",
            json={"target_module": "transformer", "expected_named_tensors_sha256": wrong},
        ),
        400,
    )
    assert (
        "missing 1 tensor(s): ghost.weight" in msg and "mismatch for 1 tensor(s): pos_embed.proj.bias" in msg
    )


def test_multipart_upload_applies_all_parts_at_once(fresh_server):
    server = fresh_server("sd3")
    master = new_weights(server, seed=2)
    names = sorted(master)
    thirds = [names[0::3], names[1::3], names[2::3]]
    original = checksum(server)
    for i, part in enumerate(thirds[:2]):
        out = upload(server, {n: master[n] for n in part}, weight_version="v7", final="false", part=i)
        assert out["weight_version"] == 0 and out["upload_id"] == "v7"
        assert checksum(server) == original  # nothing lands before the final part
    out = upload(server, {n: master[n] for n in thirds[2]}, weight_version="v7", part=2)
    assert out["weight_version"] == "v7"
    assert checksum(server) == trainer_weights_checksum(master.items(), torch.float32)


def test_update_from_disk_reads_diffusers_layout(fresh_server, tiny_model_path, tmp_path):
    server = fresh_server("sd3")
    master = new_weights(server, seed=3)
    folder = folder_with(tiny_model_path("sd3"), tmp_path / "ckpt", master)
    r = server.client.post("/update_weights_from_disk", json={"model_path": str(folder)})
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == 1
    assert checksum(server) == trainer_weights_checksum(master.items(), torch.float32)
    msg = error_of(
        server.client.post(
            "/update_weights_from_disk",
            json={"model_path": str(folder), "target_modules": ["transformer", "vae", "scheduler"]},
        ),
        400,
    )
    assert "scheduler" in msg
    msg = error_of(
        server.client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")}), 400
    )
    assert "not a folder" in msg


# ---------------------------------------------------------------------------- failures leave the old weights
def test_bad_uploads_are_400_naming_the_problem_and_change_nothing(fresh_server):
    server = fresh_server("sd3")
    master = new_weights(server, seed=4)
    img0, _ = ode_image(server)
    original = checksum(server)

    bad_name = dict(master, **{"transformer_blocks.9.ghost.weight": torch.zeros(2)})
    assert "unknown tensor names (1): transformer.transformer_blocks.9.ghost.weight" in error_of(
        server.client.post(
            "/update_weights", content=save(bad_name), headers={"Content-Type": "application/octet-stream"}
        ),
        400,
    )
    bad_shape = dict(master, **{"pos_embed.proj.bias": torch.zeros(3)})
    assert "shape mismatch (1): transformer.pos_embed.proj.bias: got (3,)" in error_of(
        server.client.post("/update_weights", content=save(bad_shape)), 400
    )
    body = save(master)
    assert "not a valid safetensors file (truncated?)" in error_of(
        server.client.post("/update_weights", content=body[: len(body) // 2]), 400
    )
    assert "empty" in error_of(server.client.post("/update_weights", content=b""), 400)
    assert "module(s) 'transformer_9' not found in pipeline" in error_of(
        server.client.post("/update_weights", content=body, params={"target_module": "transformer_9"}), 400
    )
    assert "unknown field 'query.finale'" in error_of(
        server.client.post("/update_weights", content=body, params={"finale": "true"}), 422
    )

    # Parts without their final part, or with a gap, never land.
    names = sorted(master)
    upload(server, {n: master[n] for n in names[:10]}, final="false", upload_id="u1")
    upload(server, {n: master[n] for n in names[:10]}, final="false", upload_id="u2", part=0)
    msg = error_of(
        server.client.post(
            "/update_weights",
            content=save({n: master[n] for n in names[20:]}),
            params={"upload_id": "u2", "part": 2},
        ),
        400,
    )
    assert "missing parts [1]" in msg
    # A part that fails aborts its whole upload: no later part of it is accepted, not even part 0.
    upload(server, {n: master[n] for n in names[:10]}, final="false", upload_id="u3", part=0)
    error_of(
        server.client.post(
            "/update_weights", content=b"garbage", params={"upload_id": "u3", "part": 1, "final": "false"}
        ),
        400,
    )
    msg = error_of(
        server.client.post(
            "/update_weights",
            content=save({n: master[n] for n in names[10:]}),
            params={"upload_id": "u3", "part": 2},
        ),
        400,
    )
    assert "upload 'u3' was aborted (part 1 failed" in msg
    retry = server.client.post(
        "/update_weights", content=save(master), params={"upload_id": "u3", "part": 0, "partial": "true"}
    )
    assert "upload 'u3' was aborted" in error_of(retry, 400)

    assert checksum(server) == original
    img1, version = ode_image(server)
    assert torch.equal(img0, img1) and version == 0


def test_a_one_part_retry_of_an_aborted_upload_restarts_it_only_as_a_full_update(fresh_server):
    """After part 1 of upload 'r' failed, part 0 sent again as a one-part commit: as a partial
    update it would apply a fraction of the model and is refused; as a full update it restarts the
    upload, which applies only because that one part names every parameter."""
    server = fresh_server("sd3")
    master = new_weights(server, seed=12)
    names = sorted(master)
    original = checksum(server)
    img0, _ = ode_image(server)
    upload(server, {n: master[n] for n in names[:10]}, final="false", upload_id="r", part=0)
    error_of(server.client.post("/update_weights", content=b"cut", params={"upload_id": "r", "part": 1}), 400)

    first = save({n: master[n] for n in names[:10]})
    refused = server.client.post(
        "/update_weights", content=first, params={"upload_id": "r", "part": 0, "partial": "true"}
    )
    assert "upload 'r' was aborted" in error_of(refused, 400)
    not_full = server.client.post("/update_weights", content=first, params={"upload_id": "r", "part": 0})
    assert "upload 'r' is not a full update" in error_of(not_full, 400)
    assert checksum(server) == original and torch.equal(ode_image(server)[0], img0)

    out = upload(server, master, upload_id="r", part=0, weight_version="whole")
    assert out["weight_version"] == "whole" and out["upload_id"] == "r"
    assert checksum(server) == trainer_weights_checksum(master.items(), torch.float32) != original


def test_failure_during_copy_rolls_back_to_identical_checksum(fresh_server):
    server = fresh_server("sd3")
    manager = get_weight_manager(server.engine)
    original = checksum(server)
    img0, _ = ode_image(server)
    copied = []

    def explode(module: str, name: str) -> None:
        copied.append(name)
        if len(copied) == 20:
            raise RuntimeError("simulated CUDA error")

    manager.before_copy = explode
    msg = error_of(server.client.post("/update_weights", content=save(new_weights(server, seed=5))), 500)
    assert "simulated CUDA error" in msg and "previous weights were restored" in msg
    assert checksum(server) == original
    img1, version = ode_image(server)
    assert torch.equal(img0, img1) and version == 0

    manager.before_copy = None
    upload(server, new_weights(server, seed=5))
    assert checksum(server) != original


# ---------------------------------------------------------------------------- versions and concurrency
def _slow_transformer(server, seconds: float):
    """Make every transformer call sleep, so a rollout is long enough to overlap an update."""
    return server.engine.pipe.transformer.register_forward_pre_hook(lambda *_: time.sleep(seconds))


def test_update_during_rollout_lands_after_it(fresh_server):
    server = fresh_server("sd3")
    long = {**ODE, "num_inference_steps": 12}
    old_img, _ = ode_image(server, num_inference_steps=12)
    master = new_weights(server, seed=6)
    hook = _slow_transformer(server, 0.05)
    result = {}

    def rollout():
        result["out"] = server.generate(long)

    t = threading.Thread(target=rollout)
    t.start()
    deadline = time.time() + 10
    while not server.engine.worker.busy and time.time() < deadline:
        time.sleep(0.005)
    assert server.engine.worker.busy
    out = upload(server, master, weight_version="new")
    t.join(30)
    hook.remove()
    [sample] = result["out"]
    assert out["weight_version"] == "new"
    assert sample["weight_version"] == 0
    assert torch.equal(sample["generated_output"], old_img)
    new_img, version = ode_image(server, num_inference_steps=12)
    assert version == "new" and not torch.equal(new_img, old_img)


def test_concurrent_rollouts_and_updates_never_mix_versions(fresh_server):
    # One sample per batch: batching changes float rounding on CPU, which is not what this checks.
    server = fresh_server("sd3", max_batch_size=1)
    masters = {f"w{i}": new_weights(server, seed=100 + i) for i in range(3)}
    # Reference image per version, computed serially.
    reference = {}
    for version, master in masters.items():
        upload(server, master, weight_version=version)
        reference[version] = ode_image(server)[0]
    hook = _slow_transformer(server, 0.01)
    outputs, errors = [], []

    def client(n: int):
        try:
            for _ in range(n):
                outputs.extend(server.generate(ODE))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(4,)) for _ in range(3)]
    for t in threads:
        t.start()
    for i in range(6):
        upload(server, masters[f"w{i % 3}"], weight_version=f"w{i % 3}")
    for t in threads:
        t.join(60)
    hook.remove()
    assert not errors and len(outputs) == 12
    for out in outputs:
        assert torch.equal(out["generated_output"], reference[out["weight_version"]]), out["weight_version"]


def test_version_counts_updates_when_the_trainer_sends_none(fresh_server):
    server = fresh_server("sd3")
    assert upload(server, new_weights(server, 7))["weight_version"] == 1
    assert upload(server, new_weights(server, 8), weight_version="named")["weight_version"] == "named"
    assert upload(server, new_weights(server, 9))["weight_version"] == 3


# ---------------------------------------------------------------------------- admin
def test_admin_key_guards_every_weight_route(fresh_server):
    server = fresh_server("sd3", admin_key="sekrit", api_key="user")
    routes = [
        "/update_weights", "/update_weights_from_disk", "/update_weights_from_tensor", "/get_weights_checksum",
        "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
        "/update_weights_from_tensor_checker", "/lora/load", "/lora/activate", "/lora/unload",
        "/v1/set_lora", "/v1/merge_lora_weights", "/v1/unmerge_lora_weights", "/pause_generation",
        "/continue_generation", "/release_memory_occupation", "/resume_memory_occupation",
    ]  # fmt: skip
    for route in routes:
        assert server.client.post(route, json={}).status_code == 401, route
        assert (
            server.client.post(route, json={}, headers={"Authorization": "Bearer user"}).status_code == 403
        ), route
    for route in ("/lora", "/v1/list_loras"):
        assert server.client.get(route).status_code == 401
    ok = server.client.post("/get_weights_checksum", json={}, headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200 and set(ok.json()) >= {"transformer", "vae", "text_encoder"}
    assert ok.headers["x-weight-version"] == "0"


def test_checksum_errors(fresh_server):
    server = fresh_server("sd3")
    assert "unknown module(s) critic" in error_of(
        server.client.post("/get_weights_checksum", json={"module_names": ["critic"]}), 404
    )
    assert "unknown field 'checksum_kind'" in error_of(
        server.client.post("/get_weights_checksum", json={"checksum_kind": "x"}), 422
    )


def test_release_resume_round_trip_keeps_checksum(fresh_server):
    server = fresh_server("sd3")
    before = server.client.post("/get_weights_checksum", json={}).json()
    img0, _ = ode_image(server)
    r = server.client.post("/release_memory_occupation")
    assert r.status_code == 200 and r.json()["success"], r.text
    assert "released" in error_of(server.client.post("/rollout/generate", json=ODE), 503)
    # Weights can still be read (and updated) while released.
    assert server.client.post("/get_weights_checksum", json={}).json() == before
    assert server.client.post("/release_memory_occupation").json()["message"] == "memory already released"
    r = server.client.post("/resume_memory_occupation", json={"tags": ["weights"]})
    assert r.status_code == 200, r.text
    assert server.client.post("/get_weights_checksum", json={}).json() == before
    img1, _ = ode_image(server)
    assert torch.equal(img0, img1)


def test_pause_holds_requests_until_continue(fresh_server):
    server = fresh_server("sd3")
    assert server.client.post("/pause_generation").json()["success"]
    done = threading.Event()
    result = {}

    def rollout():
        result["out"] = server.generate(ODE)
        done.set()

    t = threading.Thread(target=rollout)
    t.start()
    try:
        assert not done.wait(0.5)  # queued, not refused
        upload(server, new_weights(server, 10), weight_version="while-paused")  # admin work still runs
        assert server.client.post("/continue_generation").json()["success"]
        assert done.wait(30)
    finally:  # a failed assertion must not leave the queued request (and the teardown) hanging
        server.engine.worker.resume()
        t.join(30)
    assert result["out"][0]["weight_version"] == "while-paused"
    r = server.client.post("/pause_generation", json={"mode": "in_place"})
    assert r.status_code == 200 and r.json()["success"] and server.engine.worker.paused, r.text
    # SGLang's other modes are accepted (tests/entrypoints/test_sglang_endpoints.py); an unknown one is not.
    assert "mode" in error_of(server.client.post("/pause_generation", json={"mode": "later"}), 422)
    assert server.client.post("/continue_generation").json()["success"]
    assert not server.engine.worker.paused
