"""The one codec of deepinfer's inter-process messages: pickle, restricted on decoding to deepinfer's own
types, plain Python containers and torch dtypes, and checked to be one of a closed set of message types:
``messages.MESSAGES`` (engine <-> ranks) by default, ``server.core_messages.MESSAGES`` (server <-> engine
core process) where that channel passes its own set.

Dataclass instances travel as (class, field values): the slotted dataclasses' own pickling (``__getstate__``
/ ``__setstate__``) looks their fields up again for every object, which was 40% of the cost of a step's
outputs on the wire (a few dozen objects per request per step). The decoder rebuilds them the way their
``__setstate__`` would (no ``__init__``/``__post_init__`` run), from a field list cached per class."""

from __future__ import annotations

import dataclasses
import io
import operator
import pickle

import torch

from deepinfer.executor.messages import MESSAGES

_BUILTINS = {"tuple", "list", "dict", "set", "frozenset", "int", "float", "str", "bytes", "bool", "complex", "slice"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "deepinfer" or module.startswith("deepinfer."):
            return super().find_class(module, name)
        if module == "builtins" and name in _BUILTINS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "collections" and name in ("OrderedDict", "deque"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"message codec: {module}.{name} is not a message type")


_FIELDS: dict[type, tuple[tuple[str, ...], operator.attrgetter | None]] = {}


def _fields_of(cls: type) -> tuple[tuple[str, ...], operator.attrgetter | None]:
    """The class's dataclass field names and a getter of their values as a tuple (cached per class)."""
    entry = _FIELDS.get(cls)
    if entry is None:
        names = tuple(f.name for f in dataclasses.fields(cls))
        # attrgetter of one name returns the bare value, not a 1-tuple: fall back to a plain getattr then.
        entry = _FIELDS[cls] = (names, operator.attrgetter(*names) if len(names) > 1 else None)
    return entry


def rebuild_dataclass(cls: type, values: tuple):
    """A dataclass instance from its field values, as its ``__setstate__`` would make it (frozen ones too)."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise pickle.UnpicklingError(f"message codec: {cls!r} is not a dataclass")
    obj = object.__new__(cls)
    for name, value in zip(_fields_of(cls)[0], values, strict=True):
        object.__setattr__(obj, name, value)
    return obj


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        cls = type(obj)
        if dataclasses.is_dataclass(cls) and "__reduce__" not in cls.__dict__:
            names, get = _fields_of(cls)
            values = get(obj) if get is not None else tuple(getattr(obj, n) for n in names)
            return rebuild_dataclass, (cls, values)
        return NotImplemented


def encode(message, kinds: tuple[type, ...] = MESSAGES) -> bytes:
    if not isinstance(message, kinds):
        raise TypeError(f"message codec: {type(message).__name__} is not a message type")
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buf.getvalue()


def decode(data: bytes, kinds: tuple[type, ...] = MESSAGES):
    message = _Unpickler(io.BytesIO(data)).load()
    if not isinstance(message, kinds):
        raise TypeError(f"message codec: decoded a {type(message).__name__}, not a message")
    return message
