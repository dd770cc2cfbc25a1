"""Named LoRA adapters through the real app, against PEFT-wrapped stock pipelines."""

from __future__ import annotations

import json
import time

import pytest
import torch
from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import save, save_file

from diffusion_rollout.models import build_tiny_pipeline
from diffusion_rollout.protocol.checksums import weights_checksum
from diffusion_rollout.server.weights import get_weight_manager
from diffusion_rollout.server.weights.lora import tuner_layers

ODE = {
    "prompt": "a lighthouse at dusk",
    "seed": 3,
    "width": 32,
    "height": 32,
    "max_sequence_length": 16,
    "num_inference_steps": 3,
    "rollout_sde_type": "ode",
    "rollout_debug_mode": False,
    "rollout_log_prob_no_const": True,
}
CONFIGS = {
    "default": dict(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]),
    "old": dict(r=2, lora_alpha=2, target_modules=["to_q", "to_v"]),
}


def adapter(name: str, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """A LoRA config dict and PEFT state dict (non-zero B, so the adapter changes outputs)."""
    scratch = build_tiny_pipeline("sd3").transformer
    config = LoraConfig(**CONFIGS[name])
    scratch.add_adapter(config, adapter_name=name)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in scratch.named_parameters():
            if "lora_" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    tensors = {k: v.clone() for k, v in get_peft_model_state_dict(scratch, adapter_name=name).items()}
    return json.loads(json.dumps(config.to_dict(), default=list)), tensors


def image(server) -> tuple[torch.Tensor, object]:
    [out] = server.generate(ODE)
    return out["generated_output"], out["weight_version"]


def peft_reference(tiny_model_path, name: str, cfg: dict, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The stock diffusers pipeline with the adapter attached by PEFT directly (no server involved)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(tiny_model_path("sd3")), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.add_adapter(LoraConfig(**CONFIGS[name]), adapter_name=name)
    set_peft_model_state_dict(pipe.transformer, tensors, adapter_name=name)
    out = pipe(
        prompt=ODE["prompt"],
        height=ODE["height"],
        width=ODE["width"],
        max_sequence_length=ODE["max_sequence_length"],
        num_inference_steps=ODE["num_inference_steps"],
        generator=[torch.Generator("cpu").manual_seed(ODE["seed"])],
        output_type="pt",
    )
    return out.images[0]


def checksum(server) -> str:
    return server.client.post("/get_weights_checksum", json={"module_names": ["transformer"]}).json()[
        "transformer"
    ]


def load_bytes(server, name: str, tensors, cfg: dict | None, expect: int = 200, **query):
    metadata = {"peft_config": json.dumps(cfg)} if cfg is not None else None
    r = server.client.post(
        "/lora/load",
        content=save(tensors, metadata=metadata),
        params={"name": name, **query},
        headers={"Content-Type": "application/octet-stream"},
    )
    assert r.status_code == expect, r.text
    return r.json()


def error_of(r, status: int) -> str:
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


# ---------------------------------------------------------------------------- dynamic = PEFT
def test_default_and_old_adapters_are_bit_identical_to_peft(fresh_server, tiny_model_path, tmp_path):
    server = fresh_server("sd3")
    base_img, _ = image(server)
    base_sum = checksum(server)
    cfg_d, lora_d = adapter("default", seed=1)
    cfg_o, lora_o = adapter("old", seed=2)

    # default: bytes with the config in the safetensors metadata; old: a PEFT folder on disk.
    out = load_bytes(server, "default", lora_d, cfg_d)
    assert "loaded on transformer" in out["message"]
    folder = tmp_path / "old"
    folder.mkdir()
    save_file(lora_o, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(cfg_o))
    r = server.client.post("/lora/load", json={"name": "old", "path": str(folder)})
    assert r.status_code == 200, r.text
    assert checksum(server) == base_sum  # base weights untouched by loading

    # Nothing active yet: the base model.
    assert torch.equal(image(server)[0], base_img)

    for name, cfg, tensors in (
        ("default", cfg_d, lora_d),
        ("old", cfg_o, lora_o),
        ("default", cfg_d, lora_d),
    ):
        r = server.client.post("/lora/activate", json={"name": name, "weight_version": f"use-{name}"})
        assert r.status_code == 200, r.text
        img, version = image(server)
        assert version == f"use-{name}"
        assert torch.equal(img, peft_reference(tiny_model_path, name, cfg, tensors)), name
        assert not torch.equal(img, base_img)

    assert server.client.post("/lora/activate", json={"name": None}).status_code == 200
    assert torch.equal(image(server)[0], base_img)

    listing = server.client.get("/lora").json()["modules"]["transformer"]
    assert listing["active"] is None and set(listing["adapters"]) == {"default", "old"}
    assert listing["adapters"]["old"]["rank"] == 2 and listing["adapters"]["default"]["alpha"] == 8
    assert listing["adapters"]["default"]["checksum"] == weights_checksum(lora_d.items())

    # Unloading everything restores the exact original module.
    assert server.client.post("/lora/unload", json={}).status_code == 200
    assert checksum(server) == base_sum
    assert not any(True for _ in tuner_layers(server.engine.pipe.transformer))
    assert server.client.get("/lora").json()["modules"] == {}


def test_adapter_without_config_is_described_by_its_tensors(fresh_server, tiny_model_path):
    server = fresh_server("sd3")
    cfg, tensors = adapter("default", seed=3)
    # No config: rank from lora_A, alpha given explicitly (else it would equal the rank).
    load_bytes(server, "default", tensors, None, lora_alpha="8", activate="true")
    assert torch.equal(image(server)[0], peft_reference(tiny_model_path, "default", cfg, tensors))


# ---------------------------------------------------------------------------- merged mode
def test_merged_mode_is_close_and_unmerge_restores_exactly(fresh_server, tiny_model_path):
    server = fresh_server("sd3")
    base_sum = checksum(server)
    cfg, tensors = adapter("default", seed=4)
    load_bytes(server, "default", tensors, cfg, activate="true")
    dynamic, _ = image(server)

    r = server.client.post("/lora/activate", json={"name": "default", "mode": "merged"})
    assert r.status_code == 200 and "merged" in r.json()["message"], r.text
    assert checksum(server) != base_sum  # folded into the base weights
    merged, _ = image(server)
    assert (merged - dynamic).abs().max() < 1e-4  # float32 server: rounding only

    # Reloading the merged adapter restores the base from the kept copy, then re-merges.
    _, tensors2 = adapter("default", seed=5)
    load_bytes(server, "default", tensors2, cfg)
    assert server.client.post("/v1/unmerge_lora_weights", json={}).status_code == 200
    assert checksum(server) == base_sum
    dynamic2, _ = image(server)
    assert torch.equal(dynamic2, peft_reference(tiny_model_path, "default", cfg, tensors2))

    # SGLang's merge route, then switching the active adapter off, also restores exactly.
    assert server.client.post("/v1/merge_lora_weights", json={"target": "transformer"}).status_code == 200
    assert server.client.post("/lora/activate", json={"name": None}).status_code == 200
    assert checksum(server) == base_sum


@pytest.fixture
def bf16_server(tiny_model_path):
    from fastapi.testclient import TestClient

    from diffusion_rollout.config import ServerConfig
    from diffusion_rollout.entrypoints.app import create_app
    from diffusion_rollout.server.core.engine import Engine

    config = ServerConfig(model=str(tiny_model_path("sd3")), device="cpu", dtype="bfloat16")
    engine = Engine(config)
    engine.start()
    with TestClient(create_app(config, engine=engine)) as client:

        class Server:
            pass

        server = Server()
        server.engine, server.client = engine, client
        server.generate = lambda body: _decode(client.post("/rollout/generate", json=body))
        yield server
    engine.stop(grace_s=5)


def _decode(r):
    from diffusion_rollout.protocol import wire

    assert r.status_code == 200, r.text
    return wire.decode(r.content, r.headers["content-type"])


def test_merged_mode_in_bfloat16_is_within_bf16_rounding(bf16_server, fresh_server):
    server = bf16_server
    cfg, tensors = adapter("default", seed=6)
    load_bytes(server, "default", tensors, cfg, activate="true")
    dynamic, _ = image(server)
    tr = server.engine.pipe.transformer
    layers = {p: layer for p, layer in tuner_layers(tr) if "default" in layer.lora_A}
    base = {p: layer.get_base_layer().weight.detach().clone() for p, layer in layers.items()}

    server.client.post("/lora/activate", json={"name": "default", "mode": "merged"})
    merged, _ = image(server)

    # Each merged weight is W + B@A*scale rounded to bf16 (two roundings: the delta, then the sum).
    for p, layer in layers.items():
        exact = (
            base[p].float()
            + (layer.lora_B["default"].weight.float() @ layer.lora_A["default"].weight.float())
            * layer.scaling["default"]
        )
        got = layer.get_base_layer().weight.float()
        delta = exact - base[p].float()
        # Unit roundoff 2**-8 per rounding: |err| <= u*|delta| + u*|sum| (1% slack for the fp32 reference).
        assert ((got - exact).abs() <= 1.01 * 2**-8 * (delta.abs() + exact.abs()) + 1e-12).all(), p

    # End to end, merged bf16 is as close to the float32 result as dynamic bf16 is.
    reference = fresh_server("sd3")
    load_bytes(reference, "default", tensors, cfg, activate="true")
    exact_img = image(reference)[0]
    dynamic_err = (dynamic.float() - exact_img).abs().max()
    merged_err = (merged.float() - exact_img).abs().max()
    assert dynamic_err > 0
    assert merged_err <= 2 * dynamic_err + 2**-8, (merged_err, dynamic_err)


def test_full_update_under_a_merged_adapter_keeps_the_base_exact(fresh_server):
    server = fresh_server("sd3")
    cfg, tensors = adapter("default", seed=7)
    load_bytes(server, "default", tensors, cfg, activate="true", mode="merged")
    g = torch.Generator().manual_seed(0)
    master = {
        n: p.detach().float() + 0.05 * torch.randn(p.shape, generator=g)
        for n, p in build_tiny_pipeline("sd3").transformer.named_parameters()
    }
    r = server.client.post(
        "/update_weights", content=save(master), headers={"Content-Type": "application/octet-stream"}
    )
    assert r.status_code == 200, r.text
    server.client.post("/lora/unload", json={"name": "default"})
    from diffusion_rollout.protocol.checksums import trainer_weights_checksum

    assert checksum(server) == trainer_weights_checksum(master.items(), torch.float32)


# ---------------------------------------------------------------------------- in-place reload
def test_reload_replaces_tensors_in_place(fresh_server, tiny_model_path):
    server = fresh_server("sd3")
    cfg, tensors = adapter("default", seed=8)
    load_bytes(server, "default", tensors, cfg, activate="true")
    tr = server.engine.pipe.transformer
    before_ids = {n: id(p) for n, p in tr.named_parameters()}
    before_modules = [id(m) for m in tr.modules()]

    _, tensors2 = adapter("default", seed=9)
    t0 = time.perf_counter()
    out = load_bytes(server, "default", tensors2, cfg, weight_version="lora-2")
    elapsed = time.perf_counter() - t0
    assert "reloaded in place" in out["message"] and out["weight_version"] == "lora-2"
    assert {n: id(p) for n, p in tr.named_parameters()} == before_ids
    assert [id(m) for m in tr.modules()] == before_modules
    assert elapsed < 5
    img, version = image(server)
    assert version == "lora-2"
    assert torch.equal(img, peft_reference(tiny_model_path, "default", cfg, tensors2))
    assert server.client.get("/lora").json()["modules"]["transformer"]["adapters"]["default"]["loads"] == 2


def _matmul_ops(layer: torch.nn.Module, x: torch.Tensor) -> set[str]:
    """The aten matmul ops one LoRA layer's forward launches under ``inference_mode`` (the worker's)."""
    from torch.profiler import profile

    with profile() as prof, torch.inference_mode():
        layer(x)
    return {e.key for e in prof.key_averages() if e.key in ("aten::mm", "aten::bmm", "aten::addmm")}


def test_served_adapter_takes_the_trainers_matmul_path(fresh_server):
    """Issue #41: torch.matmul folds a >2-D input into one ``mm`` only when the weight requires grad,
    else a non-contiguous input (SD3's attention output projection sees one) runs as a ``bmm``, whose
    last bits differ on a GPU. A trainer's adapter requires grad, so the server's active one must too."""
    server = fresh_server("sd3")
    cfg, tensors = adapter("default", seed=8)
    load_bytes(server, "default", tensors, cfg, activate="true")
    tr = server.engine.pipe.transformer
    served = dict(tuner_layers(tr))["transformer_blocks.0.attn.to_out.0"]
    assert all(p.requires_grad for p in served.lora_A["default"].parameters())
    # The trainer's layer: PEFT through diffusers' add_adapter, its adapter trainable.
    trainer = build_tiny_pipeline("sd3").transformer
    trainer.add_adapter(LoraConfig(**CONFIGS["default"]), adapter_name="default")
    set_peft_model_state_dict(trainer, tensors, adapter_name="default")
    mine = dict(tuner_layers(trainer))["transformer_blocks.0.attn.to_out.0"]
    dim = served.in_features
    x = torch.randn(2, 7, dim)[:, :5]  # the image half of a joint sequence: not viewable as 2-D
    assert not x.is_contiguous()
    assert _matmul_ops(served, x) == _matmul_ops(mine, x)
    a = served.lora_A["default"]
    assert _matmul_ops(a, x) == _matmul_ops(mine.lora_A["default"], x) == {"aten::mm"}
    frozen = torch.nn.Linear(dim, a.out_features, bias=False).requires_grad_(False)
    assert _matmul_ops(frozen, x) == {"aten::bmm"}  # the path a frozen adapter took before
    with torch.inference_mode():
        assert torch.equal(served(x), mine(x))


# ---------------------------------------------------------------------------- errors
def test_lora_payload_errors_change_nothing(fresh_server):
    server = fresh_server("sd3")
    base_sum = checksum(server)
    cfg, tensors = adapter("default", seed=10)

    stray = {k.replace("transformer_blocks", "blocks"): v for k, v in tensors.items()}
    assert "binds no layer of 'transformer'" in error_of(
        server.client.post(
            "/lora/load",
            content=save(stray),
            params={"name": "x"},
            headers={"Content-Type": "application/octet-stream"},
        ),
        400,
    )
    half = {k: v for k, v in tensors.items() if not k.startswith("transformer_blocks.0.attn.to_q.lora_B")}
    assert "layers missing lora_A or lora_B (1): transformer_blocks.0.attn.to_q" in error_of(
        server.client.post(
            "/lora/load",
            content=save(half, metadata={"peft_config": json.dumps(cfg)}),
            params={"name": "x"},
            headers={"Content-Type": "application/octet-stream"},
        ),
        400,
    )
    fewer = {k: v for k, v in tensors.items() if ".to_k." not in k}
    assert "layers the config targets but the payload lacks" in error_of(
        server.client.post(
            "/lora/load",
            content=save(fewer, metadata={"peft_config": json.dumps(cfg)}),
            params={"name": "x"},
            headers={"Content-Type": "application/octet-stream"},
        ),
        400,
    )
    wrong = dict(tensors)
    key = next(k for k in wrong if k.endswith("lora_A.weight"))
    wrong[key] = torch.zeros(4, 3)
    assert "shapes that do not fit the layer" in error_of(
        server.client.post(
            "/lora/load",
            content=save(wrong),
            params={"name": "x"},
            headers={"Content-Type": "application/octet-stream"},
        ),
        400,
    )
    poisoned = dict(tensors)
    bad_b = sorted(k for k in poisoned if k.endswith("lora_B.weight"))[-1]
    poisoned[bad_b] = torch.full_like(poisoned[bad_b], float("nan"))
    message = error_of(
        server.client.post(
            "/lora/load",
            content=save(poisoned, metadata={"peft_config": json.dumps(cfg)}),
            params={"name": "x"},
            headers={"Content-Type": "application/octet-stream"},
        ),
        400,
    )
    assert "non-float or non-finite tensors (1)" in message
    assert bad_b.removesuffix(".lora_B.weight") in message
    assert "unknown LoRA config keys: bogus" in error_of(
        server.client.post(
            "/lora/load",
            content=save(tensors),
            params={"name": "x", "peft_config": json.dumps({"r": 4, "bogus": 1})},
            headers={"Content-Type": "application/octet-stream"},
        ),
        400,
    )
    assert "no LoRA file or folder" in error_of(
        server.client.post("/lora/load", json={"name": "x", "path": "/nowhere"}), 400
    )
    assert "no LoRA adapter 'ghost'" in error_of(
        server.client.post("/lora/activate", json={"name": "ghost"}), 404
    )
    assert "unknown field 'adapter'" in error_of(
        server.client.post("/lora/activate", json={"name": None, "adapter": 1}), 422
    )
    assert checksum(server) == base_sum
    assert server.client.get("/lora").json()["modules"] == {}


# ---------------------------------------------------------------------------- SGLang routes
def test_sglang_lora_routes(fresh_server, tiny_model_path, tmp_path):
    server = fresh_server("sd3")
    base_sum = checksum(server)
    cfg, tensors = adapter("default", seed=11)
    path = tmp_path / "pytorch_lora_weights.safetensors"
    # diffusers' pipeline-level layout: "transformer." key prefix and prefixed metadata.
    save_file(
        {f"transformer.{k}": v for k, v in tensors.items()},
        str(path),
        metadata={
            "format": "pt",
            "lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in cfg.items()}),
        },
    )
    r = server.client.post(
        "/v1/set_lora", json={"lora_nickname": "style", "lora_path": str(path), "target": "all"}
    )
    assert r.status_code == 200, r.text
    listing = server.client.get("/v1/list_loras").json()
    assert listing["active"]["transformer"][0]["nickname"] == "style"
    assert listing["active"]["transformer"][0]["mode"] == "dynamic"
    assert torch.equal(image(server)[0], peft_reference(tiny_model_path, "default", cfg, tensors))

    assert server.client.post("/v1/merge_lora_weights", json={}).status_code == 200
    assert server.client.get("/v1/list_loras").json()["active"]["transformer"][0]["merged"] is True
    assert server.client.post("/v1/unmerge_lora_weights", json={}).status_code == 200
    assert server.client.get("/v1/list_loras").json()["active"]["transformer"][0]["merged"] is False
    # Re-activating a cached nickname needs no path.
    assert server.client.post("/v1/set_lora", json={"lora_nickname": "style"}).status_code == 200
    assert "lora_path has 2 items" in error_of(
        server.client.post("/v1/set_lora", json={"lora_nickname": ["a"], "lora_path": ["x", "y"]}), 400
    )
    server.client.post("/lora/unload", json={})
    assert checksum(server) == base_sum


@pytest.mark.parametrize("mode", ["dynamic", "merged"])
def test_release_resume_with_adapters_keeps_everything(fresh_server, mode):
    server = fresh_server("sd3")
    cfg, tensors = adapter("default", seed=12)
    load_bytes(server, "default", tensors, cfg, activate="true", mode=mode)
    before = server.client.post("/get_weights_checksum", json={}).json()
    img0, _ = image(server)
    assert server.client.post("/release_memory_occupation").status_code == 200
    assert server.client.post("/resume_memory_occupation").status_code == 200
    assert server.client.post("/get_weights_checksum", json={}).json() == before
    assert torch.equal(image(server)[0], img0)
    assert get_weight_manager(server.engine).lora.state("transformer").merged is (mode == "merged")
