"""Which concurrent branch of a step the calling code runs in: 0 is the main stream, 1.. are side streams.

Kernels that keep device scratch across calls (the FP8 split-K tile counters, ``ops/triton/fp8_linear.py``)
keep one copy per lane, so two branches that run at the same time (``model/branches.py``) never share one.
Pure Python: the CPU path imports it too.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_LANE: contextvars.ContextVar[int] = contextvars.ContextVar("deepinfer_lane", default=0)


def current() -> int:
    return _LANE.get()


@contextlib.contextmanager
def lane(index: int) -> Iterator[None]:
    token = _LANE.set(index)
    try:
        yield
    finally:
        _LANE.reset(token)
