"""Per-row sampler input: everything the sampler needs about one row, frozen and self-contained.

A ``SamplingRow`` is built from the request's ``SamplingParams`` and its whole token history: the
reference form of the sampler's input (tests, direct callers). It carries only plain Python values, so the
sampler's result for a row is a function of (that row's logits, that row's ``SamplingRow``) and nothing
else -- which is what makes a request's tokens independent of its neighbours in the batch. The engine's
runner does not rebuild rows each step: it keeps the same settings per batch slot and the penalty counts
on the device (``runner/input_batch.py``), and a test checks it gathers the tensors these rows give.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.sampling.params import GREEDY_TEMPERATURE_EPS, MAX_LOGPROBS, SEED_LIMIT, SamplingParams
from deepinfer.sampling.rng import MASK32, MAX_POSITION, SALT_TARGET, derive_seed


def resolve_seed(params: SamplingParams, request_id: str) -> int:
    """The request's seed: ``params.seq_seed`` if given, else one derived from the request id.

    The engine should report the resolved seed back to the user so any output can be replayed.
    """
    return params.seq_seed if params.seq_seed is not None else derive_seed(request_id)


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """Sampler metadata of one logits row.

    ``position`` is the absolute sequence position of the token being sampled (prompt length + number of
    output tokens so far for a plain decode). The penalty inputs are only filled when the penalty is
    active, because building them walks the whole history in Python.
    """

    seed: int
    position: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Sorted unique ids of prompt + output (repetition penalty: "seen anywhere").
    seen_token_ids: tuple[int, ...] = ()
    # (id, count) of output tokens, sorted by id (presence / frequency penalty: OpenAI counts outputs only).
    output_token_counts: tuple[tuple[int, int], ...] = ()
    # Ids forced to -inf this step: EOS and stop_token_ids while fewer than min_tokens were generated.
    masked_token_ids: tuple[int, ...] = ()
    num_logprobs: int | None = None
    salt: int = SALT_TARGET

    def __post_init__(self) -> None:
        # Internal contract (the user-facing checks live in SamplingParams); a violation is an engine bug,
        # but a clear message beats a silent wrong hash.
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if not 0 <= self.position < MAX_POSITION:
            raise ValueError(f"position must be in [0, 2**32), got {self.position}")
        if not 0 <= self.salt <= MASK32:
            raise ValueError(f"salt must be in [0, 2**32), got {self.salt}")
        if self.num_logprobs is not None and not 0 <= self.num_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"num_logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.num_logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def has_count_penalty(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def build(
        cls,
        params: SamplingParams,
        *,
        seed: int,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        eos_token_ids: Sequence[int] = (),
        position: int | None = None,
        salt: int = SALT_TARGET,
    ) -> SamplingRow:
        """Row for sampling the next token of a request.

        ``seed`` is the resolved seed (:func:`resolve_seed`, or :func:`~deepinfer.sampling.rng.child_seed`
        for the i-th sample of an ``n > 1`` request). ``position`` defaults to
        ``len(prompt_token_ids) + len(output_token_ids)``; speculative verification passes its own.
        EOS is masked by ``min_tokens`` only when ``ignore_eos`` is off (with ``ignore_eos`` EOS is an
        ordinary token that stops nothing, so there is nothing to delay).
        """
        n_out = len(output_token_ids)
        masked: tuple[int, ...] = ()
        if n_out < params.min_tokens:
            eos = () if params.ignore_eos else tuple(eos_token_ids)
            masked = tuple(sorted(set(eos) | set(params.stop_token_ids)))
        seen: tuple[int, ...] = ()
        if params.repetition_penalty != 1.0:
            seen = tuple(sorted(set(prompt_token_ids) | set(output_token_ids)))
        counts: tuple[tuple[int, int], ...] = ()
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            counts = tuple(sorted(Counter(output_token_ids).items()))
        return cls(
            seed=seed,
            position=len(prompt_token_ids) + n_out if position is None else position,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            seen_token_ids=seen,
            output_token_counts=counts,
            masked_token_ids=masked,
            num_logprobs=params.logprobs,
            salt=salt,
        )
