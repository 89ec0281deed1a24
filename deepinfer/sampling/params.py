"""Per-request sampling parameters (vLLM-shaped), validated at the edge.

``SamplingParams`` is a frozen value object: the engine, the scheduler and the codec can share and hash
it freely. Every check raises ``ValueError`` naming the field and the allowed range, so a bad request is
rejected at the API boundary and never reaches (or kills) the engine loop.

Normalisations a caller can observe:
- ``top_k``: ``-1`` (vLLM's spelling) and ``0`` both mean "disabled" and are stored as ``0``.
- ``stop``: ``None`` / a string / a list become a tuple of non-empty strings (duplicates dropped, order kept).
- ``stop_token_ids``: ``None`` / a list become a tuple of ints.
- Floats given as ints (``temperature=1``) are stored as ``float``; numpy integers are stored as ``int``.
- ``seed=`` is an alias of ``seq_seed=``; the value is stored in ``seq_seed`` (``.seed`` reads it back).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from deepinfer.structured.params import StructuredOutputsParams

# Below this temperature a request is sampled greedily (vLLM's _SAMPLING_EPS): dividing float32 logits by
# a temperature this small overflows to inf and the softmax becomes NaN, while the distribution is already
# one-hot for any practical purpose.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20
SEED_LIMIT = 2**63  # seeds must fit a non-negative int64 (the sampler carries them in an int64 tensor)


def _is_int(value: object) -> bool:
    # bool is an int subclass; `n=True` is almost certainly a mistake, so it is rejected.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value: object, lo: int, hi: int | None = None, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    none = " or None" if allow_none else ""
    if not _is_int(value) or int(value) < lo or (hi is not None and int(value) > hi):
        raise ValueError(f"{name} must be an integer {rng}{none}, got {value!r}")
    return int(value)


def _check_float(name: str, value: object, lo: float, hi: float | None, *, lo_open: bool = False) -> float:
    if hi is not None:
        rng = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    else:
        rng = f"{'>' if lo_open else '>='} {lo:g}"
    msg = f"{name} must be a finite number {rng}, got {value!r}"
    # numbers.Real admits int, float and numpy floats; bool is excluded (temperature=True is a mistake).
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValueError(msg)
    v = float(value)
    if not math.isfinite(v) or (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
        raise ValueError(msg)
    return v


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def _check_stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be a string, a list of strings or None, got {value!r}")
    out: list[str] = []
    for s in items:
        if not isinstance(s, str) or s == "":
            raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
        if s not in out:
            out.append(s)
    return tuple(out)


def _check_stop_token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of integers >= 0 or None, got {value!r}")
    out: list[int] = []
    for t in value:
        if not _is_int(t) or int(t) < 0:
            raise ValueError(f"stop_token_ids must contain only integers >= 0, got {t!r}")
        if int(t) not in out:
            out.append(int(t))
    return tuple(out)


@dataclass(frozen=True, slots=True, init=False)
class SamplingParams:
    """What to sample and when to stop, for one request. All arguments are keyword-only.

    Greedy decoding is ``temperature < 1e-5`` (normally ``temperature=0``); top_p/top_k/min_p and the seed
    are then irrelevant. ``max_tokens=None`` means "up to the model length". ``logprobs=N`` returns the
    sampled token's logprob plus the top N (0 = only the sampled one); see ``deepinfer.sampling.sampler``
    for what distribution they are taken from.
    """

    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    max_tokens: int | None
    min_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None
    seq_seed: int | None
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    structured_outputs: StructuredOutputsParams | None  # a constraint on the output (deepinfer.structured)

    def __init__(
        self,
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        max_tokens: int | None = 16,
        min_tokens: int = 0,
        stop: str | list[str] | tuple[str, ...] | None = None,
        stop_token_ids: list[int] | tuple[int, ...] | None = None,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        seq_seed: int | None = None,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        structured_outputs: StructuredOutputsParams | dict | None = None,
        seed: int | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            names = ", ".join(sorted(unknown))
            raise ValueError(f"unknown sampling parameter(s): {names}; allowed: {', '.join(_ALLOWED)}")
        if seed is not None:
            if seq_seed is not None and seq_seed != seed:
                raise ValueError(f"seed and seq_seed are aliases but got different values: seed={seed!r}, seq_seed={seq_seed!r}")
            seq_seed = seed
        if not _is_int(top_k) or (int(top_k) < 1 and int(top_k) not in (0, -1)):
            raise ValueError(f"top_k must be an integer >= 1, or 0 / -1 to disable, got {top_k!r}")
        max_tokens_v = _check_int("max_tokens", max_tokens, 1, allow_none=True)
        min_tokens_v = _check_int("min_tokens", min_tokens, 0)
        assert min_tokens_v is not None
        if max_tokens_v is not None and min_tokens_v > max_tokens_v:
            raise ValueError(f"min_tokens must be <= max_tokens ({max_tokens_v}), got {min_tokens_v}")
        if seq_seed is not None and (not _is_int(seq_seed) or not 0 <= int(seq_seed) < SEED_LIMIT):
            raise ValueError(f"seq_seed (alias seed) must be an integer in [0, 2**63) or None, got {seq_seed!r}")
        values: dict[str, object] = {
            "n": _check_int("n", n, 1),
            "temperature": _check_float("temperature", temperature, 0.0, None),
            "top_p": _check_float("top_p", top_p, 0.0, 1.0, lo_open=True),
            "top_k": max(int(top_k), 0),  # -1 -> 0: one spelling of "disabled" downstream
            "min_p": _check_float("min_p", min_p, 0.0, 1.0),
            "repetition_penalty": _check_float("repetition_penalty", repetition_penalty, 0.0, None, lo_open=True),
            "presence_penalty": _check_float("presence_penalty", presence_penalty, -2.0, 2.0),
            "frequency_penalty": _check_float("frequency_penalty", frequency_penalty, -2.0, 2.0),
            "max_tokens": max_tokens_v,
            "min_tokens": min_tokens_v,
            "stop": _check_stop(stop),
            "stop_token_ids": _check_stop_token_ids(stop_token_ids),
            "ignore_eos": _check_bool("ignore_eos", ignore_eos),
            "logprobs": _check_int("logprobs", logprobs, 0, MAX_LOGPROBS, allow_none=True),
            "prompt_logprobs": _check_int("prompt_logprobs", prompt_logprobs, 0, MAX_LOGPROBS, allow_none=True),
            "seq_seed": None if seq_seed is None else int(seq_seed),
            "skip_special_tokens": _check_bool("skip_special_tokens", skip_special_tokens),
            "include_stop_str_in_output": _check_bool("include_stop_str_in_output", include_stop_str_in_output),
            "structured_outputs": None if structured_outputs is None else
            StructuredOutputsParams.from_dict(structured_outputs),
        }
        for key, value in values.items():
            object.__setattr__(self, key, value)  # frozen dataclass: the only way to set in __init__

    @property
    def seed(self) -> int | None:
        """Alias of :attr:`seq_seed` (the vLLM / OpenAI name)."""
        return self.seq_seed

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a request body; unknown keys are rejected by name (``seed`` is accepted)."""
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling parameters must be a mapping, got {type(d).__name__}")
        bad = [repr(k) for k in d if not isinstance(k, str)]
        if bad:
            raise ValueError(f"sampling parameter names must be strings, got {', '.join(bad)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (tuples kept); ``from_dict(p.to_dict()) == p``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def max_new_tokens(self, prompt_len: int, max_model_len: int) -> int:
        """How many tokens may still be generated: ``max_tokens`` capped by the model length."""
        room = max(max_model_len - prompt_len, 0)
        return room if self.max_tokens is None else min(self.max_tokens, room)

    def check_vocab(self, vocab_size: int) -> None:
        """Reject stop_token_ids outside the model vocabulary (the sampler indexes logits with them)."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids must be < vocab size {vocab_size}, got {t}")


_ALLOWED: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams)) + ("seed",)
