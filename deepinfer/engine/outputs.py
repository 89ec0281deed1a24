"""Public output contracts, vLLM-shaped: RequestOutput holds one CompletionOutput per sample (n)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from deepinfer.frozen_init import fast_init


@dataclass(frozen=True, slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per generated (or prompt) position: token id -> Logprob (the chosen token plus the top-N).
PositionLogprobs = dict[int, Logprob]


@fast_init  # built per sequence per step: deepinfer/frozen_init.py
@dataclass(frozen=True, slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # None while running; then "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it, if any
    logprobs: tuple[PositionLogprobs, ...] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@fast_init  # built per sequence per step: deepinfer/frozen_init.py
@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    prompt_logprobs: tuple[PositionLogprobs | None, ...] | None = None
    # For streaming: text/token deltas since the previous RequestOutput of this request, per sample.
    delta_text: tuple[str, ...] = ()
    delta_token_ids: tuple[tuple[int, ...], ...] = ()
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed) at admission


def merge_deltas(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One RequestOutput standing for two consecutive ones of the same request: ``newer``'s cumulative state with
    both steps' deltas. A stream whose reader fell behind sends the tokens it missed in one event instead of one
    event per token (what a serving loop under load needs); the concatenated text is the same."""
    if older.request_id != newer.request_id or len(older.delta_text) != len(newer.delta_text):
        raise ValueError(f"merge_deltas: outputs of {older.request_id!r} and {newer.request_id!r} do not line up")
    return replace(
        newer,
        delta_text=tuple(a + b for a, b in zip(older.delta_text, newer.delta_text)),
        delta_token_ids=tuple(a + b for a, b in zip(older.delta_token_ids, newer.delta_token_ids)),
        prompt_logprobs=newer.prompt_logprobs if newer.prompt_logprobs is not None else older.prompt_logprobs,
    )
