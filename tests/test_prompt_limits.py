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
