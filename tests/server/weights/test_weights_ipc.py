"""SGLang ``update_weights_from_tensor`` payloads, built the way SGLang clients build them.

SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` is a
``multiprocessing.reduction.ForkingPickler`` dump (torch's reducers turn CPU tensors into
shared-memory file descriptors) then base64; its bucket metadata class lives in
``sglang.srt.weight_sync.tensor_bucket``. SGLang is not installed here, so the tests register a
stand-in module under that name: the pickles then reference exactly the globals SGLang's do.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import pickle
import sys
import types
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict

from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.models import build_tiny_pipeline
from diffusion_rollout.protocol.checksums import trainer_weights_checksum
from diffusion_rollout.server.weights import ipc
from diffusion_rollout.server.weights.safe_pickle import FdPolicy

ODE = {
    "prompt": "a bowl of fruit",
    "seed": 5,
    "num_inference_steps": 3,
    "rollout_sde_type": "ode",
    "rollout_debug_mode": False,
    "rollout_log_prob_no_const": True,
}


@pytest.fixture(scope="module")
def sglang_bucket_module():
    """``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` as SGLang defines it."""
    names = ["sglang", "sglang.srt", "sglang.srt.weight_sync", "sglang.srt.weight_sync.tensor_bucket"]
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        sys.modules[n] = types.ModuleType(n)

    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = names[-1]
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    sys.modules[names[-1]].FlattenedTensorMetadata = FlattenedTensorMetadata
    yield FlattenedTensorMetadata
    for n, mod in saved.items():
        if mod is None:
            sys.modules.pop(n, None)
        else:
            sys.modules[n] = mod


def sglang_serialize(obj) -> str:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def sglang_bucket(named, meta_cls) -> dict:
    """SGLang's multi-dtype FlattenedTensorBucket: uint8 bytes, byte offsets."""
    flats, metadata, offset = [], [], 0
    for name, t in named:
        flat = t.flatten().view(torch.uint8)
        metadata.append(meta_cls(name, t.shape, t.dtype, offset, offset + flat.numel(), flat.numel()))
        flats.append(flat)
        offset += flat.numel()
    return {"flattened_tensor": torch.cat(flats), "metadata": metadata}


def new_weights(server, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: p.detach().float() + 0.05 * torch.randn(p.shape, generator=g)
        for n, p in server.engine.pipe.transformer.named_parameters()
    }


def checksum(server) -> str:
    return server.client.post("/get_weights_checksum", json={"module_names": ["transformer"]}).json()[
        "transformer"
    ]


def post(server, body: dict, expect: int = 200):
    r = server.client.post("/update_weights_from_tensor", json=body)
    assert r.status_code == expect, r.text
    return r.json()


# ---------------------------------------------------------------------------- full weights
def test_plain_list_payload(fresh_server):
    server = fresh_server("sd3", allow_cpu_ipc=True)
    master = new_weights(server, 1)
    # One entry per TP rank; this server is one rank and uses entry 0.
    entry = sglang_serialize([(f"transformer.{n}", t) for n, t in master.items()])
    out = post(server, {"serialized_named_tensors": [entry, entry], "weight_version": "ipc-1"})
    assert out["weight_version"] == "ipc-1"
    assert checksum(server) == trainer_weights_checksum(master.items(), torch.float32)


def test_flattened_bucket_with_mixed_dtypes(fresh_server, sglang_bucket_module):
    server = fresh_server("sd3", allow_cpu_ipc=True)
    master = new_weights(server, 2)
    # bf16 and fp32 tensors in one uint8 bucket: byte offsets that are not 4-aligned for fp32.
    named = [
        (n, t.to(torch.bfloat16) if i % 3 == 0 else t) for i, (n, t) in enumerate(sorted(master.items()))
    ]
    assert any(t.dtype == torch.bfloat16 for _, t in named)
    entry = sglang_serialize(sglang_bucket(named, sglang_bucket_module))
    post(server, {"serialized_named_tensors": [entry], "load_format": "flattened_bucket"})
    assert checksum(server) == trainer_weights_checksum(named, torch.float32)


def test_per_module_dict_payload_and_our_client_serializer(fresh_server):
    server = fresh_server("sd3", allow_cpu_ipc=True)
    master = new_weights(server, 3)
    g = torch.Generator().manual_seed(0)
    vae = {
        n: p.detach() + 0.01 * torch.randn(p.shape, generator=g)
        for n, p in server.engine.pipe.vae.named_parameters()
    }
    bucket = {"transformer": ipc.flatten_bucket(master.items()), "vae": ipc.flatten_bucket(vae.items())}
    entry = ipc.serialize(bucket)
    post(
        server,
        {
            "serialized_named_tensors": [entry],
            "load_format": "flattened_bucket",
            "target_modules": ["transformer", "vae"],
        },
    )
    sums = server.client.post("/get_weights_checksum", json={"module_names": ["transformer", "vae"]}).json()
    assert sums["transformer"] == trainer_weights_checksum(master.items(), torch.float32)
    assert sums["vae"] == trainer_weights_checksum(vae.items(), torch.float32)

    # Two targets but a bare list: ambiguous, refused.
    r = server.client.post(
        "/update_weights_from_tensor",
        json={
            "serialized_named_tensors": [ipc.serialize_named_tensors(master.items())],
            "target_modules": ["transformer", "vae"],
        },
    )
    assert r.status_code == 400 and "must be a dict" in r.json()["error"]["message"]


def test_bad_payloads_are_refused_and_change_nothing(fresh_server, tmp_path, sglang_bucket_module):
    server = fresh_server("sd3", allow_cpu_ipc=True)
    before = checksum(server)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = base64.b64encode(pickle.dumps([("pos_embed.proj.bias", Evil())])).decode()
    msg = post(server, {"serialized_named_tensors": [evil]}, 400)["error"]["message"]
    assert "refused pickle global" in msg and "system" in msg
    assert not marker.exists()

    for module, name in (
        ("builtins", "eval"),
        ("torch", "load"),
        ("torch.serialization", "load"),
        ("subprocess", "Popen"),
    ):
        forged = f"c{module}\n{name}\n.".encode()  # a bare GLOBAL opcode naming exactly this callable
        msg = post(server, {"serialized_named_tensors": [base64.b64encode(forged).decode()]}, 400)["error"][
            "message"
        ]
        assert f"refused pickle global {module}.{name}" in msg

    assert "not base64" in post(server, {"serialized_named_tensors": ["%%%"]}, 400)["error"]["message"]
    wrong_shape = sglang_serialize([("pos_embed.proj.bias", torch.zeros(5))])
    assert (
        "shape mismatch" in post(server, {"serialized_named_tensors": [wrong_shape]}, 400)["error"]["message"]
    )
    bucket = sglang_bucket([("pos_embed.proj.bias", torch.zeros(4))], sglang_bucket_module)
    bucket["metadata"][0].end_idx += 4  # runs past the flat tensor
    msg = post(
        server,
        {"serialized_named_tensors": [sglang_serialize(bucket)], "load_format": "flattened_bucket"},
        400,
    )
    assert "outside the flat tensor" in msg["error"]["message"]
    msg = post(server, {"serialized_named_tensors": [wrong_shape], "payload_gpu_uuids": ["a", "b"]}, 400)
    assert "payload_gpu_uuids has 2 items" in msg["error"]["message"]
    r = server.client.post(
        "/update_weights_from_tensor",
        json={"serialized_named_tensors": [wrong_shape], "load_format": "pickle"},
    )
    assert r.status_code == 422
    assert checksum(server) == before


def test_restricted_unpickler_allows_only_tensor_globals():
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    decoded = ipc.decode_entry(
        sglang_serialize([("w", t), ("p", torch.nn.Parameter(torch.ones(2)))]), FdPolicy(allow_cpu_ipc=True)
    )
    assert torch.equal(decoded[0][1], t) and torch.equal(decoded[1][1], torch.ones(2))
    with pytest.raises(WeightUpdateError, match=r"refused pickle global collections\.Counter"):
        ipc.decode_entry(base64.b64encode(pickle.dumps(__import__("collections").Counter())).decode())


# ---------------------------------------------------------------------------- lora_merge
def test_lora_merge_payload(fresh_server, sglang_bucket_module):
    server = fresh_server("sd3", allow_cpu_ipc=True)
    scratch = build_tiny_pipeline("sd3").transformer
    config = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v"])
    scratch.add_adapter(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in scratch.named_parameters():
            if "lora_" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    sd = {k: v.clone() for k, v in get_peft_model_state_dict(scratch).items()}

    for load_format in (None, "flattened_bucket"):
        named = list(sd.items())
        entry = sglang_serialize(sglang_bucket(named, sglang_bucket_module) if load_format else named)
        body = {
            "serialized_named_tensors": [entry],
            "load_format": load_format,
            "weight_update_mode": "lora_merge",
        }
        out = post(server, {**body, "lora_rank": 4, "weight_version": f"lora-{load_format}"})
        assert "adapter 'default'" in out["message"]
    [lora_out] = server.generate(ODE)
    assert lora_out["weight_version"] == "lora-flattened_bucket"
    assert "reloaded in place" in out["message"]  # the second sync reuses the adapter

    ref = fresh_server("sd3")
    ref.engine.pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v"]))
    set_peft_model_state_dict(ref.engine.pipe.transformer, sd)
    [ref_out] = ref.generate(ODE)
    assert torch.equal(lora_out["generated_output"], ref_out["generated_output"])

    wrong_rank = {
        "serialized_named_tensors": [sglang_serialize(list(sd.items()))],
        "weight_update_mode": "lora_merge",
        "lora_rank": 8,
    }
    assert "lora_rank=8" in post(server, wrong_rank, 400)["error"]["message"]
    stray = [(k.replace("transformer_blocks", "layers"), v) for k, v in sd.items()]
    msg = post(
        server,
        {"serialized_named_tensors": [sglang_serialize(stray)], "weight_update_mode": "lora_merge"},
        400,
    )
    assert "binds no layer" in msg["error"]["message"]
