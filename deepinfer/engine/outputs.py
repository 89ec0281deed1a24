"""Public output contracts, vLLM-shaped: RequestOutput holds one CompletionOutput per sample (n)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per generated (or prompt) position: token id -> Logprob (the chosen token plus the top-N).
PositionLogprobs = dict[int, Logprob]


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
