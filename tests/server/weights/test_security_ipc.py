"""Hostile ``/update_weights_from_tensor`` payloads, through the real app (issue 17, item 1 and 5).

The server runs in this process (TestClient), so "the server's descriptors" are this process's:
a listening socket made here stands for the server's own, and its descriptor number is what the
hostile payloads aim at. Payloads are built before the descriptors are counted (building one with
``ForkingPickler`` registers a descriptor with this process's resource sharer, as a trainer would).
The server runs with ``allow_cpu_ipc=True``, the most permissive setting: the checks must hold there.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from torch.multiprocessing import reductions

from diffusion_rollout.server.weights.safe_pickle import decode_torch_save

ROLLOUT = {"prompt": "a cat", "seed": 1, "num_inference_steps": 2, "rollout_sde_type": "sde"}


class Reduced:
    """Pickles as ``fn(*args)``: how a hand-made payload names any allowed global."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def forking(obj) -> str:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def plain(obj) -> str:
    return base64.b64encode(pickle.dumps(obj, protocol=4)).decode()


def dupfd_with_address(address) -> resource_sharer.DupFd:
    """A DupFd as NEWOBJ + BUILD would rebuild it, its ``_id`` naming ``address``."""
    ticket = resource_sharer.DupFd.__new__(resource_sharer.DupFd)
    ticket._id = (address, 1)
    return ticket


def fd_tensor_payload(name: str, shape, holder) -> list:
    """``[(name, tensor)]`` whose storage comes from ``rebuild_storage_fd(UntypedStorage, holder, n)``."""
    nbytes = 4 * int(torch.Size(shape).numel())
    storage = Reduced(reductions.rebuild_storage_fd, torch.UntypedStorage, holder, nbytes)
    typed = Reduced(reductions.rebuild_typed_storage, storage, torch.float32)
    stride = torch.empty(shape).stride()
    return [
        (name, Reduced(reductions.rebuild_tensor, torch.Tensor, typed, (0, torch.Size(shape), stride, False)))
    ]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def checksum(server) -> str:
    return server.client.post("/get_weights_checksum", json={"module_names": ["transformer"]}).json()[
        "transformer"
    ]


def first_param(server):
    return next(iter(server.engine.pipe.transformer.named_parameters()))


def test_hostile_payloads_leave_descriptors_listener_and_weights_alone(fresh_server):
    server = fresh_server("sd3", allow_cpu_ipc=True, ipc_timeout_s=2)
    name, param = first_param(server)
    victim = socket.create_server(("127.0.0.1", 0))  # stands for the server's listening socket
    trap = socket.create_server(("127.0.0.1", 0))  # must never be dialled
    trap.settimeout(0.5)
    payloads = {
        # A one-element int64 tensor where the descriptor holder goes: it has .detach and __index__.
        "tensor as descriptor holder": forking(
            fd_tensor_payload(name, param.shape, torch.tensor([victim.fileno()]))
        ),
        # DupFd called with an argument: the real class duplicates descriptor 0 and keeps it.
        "DupFd by REDUCE": plain([Reduced(resource_sharer.DupFd, 0) for _ in range(50)]),
        # DupFd rebuilt by NEWOBJ + BUILD naming a TCP address: the real one dials it, no timeout.
        "DupFd by NEWOBJ+BUILD to TCP": plain(
            fd_tensor_payload(name, param.shape, dupfd_with_address(trap.getsockname()))
        ),
        "DupFd with a non-dict state": plain(Reduced(resource_sharer.DupFd.__new__, resource_sharer.DupFd)),
    }
    before_sum = checksum(server)
    before = open_fds()
    for what, entry in payloads.items():
        r = server.client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [entry]})
        assert r.status_code == 400, (what, r.text)
        assert "refused" in r.json()["error"]["message"], (what, r.text)
    assert open_fds() == before
    os.fstat(victim.fileno())  # still open, and still the listening socket
    with socket.create_connection(victim.getsockname(), timeout=2):
        conn, _ = victim.accept()
        conn.close()
    with pytest.raises(TimeoutError):
        trap.accept()  # nobody connected
    assert checksum(server) == before_sum
    victim.close()
    trap.close()


def test_cpu_descriptors_are_refused_unless_enabled(fresh_server):
    server = fresh_server("sd3")  # allow_cpu_ipc defaults to false
    name, param = first_param(server)
    entry = forking([(name, torch.zeros_like(param))])  # a genuine same-process CPU payload
    r = server.client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [entry]})
    assert r.status_code == 400 and "allow_cpu_ipc=false" in r.json()["error"]["message"]
    assert not torch.equal(param, torch.zeros_like(param))


def test_stalled_senders_do_not_stop_rollouts(fresh_server, tmp_path):
    server = fresh_server("sd3", allow_cpu_ipc=True, ipc_timeout_s=1)
    name, param = first_param(server)
    path = str(tmp_path / "stall.sock")
    stall = socket.socket(socket.AF_UNIX)  # accepts connections into its backlog, never answers
    stall.bind(path)
    stall.listen(64)
    entry = plain(fd_tensor_payload(name, param.shape, dupfd_with_address(path)))
    body = {"serialized_named_tensors": [entry]}
    try:
        with ThreadPoolExecutor(12) as pool:
            hostile = [
                pool.submit(server.client.post, "/update_weights_from_tensor", json=body) for _ in range(10)
            ]
            time.sleep(0.5)  # the hostile requests are in, waiting on the silent sender
            rollout = pool.submit(server.generate, ROLLOUT)
            [out] = rollout.result(timeout=120)
            assert out["weight_version"] == 0
            for f in hostile:
                r = f.result(timeout=120)
                assert r.status_code == 400, r.text
                # Fetched and timed out, or timed out waiting for the decoder's own small pool.
                message = r.json()["error"]["message"]
                assert (
                    "could not fetch a shared CPU tensor within 1 s" in message
                    or "not decoded within 3 s" in message
                )
    finally:
        stall.close()


def test_meta_tensors_and_views_past_their_storage_are_400_before_any_copy(fresh_server):
    server = fresh_server("sd3", allow_cpu_ipc=True)
    name, param = first_param(server)
    before = checksum(server)
    copies = []
    from diffusion_rollout.server.weights import get_weight_manager

    get_weight_manager(server.engine).before_copy = lambda module, tensor: copies.append(tensor)

    meta = forking([(name, torch.empty(param.shape, device="meta"))])
    r = server.client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [meta]})
    assert r.status_code == 400 and "meta tensors carry no data" in r.json()["error"]["message"], r.text

    small = torch.zeros(param.numel())
    past = Reduced(
        reductions.rebuild_tensor,
        torch.Tensor,
        small._typed_storage(),
        (param.numel(), param.shape, param.contiguous().stride(), False),  # starts where the storage ends
    )
    r = server.client.post(
        "/update_weights_from_tensor", json={"serialized_named_tensors": [forking([(name, past)])]}
    )
    assert r.status_code == 400, r.text
    assert (
        f"reaches byte {2 * param.numel() * 4} of a storage of {param.numel() * 4} bytes"
        in r.json()["error"]["message"]
    )
    assert copies == [] and checksum(server) == before


def test_forged_cuda_handles_are_checked_before_anything_is_opened(fresh_server):
    server = fresh_server("sd3")
    name, param = first_param(server)
    n = param.numel()
    # torch's CUDA rebuild arguments with a view that starts where its 4n-byte storage ends.
    args = (
        torch.Tensor,
        param.shape,
        param.contiguous().stride(),
        n,
        torch.storage.TypedStorage,
        torch.float32,
    )
    args += (0, b"h" * 64, 4 * n, 0, False, b"r" * 64, 0, None, False)
    entry = plain([(name, Reduced(reductions.rebuild_cuda_tensor, *args))])
    r = server.client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [entry]})
    assert r.status_code == 400, r.text
    assert f"reaches byte {8 * n} of a storage of {4 * n} bytes" in r.json()["error"]["message"]


def test_torch_save_decoder_checks_views_and_globals():
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    buf = io.BytesIO()
    torch.save({"a": t, "b": t[1:, 2:]}, buf)
    out = decode_torch_save(buf.getvalue())
    assert torch.equal(out["a"], t) and torch.equal(out["b"], t[1:, 2:])

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    buf = io.BytesIO()
    torch.save({"a": Evil()}, buf)
    with pytest.raises(Exception, match="refused pickle global"):
        decode_torch_save(buf.getvalue())
