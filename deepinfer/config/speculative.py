"""Speculative decoding settings: ``speculative_config={"method": "mtp", "num_speculative_tokens": k}``.

The shape is vLLM's (a dict, or its JSON text from ``--speculative-config``). The one method is the
checkpoint's own multi-token-prediction layer (``mtp.0``), chained ``k`` times per step. Whether the draft
length may vary per request (``DEEPINFER_ENABLE_MTP_VARLEN``) is read from the environment once, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.config.json_object import json_object

METHODS = ("mtp",)
MAX_SPECULATIVE_TOKENS = 4
_FIELDS = ("method", "num_speculative_tokens")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: drafts verified per step (the MTP layer chained k times)
    # Per-request draft length 0..k from its recent acceptance (DEEPINFER_ENABLE_MTP_VARLEN=1); off: always
    # k, so which positions a step covers never depends on the past acceptance of other steps.
    varlen: bool = False

    @classmethod
    def parse(cls, value: Any, varlen: bool = False) -> "SpeculativeConfig | None":
        """A dict, its JSON text, an instance, or None (no speculation). Errors name the field."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config", _FIELDS, '{"method": "mtp", "num_speculative_tokens": 2}')
        method = value.get("method", "mtp")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method: {method!r} is not supported; allowed: {', '.join(METHODS)}")
        k = value.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens: must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        return cls(method, k, bool(varlen))
