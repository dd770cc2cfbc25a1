"""Weight and LoRA pushes from a trainer through the client, verified with the shared checksums."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save_file

from diffusion_rollout.client import (
    ChecksumMismatchError,
    RolloutClient,
    lora_checksum,
    lora_config_dict,
    lora_state_dict,
    push_lora,
    push_weights,
    push_weights_ipc,
    safetensors_parts,
    verify_lora,
    verify_weights_checksum,
)
from diffusion_rollout.client.exceptions import ServerWeightUpdateError
from diffusion_rollout.protocol.checksums import module_checksum, trainer_weights_checksum
from diffusion_rollout.testing import free_port, serve_in_thread

ODE = {
    "seed": 3,
    "num_inference_steps": 2,
    "width": 32,
    "height": 32,
    "max_sequence_length": 16,
    "rollout": False,
    "guidance_scale": 1.0,
}


def trainer_transformer(path: Path) -> torch.nn.Module:
    """The trainer's own copy of the denoiser, loaded from the served folder."""
    from diffusers import AutoModel

    model = AutoModel.from_pretrained(str(path), subfolder="transformer", dtype=torch.float32)
    model.requires_grad_(False)
    return model


def client_for(server) -> RolloutClient:
    return RolloutClient("http://testserver", http_client=server.client)


def perturbed(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.02 * torch.randn(p.shape, generator=g) for n, p in module.named_parameters()}


def test_safetensors_parts_are_bounded_cast_and_hashed():
    tensors = {f"w{i}": torch.randn(10, 10) for i in range(5)}
    tensors["big"] = torch.randn(100, 10)
    parts = list(safetensors_parts(tensors.items(), max_part_bytes=900, dtype=torch.bfloat16))
    # 200 bytes per small tensor in bf16: four fit in 900 bytes; the 2000-byte tensor travels alone.
    assert [p.names for p in parts] == [["w0", "w1", "w2", "w3"], ["w4"], ["big"]]
    for part in parts:
        loaded = load(part.data)
        assert all(t.dtype == torch.bfloat16 for t in loaded.values())
        assert all(torch.equal(loaded[n], tensors[n].to(torch.bfloat16)) for n in part.names)
        assert set(part.sha256) == set(part.names)
    with pytest.raises(ValueError, match="twice"):
        list(safetensors_parts([("a", torch.zeros(1)), ("a", torch.zeros(1))]))


def test_push_weights_in_parts_commits_once_and_verifies(fresh_server):
    server = fresh_server("sd3")
    c = client_for(server)
    tr = server.engine.pipe.transformer
    master = perturbed(tr, 1)
    before = c.get_weights_checksum(["transformer"])["transformer"]
    [img_before] = c.generate("a red square", **ODE)

    staged_versions = []
    real = c.update_weights

    def spy(data, **kw):
        out = real(data, **kw)
        staged_versions.append((kw["final"], c.model_info()["weight_version"]))
        return out

    c.update_weights = spy  # watch the version while parts arrive
    # A generator of prefixed names (as an FSDP gather would yield them), in small parts.
    result = push_weights(
        c, ((f"transformer.{n}", t) for n, t in master.items()), max_part_bytes=64 * 1024, weight_version="v1"
    )
    assert len(staged_versions) > 3
    # Nothing applied before the last part: the version only moves on the commit.
    assert all(v == 0 for final, v in staged_versions[:-1]) and staged_versions[-1] == (True, "v1")
    assert result.weight_version == "v1"
    local = trainer_weights_checksum(master.items(), torch.float32)
    assert c.get_weights_checksum(["transformer"])["transformer"] == local != before
    assert verify_weights_checksum(c, master) == local
    assert verify_weights_checksum(c, tr) == local  # a module: its parameters
    [img_after] = c.generate("a red square", **ODE)
    assert not torch.equal(img_before.generated_output, img_after.generated_output)
    with pytest.raises(ChecksumMismatchError) as info:
        verify_weights_checksum(c, perturbed(tr, 2))
    assert info.value.actual == local


def test_rejected_push_changes_nothing_and_is_not_retried(fresh_server):
    server = fresh_server("sd3")
    c = client_for(server)
    before = c.get_weights_checksum(["transformer"])["transformer"]
    bad = dict(perturbed(server.engine.pipe.transformer, 1))
    bad["no.such.layer.weight"] = torch.zeros(3)
    with pytest.raises(ServerWeightUpdateError, match=r"no\.such\.layer"):
        push_weights(c, bad, max_part_bytes=10**9)
    assert c.get_weights_checksum(["transformer"])["transformer"] == before
    assert c.model_info()["weight_version"] == 0


def test_ipc_push_same_host(fresh_server):
    server = fresh_server("sd3", allow_cpu_ipc=True)  # CPU tensors travel by descriptor
    c = client_for(server)
    for seed, load_format in ((5, "flattened_bucket"), (6, None)):
        master = perturbed(server.engine.pipe.transformer, seed)  # new values each time: no no-op passes
        res = push_weights_ipc(c, master, load_format=load_format, weight_version=f"ipc-{load_format}")
        assert res.weight_version == f"ipc-{load_format}"
        assert module_checksum(server.engine.pipe.transformer) == trainer_weights_checksum(
            master.items(), torch.float32
        )


def test_push_lora_from_a_peft_trainer_reloads_in_place_and_verifies(fresh_server, tiny_model_path):
    from peft import LoraConfig

    server = fresh_server("sd3")
    c = client_for(server)
    trainer = trainer_transformer(tiny_model_path("sd3"))
    trainer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "proj_out"]))
    base_sum = c.get_weights_checksum(["transformer"])["transformer"]

    res = push_lora(c, trainer, name="default", weight_version="l0")
    assert res.weight_version == "l0" and "loaded" in res.message
    listing = c.lora_list()["modules"]["transformer"]
    assert listing["active"] == "default"
    info = listing["adapters"]["default"]
    assert (info["rank"], info["alpha"]) == (4, 8)
    assert info["checksum"] == lora_checksum(trainer)
    # lora_B starts at zero: the adapter does not change the output yet.
    [plain] = c.generate("a red square", **ODE)

    with torch.no_grad():
        for n, p in trainer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    res = push_lora(c, trainer, name="default", weight_version="l1")
    assert "reloaded in place" in res.message
    assert verify_lora(c, trainer) == lora_checksum(trainer)
    [adapted] = c.generate("a red square", **ODE)
    assert not torch.equal(plain.generated_output, adapted.generated_output)
    # The base weights' checksum sees through the adapter: unchanged.
    assert c.get_weights_checksum(["transformer"])["transformer"] == base_sum
    c.lora_activate(None)
    [base_again] = c.generate("a red square", **ODE)
    assert torch.equal(plain.generated_output, base_again.generated_output)

    # The config travels with the tensors; a different trainer tensor is caught by verification.
    assert lora_config_dict(trainer)["target_modules"] == ["proj_out", "to_k", "to_q"]
    sd = lora_state_dict(trainer)
    assert all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in sd)
    sd[next(iter(sd))] = sd[next(iter(sd))] + 1
    with pytest.raises(ChecksumMismatchError, match="default"):
        verify_lora(c, sd)
    with pytest.raises(ChecksumMismatchError, match="no adapter"):
        verify_lora(c, sd, name="missing")


def test_a_lora_push_repeated_after_a_lost_answer_applies_nothing_twice(fresh_server, tiny_model_path):
    """A trainer that lost the answer to a push sends it again: the server then holds the adapter
    once, with the same checksum, and answers exactly as after the first push (a reload in place,
    never a sum of two adapters)."""
    from peft import LoraConfig

    server = fresh_server("sd3")
    c = client_for(server)
    trainer = trainer_transformer(tiny_model_path("sd3"))
    trainer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "proj_out"]))
    with torch.no_grad():
        for n, p in trainer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    push_lora(c, trainer, name="default", weight_version="v1")
    [once] = c.generate("a red square", **ODE)
    again = push_lora(c, trainer, name="default", weight_version="v1")
    assert again.weight_version == "v1"
    listing = c.lora_list()["modules"]["transformer"]
    assert list(listing["adapters"]) == ["default"] and listing["active"] == "default"
    assert listing["adapters"]["default"]["checksum"] == lora_checksum(trainer)
    [twice] = c.generate("a red square", **ODE)
    assert torch.equal(once.generated_output, twice.generated_output)


def test_lora_state_dict_normalizes_peft_names():
    a, b = torch.zeros(2, 4), torch.zeros(4, 2)
    raw = {
        "base_model.model.blocks.0.to_q.lora_A.default.weight": a,
        "transformer.blocks.0.to_q.lora_B.weight": b,
    }
    sd = lora_state_dict(raw, target_module="transformer")
    assert list(sd) == ["blocks.0.to_q.lora_A.weight", "blocks.0.to_q.lora_B.weight"]
    with pytest.raises(ValueError, match="no tensors"):
        lora_state_dict({})


TRAINER = textwrap.dedent(
    """
    import sys
    from safetensors.torch import load_file
    from diffusion_rollout.client import RolloutClient, WeightBroadcaster

    url, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    tensors = load_file(path)
    client = RolloutClient(url, admin_key="k")
    with WeightBroadcaster(client, master_address="127.0.0.1", master_port=port, backend="gloo",
                           group_name="client_broadcast", timeout_s=60) as b:
        result = b.broadcast(tensors, weight_version="bcast")
    print("VERSION", result.weight_version)
    """
)


def test_weight_broadcaster_over_gloo(fresh_server, tmp_path):
    """Trainer rank 0 in its own process, the server (rank 1) here, behind a real HTTP port."""
    from diffusion_rollout.entrypoints.http_server import make_server

    server = fresh_server("sd3", admin_key="k")
    master = perturbed(server.engine.pipe.transformer, 9)
    save_file({n: t.contiguous() for n, t in master.items()}, str(tmp_path / "w.safetensors"))
    http_port, group_port = free_port(), free_port()
    config = server.config.model_copy(update={"port": http_port, "log_level": "warning"})
    uv = make_server(server.app, config)
    with serve_in_thread(uv, name="test-uvicorn"):
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                TRAINER,
                f"http://127.0.0.1:{http_port}",
                str(group_port),
                str(tmp_path / "w.safetensors"),
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "VERSION bcast" in out.stdout
    assert server.engine.weight_version == "bcast"
    assert module_checksum(server.engine.pipe.transformer) == trainer_weights_checksum(
        master.items(), torch.float32
    )


@pytest.mark.parametrize("use_async", [False, True])
def test_large_bodies_are_streamed_in_slices_and_land_intact(fresh_server, monkeypatch, use_async):
    """Bodies over the slice size go out as an iterator with a Content-Length (linear, not quadratic)."""
    import asyncio

    import httpx
    from safetensors.torch import save

    import diffusion_rollout.client.calls as client_calls
    from diffusion_rollout.client import AsyncRolloutClient, RolloutClient

    monkeypatch.setattr(client_calls, "_UPLOAD_CHUNK", 4096)  # the tiny payload spans many slices
    server = fresh_server("sd3")
    new = {k: v.detach() + 0.01 for k, v in server.engine.pipe.transformer.named_parameters()}
    data = save(new)
    assert len(data) > 50 * 4096
    if use_async:

        async def push():
            async with AsyncRolloutClient(
                "http://testserver", transport=httpx.ASGITransport(app=server.app)
            ) as c:
                return await c.update_weights(data, target_module="transformer", weight_version="sliced")

        result = asyncio.run(push())
    else:
        result = RolloutClient("http://testserver", http_client=server.client).update_weights(
            data, target_module="transformer", weight_version="sliced"
        )
    assert result.weight_version == "sliced"
    assert module_checksum(server.engine.pipe.transformer) == trainer_weights_checksum(
        new.items(), torch.float32
    )
