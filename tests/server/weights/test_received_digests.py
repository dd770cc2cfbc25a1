"""``push_weights(verify=True)`` checked against hashes the server took while receiving.

The tensor checker answers from the per-tensor SHA-256 of the bytes an upload delivered (taken when
each part arrived) as long as nothing changed the weights since; otherwise it reads the live weights
back and hashes them, as before. Through the real app on the tiny SD3 model: which tensors the
checker hashes live is watched by wrapping the server's hash function.
"""

from __future__ import annotations

import threading

import pytest
import torch

from diffusion_rollout.client import ChecksumMismatchError, RolloutClient, push_weights, push_weights_ipc
from diffusion_rollout.client.exceptions import ServerWeightUpdateError
from diffusion_rollout.protocol.checksums import tensor_sha256, tensors_sha256
from diffusion_rollout.server.weights import full_ops, upload_ops


def perturbed(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.02 * torch.randn(p.shape, generator=g) for n, p in module.named_parameters()}


@pytest.fixture
def live_hashes(monkeypatch):
    """The tensors the checker hashed live (read back from the weights), call by call."""
    calls: list[set[str]] = []

    def watched(tensors):
        calls.append(set(tensors))
        return tensors_sha256(tensors)

    monkeypatch.setattr(full_ops, "tensors_sha256", watched)  # the checker
    monkeypatch.setattr(upload_ops, "tensors_sha256", watched)  # the parts, on arrival
    return calls


def test_parallel_hashes_equal_the_one_at_a_time_hash():
    tensors = {
        f"t{i}": torch.randn(64, 33).to(dt) for i, dt in enumerate([torch.float32, torch.bfloat16] * 4)
    }
    assert tensors_sha256(tensors) == {n: tensor_sha256(t) for n, t in tensors.items()}


def test_verified_push_is_checked_against_the_received_hashes(fresh_server, live_hashes):
    server = fresh_server("sd3")
    c = RolloutClient("http://testserver", http_client=server.client)
    tr = server.engine.pipe.transformer
    master = perturbed(tr, 1)
    push_weights(c, master, max_part_bytes=64 * 1024, weight_version="v1")  # verify=True: the default
    checks = [names for names in live_hashes if not names or not names <= set(master)]
    staged = [names for names in live_hashes if names and names <= set(master)]
    # Every part was hashed on arrival (the staged tensors), and the check read nothing back.
    assert set().union(*staged) == set(master) and checks == [set()]
    live = {n: tensor_sha256(p) for n, p in tr.named_parameters()}
    expected = {n: tensor_sha256(t.to(torch.float32)) for n, t in master.items()}
    assert live == expected  # what the record vouched for is what the weights hold

    # A wrong hash is still refused, naming the tensor, without reading the weights.
    name = next(iter(master))
    live_hashes.clear()
    with pytest.raises(ServerWeightUpdateError, match="checksum mismatch"):
        c.check_weights("transformer", {name: "0" * 64})
    assert live_hashes == [set()]


def test_any_later_change_makes_the_checker_read_the_live_weights(fresh_server, live_hashes):
    server = fresh_server("sd3", allow_cpu_ipc=True)  # a second transport: tensors by descriptor
    c = RolloutClient("http://testserver", http_client=server.client)
    tr = server.engine.pipe.transformer
    first, second = perturbed(tr, 1), perturbed(tr, 2)
    push_weights(c, first, weight_version="v1")
    manifest = {n: tensor_sha256(t.to(torch.float32)) for n, t in first.items()}
    # Another transport changes one tensor: the upload's record no longer describes the weights.
    name = sorted(first)[0]
    push_weights_ipc(c, {name: second[name]}, weight_version="v2", verify=False)
    live_hashes.clear()
    with pytest.raises(ServerWeightUpdateError, match="checksum mismatch for 1 tensor"):
        c.check_weights("transformer", manifest)
    assert live_hashes == [set(manifest)]  # every tensor read back and hashed
    # A later verified push is vouched for by its own record again.
    live_hashes.clear()
    push_weights(c, second, weight_version="v3")
    assert set() in live_hashes and all(n <= set(second) for n in live_hashes)


def test_bytes_altered_on_the_way_fail_verification(fresh_server, monkeypatch):
    """The negative control: one tensor arrives altered (as a corrupted transfer would deliver it)."""
    server = fresh_server("sd3")
    c = RolloutClient("http://testserver", http_client=server.client)
    master = perturbed(server.engine.pipe.transformer, 1)
    real = upload_ops.parse_received
    hit: list[str] = []
    lock = threading.Lock()  # parts in flight are parsed on several threads at once

    def corrupting(lease):
        parsed, rest = real(lease)
        with lock:
            first = bool(parsed) and not hit  # the first part with data (part 0 is empty)
            if first:
                hit.append(sorted(parsed)[0])
        if first:
            parsed = {**parsed, hit[0]: parsed[hit[0]] + 1}
        return parsed, rest

    monkeypatch.setattr(upload_ops, "parse_received", corrupting)
    with pytest.raises(ChecksumMismatchError, match="checksum mismatch for 1 tensor"):
        push_weights(c, master, max_part_bytes=64 * 1024, weight_version="v1")
    assert hit
