"""Multi-part HTTP uploads (``POST /update_weights``), staged until the part marked final.

Design decisions:

- A large update (a multi-GB transformer) may arrive as several safetensors bodies that share an
  upload id (the ``upload_id`` query parameter, else the ``weight_version``, else ``"default"``).
  Each part is parsed and validated when it arrives (names, shapes, dtype cast, no name twice in the
  upload) and its tensors are kept on the CPU *already cast* to the parameter dtype. The part with
  ``final=true`` hands the whole upload to the update core, which validates again against the live
  model and applies everything at once: atomic across parts and across modules.
- A part that fails validation fails its whole upload: the upload is dropped, nothing is applied,
  and the id is remembered as aborted for ``ttl_s``: every later part of it is refused (a client
  that sends part 0 with ``final=true`` after part 1 was refused must not commit half a model).
  A failed lone part (``final=true``, part 0 or unnumbered, nothing staged) aborts nothing, so a
  single-part update under the default id can simply be sent again.
- **A retry restarts at part 0.** A numbered part 0 *opens* an upload (unless it is a final part of
  a partial update, see below): under an id that was aborted (a part cut short when a connection broke, a refused part) or that still has
  parts staged (a trainer retrying after a lost answer), it forgets everything of the earlier
  attempt and starts the upload afresh, so a trainer re-sends a push under the same upload id and
  it completes. Nothing of two attempts can mix: a part of the earlier attempt still being parsed
  is refused when it would be recorded (it began on the old :class:`Upload`, see ``began``) and its
  failure leaves the new attempt alone; a late part of the earlier attempt that begins after the
  restart takes a part number the new attempt also sends, and the second of the two fails the
  upload. A final part 0 restarts only a full update, which applies only if that one part names
  every parameter; a final part 0 with ``partial=true`` of an aborted id stays refused, so a client
  cannot commit a fraction of a model by re-sending part 0 alone.
- Optional part numbers (``part=0,1,...``) make gaps detectable: the final part ``k`` requires
  parts ``0..k`` exactly. Unnumbered parts are accepted in arrival order.
- Memory is bounded by construction: a name may be staged once per upload, so an upload holds at
  most one copy of its target modules in the parameter dtype; at most ``max_uploads`` uploads are
  staged (a new one evicts the least recently touched), and an upload idle for ``ttl_s`` seconds is
  dropped (a trainer that died mid-upload leaves nothing behind for long).
- Staged tensors are usually views into the buffer their part was received in (``receive.py``);
  the upload holds those buffers' leases and gives them back when it is applied, dropped, evicted
  or expired (an upload lost another way frees its buffers with its last reference instead).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from diffusion_rollout.errors import WeightUpdateError
from diffusion_rollout.server.weights.receive import Lease

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 600.0
DEFAULT_MAX_UPLOADS = 2
MAX_ABORTED = 1024  # aborted upload ids remembered (the oldest are forgotten first)


@dataclass
class Upload:
    upload_id: str
    created_at: float
    touched_at: float
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    part_numbers: set[int] = field(default_factory=set)
    unnumbered_parts: int = 0
    num_bytes: int = 0
    in_flight: int = 0  # parts begun but not yet recorded
    numbered: bool | None = None  # set by the first part: all parts numbered, or none
    parts_begun: set[int] = field(default_factory=set)
    leases: list[Lease] = field(default_factory=list)  # receive buffers the staged tensors view
    # SHA-256 of each staged tensor's bytes, taken on arrival (``received_digests.py``)
    digests: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def num_parts(self) -> int:
        return len(self.part_numbers) + self.unnumbered_parts

    @property
    def num_tensors(self) -> int:
        return sum(len(v) for v in self.tensors.values())

    def seen_names(self, module: str) -> set[str]:
        return set(self.tensors.get(module, {}))

    def release(self) -> None:
        """Drop the staged tensors and give their receive buffers back (after apply or on drop)."""
        self.tensors = {}
        leases, self.leases = self.leases, []
        for lease in leases:
            lease.release()


class StagingArea:
    """Uploads in progress, keyed by upload id. Thread-safe; holds CPU tensors only."""

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        max_uploads: int = DEFAULT_MAX_UPLOADS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_uploads = max_uploads
        self._clock = clock
        self._uploads: dict[str, Upload] = {}
        self._aborted: dict[str, tuple[str, float]] = {}  # upload id -> (why, when): refused for ttl_s
        # upload id -> (why, when) of every recent drop, only to explain it to parts still in flight
        # (an upload dropped before any part was staged may be sent again under the same id).
        self._dropped: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ queries
    def get(self, upload_id: str) -> Upload | None:
        with self._lock:
            self._sweep_locked()
            return self._uploads.get(upload_id)

    def ids(self) -> list[str]:
        with self._lock:
            self._sweep_locked()
            return list(self._uploads)

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return sum(u.num_bytes for u in self._uploads.values())

    # ------------------------------------------------------------------ mutation
    def begin_part(self, upload_id: str, part: int | None, *, opens: bool = False) -> Upload:
        """The upload this part belongs to (created on its first part); checks the part number.

        ``opens``: the part is a numbered part 0 that cannot commit a fraction of a model (not final,
        or final for a full update), which (re)starts the upload from scratch.
        """
        with self._lock:
            self._sweep_locked()
            if opens:
                self._restart_locked(upload_id)
            aborted = self._aborted.get(upload_id)
            if aborted is not None:
                raise WeightUpdateError(
                    f"upload {upload_id!r} was aborted ({aborted[0]}); its remaining parts are refused. "
                    "Nothing of it was applied: send the whole update again under a new upload_id",
                    field="upload_id",
                )
            upload = self._uploads.get(upload_id)
            if upload is None:
                if part is not None and part > 0:
                    raise WeightUpdateError(
                        f"no staged upload {upload_id!r} (expired, dropped after a failed part, or part 0 "
                        f"never arrived); part {part} cannot start one",
                        field="upload_id",
                    )
                self._make_room_locked()
                self._dropped.pop(upload_id, None)  # a new upload under a reused id
                now = self._clock()
                upload = Upload(upload_id, created_at=now, touched_at=now)
                self._uploads[upload_id] = upload
            if part is not None and part < 0:
                raise WeightUpdateError(f"part must be >= 0, got {part}", field="part")
            numbered = part is not None
            if upload.numbered is not None and upload.numbered != numbered:
                raise WeightUpdateError(
                    f"upload {upload_id!r} mixes numbered and unnumbered parts", field="part"
                )
            if part is not None and (part in upload.part_numbers or part in upload.parts_begun):
                raise WeightUpdateError(f"part {part} of upload {upload_id!r} was already sent", field="part")
            upload.numbered = numbered
            if part is not None:
                upload.parts_begun.add(part)
            upload.in_flight += 1
            upload.touched_at = self._clock()
            return upload

    def add_part(
        self,
        upload_id: str,
        part: int | None,
        module: str,
        tensors: dict[str, torch.Tensor],
        lease: Lease | None = None,
        digests: dict[str, str] | None = None,
        *,
        began: Upload | None = None,
    ) -> Upload:
        """Record a validated part (tensors already cast to the parameter dtype).

        ``lease``: the receive buffer the tensors are views of; the upload releases it when it ends
        (on a refusal here the caller still owns it). ``began``: the upload :meth:`begin_part`
        returned for this part; a part begun on an attempt that was restarted since is refused.
        """
        with self._lock:
            upload = self._uploads.get(upload_id)
            if upload is not None and began is not None and upload is not began:
                raise WeightUpdateError(
                    f"upload {upload_id!r} was restarted at part 0 while this part of the earlier attempt "
                    "was parsed; the part is not part of the new attempt",
                    field="upload_id",
                )
            if upload is None:
                # A concurrent part that failed dropped the upload: name its failure, which is the
                # cause the trainer must fix, not this part's bad luck.
                dropped = self._dropped.get(upload_id)
                why = f"it was dropped ({dropped[0]})" if dropped is not None else "it expired or was dropped"
                raise WeightUpdateError(
                    f"upload {upload_id!r}: {why} while this part was parsed; nothing of it was applied, "
                    "start over",
                    field="upload_id",
                )
            staged = upload.tensors.setdefault(module, {})
            twice = sorted(set(staged) & set(tensors))
            if twice:
                raise WeightUpdateError(f"tensors sent twice in upload {upload_id!r}: {', '.join(twice[:5])}")
            staged.update(tensors)
            if digests:
                upload.digests.setdefault(module, {}).update(digests)
            if lease is not None:
                upload.leases.append(lease)
            upload.in_flight -= 1
            upload.num_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
            if part is None:
                upload.unnumbered_parts += 1
            else:
                upload.part_numbers.add(part)
            upload.touched_at = self._clock()
            return upload

    def take_complete(self, upload_id: str, final_part: int | None) -> Upload:
        """Remove and return the upload after its final part; a gap in part numbers is an error."""
        with self._lock:
            upload = self._uploads.pop(upload_id, None)
        if upload is None:
            raise WeightUpdateError(f"no staged upload {upload_id!r}", field="upload_id")
        if upload.in_flight:
            raise WeightUpdateError(
                f"upload {upload_id!r}: {upload.in_flight} part(s) were still arriving when the final part "
                "was complete; send the final part last. Nothing was applied",
                field="final",
            )
        if final_part is not None:
            missing = sorted(set(range(final_part + 1)) - upload.part_numbers)
            extra = sorted(p for p in upload.part_numbers if p > final_part)
            if missing or extra:
                what = []
                if missing:
                    what.append(f"missing parts {missing}")
                if extra:
                    what.append(f"parts after the final one {extra}")
                raise WeightUpdateError(
                    f"upload {upload_id!r} is incomplete ({'; '.join(what)}); nothing was applied",
                    field="part",
                )
        return upload

    def discard(
        self, upload_id: str, reason: str, *, abort: bool = False, began: Upload | None = None
    ) -> bool:
        """Drop an upload; ``abort`` (or parts already staged) also refuses its later parts for ``ttl_s``.

        ``began``: the attempt the failing part belonged to; when the id has been restarted since,
        the new attempt is left alone and nothing is dropped (an id with no upload left is still
        marked aborted, as without ``began``).
        """
        with self._lock:
            current = self._uploads.get(upload_id)
            if began is not None and current is not None and current is not began:
                return False  # the id was restarted: the failing part belonged to the earlier attempt
            upload = self._uploads.pop(upload_id, None)
            if abort or (upload is not None and upload.num_parts > 0):
                while len(self._aborted) >= MAX_ABORTED:
                    del self._aborted[next(iter(self._aborted))]
                self._aborted[upload_id] = (reason[:200], self._clock())
            if upload is not None:
                while len(self._dropped) >= MAX_ABORTED:
                    del self._dropped[next(iter(self._dropped))]
                self._dropped[upload_id] = (reason[:200], self._clock())
        if upload is not None:
            logger.warning("dropped staged upload %r (%d tensors): %s", upload_id, upload.num_tensors, reason)
            upload.release()
        return upload is not None

    def _restart_locked(self, upload_id: str) -> None:
        """Forget an earlier attempt under ``upload_id`` (aborted, or with parts staged)."""
        aborted = self._aborted.pop(upload_id, None)
        earlier = self._uploads.pop(upload_id, None)
        if earlier is None and aborted is None:
            return
        why = "restarted at part 0"
        self._dropped[upload_id] = (why, self._clock())
        logger.info(
            "upload %r %s (earlier attempt: %s)",
            upload_id,
            why,
            f"aborted: {aborted[0]}" if aborted else f"{earlier.num_parts} part(s) staged",
        )
        if earlier is not None:
            earlier.release()

    # ------------------------------------------------------------------ bounds
    def _sweep_locked(self) -> None:
        now = self._clock()
        for table in (self._aborted, self._dropped):
            for uid, (_, when) in list(table.items()):
                if now - when > self.ttl_s:
                    del table[uid]
        for uid, upload in list(self._uploads.items()):
            if now - upload.touched_at > self.ttl_s:
                del self._uploads[uid]
                logger.warning(
                    "staged upload %r expired after %.0f s idle (%d tensors dropped)",
                    uid,
                    now - upload.touched_at,
                    upload.num_tensors,
                )
                upload.release()

    def _make_room_locked(self) -> None:
        while len(self._uploads) >= self.max_uploads:
            oldest = min(self._uploads.values(), key=lambda u: u.touched_at)
            del self._uploads[oldest.upload_id]
            logger.warning(
                "staged upload %r dropped to make room (at most %d uploads are staged)",
                oldest.upload_id,
                self.max_uploads,
            )
            oldest.release()
