"""A settings object given as a dict or as its JSON text (``--speculative-config '{...}'`` and the like)."""

from __future__ import annotations

import json
from typing import Any


def json_object(value: Any, name: str, fields: tuple[str, ...], example: str) -> dict[str, Any]:
    """``value`` (a dict, or JSON text of one) checked to hold only ``fields``; errors name ``name`` or
    ``name.<field>`` and show ``example``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not valid JSON ({e.msg}); expected e.g. '{example}'") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: must be an object with any of {', '.join(fields)}, got {value!r}")
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"{name}.{unknown[0]}: unknown field; allowed: {', '.join(fields)}")
    return value
