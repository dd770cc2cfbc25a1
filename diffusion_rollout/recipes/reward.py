"""``--reward`` scored where ``--reward-on`` says: in the trainer's process, or on the rollout server.

The same plug-in either way (``diffusion_rollout.rewards``: a built-in name or ``module:callable``).
Scored on the server, the request names the reward and no pixels travel unless ``--log-to`` shows
them; a missing value stops the run, naming why, since a batch without its rewards cannot be trained on.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch

from diffusion_rollout.client import RolloutOutput


def recipe_reward(args: argparse.Namespace) -> tuple[str, str]:
    """``--reward`` as (NAME, SPEC): ``NAME=SPEC``, a built-in named after itself, else ``reward``."""
    from diffusion_rollout.rewards import parse_named_reward

    try:
        return parse_named_reward(args.reward)
    except ValueError:
        return "reward", args.reward


def server_rewards(args: argparse.Namespace) -> list[str]:
    """The ``serve --reward`` values for a server started here."""
    if getattr(args, "reward_on", "trainer") != "server":
        return []
    name, spec = recipe_reward(args)
    return [f"{name}={spec}"]


class RecipeReward:
    """``--reward`` scored where ``--reward-on`` says: the same callable in this process, or on
    the server (the request names it, and no pixels travel unless ``--log-to`` shows them)."""

    def __init__(self, args: argparse.Namespace, client: Any) -> None:
        from diffusion_rollout.rewards import load_reward

        self.name, spec = recipe_reward(args)
        self.on_server = args.reward_on == "server"
        self.keep_pixels = bool(getattr(args, "log_to", None))
        if not self.on_server:
            # The GPU memory the reward model holds in this process, for the placement comparison.
            before = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
            self.fn = load_reward(spec)
            self.resident_bytes = None if before is None else torch.cuda.memory_allocated() - before
            return
        if client is None:
            raise SystemExit("--reward-on server needs a rollout server (not --layout in-process)")
        served = client.server_info().get("rewards") or []
        if self.name not in served:
            raise SystemExit(
                f"--reward-on server: the server at {client.urls[0]} does not serve a reward named "
                f"{self.name!r} (it serves {list(served) or 'none'}); start it with --reward {self.name}=SPEC"
            )

    def record(self, client: Any) -> dict[str, Any] | None:
        """The server's account of the reward (calls, seconds, device, memory held), for the run record;
        for a reward scored here, the memory it holds in this process."""
        if not self.on_server:
            return {"name": self.name, "where": "trainer", "resident_bytes": self.resident_bytes}
        rewards = client.server_info(admin=client.admin_key is not None).get("rewards")
        return rewards.get(self.name) if isinstance(rewards, dict) else None

    def request_fields(self) -> dict[str, Any]:
        if not self.on_server:
            return {}
        return {"rewards": [self.name], **({} if self.keep_pixels else {"return_output": False})}

    def __call__(self, outputs: Sequence[RolloutOutput]) -> torch.Tensor:
        if not self.on_server:
            return self.fn(uint8_images(outputs), [o.prompt for o in outputs]).float()
        values = []
        for i, o in enumerate(outputs):
            value = (o.rewards or {}).get(self.name)
            if value is None:  # a missing reward cannot be trained on: stop, naming why
                why = (o.reward_errors or {}).get(self.name, "the answer has no such reward")
                raise RuntimeError(
                    f"the server's reward {self.name!r} failed for output {i} ({o.prompt!r}): {why}"
                )
            values.append(value)
        return torch.tensor(values, dtype=torch.float32)


def uint8_images(outputs: Sequence[RolloutOutput]) -> torch.Tensor:
    return torch.stack([o.generated_output for o in outputs])
