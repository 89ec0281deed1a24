"""``deepinfer serve``'s own log lines (the engine mode at start-up, the periodic stats, EPLB moves, cache
tiers) on stderr, at the server's ``--log-level``, beside uvicorn's: the ``deepinfer`` loggers have no handler
otherwise (a library leaves that to its application), so their INFO lines would be lost."""

from __future__ import annotations

import logging

FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def log_to_stderr(level: str) -> None:
    """Give the ``deepinfer`` logger a stderr handler (once per process) and ``level`` ("info", "debug", ...)."""
    logger = logging.getLogger("deepinfer")
    if not any(getattr(h, "_deepinfer", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT, "%m-%d %H:%M:%S"))
        handler._deepinfer = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(level.upper())
