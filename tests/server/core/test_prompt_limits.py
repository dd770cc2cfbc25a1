"""Prompt limits (issue 17, item 3): refused at planning, before the worker sees the request."""

from __future__ import annotations

BODY = {"seed": 1, "num_inference_steps": 2, "rollout_sde_type": "sde"}


def test_prompts_over_the_character_limit_are_400_naming_the_limit(served):
    server = served("sd3")
    limit = server.config.max_prompt_chars
    batches = server.engine.worker.batches_run
    for field in ("prompt", "negative_prompt"):
        body = {**BODY, "prompt": "a cat", field: "x" * (limit + 1)}
        r = server.client.post("/rollout/generate", json=body)
        assert r.status_code == 400, r.text[:300]
        message = r.json()["error"]["message"]
        assert f"{field} has {limit + 1} characters" in message and f"max_prompt_chars={limit}" in message
    # A 15 MB prompt fits the body limit but is refused the same way, and nothing ran.
    r = server.client.post("/rollout/generate", json={**BODY, "prompt": "y" * 15_000_000})
    assert r.status_code == 400 and "max_prompt_chars" in r.json()["error"]["message"]
    assert server.engine.worker.batches_run == batches
    [out] = server.generate({**BODY, "prompt": "z" * limit})  # at the limit: served
    assert out["generated_output"] is not None
    assert server.client.get("/server_info").json()["limits"]["max_prompt_chars"] == limit


def test_token_limit_counts_with_the_pipelines_tokenizer(fresh_server):
    server = fresh_server("sd3", max_prompt_tokens=8)
    long = "a photo of a red cat sitting on a blue chair in the sun"
    r = server.client.post("/rollout/generate", json={**BODY, "prompt": long})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "prompt has" in message and "tokens; the limit is max_prompt_tokens=8" in message
    [out] = server.generate({**BODY, "prompt": "a red cat"})
    assert out["generated_output"] is not None


def _sd3_embeds(tokens: int) -> dict:
    import torch

    return {
        "prompt_embeds": torch.zeros(1, tokens, 32),
        "pooled_prompt_embeds": torch.zeros(1, 24),
        "negative_prompt_embeds": torch.zeros(1, tokens, 32),
        "negative_pooled_prompt_embeds": torch.zeros(1, 24),
    }


def _post_embeds(server, embeds: dict, **extra):
    from diffusion_rollout.protocol import wire

    body = {**BODY, "prompt": "a cat", "guidance_scale": 4.5, "width": 32, "height": 32, **embeds, **extra}
    return server.client.post(
        "/rollout/generate", content=wire.encode(body, wire.MSGPACK), headers={"Content-Type": wire.MSGPACK}
    )


def test_embeddings_longer_than_the_model_encodes_are_400_before_the_worker_sees_them(served):
    """A tensor that fits the 16 MiB body limit ([1, 131000, 32] in 16 bits) once held the worker for
    minutes: its tokens are bounded as a prompt's are."""
    server = served("sd3")
    limit = server.engine.adapter.max_embedding_tokens()
    assert limit == 77 + 512  # CLIP's tokens, then T5's most
    batches = server.engine.worker.batches_run
    huge = {**_sd3_embeds(93), "prompt_embeds": _sd3_embeds(120_000)["prompt_embeds"]}  # 15.4 MB
    r = _post_embeds(server, huge)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["message"] == (
        f"prompt_embeds has 120000 tokens; the limit is {limit}, the most a text encoding of this model "
        "(sd3) holds (max_prompt_tokens sets another)"
    )
    long_negative = {**_sd3_embeds(93), "negative_prompt_embeds": _sd3_embeds(limit + 1)["prompt_embeds"]}
    r = _post_embeds(server, long_negative)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        f"negative_prompt_embeds has {limit + 1} tokens; the limit is {limit}"
    )
    assert server.engine.worker.batches_run == batches  # nothing ran
    r = _post_embeds(server, _sd3_embeds(limit))  # at the limit: served
    assert r.status_code == 200, r.text[:300]


def test_max_prompt_tokens_bounds_embeddings_too(fresh_server):
    server = fresh_server("sd3", max_prompt_tokens=100)
    r = _post_embeds(server, _sd3_embeds(101))
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["message"] == "prompt_embeds has 101 tokens; the limit is max_prompt_tokens=100"
    assert _post_embeds(server, _sd3_embeds(93)).status_code == 200
