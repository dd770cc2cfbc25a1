"""Prompt size limits, checked when a request is planned, before it is queued.

Why: a prompt's cost on the worker grows with its length (tokenizing a 15 MB prompt kept a worker
busy for minutes, and a running batch cannot be interrupted), while the text encoders only ever
read their ``max_sequence_length`` tokens. ``max_prompt_chars`` is checked first and costs nothing;
``max_prompt_tokens`` (optional: unset, longer prompts are truncated as diffusers does) counts with
the pipeline's first tokenizer, on at most ``max_prompt_chars`` characters.
"""

from __future__ import annotations

from typing import Any

from diffusion_rollout.errors import RequestError

TOKENIZER_NAMES = ("tokenizer", "tokenizer_2", "tokenizer_3")


def first_tokenizer(pipe: Any) -> Any | None:
    for name in TOKENIZER_NAMES:
        tokenizer = getattr(pipe, name, None)
        if tokenizer is not None:
            return tokenizer
    return None


def _texts(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else [v for v in value if isinstance(v, str)]


def check_prompt_limits(params: Any, config: Any, pipe: Any) -> None:
    """``RequestError`` naming the field and the limit when a prompt is too long."""
    for field in ("prompt", "negative_prompt"):
        for text in _texts(getattr(params, field, None)):
            if len(text) > config.max_prompt_chars:
                raise RequestError(
                    f"{field} has {len(text)} characters; the limit is max_prompt_chars={config.max_prompt_chars}",
                    field=field,
                )
            if config.max_prompt_tokens is None:
                continue
            tokenizer = first_tokenizer(pipe)
            if tokenizer is None:
                continue
            count = len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
            if count > config.max_prompt_tokens:
                raise RequestError(
                    f"{field} has {count} tokens; the limit is max_prompt_tokens={config.max_prompt_tokens}",
                    field=field,
                )
