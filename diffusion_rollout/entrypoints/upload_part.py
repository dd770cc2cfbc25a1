"""One part of ``POST /update_weights``: its query parameters, and how a received body is applied.

Design decisions:

- **One implementation for both ports.** The ASGI route (``routers/weights.py``) and the direct
  receive listener (``upload_listener.py``) parse the query with :class:`UploadQuery`, refuse a
  body that did not arrive whole with :func:`refuse_body`, and apply it with :func:`apply_part`;
  only how the bytes reach the receive buffer differs. The same request therefore gets the same
  answer on either port.
- **Unknown parameters are refused** (``extra="forbid"``): a misspelt ``finale=true`` must not
  silently become the default. FastAPI validates the model itself on the route (and lists the
  parameters in the OpenAPI schema); :meth:`UploadQuery.from_pairs` raises the same
  ``RequestValidationError`` (``loc`` starting with ``"query"``) for callers outside FastAPI.
- The message of a body cut short is made here (:func:`truncated_body_error`), so both receivers
  word it alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.server.weights import Lease

UPLOAD_PATH = "/update_weights"


class UploadQuery(BaseModel):
    """The query parameters of ``POST /update_weights`` (routers/weights.py describes each)."""

    model_config = ConfigDict(extra="forbid")

    target_module: str = Field("transformer", description="the component the tensors belong to")
    weight_version: str | None = Field(None, description="the version to report once applied")
    final: bool = Field(True, description="apply everything staged under this upload now")
    upload_id: str | None = Field(None, description="groups the parts of one update")
    part: int | None = Field(None, description="0-based part number (a missing part is then detected)")
    flush_cache: bool = Field(True, description="also clear the prompt-encoding cache")
    partial: bool = Field(False, description="apply exactly the tensors sent, not a full update")

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[str, str]]) -> UploadQuery:
        """From decoded ``(name, value)`` pairs; a repeated name keeps its last value, as on the route."""
        try:
            return cls.model_validate(dict(pairs))
        except ValidationError as exc:
            raise RequestValidationError(
                [{**e, "loc": ("query", *e["loc"])} for e in exc.errors(include_url=False)]
            ) from None

    def part_fields(self) -> dict[str, Any]:
        """What identifies the part to ``refuse_part``."""
        return {
            "upload_id": self.upload_id,
            "weight_version": self.weight_version,
            "part": self.part,
            "final": self.final,
        }


def truncated_body_error(received: int, expected: int) -> WeightUpdateError:
    return WeightUpdateError(
        f"the body ended after {received} of the {expected} bytes its Content-Length announced "
        "(truncated upload); nothing was staged",
        field="body",
    )


async def refuse_body(manager, exc: WeightUpdateError, query: UploadQuery) -> NoReturn:
    """A part whose body did not arrive whole: nothing of it is staged, and its upload is dropped
    like that of any failing part. Raises the error to answer."""
    await manager.refuse_part(exc, **query.part_fields())
    raise exc  # refuse_part raises; this line only keeps the NoReturn promise


async def apply_part(manager, body: Lease, query: UploadQuery) -> dict[str, Any]:
    """Stage (and with ``final``, apply) one received part; ``body`` belongs to the manager from here."""
    return await manager.upload_part(
        body,
        target_module=query.target_module,
        weight_version=query.weight_version,
        final=query.final,
        upload_id=query.upload_id,
        part=query.part,
        flush_cache=query.flush_cache,
        partial=query.partial,
    )
