"""Watches the transformer calls of one pipeline run without changing them.

Forward pre-hooks (which return nothing, so the call is untouched and the ODE path stays
bit-identical) record, per loop step, the timestep the pipeline handed to the model and which
expert ran it, and keep the arguments of the first step's calls by parameter name: these are the
conditioning a trainer needs to replay any step (``denoising_env``). Pipelines that pass the
transformer's inputs positionally (Z-Image calls ``transformer(x, t, cap_feats, ...)``) are recorded
under the names of the module's ``forward`` parameters, so every family's calls look alike to the
adapters.

The loop step comes from the rollout state when there is one. Plain generation has none, so the
engine then hands :meth:`TransformerCallRecorder.on_step_end` to the pipeline as its
``callback_on_step_end`` (which diffusers calls after every step and which returns nothing to
change): that is how a two-expert model names the expert of every step even without a rollout.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch


class TransformerCallRecorder:
    def __init__(self, step_index: Callable[[], int] | None = None) -> None:
        self._steps_done = 0
        self._step_index = step_index or (lambda: self._steps_done)
        self.first_step_calls: list[dict[str, Any]] = []
        self.timesteps: dict[int, torch.Tensor] = {}
        self.experts: dict[int, str] = {}
        self.timestep_dtype: torch.dtype | None = None
        self._owner: int | None = None

    def _hook(self, name: str, module: torch.nn.Module):
        try:
            signature = inspect.signature(module.forward)
        except (TypeError, ValueError):  # a forward without an inspectable signature: keywords only
            signature = None

        def named(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
            if not args or signature is None:
                return dict(kwargs)
            try:
                return dict(signature.bind_partial(*args, **kwargs).arguments)
            except TypeError:
                return dict(kwargs)

        def pre_hook(module, args, kwargs):
            if threading.get_ident() != self._owner:
                # Another pipeline lane's call of the shared module (server/speed/lanes.py): not ours.
                return None
            step = self._step_index()
            if step not in self.timesteps:
                t = kwargs.get("timestep")
                if t is None and len(args) > 1:
                    t = args[1]
                if isinstance(t, torch.Tensor):
                    # The last entry: per-token timesteps (Wan 2.2 TI2V image-to-video) give the
                    # conditioning first frame's tokens 0; every other pipeline passes one value.
                    self.timesteps[step] = t.reshape(-1)[-1].detach().float()
                    self.timestep_dtype = t.dtype
                self.experts[step] = name
            if step == 0 and name == self.experts.get(0):
                self.first_step_calls.append(named(args, kwargs))
            return None

        return pre_hook

    def on_step_end(self, pipe: Any, step: int, timestep: Any, callback_kwargs: dict) -> dict:
        """diffusers' ``callback_on_step_end``: step ``step`` has finished (nothing is changed)."""
        self._steps_done = int(step) + 1
        return {}

    @contextlib.contextmanager
    def attach(self, modules: dict[str, torch.nn.Module]) -> Iterator[TransformerCallRecorder]:
        # Only the attaching thread's calls are recorded: with pipeline lanes, several threads call
        # the same modules at once.
        self._owner = threading.get_ident()
        handles = [
            m.register_forward_pre_hook(self._hook(n, m), with_kwargs=True) for n, m in modules.items()
        ]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def timestep_tensor(self, num_steps: int) -> torch.Tensor:
        """[T+1] float32 on the device the timesteps were recorded on: the model's timestep at each
        step, then a terminal 0. Built there, not on the host: a host copy here would wait for the
        whole batch (VAE decode included) and leave the GPU idle while the worker prepares the next."""
        device = next(iter(self.timesteps.values())).device if self.timesteps else torch.device("cpu")
        nan = torch.full((), float("nan"), device=device)
        vals = [self.timesteps.get(i, nan).to(device) for i in range(num_steps)]
        return torch.stack([*vals, torch.zeros((), device=device)]).float()

    def expert_list(self, num_steps: int) -> list[str]:
        return [self.experts.get(i, "") for i in range(num_steps)]
