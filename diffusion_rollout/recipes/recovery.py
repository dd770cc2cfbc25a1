"""A training run that survives its servers: wait, re-push, verify, redo.

A server that is restarted (by a supervisor, after a crash or a kill) comes back with its base
weights; a connection that drops mid-rollout or mid-push leaves the trainer not knowing what the
server did; an answer that comes too late is lost. :class:`Recovery` turns each of these into the
same few steps instead of an exit:

1. **Wait** for readiness (``/health_generate``) with exponential backoff, up to
   ``--recover-timeout`` seconds in all; past that the run stops with an error naming the cause.
2. **Ask before pushing.** ``holds(version)`` reads the server's weight version and adapter
   checksums: a push whose answer was lost but which landed is verified, not repeated.
3. **Re-push** the trainer's current weights (``sync(version)``: LoRA or full weights, checksum
   verified), repeating steps 1-3 while the server cannot take them.
4. **Redo** the iteration's rollouts (same seeds, same jobs).

Design decisions:

- **The trainer's weights are the truth.** The server holds a copy; when the copy's version or
  checksum is not the trainer's, the copy is replaced. Nothing about the server's state is assumed
  after a failure: it is read back.
- **A batch is trained only when vouched for.** Rollouts whose ``weight_version`` is not the one
  the trainer pushed are rejected and counted (``off_policy_rejected``, in groups), never trained
  on: the recipe's synchronous loop trains on-policy without TIS, so a batch from any other version
  is poison. (The asynchronous loop's stale batches are another matter: they carry their staleness
  and are trained with TIS, within ``--async-depth``.)
- **Rank 0 decides, every rank redoes.** Each rank reports its rollouts' outcome; any failure on
  any rank makes every rank take part in one recovery (rank 0 waits, checks and pushes; a full
  weight push gathers on every rank) and every rank redoes its rollouts, so the ranks never train
  on batches of different versions.
- **Every recovery is recorded**: the iteration, the cause (``rollout_connection_lost``,
  ``rollout_timeout``, ``rollout_server_unavailable``, ``off_policy_batch``, ``push_connection_lost``,
  ``push_timeout``, ``push_server_unavailable``, ``push_not_verified``, ``push_replicas_diverged``: a
  replica of a pool died during the push and the pool asks for the weights again), what happened (re-pushed or
  found already held), the attempts, the seconds from the failed call to the server holding the
  trainer's version again and the wall-clock time it ended (``at``); the run record keeps them as
  ``recoveries``, and a checkpoint keeps them for the run that resumes from it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from diffusion_rollout.client import (
    ChecksumMismatchError,
    RolloutConnectionError,
    RolloutHTTPError,
    RolloutTimeoutError,
)
from diffusion_rollout.recipes.ranks import Ranks

logger = logging.getLogger(__name__)

# Answers that mean the server is (re)starting, paused or overloaded rather than refusing the request.
_TRANSIENT_STATUSES = (502, 503, 504)


def failure_cause(exc: BaseException, phase: str) -> str | None:
    """``phase_kind`` for a failure the run recovers from (a lost connection, a timeout, a server
    that is starting), else None: the error is real and is raised."""
    if isinstance(exc, ServerFailure):
        return exc.cause
    if isinstance(exc, RolloutTimeoutError):
        return f"{phase}_timeout"
    if isinstance(exc, RolloutConnectionError):
        return f"{phase}_connection_lost"
    if isinstance(exc, RolloutHTTPError) and exc.status_code in _TRANSIENT_STATUSES:
        return f"{phase}_server_unavailable"
    if isinstance(exc, RolloutHTTPError) and exc.error_type == "replicas_diverged":
        # A replica died during a change and the pool asks for the weights again.
        return f"{phase}_replicas_diverged"
    if isinstance(exc, ChecksumMismatchError):
        return f"{phase}_not_verified"
    return None


class ServerFailure(RuntimeError):
    """A recoverable failure that rank 0 met talking to the server, raised on every rank."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause
        self.detail = detail


def on_main(
    ranks: Ranks, fn: Callable[[], Any], phase: str, *, others: Callable[[], Any] | None = None
) -> Any:
    """``fn()`` on rank 0 (``others()`` on the other ranks, for a collective), rank 0's result on
    every rank; a recoverable failure of rank 0's is raised on every rank as :class:`ServerFailure`
    (so no rank waits in a collective that rank 0 left)."""
    out = None
    if not ranks.is_main and others is not None:
        others()
    if ranks.is_main:
        try:
            out = ("ok", fn())
        except Exception as exc:
            cause = failure_cause(exc, phase)
            if cause is None:
                raise
            out = ("failed", (cause, f"{type(exc).__name__}: {exc}"))
    status, value = ranks.broadcast(out)
    if status == "failed":
        raise ServerFailure(*value)
    return value


class RecoveryError(RuntimeError):
    """The server did not hold the trainer's weights again within the recovery's bounds."""


class Recovery:
    """Bounded recovery from a lost server for one run (see the module docstring).

    ``client`` is this rank's client (rank 0's is the one that waits, checks and pushes).
    ``timeout_s`` bounds one recovery in all (waiting plus re-pushing); ``attempts`` bounds the
    re-pushes within it and the redone rollouts of one iteration.
    """

    def __init__(
        self, client, ranks: Ranks | None = None, *, timeout_s: float = 600.0, attempts: int = 5,
        backoff_s: float = 0.5, max_backoff_s: float = 10.0,
    ) -> None:  # fmt: skip
        self.client = client
        self.ranks = ranks or Ranks()
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.events: list[dict[str, Any]] = []
        self.off_policy_rejected = 0  # groups (requests) from an unexpected weight version, never trained on

    # ---------------------------------------------------------------------------------- the phases
    def rollouts(
        self, iteration: int, version: Any, make: Callable[[], Any], sync: Callable[[Any], bool | None],
        holds: Callable[[Any], bool], *, expect_version: bool = True, reset: Callable[[], None] | None = None,
    ) -> Any:  # fmt: skip
        """This rank's groups from ``make()``, all made under ``version``; any rank's lost connection
        or off-policy batch makes every rank recover and redo (``reset()`` first, on every rank, when
        the source of the batches must be renewed). ``expect_version`` false: ``make()`` returns a
        batch of its own kind whose versions are not checked here (the asynchronous stream's, whose
        staleness rule decides)."""
        for _ in range(self.attempts + 1):
            t0 = time.monotonic()
            groups, cause, detail, rejected = None, None, "", 0
            try:
                groups = make()
            except Exception as exc:
                cause = failure_cause(exc, "rollout")
                if cause is None:
                    raise
                detail = exc.detail if isinstance(exc, ServerFailure) else f"{type(exc).__name__}: {exc}"
            else:
                versions = {o.weight_version for g in groups for o in g} if expect_version else {version}
                if versions != {version}:
                    cause, rejected = "off_policy_batch", len(groups)
                    detail = f"rollouts came from {sorted(map(str, versions))}, expected {version!r}"
            reports = self.ranks.gather((cause, detail, rejected))
            failed = [(c, d) for c, d, _ in reports if c is not None]
            if not failed:
                return groups
            self.off_policy_rejected += sum(r for _, _, r in reports)
            self.recover(iteration, failed[0][0], failed[0][1], version, sync, holds, since=t0)
            if reset is not None:
                reset()
        raise RecoveryError(
            f"iteration {iteration}: rollouts failed {self.attempts + 1} times in a row ({failed[0][1]})"
        )

    def push(
        self, iteration: int, version: Any, sync: Callable[[Any], bool | None], holds: Callable[[Any], bool]
    ) -> bool | None:
        """``sync(version)`` (a collective: every rank calls it); a lost connection, a timeout or an
        unverified push recovers until the server holds ``version``. Returns ``sync``'s verdict
        (True once recovered; None where nothing is pushed)."""
        t0 = time.monotonic()
        ok, cause, detail = self._guarded(sync, version, "push")
        if ok is not False:
            return ok
        self.recover(iteration, cause, detail, version, sync, holds, since=t0)
        return True

    def final(
        self, iteration: int, version: Any, sync: Callable[[Any], bool | None], holds: Callable[[Any], bool],
        read: Callable[[], dict[str, Any]],
    ) -> dict[str, Any]:  # fmt: skip
        """The run's last word with the server (every rank calls it): ``read()`` on rank 0 once the
        server holds ``version``, its result on every rank. A server lost after the last push (a
        restart: base weights) is waited for and re-pushed as at any other point. When it does not
        come back within the recovery's bounds, or the read keeps failing, the answer is
        ``{"final_check_error": why}`` instead: the training itself is complete and checkpointed, so
        the run ends with its record (exit 0) rather than an exception."""
        t0 = time.monotonic()

        def checked() -> dict[str, Any]:
            if not holds(version):
                raise ServerFailure(
                    "final_weights_lost", f"the server no longer holds weight version {version!r}"
                )
            try:
                return read()
            except Exception as exc:  # (a restart between the check and the read: check again)
                if failure_cause(exc, "final") is not None:
                    raise
                raise ServerFailure("final_read_failed", f"{type(exc).__name__}: {exc}") from exc

        why = ""
        for _ in range(self.attempts + 1):
            try:
                return on_main(self.ranks, checked, "final")
            except ServerFailure as exc:
                why = f"{exc.cause}: {exc.detail}"
                try:
                    self.recover(iteration, exc.cause, exc.detail, version, sync, holds, since=t0)
                except RecoveryError as gone:
                    why = str(gone)
                    break
        if self.ranks.is_main:
            logger.error("the run's final check could not be made: %s", why)
        return {"final_check_error": why}

    # ---------------------------------------------------------------------------------- recovery
    def recover(
        self, iteration: int, cause: str, detail: str, version: Any, sync: Callable[[Any], bool | None],
        holds: Callable[[Any], bool], *, since: float | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Wait for the server, then make it hold ``version`` (checked first, pushed if not); every
        rank calls this together. Records and returns the event."""
        t0 = time.monotonic() if since is None else since
        deadline = time.monotonic() + self.timeout_s
        log = logger.warning if self.ranks.is_main else logger.debug  # rank 0 speaks for the run
        log("iteration %d: %s (%s); recovering weight version %r", iteration, cause, detail, version)
        action, last = None, detail
        for attempt in range(1, self.attempts + 1):
            # Diverged replicas may each answer differently: push again rather than ask.
            check = None if cause.endswith("replicas_diverged") else holds
            state = self._main_state(version, check, deadline) if self.ranks.is_main else None
            state = self.ranks.broadcast(state)
            if state == "held":
                action = "already held"
            elif state == "lost":
                ok, _, why = self._guarded(sync, version, "push")
                if ok is not False:
                    action = "re-pushed"
                else:
                    last = why
            elif state == "gone":
                break
            if action is not None:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
        if action is None:
            url = getattr(self.client, "url", "the server")
            hint = (
                "the server answers but does not take the trainer's weights"
                if state == "lost"
                else "is `serve` supervised (restarted when it exits)?"
            )
            raise RecoveryError(
                f"iteration {iteration}: {cause}: {url} did not hold weight version {version!r} again "
                f"within {self.timeout_s:g} s and {attempt} attempts (last: {last}); {hint}"
            )
        event = {
            "iteration": iteration, "cause": cause, "detail": detail[:300], "action": action,
            "attempts": attempt, "seconds": round(time.monotonic() - t0, 3), "at": round(time.time(), 3),
        }  # fmt: skip
        self.events.append(event)
        log(
            "iteration %d: recovered from %s in %.1f s (%s, %d attempt(s))",
            iteration, cause, event["seconds"], action, attempt,
        )  # fmt: skip
        return event

    def _main_state(self, version: Any, holds: Callable[[Any], bool] | None, deadline: float) -> str | None:
        """Rank 0: ``held`` or ``lost`` once the server is ready (``holds`` None: ``lost``); None
        while it is not (yet); ``gone`` past the deadline."""
        left = deadline - time.monotonic()
        if left <= 0:
            return "gone"
        try:
            self.client.wait_until_ready(timeout_s=left)
            return "held" if holds is not None and holds(version) else "lost"
        except Exception as exc:
            if failure_cause(exc, "check") is None:
                raise
            return None

    def _guarded(self, sync: Callable[[Any], bool | None], version: Any, phase: str):
        """``sync(version)`` with a recoverable failure on rank 0 turned into ``(False, cause, detail)``
        on every rank (so no rank waits forever in a collective rank 0 left)."""
        ok, cause, detail = None, None, ""
        try:
            ok = sync(version)
        except Exception as exc:
            cause = failure_cause(exc, phase)
            if cause is None:
                raise
            ok = False
            detail = exc.detail if isinstance(exc, ServerFailure) else f"{type(exc).__name__}: {exc}"
        else:
            if ok is False:
                cause, detail = (
                    f"{phase}_not_verified",
                    "the server's checksum or version is not the trainer's",
                )
        return ok, cause, detail

    # ---------------------------------------------------------------------------------- the record
    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps, so that a restarted trainer's record still counts them."""
        return {"recoveries": list(self.events), "off_policy_rejected": self.off_policy_rejected}

    def restore(self, state: dict[str, Any]) -> None:
        self.events = list(state.get("recoveries", []))
        self.off_policy_rejected = int(state.get("off_policy_rejected", 0))

    def record(self) -> dict[str, Any]:
        """``recoveries`` (every event), their count and seconds per cause, and ``off_policy_rejected``."""
        by_cause: dict[str, dict[str, float]] = {}
        for e in self.events:
            c = by_cause.setdefault(e["cause"], {"count": 0, "seconds": 0.0})
            c["count"] += 1
            c["seconds"] = round(c["seconds"] + e["seconds"], 3)
        return {"recoveries": list(self.events), "recoveries_by_cause": by_cause,
                "off_policy_rejected": self.off_policy_rejected}  # fmt: skip


def server_holds_lora(
    client, version: Any, checksums: dict[str, str], active: str | None, target: str = "transformer"
) -> bool:
    """Whether the server is at ``version`` with adapters of exactly ``checksums`` and ``active`` active."""
    if client.model_info().get("weight_version") != version:
        return False
    listing = client.lora_list()["modules"].get(target, {})
    adapters = listing.get("adapters", {})
    held = all(adapters.get(name, {}).get("checksum") == c for name, c in checksums.items())
    return held and (active is None or listing.get("active") == active)
