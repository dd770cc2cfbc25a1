"""The last part of a batch, on the results thread: wait for its host copies and answer its requests.

The GPU worker hands a finished batch over (``server/core/batch_runner.py``) and starts the next one; here
the side-stream copies are awaited (``result_copy.py``), the NaN/Inf flags read, the conditioning of
outputs that share it made lean (``lean.py``), the batch counted in ``/metrics`` and every request's
future answered with its own outputs. A failure while finishing answers every request of the batch
with a ``GenerationError``: nothing is left waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from diffusion_rollout.errors import GenerationError
from diffusion_rollout.protocol import lean
from diffusion_rollout.server.core.metrics import Metrics

logger = logging.getLogger(__name__)


def deliver(
    jobs, plans, results, flags, copier, call, version, elapsed, metrics: Metrics, on_ok: Callable[[], None]
) -> None:
    """Answer a batch's requests once its host copies are done; when finishing fails, every request of
    the batch gets the error and ``on_ok`` does not run. ``on_ok`` runs before any request is
    answered, so a caller that awaited its answer already sees what it records (the engine's last
    good generation, which ``/health_generate`` reads)."""
    try:
        copier.wait()
        nonfinite = flags.tolist()
        row = 0
        for pl in plans:
            n = len(pl.seeds)
            # Outputs of one request share their conditioning when it is the same bits, so the lean
            # form sends it once (lean.py); the per-output form is unchanged.
            mine = results[row : row + n]
            for r, env in zip(mine, lean.share_equal([r.denoising_env for r in mine]), strict=True):
                r.denoising_env = env
            row += n
        for r, bad_row in zip(results, nonfinite, strict=True):
            r.nonfinite_output = bool(bad_row)
    except Exception as exc:
        logger.exception("finishing a batch's results failed")
        err = GenerationError(f"copying the results failed: {type(exc).__name__}: {exc}")
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(err)
        return
    bad = [r for r in results if r.nonfinite_output]
    for r in bad:
        logger.warning(
            "nonfinite_output request_id=%s seed=%d weight_version=%s: NaN/Inf in the output",
            r.request_id,
            r.seed,
            version,
        )
    metrics.batch_done(len(results), call.num_inference_steps, elapsed, nonfinite=len(bad))
    on_ok()
    row = 0
    for job, pl in zip(jobs, plans, strict=True):
        n = len(pl.seeds)
        if not job.future.done():
            job.future.set_result(results[row : row + n])
        row += n
