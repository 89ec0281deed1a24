"""The inter-process message codec: dataclass messages round-trip exactly (as (class, field values)), and
decoding stays restricted to deepinfer's own types."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import pytest
import torch

from deepinfer.executor import codec
from deepinfer.server.core_messages import MESSAGES, StepOutputs
from deepinfer.server.engine_stats import EngineStats
from deepinfer.server.output_wire import OutputDelta, PlainDelta, SampleDelta


def _step() -> StepOutputs:
    sample = SampleDelta(0, " world", (11, 12), ({11: None},), None, None, None, " world", (11, 12))
    delta = OutputDelta("r-0", (sample,), False, 3, None, "hello", (1, 2, 3))
    stats_fields = {f: 0 for f in EngineStats.__dataclass_fields__}
    return StepOutputs((delta, delta), EngineStats(**stats_fields))


def test_step_outputs_round_trip_equal_and_shared() -> None:
    msg = _step()
    back = codec.decode(codec.encode(msg, MESSAGES), MESSAGES)
    assert back == msg and type(back.outputs[0].samples[0]) is SampleDelta
    assert back.outputs[0] is back.outputs[1]  # pickle's memo still shares repeated objects
    with pytest.raises(Exception):  # frozen stays frozen
        back.outputs[0].finished = True


def test_plain_deltas_round_trip_in_order() -> None:
    # PlainDeltas cross as tuples of their fields (StepOutputs.__reduce__), among full deltas, in order.
    first = _step().outputs[0]
    plain = [PlainDelta(f"r-{i}", "x" * i, tuple(range(i)), "length" if i == 2 else None, None, i == 2, i)
             for i in range(3)]
    msg = StepOutputs((plain[0], first, plain[1], plain[2]), _step().stats)
    data = codec.encode(msg, MESSAGES)
    back = codec.decode(data, MESSAGES)
    assert back == msg and [type(d) for d in back.outputs] == [PlainDelta, OutputDelta, PlainDelta, PlainDelta]
    assert b"PlainDelta" not in data  # no class reference: plain tuples
    assert codec.decode(codec.encode(StepOutputs((), msg.stats), MESSAGES), MESSAGES).outputs == ()


@dataclass
class _Plain:  # not slotted, with a field outside __init__ and a default factory
    a: int
    b: list = field(default_factory=list)
    c: str = field(init=False, default="x")


def test_any_dataclass_keeps_every_field() -> None:
    obj = _Plain(1, [torch.float16])
    obj.c = "set later"
    back = codec.rebuild_dataclass(*codec._Pickler.reducer_override(None, obj)[1])
    assert (back.a, back.b, back.c) == (1, [torch.float16], "set later")


@dataclass(frozen=True, slots=True)
class _Base:
    a: int


@dataclass(frozen=True, slots=True)
class _Derived(_Base):  # a slot of the base class, one of its own
    b: tuple = ()


@dataclass(frozen=True, slots=True)
class _One:
    x: object


@dataclass(frozen=True)
class _Empty:
    pass


def test_every_shape_of_dataclass_round_trips() -> None:
    """The per-class field getters and setters: inherited slots, one field, no field, no slots."""
    for obj in (_Derived(1, (2, 3)), _One(_Derived(4)), _Empty(), _Plain(5)):
        back = codec.rebuild_dataclass(*codec._Pickler.reducer_override(None, obj)[1])
        assert back == obj and type(back) is type(obj)
    with pytest.raises(pickle.UnpicklingError, match="_Derived has 2 fields, got 1"):
        codec.rebuild_dataclass(_Derived, (1,))


def test_decoding_refuses_foreign_types() -> None:
    class Evil:
        def __reduce__(self):
            import os
            return os.system, ("true",)

    with pytest.raises(pickle.UnpicklingError):
        codec.decode(pickle.dumps(Evil()), MESSAGES)
    class NotADataclass:
        def __reduce__(self):
            return codec.rebuild_dataclass, (dict, ())

    with pytest.raises(pickle.UnpicklingError):  # the rebuild helper takes dataclasses only
        codec.decode(pickle.dumps(NotADataclass()), MESSAGES)
    with pytest.raises(TypeError):
        codec.encode(("not", "a message"), MESSAGES)
