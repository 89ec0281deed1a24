"""Inspections run on the engine between steps (``bridge.call(fn)`` / ``call_sync(fn)``), from tests and
tools. With the engine in its own process a function crosses by reference (module and name), so it must
live at module level in deepinfer, like these; what it returns must be plain data."""

from __future__ import annotations


def idle_state(engine) -> tuple[bool, dict[str, float]]:
    """(whether any request is unfinished, each cache pool's usage)."""
    return engine.has_unfinished_requests(), dict(engine.cache.usage())


def check_cache_integrity(engine) -> None:
    """Raises AssertionError when the cache manager's books do not balance."""
    engine.cache.check_integrity()


def num_unfinished(engine) -> int:
    return engine.get_num_unfinished_requests()


def async_scheduling(engine) -> bool:
    return bool(engine.async_scheduling)
