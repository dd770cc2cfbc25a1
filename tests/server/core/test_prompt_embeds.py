"""Precomputed conditioning over the wire (``prompt_embeds`` and friends) on tiny SD3 and FLUX."""

from __future__ import annotations

import pytest
import torch

from diffusion_rollout.client import RolloutClient
from diffusion_rollout.models import TINY_CALL_DEFAULTS
from diffusion_rollout.protocol import wire
from tests.family_helpers import stock_pipe

ODE = {"rollout_sde_type": "ode", "rollout_log_prob_no_const": True}
ENV = {"rollout_return_denoising_env": True, "rollout_return_dit_trajectory": True, "lean_response": False}


def call(family: str) -> dict:
    return dict(TINY_CALL_DEFAULTS[family])


def client_of(server) -> RolloutClient:
    return RolloutClient("http://testserver", http_client=server.client)


def conditioning(family: str, env: dict) -> dict[str, torch.Tensor]:
    """The server's own encoding, read back from a rollout's denoising_env, by pipeline argument name."""
    pos = env["pos_cond_kwargs"]
    embeds = {
        "prompt_embeds": pos["encoder_hidden_states"],
        "pooled_prompt_embeds": pos["pooled_projections"],
    }
    neg = env["neg_cond_kwargs"]
    if neg is not None:
        embeds["negative_prompt_embeds"] = neg["encoder_hidden_states"]
        embeds["negative_pooled_prompt_embeds"] = neg["pooled_projections"]
    return embeds


def post(server, body: dict, *, media: str):
    """POST a body holding tensors as msgpack (raw bytes) or JSON (base64)."""
    return server.client.post(
        "/rollout/generate", content=wire.encode(body, media), headers={"Content-Type": media}
    )


@pytest.mark.parametrize(
    ("family", "extra"), [("sd3", {}), ("flux", {"negative_prompt": "blurry", "true_cfg_scale": 2.0})]
)
def test_conditioning_from_embeddings_equals_the_servers_own_from_text(served, family, extra):
    server = served(family)
    body = {"prompt": "a red square", "seed": 3, "num_outputs_per_prompt": 2, **call(family), **extra}
    [text, _] = server.generate({**body, **ODE, **ENV})
    embeds = conditioning(family, text["denoising_env"])
    assert embeds["prompt_embeds"].shape[1] == (77 + 16 if family == "sd3" else 16)  # CLIP + T5 / T5 tokens
    sent = {k: v for k, v in body.items() if k not in ("prompt", "negative_prompt", "max_sequence_length")}
    for media in (wire.MSGPACK, wire.JSON):
        r = post(server, {**sent, **embeds, **ODE, **ENV, "prompt": "label"}, media=media)
        assert r.status_code == 200, r.text[:500]
        first, second = wire.decode(r.content, r.headers["content-type"])
        assert first["prompt"] == "label"
        assert torch.equal(first["generated_output"], text["generated_output"])
        assert torch.equal(first["dit_trajectory"]["latents"], text["dit_trajectory"]["latents"])
        assert conditioning(family, first["denoising_env"]).keys() == embeds.keys()
        for k, v in conditioning(family, first["denoising_env"]).items():
            assert torch.equal(v, embeds[k]), k
        assert not torch.equal(second["generated_output"], first["generated_output"])  # seed + 1
    # A stochastic rollout from the same conditioning: the same log-probs, bit for bit.
    [sde_text] = server.generate({**body, "num_outputs_per_prompt": 1})
    [sde_embeds] = client_of(server).generate(
        None, **{k: v for k, v in sent.items() if k != "num_outputs_per_prompt"}, **embeds
    )
    assert sde_embeds.prompt == ""
    assert torch.equal(sde_embeds.rollout_log_probs, sde_text["rollout_log_probs"])


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_ode_with_embeddings_is_the_stock_pipeline_given_them(served, tiny_model_path, family):
    """The trainer's own encoding at another length (8 T5 tokens; the server's default is 16)."""
    pipe = stock_pipe(tiny_model_path(family))
    if family == "sd3":
        pe, npe, ppe, nppe = pipe.encode_prompt(
            "a red square", None, None, negative_prompt="", max_sequence_length=8
        )
        embeds = dict(
            prompt_embeds=pe,
            pooled_prompt_embeds=ppe,
            negative_prompt_embeds=npe,
            negative_pooled_prompt_embeds=nppe,
        )
    else:
        pe, ppe, _ = pipe.encode_prompt("a red square", None, max_sequence_length=8)
        embeds = dict(prompt_embeds=pe, pooled_prompt_embeds=ppe)
    settings = {k: v for k, v in call(family).items() if k != "max_sequence_length"}
    outs = client_of(served(family)).generate(
        None, **embeds, **settings, seeds=[5, 9], num_outputs_per_prompt=2, rollout=False
    )
    gens = [torch.Generator().manual_seed(s) for s in (5, 9)]
    # Given embeddings, the stock pipeline takes one row per image (it repeats only what it encodes).
    rows = {k: v.repeat(2, *[1] * (v.ndim - 1)) for k, v in embeds.items()}
    stock = pipe(**rows, **settings, generator=gens, output_type="pt").images
    assert torch.equal(torch.stack([o.generated_output for o in outs]), stock)


def test_embeddings_bypass_the_prompt_cache(fresh_server):
    server = fresh_server("sd3")
    [text] = server.generate({"prompt": "a cat", "seed": 1, **call("sd3"), **ODE, **ENV})
    cache = server.engine.prompt_cache
    hits, misses = cache.hits, cache.misses
    embeds = conditioning("sd3", text["denoising_env"])
    embeds["prompt_embeds"] = embeds["prompt_embeds"] * 0.5  # other conditioning under the same label
    settings = {k: v for k, v in call("sd3").items() if k != "max_sequence_length"}
    [half] = client_of(server).generate("a cat", seed=1, **settings, **embeds, **ODE)
    assert (cache.hits, cache.misses) == (hits, misses)
    assert not torch.equal(half.generated_output, text["generated_output"])
    [again] = server.generate({"prompt": "a cat", "seed": 1, **call("sd3"), **ODE})
    assert torch.equal(again["generated_output"], text["generated_output"])  # the cache still holds text


def _sd3_embeds(tokens: int = 93, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {
        "prompt_embeds": torch.randn(1, tokens, 32, dtype=dtype),
        "pooled_prompt_embeds": torch.randn(1, 24, dtype=dtype),
        "negative_prompt_embeds": torch.randn(1, tokens, 32, dtype=dtype),
        "negative_pooled_prompt_embeds": torch.randn(1, 24, dtype=dtype),
    }


@pytest.mark.parametrize(
    ("change", "status", "field", "words"),
    [
        ({"prompt_embeds": torch.zeros(1, 93, 16)}, 400, "prompt_embeds", "expected [1, tokens, 32]"),
        ({"pooled_prompt_embeds": torch.zeros(2, 24)}, 400, "pooled_prompt_embeds", "expected [1, 24]"),
        ({"prompt_embeds": torch.zeros(93, 32)}, 400, "prompt_embeds", "expected [1, tokens, 32]"),
        ({"negative_prompt_embeds": torch.zeros(1, 80, 32)}, 400, "negative_prompt_embeds", "must equal"),
        (
            {"prompt_embeds": torch.zeros(1, 93, 32, dtype=torch.bfloat16)},
            400,
            "prompt_embeds",
            "dtype torch.bfloat16, expected torch.float32",
        ),
        ({"pooled_prompt_embeds": None}, 400, "pooled_prompt_embeds", "required with prompt_embeds"),
        ({"negative_pooled_prompt_embeds": None}, 400, "negative_pooled_prompt_embeds", "uses CFG"),
        ({"guidance_scale": 1.0}, 400, "negative_prompt_embeds", "no CFG"),
        ({"negative_prompt": "ugly"}, 400, "negative_prompt", "negative_prompt_embeds"),
        ({"max_sequence_length": 16}, 400, "max_sequence_length", "embeddings replace"),
        ({"prompt_embeds": torch.full((1, 93, 32), float("nan"))}, 400, "prompt_embeds", "NaN"),
        ({"prompt_embeds": {"__tensor__": True, "data": b"junk"}}, 400, "prompt_embeds", "safetensors"),
        ({"prompt_embeds": None}, 422, "prompt", "field required"),
    ],
)
def test_unsuitable_embeddings_get_a_4xx_naming_the_field_and_the_server_keeps_serving(
    served, change, status, field, words
):
    server = served("sd3")
    body = {"seed": 0, **{k: v for k, v in call("sd3").items() if k != "max_sequence_length"}}
    body.update(_sd3_embeds())
    body.update(change)
    body = {k: v for k, v in body.items() if v is not None}
    r = post(server, body, media=wire.MSGPACK)
    assert r.status_code == status, r.text[:500]
    assert field in r.text and words in r.text, r.text[:500]
    [ok] = server.generate({"prompt": "a cat", "seed": 0, **call("sd3"), **ODE})  # still serving
    assert ok["generated_output"].shape == (3, 32, 32)


def test_a_tensor_reference_outside_a_msgpack_body_is_refused(served):
    body = {"prompt_embeds": {"__tensor__": True, "ref": 0}, **call("sd3")}
    r = served("sd3").client.post("/rollout/generate", json=body)
    assert r.status_code == 422 and "msgpack body" in r.text


def test_sent_embeddings_of_other_lengths_share_no_pipeline_call(fresh_server):
    """Two requests whose embeddings differ in tokens are batched apart, each equal to its lone run."""
    server = fresh_server("sd3", batch_wait_ms=200, max_batch_size=4)
    client = client_of(server)
    settings = {k: v for k, v in call("sd3").items() if k != "max_sequence_length"}
    short, long = _sd3_embeds(85), _sd3_embeds(93)
    items = [
        {"prompt_embeds": e["prompt_embeds"], **{k: v for k, v in e.items() if k != "prompt_embeds"}}
        for e in (short, long)
    ]
    together = client.generate_many(items, max_concurrency=2, seed=4, rollout=False, **settings)
    for item, [out] in zip(items, together, strict=True):
        [alone] = client.generate(None, **item, seed=4, rollout=False, **settings)
        assert out.batch_size == 1
        assert torch.equal(out.generated_output, alone.generated_output)


def test_the_async_client_sends_embeddings_as_the_sync_one_does(served):
    import asyncio

    import httpx

    from diffusion_rollout.client import AsyncRolloutClient

    server = served("sd3")
    [text] = server.generate({"prompt": "a dog", "seed": 2, **call("sd3"), **ODE, **ENV})
    embeds = conditioning("sd3", text["denoising_env"])
    settings = {k: v for k, v in call("sd3").items() if k != "max_sequence_length"}

    async def go():
        transport = httpx.ASGITransport(app=server.app)
        async with AsyncRolloutClient("http://test", transport=transport) as client:
            return await client.generate_many(
                [{"prompt_embeds": embeds["prompt_embeds"]}],
                **{k: v for k, v in embeds.items() if k != "prompt_embeds"},
                seed=2,
                **settings,
                **ODE,
            )

    [[out]] = asyncio.run(go())
    assert torch.equal(out.generated_output, text["generated_output"])


def test_a_family_that_takes_text_only_refuses_embeddings_by_name(served):
    server = served("qwenimage")
    body = {
        "prompt_embeds": torch.zeros(1, 4, 32),
        "seed": 0,
        "num_inference_steps": 2,
        "height": 32,
        "width": 32,
    }
    r = post(server, body, media=wire.MSGPACK)
    assert r.status_code == 400 and "prompt_embeds: this model (qwenimage) takes prompt text only" in r.text
