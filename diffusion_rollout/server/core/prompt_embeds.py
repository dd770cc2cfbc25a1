"""Precomputed conditioning (``prompt_embeds`` and friends) checked against the loaded model.

A trainer that encodes its prompts itself (flow_grpo encodes with 128 T5 tokens, the server's
default is 256) sends the tensors instead of the text, under the names of the diffusers pipeline's
own arguments. The server hands them to the pipeline exactly as the stock pipeline takes them, so
the ODE path stays bit-identical to the stock pipeline called with the same embeddings.

Design decisions:

- **The family says what it takes.** ``FamilyAdapter.embedding_shapes`` gives one row's shape per
  name (``None`` where any length goes: the tokens), the transformer's input widths; a family
  that returns nothing takes text only. The dtype is the one the pipeline computes in
  (``embedding_dtype``): the server never casts, since a cast would change what the request meant.
- **One prompt per request**, as with text: each tensor holds one row (``[1, tokens, dim]``,
  ``[1, dim]``); the request's ``num_outputs_per_prompt`` outputs share it.
- **Complete or refused.** The pooled half comes with ``prompt_embeds``; the negatives come exactly
  when the call uses CFG (SD3: ``guidance_scale > 1``; FLUX: the negatives themselves switch true CFG
  on, with ``true_cfg_scale > 1``), because the pipeline would otherwise encode an empty negative
  itself or silently drop the tensors sent. Text fields that only steer encoding
  (``negative_prompt``, ``max_sequence_length``) are refused beside embeddings; ``prompt`` stays a
  label that is echoed back.
- **No prompt cache.** Embeddings are used as sent; the cache is keyed by text and never sees them.
- **Bounded like prompts.** The token length (the one free dimension) is at most ``max_prompt_tokens``
  when it is set, else the most a text encoding of the model holds (``max_embedding_tokens``):
  checked before the values are read, so a long tensor costs no more than a long prompt.
- Every refusal is a ``RequestError`` (400) naming the field and the expected shape and dtype.
"""

from __future__ import annotations

import torch

from diffusion_rollout.errors import RequestError
from diffusion_rollout.server.core.params import GenerateParams
from diffusion_rollout.server.families import CallSettings, FamilyAdapter


def _shape_text(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("tokens" if d is None else str(d) for d in shape) + "]"


def _matches(actual: tuple[int, ...], expected: tuple[int | None, ...]) -> bool:
    return len(actual) == len(expected) and all(
        (e is None and a >= 1) or a == e for a, e in zip(actual, expected, strict=True)
    )


def _check_tokens(
    name: str,
    tensor: torch.Tensor,
    shape: tuple[int | None, ...],
    adapter: FamilyAdapter,
    max_prompt_tokens: int | None,
) -> None:
    # The token length is the one size a sender chooses, and the worker's time grows with it
    # (quadratically in attention): bounded as a prompt is, before anything reads the values.
    tokens = max((a for a, e in zip(tensor.shape, shape, strict=True) if e is None), default=0)
    if max_prompt_tokens is not None:
        if tokens > max_prompt_tokens:
            raise RequestError(
                f"{name} has {tokens} tokens; the limit is max_prompt_tokens={max_prompt_tokens}", field=name
            )
        return
    limit = adapter.max_embedding_tokens()
    if tokens > limit:
        raise RequestError(
            f"{name} has {tokens} tokens; the limit is {limit}, the most a text encoding of this model "
            f"({adapter.name}) holds (max_prompt_tokens sets another)",
            field=name,
        )


def check_embeddings(
    p: GenerateParams, adapter: FamilyAdapter, call: CallSettings, max_prompt_tokens: int | None = None
) -> None:
    """Refuse (``RequestError``) precomputed conditioning that does not suit this model and call, or
    that holds more tokens than ``max_prompt_tokens`` (unset: the most the model's text encoding has)."""
    embeds = p.embeds
    if not embeds:
        return
    expected = adapter.embedding_shapes()
    first = next(iter(embeds))
    if not expected:
        raise RequestError(
            f"{first}: this model ({adapter.name}) takes prompt text only; send prompt", field=first
        )
    for name in embeds:
        if name not in expected:
            raise RequestError(
                f"{name}: this model ({adapter.name}) takes {', '.join(expected)}, not {name}", field=name
            )
    for text_field in ("negative_prompt", "max_sequence_length"):
        if getattr(p, text_field) is not None:
            raise RequestError(
                f"{text_field}: steers prompt encoding, which embeddings replace; leave it out (send the "
                "negative as negative_prompt_embeds)",
                field=text_field,
            )
    dtype = adapter.embedding_dtype()
    for name, tensor in embeds.items():
        shape = expected[name]
        if not _matches(tuple(tensor.shape), shape):
            raise RequestError(
                f"{name}: shape {list(tensor.shape)}, expected {_shape_text(shape)} (one prompt's row) for "
                f"this model ({adapter.name})",
                field=name,
            )
        _check_tokens(name, tensor, shape, adapter, max_prompt_tokens)
        if tensor.dtype != dtype:
            raise RequestError(
                f"{name}: dtype {tensor.dtype}, expected {dtype} (the model's; cast before sending), shape "
                f"{_shape_text(shape)}",
                field=name,
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise RequestError(f"{name}: holds NaN or Inf", field=name)

    negatives = [n for n in expected if n.startswith("negative_")]
    positives = [n for n in expected if not n.startswith("negative_")]
    for name in positives:
        if name not in embeds:
            raise RequestError(
                f"{name}: required with {first} (expected {_shape_text(expected[name])})", field=name
            )
    cfg = adapter.uses_cfg(call)
    for name in negatives:
        if cfg and name not in embeds:
            raise RequestError(
                f"{name}: required with prompt_embeds when this call uses CFG ({adapter.name}, "
                f"guidance_scale={call.guidance_scale}); send the negative's encoding (that of '' for none), "
                f"expected {_shape_text(expected[name])}",
                field=name,
            )
        if not cfg and name in embeds:
            raise RequestError(
                f"{name}: this call uses no CFG ({adapter.name}, guidance_scale={call.guidance_scale}, "
                f"true_cfg_scale={call.true_cfg_scale}), so the negative would be ignored; leave it out",
                field=name,
            )
    if cfg and adapter.cfg_layout == "batched":  # one transformer call on [uncond; cond]: equal shapes
        for name in negatives:
            positive = name.removeprefix("negative_")
            if embeds[name].shape != embeds[positive].shape:
                raise RequestError(
                    f"{name}: shape {list(embeds[name].shape)} must equal {positive}'s "
                    f"{list(embeds[positive].shape)} ({adapter.name} batches the two branches)",
                    field=name,
                )
