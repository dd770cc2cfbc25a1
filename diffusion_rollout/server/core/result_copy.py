"""Device-to-host copies of a batch's results, made while the next batch runs.

Design decisions:

- **One copier per pipeline call.** On CUDA it owns a side stream. Before each copy the side stream
  waits for everything queued so far on the compute stream (not only what the pipeline call queued:
  the split of a batch into outputs queues its own casts, uint8 conversions and NaN checks, and a
  copy issued before those kernels ran would read memory they have not written yet), then copies the
  tensor into page-locked (pinned) host memory with ``non_blocking=True``; ``finish`` records an
  event. The worker thread returns at once
  and starts the next batch; the copies overlap its kernels. ``wait()`` (on the results thread) blocks
  until the event has passed, after which the host tensors hold their final values.
- **Memory safety.** A source tensor is marked used by the side stream (``record_stream``), so the
  caching allocator does not hand its memory to the next batch before the copy has read it, even
  though the worker drops its references right away.
- **Compact per-output tensors.** Every copy is a new tensor of exactly the output's elements (not a
  view of the batch), so a ``SampleResult`` stays plain: pickling it (Ray) or serializing it never
  drags the whole batch's storage along.
- **CPU: the same path.** Without CUDA there is no stream and no pinning; ``copy`` makes the same
  compact clone synchronously and ``wait`` returns at once.
"""

from __future__ import annotations

import torch


class HostCopier:
    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda") and torch.cuda.is_available()
        self._stream = None
        self._event = None
        if self.cuda:
            self._device = torch.device(device)
            self._stream = torch.cuda.Stream(device=self._device)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A compact host copy of ``t`` (valid after ``wait()``); host tensors are cloned."""
        t = t.detach()
        if t.device.type == "cpu":
            return t.clone(memory_format=torch.contiguous_format)
        if not self.cuda:  # a non-CUDA accelerator: a plain synchronous copy
            return t.to("cpu", copy=True)
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        # The kernel that produced ``t`` may have been queued after the previous copy (see above).
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            out.copy_(t, non_blocking=True)
        t.record_stream(self._stream)
        return out

    def copy_tree(self, obj):
        """``copy`` applied to every tensor of a nested dict/list structure (other values kept)."""
        if isinstance(obj, torch.Tensor):
            return self.copy(obj)
        if isinstance(obj, dict):
            return {k: self.copy_tree(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.copy_tree(v) for v in obj]
        return obj

    def finish(self) -> None:
        """Mark the end of the copies (call on the worker thread, after the last ``copy``)."""
        if self.cuda:
            self._event = torch.cuda.Event()
            self._event.record(self._stream)

    def wait(self) -> None:
        """Block until every copy has landed (any thread)."""
        if self._event is not None:
            self._event.synchronize()
