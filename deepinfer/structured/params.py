"""StructuredOutputsParams: one constraint per request, in vLLM's shape (``SamplingParams.structured_outputs``).

Exactly one of ``json`` (a JSON schema, as a dict or a JSON string), ``json_object`` (any JSON object),
``regex``, ``choice`` (the output is one of these strings), ``grammar`` (a Lark grammar, llguidance's
dialect) or ``tools`` (OpenAI function specs: the output is a DSML call of one or more of them; what the
server's ``tool_choice: "required"`` / a named function sets) is set. Types are checked here; whether the schema / regex / grammar compiles is checked by the
grammar backend when the request is added (``structured/backend.py``), both raising ValueError naming the
field.
"""

from __future__ import annotations

import json as jsonlib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

_KINDS = ("json", "json_object", "regex", "choice", "grammar", "tools")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    json: str | None = None  # the schema, serialized (a dict argument is serialized on construction)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    tools: tuple[Mapping, ...] | None = None  # function specs ({"name", "parameters"}) a tool call may use

    def __init__(self, *, json: str | Mapping | None = None, json_object: bool = False, regex: str | None = None,
                 choice: list[str] | tuple[str, ...] | None = None, grammar: str | None = None,
                 tools: list[Mapping] | tuple[Mapping, ...] | None = None) -> None:
        if isinstance(json, Mapping):
            json = jsonlib.dumps(json)
        elif json is not None and not isinstance(json, str):
            raise ValueError(f"structured_outputs.json: expected a JSON schema (an object or a JSON string), got "
                             f"{type(json).__name__}")
        if not isinstance(json_object, bool):
            raise ValueError(f"structured_outputs.json_object: must be true or false, got {json_object!r}")
        for name, value in (("regex", regex), ("grammar", grammar)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}: expected a non-empty string, got {value!r}")
        if choice is not None:
            if (not isinstance(choice, (list, tuple)) or not choice
                    or not all(isinstance(c, str) and c for c in choice)):
                raise ValueError(f"structured_outputs.choice: expected a non-empty list of non-empty strings, got "
                                 f"{choice!r}")
            choice = tuple(choice)
        if tools is not None:
            if (not isinstance(tools, (list, tuple)) or not tools
                    or not all(isinstance(f, Mapping) and isinstance(f.get("name"), str) and f["name"] for f in tools)):
                raise ValueError("structured_outputs.tools: expected a non-empty list of functions with a name")
            tools = tuple(tools)
        values = {"json": json, "json_object": json_object, "regex": regex, "choice": choice, "grammar": grammar,
                  "tools": tools}
        given = [k for k in _KINDS if values[k] not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: set exactly one of {', '.join(_KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        for key, value in values.items():
            object.__setattr__(self, key, value)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_dict(cls, d: Any) -> "StructuredOutputsParams":
        if isinstance(d, StructuredOutputsParams):
            return d
        if not isinstance(d, Mapping):
            raise ValueError(f"structured_outputs: expected an object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_KINDS))
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]}: unknown key; allowed: {', '.join(_KINDS)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) not in (None, False)}
