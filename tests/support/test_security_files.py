"""What the server trusts on disk (``own_files.py``): a compile cache that is not the server's
own is refused whole and nothing in it runs; writes never follow a planted link.

"Another user" is uid 65534 (``nobody``), given with ``os.chown``: the suite runs as root in CI, and a
non-root run cannot chown, so those cases need root. A planted pickle would create a marker file
when unpickled (``open(marker, "w")``): the proof that nothing was loaded is that the marker does not
exist.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path

import pytest
import torch

from diffusion_rollout.errors import UntrustedFileError
from diffusion_rollout.own_files import append_private, read_own, write_private
from diffusion_rollout.server.speed.compile_cache import INDUCTOR_ENV, CompileCache
from diffusion_rollout.server.speed.precompiled_blocks import FOLDER, PrecompiledBlocks, structure_digest

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


class _Planted:
    """Unpickling it creates ``marker``: what a hostile pickle would do, without running a shell."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _plant_cache(folder: Path, marker: Path) -> tuple[torch.nn.Module, PrecompiledBlocks]:
    """A key folder as an earlier start would leave it, each file a pickle that creates ``marker``:
    saved artifacts, an inductor entry and a precompiled block whose structure matches a real block."""
    block = torch.nn.Linear(4, 4)
    block.compile()  # what compile_block does: the block gets a compiled call, nothing compiles yet
    blocks = PrecompiledBlocks(folder / FOLDER)
    blocks.attach([block])
    payload = pickle.dumps(_Planted(marker))
    (folder / FOLDER).mkdir(parents=True)
    (folder / FOLDER / "Linear-x-y.pt").write_bytes(payload)
    meta = {"structure": structure_digest(block), "signature": "y", "block": "Linear"}
    (folder / FOLDER / "Linear-x-y.json").write_text(json.dumps(meta))
    (folder / "artifacts.bin").write_bytes(payload)
    (folder / "inductor" / "fxgraph").mkdir(parents=True)
    (folder / "inductor" / "fxgraph" / "entry").write_bytes(payload)
    return block, blocks


def _give_away(folder: Path) -> None:
    for here, dirs, files in os.walk(folder):
        for name in (*dirs, *files):
            os.chown(Path(here) / name, NOBODY, NOBODY)
    os.chown(folder, NOBODY, NOBODY)


@pytest.fixture
def inductor_env(monkeypatch):
    """Restore inductor's cache variable after the test (activate sets it for the process)."""
    monkeypatch.delenv(INDUCTOR_ENV, raising=False)


@needs_root
@pytest.mark.parametrize("how", ["owned by nobody", "a file owned by nobody", "world-writable"])
def test_a_compile_cache_not_the_servers_own_is_refused_and_nothing_in_it_runs(
    tmp_path, inductor_env, caplog, how
):
    root = tmp_path / "shared-cache"
    marker = tmp_path / "planted-pickle-ran"
    cache = CompileCache(root, "key0", {"torch": torch.__version__})
    _, blocks = _plant_cache(cache.folder, marker)
    if how == "owned by nobody":
        _give_away(root)
    elif how == "a file owned by nobody":
        os.chown(cache.folder / FOLDER / "Linear-x-y.pt", NOBODY, NOBODY)
    else:
        os.chmod(cache.folder, 0o777)

    with caplog.at_level(logging.WARNING, logger="diffusion_rollout.server.speed.compile_cache"):
        cache.activate()

    assert not cache.trusted
    assert "not by the server's user" in cache.refused or "writable by group or others" in cache.refused
    refusals = [r.getMessage() for r in caplog.records if "refusing" in r.getMessage()]
    assert len(refusals) == 1 and str(cache.folder) in refusals[0] and cache.refused in refusals[0]
    # Inductor compiles into a private folder of its own, never into the refused one.
    private = Path(os.environ[INDUCTOR_ENV])
    assert root not in private.parents and private.stat().st_mode & 0o777 == 0o700
    assert cache.report()["refused"] == cache.refused and cache.loaded_artifacts == 0
    assert cache.last_warmup_s() is None
    cache.save(1.0)  # nothing is written into a refused folder either
    assert not (cache.folder / "key.json").exists() and not (cache.folder / "warmup.json").exists()

    # The precompiled blocks check their folder again and read each file through read_own.
    assert blocks.load() == 0 and blocks.loaded == 0 and not blocks.active
    assert blocks.why_not.startswith("refused: ")
    assert not marker.exists()


def test_the_servers_own_cache_is_used_and_made_private(tmp_path, inductor_env):
    cache = CompileCache(tmp_path / "a" / "cache", "key0", {"torch": torch.__version__})
    cache.activate()
    assert cache.trusted, cache.refused
    assert os.environ[INDUCTOR_ENV] == str(cache.folder / "inductor")
    for folder in (tmp_path / "a", cache.root, cache.folder, cache.folder / "inductor"):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    assert json.loads((cache.folder / "key.json").read_text()) == {"torch": torch.__version__}
    cache.save(2.5)
    assert cache.last_warmup_s() == 2.5


def test_a_link_planted_in_the_cache_is_never_written_through(tmp_path, inductor_env):
    victim = tmp_path / "victim"
    victim.write_text("root's file")
    cache = CompileCache(tmp_path / "cache", "key0", {"torch": torch.__version__})
    cache.folder.mkdir(parents=True, mode=0o700)
    (cache.folder / "key.json").symlink_to(victim)
    cache.activate()
    assert cache.refused == f"{cache.folder / 'key.json'} is a symbolic link"
    assert victim.read_text() == "root's file"

    # The writers themselves replace a link, never write through it...
    link = tmp_path / "warmup.json"
    link.symlink_to(victim)
    write_private(link, "{}")
    assert victim.read_text() == "root's file" and not link.is_symlink() and link.read_text() == "{}"
    assert link.stat().st_mode & 0o777 == 0o600
    # ...and an appended file (the warm-up profile's stacks) must be a plain file of ours.
    stacks = tmp_path / "warmup_stacks.txt"
    stacks.symlink_to(victim)
    with pytest.raises(UntrustedFileError, match="without following a link"):
        append_private(stacks, "sample\n")
    os.unlink(stacks)
    os.link(victim, stacks)  # a hard link to another file
    with pytest.raises(UntrustedFileError, match="one link"):
        append_private(stacks, "sample\n")
    assert victim.read_text() == "root's file"
    reader = tmp_path / "read-link"
    reader.symlink_to(victim)
    with pytest.raises(UntrustedFileError, match="without following a link"):
        read_own(reader)


def test_the_warmup_profile_never_writes_through_a_planted_link(tmp_path, caplog):
    from diffusion_rollout.server.speed.warmup_profile import STACKS_FILE, WarmupProfile

    victim = tmp_path / "victim"
    victim.write_text("root's file")
    folder = tmp_path / "profile"
    folder.mkdir()
    (folder / STACKS_FILE).symlink_to(victim)
    profile = WarmupProfile(folder, 0.05, lambda: [], cprofile=False)
    with caplog.at_level(logging.WARNING, logger="diffusion_rollout.server.speed.warmup_profile"):
        profile.start()
        profile.sample()
        profile.stop()
    assert victim.read_text() == "root's file"
    assert any("not writing" in r.getMessage() for r in caplog.records)


@needs_root
def test_a_server_on_a_refused_cache_serves_and_says_why(fresh_server, tmp_path, inductor_env):
    """The real engine and app: ``compile_cache`` owned by another user is refused at start, reported
    in ``/server_info``, and no precompiled block is attached from it."""
    root = tmp_path / "shared-cache"
    root.mkdir()
    os.chown(root, NOBODY, NOBODY)
    server = fresh_server("sd3", compile=True, warmup_shapes="none", compile_cache=str(root))
    info = server.client.get("/server_info").json()["speed"]["compile"]
    refused = info["cache"]["refused"]
    assert refused.startswith(f"{root} ") and f"owned by uid {NOBODY}" in refused, info["cache"]
    assert info["precompiled"] is None and info["cache"]["artifacts_loaded"] == 0
    assert root not in Path(os.environ[INDUCTOR_ENV]).parents
    assert list(root.iterdir()) == []  # nothing was made or written there
