"""Logging set-up with the request id in every line.

The id lives in a ContextVar so log lines written anywhere while serving a request (router, engine
worker via the job that carries it) name the request without passing loggers around.
"""

from __future__ import annotations

import contextvars
import logging

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def configure_logging(level: str = "info") -> None:
    """Install one stream handler on the package logger (idempotent)."""
    logger = logging.getLogger("diffusion_rollout")
    logger.setLevel(level.upper())
    if any(getattr(h, "_diffusion_rollout", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler._diffusion_rollout = True  # type: ignore[attr-defined]
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
