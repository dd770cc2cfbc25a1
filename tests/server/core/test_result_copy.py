"""Host copies of a batch's results: every copy holds the final value of its tensor.

The GPU test is the one that matters: the batch split queues casts and conversions on the compute
stream *after* the copier was made, and a copy that does not wait for them reads memory not yet
written (found on an H200 as a non-exact ODE gate in bf16: the float cast of the latents raced the
copy). The test queues a long chain of kernels, then a cast, then copies the cast.
"""

from __future__ import annotations

import pytest
import torch

from diffusion_rollout.server.core.result_copy import HostCopier


def test_cpu_copies_are_compact_clones():
    base = torch.arange(12.0).reshape(3, 4)
    copier = HostCopier("cpu")
    row = copier.copy(base[1])
    tree = copier.copy_tree({"a": [base[2]], "b": 3})
    copier.finish()
    copier.wait()
    base.zero_()  # the copies own their memory
    assert torch.equal(row, torch.tensor([4.0, 5.0, 6.0, 7.0]))
    assert row.untyped_storage().nbytes() == 4 * 4
    assert torch.equal(tree["a"][0], torch.tensor([8.0, 9.0, 10.0, 11.0])) and tree["b"] == 3


@pytest.mark.gpu
def test_a_copy_waits_for_kernels_queued_after_the_copier_was_made():
    g = torch.Generator("cuda").manual_seed(0)
    a = torch.randn(2048, 2048, device="cuda", generator=g, dtype=torch.bfloat16) / 48
    for trial in range(5):
        copier = HostCopier("cuda")
        x = a
        for _ in range(40):  # tens of milliseconds of queued work before the value exists
            x = torch.tanh(x @ a)
        y = (x * (trial + 1)).float()  # the cast the batch split does, queued after the copier
        host = copier.copy(y)
        flags = copier.copy(torch.stack([torch.isfinite(y).all(), torch.isfinite(x).all()]))
        copier.finish()
        copier.wait()
        torch.cuda.synchronize()
        assert torch.equal(host, y.cpu()), f"trial {trial}: the copy read the tensor before it was written"
        assert flags.tolist() == [True, True]
