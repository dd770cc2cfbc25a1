"""How a LoRA adapter is loaded, besides its name, its module and its tensors: one object from the
request to the load.

Why one object: each of these options used to travel as its own keyword through the routers, the
weight manager's three load paths and the load itself, so a new option meant editing each of them.
Now the HTTP bodies inherit these fields, the routers build one :class:`LoraLoadOptions`, and only the
code that acts on an option reads it (``server/weights/lora_ops.py``). The cluster forwards it to
its replicas as it is (it pickles).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ModeName = Literal["dynamic", "merged"]


class LoraLoadFields(BaseModel):
    """The load options as fields of a request body (``/lora/load``'s JSON or query string)."""

    lora_alpha: float | None = Field(None, gt=0)
    activate: bool = False
    mode: ModeName | None = None
    strength: float | None = None

    def load_options(self) -> LoraLoadOptions:
        return LoraLoadOptions(**{name: getattr(self, name) for name in LoraLoadFields.model_fields})


class LoraLoadOptions(LoraLoadFields):
    """The options of one load: ``lora_alpha`` (alpha for an adapter that brings no config; default
    its rank), ``activate`` (make it the module's active adapter), ``mode`` and ``strength`` (the
    active adapter's, set with it). Frozen: one load's options never change on the way."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def changes_active(self) -> bool:
        """Whether the load also sets the active adapter, its mode or its strength."""
        return self.activate or self.mode is not None or self.strength is not None
