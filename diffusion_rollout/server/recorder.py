"""Watches the transformer calls of one pipeline run without changing them.

Forward pre-hooks (which return nothing, so the call is untouched and the ODE path stays
bit-identical) record, per loop step, the timestep the pipeline handed to the model and which
expert ran it, and keep the keyword arguments of the first step's calls: these are the
conditioning a trainer needs to replay any step (``denoising_env``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


class TransformerCallRecorder:
    def __init__(self, step_index: Callable[[], int]) -> None:
        self._step_index = step_index
        self.first_step_calls: list[dict[str, Any]] = []
        self.timesteps: dict[int, torch.Tensor] = {}
        self.experts: dict[int, str] = {}
        self.timestep_dtype: torch.dtype | None = None

    def _hook(self, name: str):
        def pre_hook(module, args, kwargs):
            step = self._step_index()
            if step not in self.timesteps:
                t = kwargs.get("timestep")
                if t is None and len(args) > 1:
                    t = args[1]
                if isinstance(t, torch.Tensor):
                    self.timesteps[step] = t.reshape(-1)[0].detach().float()
                    self.timestep_dtype = t.dtype
                self.experts[step] = name
            if step == 0 and name == self.experts.get(0):
                self.first_step_calls.append(dict(kwargs))
            return None

        return pre_hook

    @contextlib.contextmanager
    def attach(self, modules: dict[str, torch.nn.Module]) -> Iterator[TransformerCallRecorder]:
        handles = [m.register_forward_pre_hook(self._hook(n), with_kwargs=True) for n, m in modules.items()]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def timestep_tensor(self, num_steps: int) -> torch.Tensor:
        """[T+1] float32: the model's timestep at each step, then a terminal 0."""
        vals = [self.timesteps.get(i, torch.tensor(float("nan"))) for i in range(num_steps)]
        return torch.stack([v.cpu() for v in vals] + [torch.zeros(())]).float()

    def expert_list(self, num_steps: int) -> list[str]:
        return [self.experts.get(i, "") for i in range(num_steps)]
