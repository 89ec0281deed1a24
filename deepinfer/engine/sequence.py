"""Internal request state. One ``Sequence`` per sample stream (a request with n=3 owns three).

There is no prefill/decode mode: a sequence has ``num_tokens`` known tokens (prompt + generated) and
``num_computed`` of them in the cache; a step advances ``num_computed``. A sample is drawn when a step
brings ``num_computed`` up to ``num_tokens``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from deepinfer.engine.outputs import PositionLogprobs
from deepinfer.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: str
    index: int
    request: "RequestState"
    token_ids: list[int]
    num_prompt: int
    seed: int
    arrival: int
    detok: object  # IncrementalDetokenizer
    max_output: int  # tokens it may generate: max_tokens capped by the model length
    num_computed: int = 0
    # Tokens drawn on the device whose ids have not reached the host yet (async scheduling: one step's draws;
    # with speculation, a verify step's k + 1, of which the accepted drafts' and the next are emitted).
    num_pending: int = 0
    # Async scheduling with speculation: drafts the MTP layer proposes in the step in flight (on the device).
    pending_drafts: int = 0
    grammar: object | None = None  # the structured-output matcher (llguidance.LLMatcher), fed every token
    # The prompt opened a thinking block: the constraint starts after the model closes it (the reasoning
    # is free text; only the answer is constrained).
    grammar_after: int | None = None  # the token that starts the constraint (``</think>``), None: from the start
    # Speculative decoding: the MTP layer's drafts for the tokens after the last one (verified next step),
    # and the running estimate of how often a draft is accepted (for variable draft lengths).
    drafts: tuple[int, ...] = ()
    draft_acceptance: float = 1.0
    # Prefix caching: the hash chain of the sequence's full blocks computed so far (``kv/prefix_hash.py``).
    block_hashes: tuple[bytes, ...] = ()
    # Bounded replay after a prefix hit: the hit's boundary while positions before it are being recomputed.
    emit_from: int = 0
    status: Status = Status.WAITING
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # Streaming bookkeeping: what the last emitted RequestOutput already covered.
    emitted_text: int = 0
    emitted_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_planned: int = 0  # prompt positions whose logprobs some step computes
    cache_salt: str | None = None  # tenancy: requests with different salts never share cache blocks
    num_cached_tokens: int | None = None  # prompt tokens the first sample found cached at its first admission

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # a loop, not all(genexpr): read for every request at every step
            if s.status is not Status.FINISHED:
                return False
        return True
