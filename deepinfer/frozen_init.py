"""``fast_init``: a faster ``__init__`` for the frozen, slotted dataclasses built for every sequence of every
step (work items, samples, output deltas).

A frozen dataclass's generated ``__init__`` sets each field with ``object.__setattr__(self, name, value)``,
which looks the name up again on every call: a dozen-field work item costs ~1.5 us to build, five times an
unfrozen one, and the engine builds several of them per generated token. A slot's member descriptor sets the
field directly (what ``object.__setattr__`` ends up calling); the ``__init__`` made here calls those, one
line per field, with the dataclass's own parameter list and defaults. The class stays frozen (assignment
still raises) and equal instances come out (``tests/unit/test_frozen_init.py``).

Only plain cases are taken: every field in ``__init__``, no ``default_factory``, no keyword-only field, no
``__post_init__``; anything else raises TypeError at import time rather than silently differing.
"""

from __future__ import annotations

import dataclasses
import types


def fast_init(cls: type) -> type:
    """Replace the ``__init__`` of a frozen, slotted dataclass ``cls`` by one setting its slots directly.
    Apply it on top of ``@dataclass(frozen=True, slots=True)``."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"fast_init: {cls.__name__} is not a frozen, slotted dataclass")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"fast_init: {cls.__name__} has a __post_init__")
    namespace: dict[str, object] = {}
    args, body = [], []
    for f in dataclasses.fields(cls):
        slot = getattr(cls, f.name, None)
        if not f.init or f.kw_only or f.default_factory is not dataclasses.MISSING \
                or not isinstance(slot, types.MemberDescriptorType):
            raise TypeError(f"fast_init: {cls.__name__}.{f.name} is not a plain slot field")
        namespace[f"_set_{f.name}"] = slot.__set__
        if f.default is dataclasses.MISSING:
            args.append(f.name)
        else:
            namespace[f"_default_{f.name}"] = f.default
            args.append(f"{f.name}=_default_{f.name}")
        body.append(f"    _set_{f.name}(self, {f.name})")
    source = f"def __init__(self, {', '.join(args)}):\n" + ("\n".join(body) or "    pass") + "\n"
    exec(source, namespace)  # the way dataclasses builds its own __init__
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    cls.__init__ = init
    return cls
