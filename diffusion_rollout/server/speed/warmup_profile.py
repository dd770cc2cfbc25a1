"""Where a compiled server's warm-up spends its wall time: ``--warmup-profile DIR``.

Design decisions:

- **Two views, both plain files in DIR.** ``warmup_call_<i>.pstats`` and its text summary
  ``warmup_call_<i>.txt`` (top 60 functions by cumulative time, top 40 by own time, with file:line)
  come from ``cProfile`` around each warm-up call; ``warmup_stacks.txt`` gets the worker thread's
  Python stack every ``warmup_profile_interval_s`` seconds, appended and closed at once, so a run cut
  off mid-call (a ready timeout, a killed job) still shows where the call was. When the warm-up ends,
  the stacks file closes with a tally of the functions seen across the samples.
- **On the worker thread.** ``cProfile`` sees only the thread it is enabled on (Python 3.11), and the
  warm-up's pipeline calls run on the engine's worker thread, not on the thread that waits for them:
  during the warm-up the worker runs each batch under :meth:`WarmupProfile.around_call`
  (``Worker.batch_hook``); nothing else runs on the worker then (requests get 503 until ready). The
  summary is written by the waiting thread after the call is timed, so the call's seconds in
  ``/server_info`` do not include writing it (they do include cProfile's own overhead, large for
  Python-heavy work such as Dynamo's tracing, small for time spent in kernels and compilers).
- **Never in the way.** A profiler that cannot start (Python 3.12's ``cProfile`` allows one per
  process) is logged and the call runs unprofiled; a failed sample or write is logged once and the
  warm-up goes on. Unset, none of this exists: no thread, no hook, no file, no report key.
- **Never through a link.** The folder may be shared (``/tmp``): files are written to a fresh file
  renamed into place, and the stacks file is appended only when it is a regular file of the server's
  own with one link (``own_files.py``); a planted link is replaced or refused, never written
  through.
"""

from __future__ import annotations

import collections
import contextlib
import cProfile
import io
import logging
import marshal
import os
import pstats
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from diffusion_rollout.errors import UntrustedFileError
from diffusion_rollout.own_files import append_private, make_private_dirs, write_private

logger = logging.getLogger(__name__)

STACKS_FILE = "warmup_stacks.txt"
TOP_CUMULATIVE = 60
TOP_OWN = 40
TALLY_TOP = 40


class WarmupProfile:
    """cProfile per warm-up call and periodic stack samples of the worker's threads, into ``folder``."""

    def __init__(
        self, folder: Path, interval_s: float, thread_ids: Callable[[], list[int]], *, cprofile: bool = True
    ) -> None:
        self.folder = Path(folder)
        self.cprofile = cprofile
        self.interval_s = interval_s
        self._thread_ids = thread_ids
        self.calls = 0
        self.samples = 0
        self.files: list[str] = []
        self._started = time.monotonic()
        self._current: str | None = None  # the call the worker runs now, for the samples
        self._pending: list[tuple[int, str, cProfile.Profile, float]] = []
        # Set while no call is inside around_call: a call's future resolves inside the worker's batch,
        # before the hook has stopped its profiler, so the waiting thread must wait for this first.
        self._between_calls = threading.Event()
        self._between_calls.set()
        self._tally: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._warned: set[str] = set()

    @property
    def stacks_path(self) -> Path:
        return self.folder / STACKS_FILE

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        """Open the stacks file (appending) and start the sampler thread."""
        make_private_dirs(self.folder)
        self._started = time.monotonic()
        self._append(
            f"# warm-up stacks: pid {os.getpid()}, started {time.strftime('%Y-%m-%dT%H:%M:%S')}, "
            f"the worker thread's Python stack every {self.interval_s:g} s (innermost call last)\n"
        )
        self._add_file(self.stacks_path)
        self._sampler = threading.Thread(target=self._sample_loop, name="warmup-profile", daemon=True)
        self._sampler.start()
        logger.info(
            "warm-up profile: %sthe worker's stack every %g s (%s) in %s",
            "cProfile of each warm-up call (warmup_call_<i>.txt, .pstats) and " if self.cprofile else "",
            self.interval_s, STACKS_FILE, self.folder,
        )  # fmt: skip

    def stop(self) -> None:
        """Stop sampling; end the stacks file with the tally of the functions the samples saw."""
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(timeout=self.interval_s + 10)
        self.write_pending()
        lines = [
            f"# warm-up ended after {time.monotonic() - self._started:.1f} s: {self.samples} sample(s); "
            f"functions on the worker's stack, by the number of samples that saw them "
            f"(top {TALLY_TOP}):"
        ]
        lines += [f"{n:6d}  {where}" for where, n in self._tally.most_common(TALLY_TOP)]
        self._append("\n".join(lines) + "\n")
        logger.info("warm-up profile: %d stack sample(s) in %s", self.samples, self.stacks_path)

    def report(self) -> dict[str, Any]:
        """What ``/server_info`` lists under the warm-up (``profile``)."""
        return {
            "dir": str(self.folder),
            "files": list(self.files),
            "stack_interval_s": self.interval_s,
            "stack_samples": self.samples,
            "cprofile": self.cprofile,
        }

    # ------------------------------------------------------------------ cProfile, one warm-up call
    @contextlib.contextmanager
    def around_call(self, jobs: list[Any]) -> Iterator[None]:
        """Run on the worker thread around one warm-up batch (``Worker.batch_hook``)."""
        self.calls += 1
        index = self.calls
        label = jobs[0].request_id if jobs else "-"
        self._current = f"warm-up call {index} ({label})"
        self._between_calls.clear()
        profiler: cProfile.Profile | None = cProfile.Profile() if self.cprofile else None
        try:
            if profiler is not None:
                profiler.enable()
        except ValueError as exc:  # Python 3.12+: another profiler is active in this process
            self._warn_once("enable", "warm-up profile: cProfile not started for call %d: %s", index, exc)
            profiler = None
        t0 = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - t0
            if profiler is not None:
                profiler.disable()
                self._pending.append((index, label, profiler, seconds))
            self._current = None
            self._between_calls.set()

    def write_pending(self) -> None:
        """Write the pstats and summary of the calls profiled since the last write (caller's thread),
        once the worker has left the call it is in."""
        if not self._between_calls.wait(timeout=60):
            self._warn_once("wait", "warm-up profile: call %d still running after 60 s", self.calls)
        while self._pending:
            index, label, profiler, seconds = self._pending.pop(0)
            try:
                self._write_call(index, label, profiler, seconds)
            except Exception as exc:  # a diagnostic must not fail the warm-up
                self._warn_once("write", "warm-up profile: could not write call %d: %s", index, exc)

    def _write_call(self, index: int, label: str, profiler: cProfile.Profile, seconds: float) -> None:
        t0 = time.perf_counter()
        raw = self.folder / f"warmup_call_{index}.pstats"
        profiler.create_stats()  # what dump_stats writes, written here without following a link
        write_private(raw, marshal.dumps(profiler.stats))
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        text.write(
            f"warm-up call {index} ({label}): {seconds:.1f} s on the worker thread, under cProfile "
            f"(pid {os.getpid()}, Python {sys.version.split()[0]}); raw: {raw.name} "
            f"(python -m pstats {raw.name})\n\n"
            f"== top {TOP_CUMULATIVE} by cumulative time ==\n"
        )
        stats.sort_stats(pstats.SortKey.CUMULATIVE).print_stats(TOP_CUMULATIVE)
        text.write(f"\n== top {TOP_OWN} by total (own) time ==\n")
        stats.sort_stats(pstats.SortKey.TIME).print_stats(TOP_OWN)
        summary = self.folder / f"warmup_call_{index}.txt"
        write_private(summary, text.getvalue())
        self._add_file(summary)
        self._add_file(raw)
        logger.info(
            "warm-up profile of call %d: %s (written in %.1f s)", index, summary, time.perf_counter() - t0
        )

    # ------------------------------------------------------------------ stack samples
    def _sample_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as exc:  # keep sampling; say it once
                self._warn_once("sample", "warm-up profile: a stack sample failed: %s", exc)

    def sample(self) -> None:
        """Append the worker threads' current Python stacks to the stacks file."""
        frames = sys._current_frames()
        names = {t.ident: t.name for t in threading.enumerate()}
        elapsed = time.monotonic() - self._started
        out = [
            f"=== {time.strftime('%Y-%m-%dT%H:%M:%S')} +{elapsed:.1f} s: "
            f"{self._current or 'no warm-up call on the worker'}"
        ]
        for ident in self._thread_ids():
            frame = frames.get(ident)
            name = names.get(ident, "?")
            if frame is None:
                out.append(f"--- thread {name}: not running")
                continue
            stack = traceback.extract_stack(frame)
            out.append(f"--- thread {name} ({len(stack)} frames, innermost last):")
            out.extend(line.rstrip("\n") for line in traceback.format_list(stack))
            self._tally.update(_functions(frame))
        del frames
        self._append("\n".join(out) + "\n")
        self.samples += 1

    # ------------------------------------------------------------------ helpers
    def _append(self, text: str) -> None:
        try:
            append_private(self.stacks_path, text)
        except (OSError, UntrustedFileError) as exc:  # a planted link or a full disk: say it once
            self._warn_once("append", "warm-up profile: not writing %s: %s", self.stacks_path, exc)

    def _add_file(self, path: Path) -> None:
        if str(path) not in self.files:
            self.files.append(str(path))

    def _warn_once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(msg, *args)


def _functions(frame: Any) -> set[str]:
    """The functions on a stack, each once, as ``file:first line (name)`` (pstats' naming)."""
    seen = set()
    while frame is not None:
        code = frame.f_code
        seen.add(f"{code.co_filename}:{code.co_firstlineno}({code.co_name})")
        frame = frame.f_back
    return seen
