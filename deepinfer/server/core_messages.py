"""The messages between the server (HTTP process) and the engine core process: frozen, plain data, sent
through the one restricted-pickle codec (``executor/codec.py``) with this module's ``MESSAGES`` as the
closed set of types.

Server -> core: ``Submit``, ``Abort``, ``CallEngine``, ``Drain``, ``Shutdown``.
Core -> server: ``CoreReady`` or ``CoreFailed`` once at start; then ``StepOutputs`` (one per engine step),
``Answer`` (to a Submit or a CallEngine, by ``call_id``), ``CoreDied`` and, last, ``CoreClosed``.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deepinfer.server.commands import EngineRequest
from deepinfer.server.engine_stats import EngineStats
from deepinfer.server.output_wire import OutputDelta, PlainDelta, plain_fields


@dataclass(frozen=True, slots=True)
class Submit:
    """Admit ``requests`` all or none; answered by ``Answer(call_id)`` (an error names the field)."""

    call_id: int
    requests: tuple[EngineRequest, ...]


@dataclass(frozen=True, slots=True)
class Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CallEngine:
    """Run ``fn(engine, *args)`` between steps. ``fn`` crosses by reference, so it must be a module-level
    function of deepinfer (``server/engine_queries.py``); the result must be plain data."""

    call_id: int
    fn: Callable[..., Any]
    args: tuple = ()


@dataclass(frozen=True, slots=True)
class Drain:
    """Shutdown has begun: abort whatever still runs ``grace`` seconds from now."""

    grace: float


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Abort everything, close the engine (cache tiers written down), answer ``CoreClosed`` and exit."""


@dataclass(frozen=True, slots=True)
class RemoteError:
    """An exception raised in the core, by type name and message (exceptions themselves do not cross)."""

    kind: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> "RemoteError":
        return cls(type(exc).__name__, str(exc))

    def rebuild(self) -> Exception:
        """The same builtin exception type (a ValueError stays a ValueError: a 400 naming the field)."""
        cls = getattr(builtins, self.kind, None)
        if isinstance(cls, type) and issubclass(cls, Exception) and cls is not KeyError:
            return cls(self.message)
        return RuntimeError(f"{self.kind}: {self.message}")


@dataclass(frozen=True, slots=True)
class CoreReady:
    pid: int


@dataclass(frozen=True, slots=True)
class CoreFailed:
    """Building the engine failed (bad arguments, no memory, ...)."""

    error: RemoteError


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """One engine step's outputs, batched, and the engine's counters after it."""

    outputs: tuple[OutputDelta | PlainDelta, ...]
    stats: EngineStats

    def __reduce__(self):
        # PlainDeltas (most of a step's outputs) travel as tuples of their field values: pickle writes those in
        # C, where an object costs the codec's reducer call on encoding and a rebuild on decoding.
        outputs = tuple([plain_fields(d) if type(d) is PlainDelta else d for d in self.outputs])
        return _step_outputs, (outputs, self.stats)


def _step_outputs(outputs: tuple, stats: EngineStats) -> StepOutputs:
    """A StepOutputs from its wire form (``StepOutputs.__reduce__``)."""
    return StepOutputs(tuple([PlainDelta(*d) if type(d) is tuple else d for d in outputs]), stats)


@dataclass(frozen=True, slots=True)
class Answer:
    call_id: int
    value: Any = None
    error: RemoteError | None = None


@dataclass(frozen=True, slots=True)
class CoreDied:
    """``step()`` raised: the core is going down; every open request has failed."""

    error: RemoteError


@dataclass(frozen=True, slots=True)
class CoreClosed:
    """The engine is closed; the process exits next."""


MESSAGES = (Submit, Abort, CallEngine, Drain, Shutdown, CoreReady, CoreFailed, StepOutputs, Answer, CoreDied,
            CoreClosed)
