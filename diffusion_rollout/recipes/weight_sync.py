"""The trainer's weights on the server: push them, verify them, and ask whether they are still there.

Each recipe hands :class:`~diffusion_rollout.recipes.recovery.Recovery` two callables, ``push(version)``
and ``holds(version)``; the classes here are those pairs, one per way a recipe trains:

- :class:`ServedLora`: Flow-GRPO's one adapter (``default``, active), or with ``--full-finetune`` the
  full weights (:class:`~diffusion_rollout.recipes.full.FullFinetune`, every rank gathering);
- :class:`ServedAdapters`: DiffusionNFT's pair, ``default`` (trained) and ``old`` (the EMA, active:
  the server samples from it).

A push counts only once it is verified: the server's checksum of each adapter read back and compared
with the trainer's. Rank 0 talks to the server and every rank leaves with its verdict
(:func:`~diffusion_rollout.recipes.recovery.on_main`), so no rank trains ahead of a push that failed.
"""

from __future__ import annotations

from typing import Any

import torch

from diffusion_rollout.client import RolloutClient, lora_checksum, push_lora
from diffusion_rollout.recipes.ranks import Ranks
from diffusion_rollout.recipes.recovery import on_main, server_holds_lora


def server_adapter_checksum(client: RolloutClient, name: str = "default") -> str | None:
    """The server's checksum of adapter ``name``; None where it holds none (a restarted server)."""
    listing = client.lora_list()["modules"].get("transformer", {})
    return listing.get("adapters", {}).get(name, {}).get("checksum")


def adapter_checksums(client: RolloutClient) -> dict[str, str]:
    """The server's adapter checksums by name (none where it holds none: a restarted server)."""
    adapters = client.lora_list()["modules"].get("transformer", {}).get("adapters", {})
    return {name: a["checksum"] for name, a in adapters.items()}


class ServedLora:
    """Flow-GRPO's trained weights on the server: the ``default`` adapter, or the full weights
    (``full``: every rank takes part in the FSDP2 gathers, rank 0 sends)."""

    def __init__(
        self, client: RolloutClient, transformer: torch.nn.Module, dtype: torch.dtype, ranks: Ranks,
        full: Any = None,
    ) -> None:  # fmt: skip
        self.client, self.transformer, self.dtype, self.ranks, self.full = (
            client,
            transformer,
            dtype,
            ranks,
            full,
        )

    def push(self, version: str) -> bool | None:
        """Rank 0 pushes the trainer's weights (every rank takes part in an FSDP2 gather); every rank
        leaves with rank 0's verdict, i.e. only once the server holds ``version``."""
        full = self.full
        if full is not None:  # (a send that fails mid-gather still finishes every rank's gathers: full.py)
            return on_main(
                self.ranks, lambda: full.push(self.client, version), "push",
                others=lambda: full.push(None, version),
            )  # fmt: skip

        def lora() -> bool:
            result = push_lora(
                self.client, self.transformer, name="default", activate=True, weight_version=version
            )
            ok = lora_checksum(self.transformer, dtype=self.dtype) == server_adapter_checksum(self.client)
            return ok and result.weight_version == version

        return on_main(self.ranks, lora, "push")

    def holds(self, version: str) -> bool:
        """Rank 0: whether the server still holds the trainer's weights at ``version`` (full
        weights: never assumed; re-pushing the same weights is harmless)."""
        if self.full is not None:
            return False
        return server_holds_lora(
            self.client, version, {"default": lora_checksum(self.transformer, dtype=self.dtype)}, "default"
        )

    def final_state(self) -> dict[str, Any]:
        """What the run's record keeps of the server at the end."""
        return {"server_adapter_checksum": server_adapter_checksum(self.client)}


class ServedAdapters:
    """DiffusionNFT's two adapters on the server: ``default`` and ``old``, ``old`` active."""

    NAMES = ("default", "old")

    def __init__(self, client: RolloutClient, transformer: torch.nn.Module, dtype: torch.dtype, ranks: Ranks):
        self.client, self.transformer, self.dtype, self.ranks = client, transformer, dtype, ranks

    def checksums(self) -> dict[str, str]:
        """The trainer's checksum of each adapter, in the served dtype."""
        return {a: lora_checksum(self.transformer, adapter_name=a, dtype=self.dtype) for a in self.NAMES}

    def push(self, version: str) -> bool:
        """Rank 0 pushes both adapters; every rank leaves with its verdict once the server holds them."""

        def both() -> bool:
            push_lora(self.client, self.transformer, name="default", activate=False, weight_version=version)
            push_lora(self.client, self.transformer, name="old", activate=True, weight_version=version)
            served = adapter_checksums(self.client)
            return all(
                lora_checksum(self.transformer, adapter_name=a, dtype=self.dtype) == served.get(a)
                for a in self.NAMES
            )

        return on_main(self.ranks, both, "push")

    def holds(self, version: str) -> bool:
        """Rank 0: whether the server still holds both adapters at ``version``, ``old`` active."""
        return server_holds_lora(self.client, version, self.checksums(), "old")

    def final_state(self) -> dict[str, Any]:
        """What the run's record keeps of the server at the end: the active adapter and the checksums."""
        return {
            "active_adapter": self.client.lora_list()["modules"]["transformer"]["active"],
            "server_adapter_checksums": adapter_checksums(self.client),
        }
