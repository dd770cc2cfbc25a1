"""Tensors in request bodies: the ``WireTensor`` field type of the protocol models.

A request field that holds a tensor (precomputed conditioning: ``prompt_embeds`` and friends) takes
the wire envelope of api.md in either body form:

- **JSON**: ``{"__tensor__": true, "data": <base64 of the safetensors file>, "shape", "dtype"}``,
  decoded here, while the model is validated.
- **msgpack** (the efficient path): the envelope's ``data`` is raw bytes. ``MsgpackBodyMiddleware``
  decodes each envelope into a tensor while it unpacks the body (one copy of the bytes, no base64)
  and hands the route ``{"__tensor__": true, "ref": i}`` instead, with the tensors themselves in a
  context variable that lives for that one request (:func:`holding`). A ``ref`` outside a msgpack
  body names nothing and is refused, so a JSON client cannot reach another request's tensors.

A malformed envelope is a validation error (422) naming the field; whether a well-formed tensor
suits the model (shape, dtype) is the planner's question (400), as for every other field.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Annotated, Any

import torch
from pydantic import PlainValidator, WithJsonSchema

from diffusion_rollout.protocol import wire

_HELD: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar(
    "diffusion_rollout_request_tensors", default=None
)


@contextlib.contextmanager
def holding(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Make ``tensors`` the targets of ``{"__tensor__": true, "ref": i}`` while the request runs."""
    token = _HELD.set(tensors)
    try:
        yield
    finally:
        _HELD.reset(token)


def _tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if not isinstance(value, dict) or value.get(wire.TENSOR_KEY) is not True:
        raise ValueError('expected a tensor envelope {"__tensor__": true, "data", "shape", "dtype"}')
    if "ref" in value:
        held, ref = _HELD.get(), value["ref"]
        if held is None or not isinstance(ref, int) or not 0 <= ref < len(held):
            raise ValueError("a tensor reference is only valid inside a msgpack body")
        return held[ref]
    try:
        return wire.envelope_to_tensor(value)
    except wire.WireFormatError as exc:
        raise ValueError(str(exc)) from None


WireTensor = Annotated[
    Any,
    PlainValidator(_tensor),
    WithJsonSchema(
        {
            "type": "object",
            "description": "a tensor envelope: {__tensor__: true, data: safetensors bytes, shape, dtype}",
        }
    ),
]
