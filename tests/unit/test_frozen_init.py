"""``fast_init`` (deepinfer/frozen_init.py): the same instances as the dataclass's own ``__init__``, the same
parameters and defaults, still frozen; what it cannot do exactly is refused when the class is defined."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from deepinfer.engine.detokenizer import DetokenizerUpdate
from deepinfer.engine.outputs import CompletionOutput, RequestOutput
from deepinfer.frozen_init import fast_init
from deepinfer.runner.model_runner import SeqSamples
from deepinfer.sched.plan import SeqWork, TableEdit
from deepinfer.server.output_wire import OutputDelta, SampleDelta


@dataclasses.dataclass(frozen=True, slots=True)
class _Plain:
    a: int
    b: tuple = ()
    c: str | None = None


@fast_init
@dataclasses.dataclass(frozen=True, slots=True)
class _Fast:
    a: int
    b: tuple = ()
    c: str | None = None


def _values(obj) -> tuple:
    return tuple(getattr(obj, f.name) for f in dataclasses.fields(obj))


@pytest.mark.parametrize("args, kwargs", [((1,), {}), ((1, (2,)), {}), ((1,), {"c": "x"}), ((), {"a": 1, "b": (3,)}),
                                          ((1, (2,), "y"), {})])
def test_same_instances_as_the_dataclass_init(args, kwargs) -> None:
    plain, fast = _Plain(*args, **kwargs), _Fast(*args, **kwargs)
    assert _values(fast) == _values(plain)
    assert fast == _Fast(*_values(plain)) and hash(fast) == hash(_Fast(*_values(plain)))
    assert dataclasses.replace(fast, c="z") == _Fast(fast.a, fast.b, "z")
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.a = 2
    for bad in ((), (1, 2, 3, 4)):
        with pytest.raises(TypeError):
            _Fast(*bad)
    with pytest.raises(TypeError):
        _Fast(1, d=3)


@pytest.mark.parametrize("cls", [SeqWork, TableEdit, SeqSamples, SampleDelta, OutputDelta, DetokenizerUpdate,
                                 CompletionOutput, RequestOutput])
def test_the_engine_classes_keep_their_parameters(cls) -> None:
    params = list(inspect.signature(cls).parameters.values())
    fields = dataclasses.fields(cls)
    assert [p.name for p in params] == [f.name for f in fields]
    assert [p.default for p in params] == [inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
                                           for f in fields]


def test_refuses_what_it_cannot_do_exactly() -> None:
    with pytest.raises(TypeError, match="not a frozen, slotted dataclass"):
        @fast_init
        @dataclasses.dataclass(frozen=True)
        class NoSlots:
            a: int
    with pytest.raises(TypeError, match="__post_init__"):
        @fast_init
        @dataclasses.dataclass(frozen=True, slots=True)
        class PostInit:
            a: int

            def __post_init__(self) -> None:
                pass
    with pytest.raises(TypeError, match="b is not a plain slot field"):
        @fast_init
        @dataclasses.dataclass(frozen=True, slots=True)
        class Factory:
            a: int
            b: list = dataclasses.field(default_factory=list)
