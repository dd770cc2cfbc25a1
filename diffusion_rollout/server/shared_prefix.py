"""Shared ODE prefixes (issue #60, ``rollout_share_prefix``): a group's deterministic start, once.

A request whose ``G`` outputs share x_T (``initial_noise_seed``) and whose first stochastic step is
``k`` runs steps ``0..k-1`` as ODE steps on ``G`` identical rows: the same latent, the same prompt,
the same timestep. Those rows need one transformer evaluation, not ``G``.

How, and why this way:

- **One stock pipeline call.** The pipeline runs its own loop at batch ``G`` as always; only the
  transformer calls of the prefix steps are narrowed. A forward pre-hook keeps one row of each
  guidance chunk (the pipeline stacks ``[uncond, cond]`` for CFG, so a batch of ``m * G`` rows has
  ``m`` chunks) and a forward hook repeats the model output back to ``m * G`` rows. The scheduler,
  the trajectory, the step indices, the log-probs and ``denoising_env`` are recorded exactly as
  without sharing (the recorder's hooks run first and see the full batch), so every answer field
  keeps its meaning; the prefix latents are recorded once per output (identical copies).
- **What is exact.** The ODE step is elementwise and the rows are identical, so the branch point
  ``x_k`` is the latent a batch-1 run of the prefix computes, bit for bit, and the steps from ``k``
  on run at batch ``G`` as before. So each output equals, bit for bit, the output of two stock
  calls: the prefix alone at batch 1, then the group at batch ``G`` from that ``x_k`` with the
  remaining sigmas (tests/test_shared_prefix.py proves it on the CPU for SD3 and Qwen-Image, with
  and without guidance). It is **not** in general equal to the same group run without sharing: a
  transformer's last bits depend on its batch size (measured on the CPU, float32, tiny SD3 and
  Qwen-Image: batch 1 and batch 4 rows differ), so the option is opt-in, and the answer says it
  ran (``shared_prefix_steps``).
- Stochastic steps are never narrowed: they run at batch ``G`` as the trainer's replay does, so
  the PPO ratio stays exactly 1 (prefix steps are ODE steps, log-prob 0, never replayed).
- Only calls from the thread that attached the hooks are changed (pipeline lanes share modules).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from diffusion_rollout.errors import RequestError

# Families whose transformer calls have been checked to take the batch on dimension 0 of every
# per-row argument (tensors and per-row lists such as Qwen-Image's img_shapes), and tested.
SUPPORTED_FAMILIES = ("sd3", "qwenimage")


def prefix_steps(settings: Any, num_steps: int) -> int:
    """``k``: the loop steps before the first stochastic one (all ``T`` when none is stochastic)."""
    stochastic = settings.stochastic_steps(num_steps)
    return min(stochastic) if stochastic else num_steps


def validate(p: Any, family: str, *, context_parallel: bool) -> None:
    """400 naming ``rollout_share_prefix`` when the request's rows would not be identical."""
    if not p.share_prefix:
        return
    field = "rollout_share_prefix"
    if family not in SUPPORTED_FAMILIES:
        raise RequestError(
            f"rollout_share_prefix is supported for {', '.join(SUPPORTED_FAMILIES)}, not {family}",
            field=field,
        )
    if not p.rollout:
        raise RequestError("rollout_share_prefix needs rollout=true", field=field)
    if p.initial_noise_seed is None or p.initial_noise_group_ids is not None or p.initial_noise is not None:
        raise RequestError(
            "rollout_share_prefix needs one x_T for the whole group: send initial_noise_seed "
            "(without initial_noise_group_ids or initial_noise)",
            field=field,
        )
    if p.feature_cache is not None:
        raise RequestError("rollout_share_prefix cannot be combined with feature_cache", field=field)
    if context_parallel:
        raise RequestError("rollout_share_prefix is not supported on a context_parallel engine", field=field)


def _take(value: Any, rows: torch.Tensor, batch: int) -> Any:
    """``value`` narrowed to ``rows`` when it is per-row (batch on dimension 0), else as is."""
    if isinstance(value, torch.Tensor):
        if value.ndim > 0 and value.shape[0] == batch:
            return value.index_select(0, rows.to(value.device))
        return value
    if isinstance(value, (list, tuple)) and len(value) == batch:
        return type(value)(value[i] for i in rows.tolist())
    return value


def _repeat(output: Any, expand: torch.Tensor) -> Any:
    """The model output of the narrowed rows repeated back to the full batch."""
    if isinstance(output, torch.Tensor):
        return output.index_select(0, expand.to(output.device))
    if isinstance(output, tuple):
        return (_repeat(output[0], expand), *output[1:])
    if hasattr(output, "sample"):  # diffusers' Transformer2DModelOutput
        output.sample = _repeat(output.sample, expand)
        return output
    raise TypeError(f"shared prefix: unexpected transformer output {type(output).__name__}")


@contextlib.contextmanager
def narrowed_prefix(
    modules: dict[str, torch.nn.Module], group: int, steps: int, loop_index: Callable[[], int]
) -> Iterator[None]:
    """While ``loop_index() < steps``, run each transformer call on one row per ``group`` rows.

    Attach *after* the call recorder (hooks run in registration order), so it records full batches.
    """
    if group < 2 or steps < 1:
        yield
        return
    owner = threading.get_ident()
    pending: list[torch.Tensor] = []  # the expansion of the call in flight (pre-hook -> hook)

    def active() -> bool:
        return threading.get_ident() == owner and loop_index() < steps

    def pre_hook(module, args, kwargs):
        if not active():
            return None
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        batch = hidden.shape[0]
        if batch % group:
            raise RuntimeError(
                f"shared prefix: a batch of {batch} rows is not a multiple of the group {group}"
            )
        chunks = batch // group
        rows = torch.arange(chunks) * group  # the first row of each guidance chunk
        pending.append(torch.arange(chunks).repeat_interleave(group))
        return (
            tuple(_take(a, rows, batch) for a in args),
            {name: _take(v, rows, batch) for name, v in kwargs.items()},
        )

    def hook(module, args, kwargs, output):
        if threading.get_ident() != owner or not pending:
            return None
        return _repeat(output, pending.pop())

    handles = []
    try:
        for m in modules.values():
            handles.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(m.register_forward_hook(hook, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()
