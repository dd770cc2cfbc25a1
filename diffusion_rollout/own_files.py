"""Folders the server loads code from, and files it writes, only when they are its own.

Design decisions:

- **Trusted as ssh trusts ``authorized_keys``.** What the server unpickles, or lets torch load (the
  compile cache: saved artifacts, precompiled blocks, and inductor's pickles, generated ``.py`` and
  ``.so``), runs as the server. Such a folder is trusted only when it and every entry under it are
  owned by the server's effective user (or root, who could run anything as it anyway) and writable by
  no one else, and no entry is a symbolic link; each folder above it must be owned by that user or
  root and writable by no one else, unless it is sticky (``/tmp``: others cannot rename or remove
  what is not theirs). Anything else names the first offending path, and the caller refuses the
  whole folder: a folder others can write could gain a file after any check of its files.
- **Checked again when read.** :func:`read_own` opens without following a link and checks the open
  descriptor (``fstat``), so a file swapped between the folder's check and the read is refused too.
- **Writes never follow a link.** A whole file goes to a fresh temporary file in its folder (created
  exclusively, so no planted name is reused) that is then renamed over the name: a rename replaces a
  link, it never writes through it. An appended file is opened with ``O_NOFOLLOW`` and must be a
  regular file of ours with a single link (a hard link to another file is refused).
- **Folders made here are 0700**, each level that did not exist.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from diffusion_rollout.errors import UntrustedFileError

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _owners() -> set[int]:
    return {os.geteuid(), 0}


def _why_entry(path: Path, st: os.stat_result) -> str | None:
    """Why one entry under a trusted folder (the folder itself included) is not the server's own."""
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return f"{path} is neither a folder nor a regular file"
    if st.st_uid not in _owners():
        return f"{path} is owned by uid {st.st_uid}, not by the server's user (uid {os.geteuid()})"
    if st.st_mode & _OTHERS_WRITE:
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _why_ancestor(path: Path, st: os.stat_result) -> str | None:
    if st.st_uid not in _owners():
        return f"{path} (above it) is owned by uid {st.st_uid}, not by the server's user or root"
    if st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
        return f"{path} (above it) is writable by group or others and not sticky"
    return None


def why_not_own_folder(folder: str | os.PathLike[str]) -> str | None:
    """Why ``folder`` (which must exist) and the folders above it cannot be trusted, or None."""
    real = Path(os.path.realpath(folder))
    try:
        why = _why_entry(real, os.lstat(real))
        if why is None and not real.is_dir():
            why = f"{real} is not a folder"
        for above in real.parents:
            why = why or _why_ancestor(above, os.stat(above))
    except OSError as exc:
        return f"{real} cannot be checked ({exc})"
    return why


def why_not_own_tree(folder: str | os.PathLike[str]) -> str | None:
    """Why ``folder``, a folder above it or any entry under it cannot be trusted, or None."""
    why = why_not_own_folder(folder)
    if why is not None:
        return why
    errors: list[OSError] = []
    for here, dirs, files in os.walk(os.path.realpath(folder), onerror=errors.append):
        for name in (*dirs, *files):  # a link to a folder is listed, never descended into
            path = Path(here) / name
            try:
                why = _why_entry(path, os.lstat(path))
            except OSError as exc:
                why = f"{path} cannot be checked ({exc})"
            if why is not None:
                return why
    return f"{errors[0].filename} cannot be listed ({errors[0]})" if errors else None


def why_not_own_or_makeable(folder: str | os.PathLike[str]) -> str | None:
    """:func:`why_not_own_folder` for a folder that exists; for one that does not, why it cannot be
    made safely (the closest folder above that exists must pass as one above a trusted folder)."""
    p = Path(os.path.abspath(folder))
    if os.path.lexists(p):
        return why_not_own_folder(p)
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    real = Path(os.path.realpath(p))
    try:
        if not real.is_dir():
            return f"{real} is not a folder"
        for level in (real, *real.parents):
            why = _why_ancestor(level, os.stat(level))
            if why is not None:
                return why
    except OSError as exc:
        return f"{real} cannot be checked ({exc})"
    return None


def make_private_dirs(folder: str | os.PathLike[str]) -> Path:
    """Make ``folder`` and the missing folders above it, each 0700 (those that exist are left)."""
    folder = Path(os.path.abspath(folder))
    for level in (*reversed(folder.parents), folder):
        try:
            os.mkdir(level, 0o700)
        except FileExistsError:
            if not os.path.isdir(level):
                raise NotADirectoryError(f"{level} exists and is not a folder") from None
    return folder


def read_own(path: str | os.PathLike[str]) -> bytes:
    """The bytes of ``path``, a regular file of the server's own that no one else can write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise UntrustedFileError(f"{path} cannot be opened without following a link ({exc})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        why = _why_entry(Path(path), st) or (None if stat.S_ISREG(st.st_mode) else f"{path} is not a file")
        if why is not None:
            raise UntrustedFileError(why)
        return f.read()


def write_private(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Replace ``path`` with ``data`` (a new 0600 file renamed over it; a link there is replaced)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def private_temp_name(folder: str | os.PathLike[str], name: str) -> str:
    """A fresh empty 0600 file in ``folder`` for a writer that takes a path (rename it into place)."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    os.close(fd)
    return tmp


def append_private(path: str | os.PathLike[str], text: str) -> None:
    """Append ``text`` to ``path`` (created 0600), never through a link or into another's file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise UntrustedFileError(f"{path} cannot be opened without following a link ({exc})") from None
    with os.fdopen(fd, "a") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            raise UntrustedFileError(f"{path} is not a regular file of the server's own with one link")
        f.write(text)
