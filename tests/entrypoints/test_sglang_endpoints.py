"""SGLang's endpoint surface beyond rollouts, through the real app on the tiny SD3 model.

``/abort_request`` (queued work dropped, a running batch finishes), ``/set_lora_from_tensor``
(decoded without arbitrary pickle), memory and pause options of SGLang and Relax, ``/v1/set_lora``'s
``merge_mode``/``lora_alpha`` and the info routes. LoRA results are compared with PEFT exactly.
"""

from __future__ import annotations

import base64
import io
import pickle
import threading
import time
import zipfile

import pytest
import torch

from tests.server.weights.test_lora import adapter, checksum, image, peft_reference

GEN = {"prompt": "a red cat", "width": 32, "height": 32, "num_inference_steps": 2, "max_sequence_length": 16}


def post_in_thread(server, body: dict) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        box["response"] = server.client.post(
            "/rollout/generate", json=body, headers={"Accept": "application/json"}
        )

    t = threading.Thread(target=run)
    t.start()
    return t, box


def wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# ---------------------------------------------------------------------------- abort
def test_abort_drops_queued_work_of_that_rid_only(fresh_server):
    srv = fresh_server("sd3")
    srv.engine.worker.pause()
    threads = []
    try:
        threads.append(post_in_thread(srv, {**GEN, "seed": 1, "rid": "keep"}))
        wait_until(lambda: srv.engine.worker.depth == 1)
        threads.append(post_in_thread(srv, {**GEN, "seed": 2, "rid": "tail"}))
        threads.append(post_in_thread(srv, {**GEN, "seed": 3, "extra_sampling_params": {"rid": "tail"}}))
        wait_until(lambda: srv.engine.worker.depth == 3)
        r = srv.client.post("/abort_request", json={"rid": "tail"})
        assert r.status_code == 200 and r.json()["dropped"] == 2 and r.json()["running"] == 0, r.text
        for t, box in threads[1:]:
            t.join(30)
            err = box["response"].json()["error"]
            assert box["response"].status_code == 499 and err["type"] == "request_aborted"
        assert srv.engine.worker.depth == 1
        # An id nobody uses is not an error (SGLang's behaviour); nothing else is touched.
        assert srv.client.post("/abort_request", json={"rid": "nobody"}).json()["dropped"] == 0
    finally:
        srv.engine.worker.resume()
    t, box = threads[0]
    t.join(60)
    assert box["response"].status_code == 200
    assert box["response"].json()[0]["request_id"] == "keep"


def test_the_trainer_client_aborts_its_own_tail(fresh_server):
    from diffusion_rollout.client import RolloutClient
    from diffusion_rollout.errors import RequestAbortedError

    srv = fresh_server("sd3")
    client = RolloutClient("http://testserver", http_client=srv.client)
    srv.engine.worker.pause()
    box: dict = {}

    def run() -> None:
        try:
            client.generate(
                "a red cat", seed=1, rid="tail-1", **{k: v for k, v in GEN.items() if k != "prompt"}
            )
        except RequestAbortedError as exc:
            box["error"] = exc

    t = threading.Thread(target=run)
    try:
        t.start()
        wait_until(lambda: srv.engine.worker.depth == 1)
        result = client.abort_request("tail-1")
        assert result.success and next(iter(result.responses.values()))["dropped"] == 1
    finally:
        srv.engine.worker.resume()
    t.join(30)
    assert box["error"].status_code == 499 and box["error"].error_type == "request_aborted"


def test_abort_leaves_a_running_batch_to_finish(fresh_server):
    srv = fresh_server("sd3")
    entered, release = threading.Event(), threading.Event()

    def hold(module, args, kwargs):
        entered.set()
        release.wait(30)

    handle = srv.engine.adapter.transformers()["transformer"].register_forward_pre_hook(
        hold, with_kwargs=True
    )
    try:
        t, box = post_in_thread(srv, {**GEN, "seed": 1, "rid": "running"})
        assert entered.wait(30)
        r = srv.client.post("/abort_request", json={"rid": "running"})
        assert r.json()["dropped"] == 0 and r.json()["running"] == 1, r.text
    finally:
        release.set()
        handle.remove()
    t.join(60)
    assert box["response"].status_code == 200 and box["response"].json()[0]["request_id"] == "running"


def test_abort_request_validation_and_keys(fresh_server):
    srv = fresh_server("sd3", admin_key="adm")
    assert srv.client.post("/abort_request", json={}).status_code == 400
    assert srv.client.post("/abort_request", json={"rid": "x", "ridd": 1}).status_code == 422
    # One rid needs only the API key (none here); aborting everything needs the admin key.
    assert srv.client.post("/abort_request", json={"abort_all": True}).status_code == 401
    r = srv.client.post("/abort_request", json={"abort_all": True}, headers={"Authorization": "Bearer adm"})
    assert r.status_code == 200
    r = srv.client.post("/abort_request", json={"rid": "x", "finished_reason": {"type": "abort"}})
    assert r.status_code == 200 and r.json()["ignored_fields"] == ["finished_reason"]


def test_pause_in_abort_mode_drops_the_queue(fresh_server):
    srv = fresh_server("sd3")
    assert srv.client.post("/pause_generation", json={}).status_code == 200
    try:
        t, box = post_in_thread(srv, {**GEN, "seed": 1})
        wait_until(lambda: srv.engine.worker.depth == 1)
        r = srv.client.post("/pause_generation", json={"mode": "abort"})
        assert r.status_code == 200 and r.json()["aborted"] == 1
        t.join(30)
        assert box["response"].status_code == 499
        r = srv.client.post("/pause_generation", json={"mode": "retract"})
        assert r.status_code == 200 and r.json()["ignored_fields"] == ["mode"]
    finally:
        srv.client.post("/continue_generation")
    assert srv.client.post("/pause_generation", json={"mode": "sideways"}).status_code == 422
    srv.client.post("/continue_generation")


# ---------------------------------------------------------------------------- set_lora_from_tensor
def blob(obj, **save_kw) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf, **save_kw)
    return base64.b64encode(buf.getvalue()).decode()


def test_set_lora_from_tensor_dynamic_is_peft_and_merged_uses_the_pristine_base(
    fresh_server, tiny_model_path
):
    srv = fresh_server("sd3")
    base_sum = checksum(srv)
    cfg, tensors = adapter("default", seed=3)
    # Without a config the payload describes the adapter; alpha would be the rank (4) unless sent.
    body = {
        "lora_name": "default",
        "target": "transformer",
        "strength": 1.0,
        "serialized_tensors": blob(tensors),
        "lora_alpha": 8,
    }
    r = srv.client.post("/set_lora_from_tensor", json={**body, "merge_mode": "dynamic"})
    assert r.status_code == 200, r.text
    assert r.json()["adapted_layers"] == len(tensors) // 2 and r.json()["success"] is True
    assert torch.equal(image(srv)[0], peft_reference(tiny_model_path, "default", cfg, tensors))

    # Relax's call (no merge_mode): merged into the kept pristine base; a second push replaces it.
    r = srv.client.post("/set_lora_from_tensor", json={**body, "weight_version": "step-1"})
    assert r.status_code == 200 and r.json()["weight_version"] == "step-1", r.text
    assert checksum(srv) != base_sum
    _, tensors2 = adapter("default", seed=4)
    assert (
        srv.client.post(
            "/set_lora_from_tensor", json={**body, "serialized_tensors": blob(tensors2)}
        ).status_code
        == 200
    )
    assert srv.client.post("/v1/unmerge_lora_weights", json={}).status_code == 200
    assert torch.equal(image(srv)[0], peft_reference(tiny_model_path, "default", cfg, tensors2))
    srv.client.post("/lora/unload", json={})
    assert checksum(srv) == base_sum


class _Opens:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _zip_bomb() -> str:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({}, protocol=2))
        z.writestr("archive/data/0", b"\0" * 4_000_000)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("protocol", [2, 4])
def test_set_lora_from_tensor_refuses_arbitrary_pickle(fresh_server, tmp_path, protocol):
    srv = fresh_server("sd3", max_upload_bytes=1_000_000)
    before = checksum(srv)
    _, tensors = adapter("default", seed=3)
    target = tmp_path / "pwned"
    evil = {**tensors, "x": _Opens(str(target))}
    cases = {
        "io.open": blob(evil, pickle_protocol=protocol),
        "not base64": "@@@",
        "not a torch.save file": base64.b64encode(b"hello").decode(),
        "unpacks to": _zip_bomb(),
        "floating-point tensor": blob({"a.lora_A.weight": torch.ones(2, 2, dtype=torch.int64)}),
        "str -> floating-point": blob({"a.lora_A.weight": 1.5}),
    }
    for needle, payload in cases.items():
        r = srv.client.post("/set_lora_from_tensor", json={"serialized_tensors": payload})
        assert r.status_code == 400, (needle, r.text)
        assert needle in r.json()["error"]["message"] and "serialized_tensors" in r.json()["error"]["message"]
    assert not target.exists() and checksum(srv) == before
    # The same tensors without the hostile entry load, whichever pickle protocol saved them.
    r = srv.client.post(
        "/set_lora_from_tensor", json={"serialized_tensors": blob(tensors, pickle_protocol=protocol)}
    )
    assert r.status_code == 200, r.text
    assert (
        srv.client.post(
            "/set_lora_from_tensor", json={"serialized_tensors": "", "lora_nmae": "x"}
        ).status_code
        == 422
    )


# ---------------------------------------------------------------------------- memory, set_lora, info
def test_memory_options_of_sglang_and_relax_are_accepted_and_reported(fresh_server):
    srv = fresh_server("sd3")
    r = srv.client.post(
        "/release_memory_occupation", json={"tags": ["weights"], "cpu_backup_tags": ["weights"]}
    )
    assert r.status_code == 200 and r.json()["ignored_fields"] == ["cpu_backup_tags"], r.text
    r = srv.client.post("/resume_memory_occupation", json={"weights_only": True})
    assert r.status_code == 200 and r.json()["ignored_fields"] == ["weights_only"], r.text
    assert srv.client.post("/resume_memory_occupation", json={"weights_olny": True}).status_code == 422
    srv.generate({**GEN, "seed": 1})


def test_sglang_set_lora_merge_mode_and_alpha(fresh_server, tiny_model_path, tmp_path):
    from safetensors.torch import save_file

    srv = fresh_server("sd3")
    cfg, tensors = adapter("default", seed=11)
    path = tmp_path / "adapter.safetensors"
    save_file(tensors, str(path))  # no config: lora_alpha comes with the request
    body = {"lora_nickname": "style", "lora_path": str(path), "target": "transformer", "lora_alpha": 8}
    r = srv.client.post("/v1/set_lora", json={**body, "merge_mode": "dynamic"})
    assert r.status_code == 200, r.text
    assert torch.equal(image(srv)[0], peft_reference(tiny_model_path, "default", cfg, tensors))
    assert (
        srv.client.post("/v1/set_lora", json={"lora_nickname": "style", "merge_mode": "merge"}).status_code
        == 200
    )
    assert srv.client.get("/v1/list_loras").json()["active"]["transformer"][0]["merged"] is True


def test_info_routes(served):
    srv = served("sd3")
    info = srv.client.get("/v1/model_info").json()
    assert info["model_path"] == str(srv.path) and info["family"] == "sd3"
    assert srv.client.get("/weight_version").json() == {"weight_version": srv.engine.weight_version}


# ---------------------------------------------------------------------------- SGLang's refit tests
@pytest.mark.parametrize("family", ["flux2-klein", "sd3"])
def test_sglang_update_weights_from_disk_tests(fresh_server, tiny_model_path, tmp_path, family):
    """What SGLang's ``multimodal_gen/test/server/test_update_weights_from_disk.py`` (read at commit
    07cc6791) sends and checks, on its default family (FLUX.2 klein) and on SD3: ``{"model_path",
    "flush_cache"[, "target_modules"]}`` with ``requests``; the same model answers 200 with
    ``success``; flush_cache true or false, and ``target_modules=["transformer"]``, 200; a path that
    does not exist fails with ``result.get("success", True)`` false; ``{}`` is a 400; an unknown
    module is a 400 whose ``message`` holds "not found in pipeline". The scripts published beside
    SGLang's refit PRs also corrupt one module's file and look for "Failed to update module 'vae'"
    and "rolled back" in the message, with the weights unchanged."""
    import shutil

    srv = fresh_server(family)
    model = str(tiny_model_path(family))

    def update(body: dict) -> tuple[dict, int]:
        r = srv.client.post("/update_weights_from_disk", json=body)
        return r.json(), r.status_code

    for body in (
        {"model_path": model, "flush_cache": True},
        {"model_path": model, "flush_cache": False},
        {"model_path": model, "flush_cache": True, "target_modules": ["transformer"]},
    ):
        result, status = update(body)
        assert status == 200 and result.get("success", False), result
    result, _ = update({"model_path": "/nonexistent/path/to/model", "flush_cache": True})
    assert not result.get("success", True) and "nonexistent" in result["message"]
    result, status = update({})
    assert status == 400 and result["success"] is False and result["message"] == "model_path is required"
    result, status = update(
        {"model_path": model, "flush_cache": True, "target_modules": ["nonexistent_module"]}
    )
    assert status == 400 and not result.get("success", True)
    assert "not found in pipeline" in result.get("message", "")

    before = srv.client.post("/get_weights_checksum", json={}).json()
    corrupt = tmp_path / "corrupt"
    shutil.copytree(model, corrupt)
    (vae_file,) = sorted((corrupt / "vae").glob("*.safetensors"))
    vae_file.write_bytes(vae_file.read_bytes()[:100])
    result, status = update({"model_path": str(corrupt), "target_modules": ["transformer", "vae"]})
    assert status == 400 and result["success"] is False
    assert "Failed to update module 'vae'" in result["message"] and "rolled back" in result["message"]
    assert srv.client.post("/get_weights_checksum", json={}).json() == before


# ---------------------------------------------------------------------------- OpenAI image route
def test_openai_images_generations_as_sglang_refit_test_calls_it(served):
    """SGLang's end-to-end refit test (``test_update_weights_from_disk.py``, commit 07cc6791) and
    the router's end-to-end test call ``openai.OpenAI(base_url=.../v1).images.generate(model=
    "default", prompt, n=1, size=..., response_format="b64_json")``: the client POSTs that JSON to
    ``/v1/images/generations`` and the test checks ``response.data`` is not empty. The PNG here is
    the plain generation of the same seed, pixel for pixel."""
    import base64
    import io

    from PIL import Image

    srv = served("sd3")
    body = {
        "model": "default",
        "prompt": "a beautiful sunset",
        "n": 2,
        "size": "32x32",
        "response_format": "b64_json",
    }
    r = srv.client.post(
        "/v1/images/generations", json={**body, "seed": 4, "num_inference_steps": 2, "quality": "hd"}
    )
    assert r.status_code == 200, r.text
    answer = r.json()
    assert isinstance(answer["created"], int) and len(answer["data"]) == 2 and answer["size"] == "32x32"
    assert answer["ignored_fields"] == ["quality"]
    png = Image.open(io.BytesIO(base64.b64decode(answer["data"][1]["b64_json"])))
    assert png.format == "PNG" and png.size == (32, 32)
    (_, second) = srv.generate(
        {"prompt": "a beautiful sunset", "seed": 4, "num_inference_steps": 2, "width": 32, "height": 32,
         "num_outputs_per_prompt": 2, "rollout": False, "output_dtype": "uint8"}
    )  # fmt: skip
    pixels = torch.tensor(list(png.getdata()), dtype=torch.uint8).reshape(32, 32, 3).permute(2, 0, 1)
    assert torch.equal(pixels, second["generated_output"])
    bad = srv.client.post("/v1/images/generations", json={**body, "response_format": "url"})
    assert bad.status_code == 400 and "b64_json" in bad.json()["error"]["message"]
    bad = srv.client.post("/v1/images/generations", json={**body, "size": "big"})
    assert bad.status_code == 400 and "size" in bad.json()["error"]["message"]


@pytest.mark.parametrize("family", ["flux2-klein", "qwenimage"])
def test_sglang_refit_checksums_default_modules_and_repo_id(
    fresh_server, tiny_model_path, tmp_path, family, monkeypatch
):
    """What SGLang's current refit test (``test_update_weights_from_disk.py`` at commit 2a5b6808,
    its FLUX.2 klein and Qwen-Image pairs) sends and checks: it resets the server by posting the
    served model's Hub repo id as ``model_path`` (SGLang resolves it like ``maybe_download_model``),
    refits a folder whose transformer and vae differ with no ``target_modules`` (SGLang's
    ``WeightsUpdater`` then updates every module), and compares ``/get_weights_checksum``'s
    ``transformer`` with SHA-256 over the folder's file tensors (sorted names, name then raw bytes).
    Qwen-Image's text encoder is saved under transformers' file names (``model.layers...``), which
    a default refit must read as the module names them. A repo id that is in no cache stays a 400."""
    import hashlib
    import shutil

    from safetensors.torch import load_file, save_file

    def disk_checksum(folder) -> str:
        h = hashlib.sha256()
        tensors: dict = {}
        for f in sorted((folder / "transformer").glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        for name in sorted(tensors):
            h.update(name.encode())
            h.update(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().data)
        return h.hexdigest()

    srv = fresh_server(family)
    base = tiny_model_path(family)
    repo = "tiny-org/base-model"
    snap = tmp_path / "hub" / "models--tiny-org--base-model" / "snapshots" / ("0" * 40)
    shutil.copytree(base, snap)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("0" * 40)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read at import, so patched
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    other = tmp_path / "other"
    shutil.copytree(base, other)
    for module in ("transformer", "vae"):
        for f in (other / module).glob("*.safetensors"):
            save_file(
                {k: v + 0.01 if v.is_floating_point() else v for k, v in load_file(str(f)).items()}, str(f)
            )

    def update(body: dict) -> tuple[dict, int]:
        r = srv.client.post("/update_weights_from_disk", json=body)
        return r.json(), r.status_code

    def checksums() -> dict:
        return srv.client.post("/get_weights_checksum", json={}).json()

    before = checksums()
    assert before["transformer"] == disk_checksum(base)
    result, status = update({"model_path": str(other), "flush_cache": True})
    assert status == 200 and result["success"], result
    after = checksums()
    assert after["transformer"] == disk_checksum(other)
    assert after["vae"] != before["vae"]
    encoders = [m for m in before if m.startswith("text_encoder")]
    assert encoders and all(after[m] == before[m] for m in encoders)  # the same files, read by their names

    result, status = update({"model_path": repo, "flush_cache": True})
    assert status == 200 and result["success"], result
    assert checksums() == before
    result, status = update({"model_path": "tiny-org/not-cached", "flush_cache": True})
    assert status == 400 and result["success"] is False
    result, status = update({"model_path": str(other), "target_modules": ["all"]})
    assert status == 200 and checksums()["vae"] == after["vae"]


def test_port_listens_before_uvicorns_startup_line(monkeypatch):
    """SGLang's fixture takes uvicorn's "Application startup complete." as ready and sends its
    first request at once; uvicorn prints that line before it binds the port. The server listens
    before the app's start-up runs, so that request is never refused."""
    import asyncio
    import socket

    import uvicorn

    from diffusion_rollout.entrypoints.http_server import DrainingServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seen: dict = {}

    async def app(scope, receive, send):
        if scope["type"] != "lifespan":
            return
        await receive()
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # refused if not yet listening
            seen["connected"] = True
        await send({"type": "lifespan.startup.complete"})
        await receive()
        await send({"type": "lifespan.shutdown.complete"})

    class Engine:
        def begin_shutdown(self) -> None:
            pass

    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on"), Engine())

    async def run() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        server.should_exit = True
        await task

    asyncio.run(run())
    assert seen.get("connected") and server.started
