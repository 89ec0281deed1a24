"""StepPlan: what the scheduler tells the runner about one step, as typed, frozen, self-contained data.

A plan holds plain values only (ids, counts, token ids, block ids), never pointers into live sequences,
so it can cross a process boundary unchanged and the runner cannot read state the scheduler changes later
(with async scheduling the scheduler plans step N+1 while step N still runs).

The runner keeps a persistent batch state (``runner/input_batch.py``) that a plan edits:
  * ``left``: sequences that left the batch (finished, aborted, preempted) since the previous plan;
  * ``joined``: sequences that entered it (admitted, or resumed after preemption), with their sampling
    settings, which stay fixed for their life;
  * ``table_edits``: block-table changes since the previous plan ("entries [start, start+k) are now these
    ids", "the table now has this many entries"), in the order the cache manager made them;
  * ``work``: each scheduled sequence's new tokens. A step may give a sequence any number of tokens and
    draw samples at the last ``num_samples`` of them (a draft verification draws at all k+1). The last
    ``num_placeholders`` inputs are tokens the sequence's previous step drew that the host has not seen
    yet: the runner takes them from its device-side record of the last drawn tokens.
    With speculative decoding (MTP) a decoding sequence's inputs are its last token plus ``num_drafts``
    drafts, drawn at every one of them (verification); ``num_proposals`` asks the runner for that many new
    drafts after the step, and ``next_token`` is the known token after the last input of a prompt chunk
    that draws nothing (the MTP layer at position p reads token p + 1). With both (async scheduling and
    speculation) a sequence whose verify step is still in flight has only placeholders: its last emitted
    token and ``num_drafts`` drafts of that step, at the positions its full acceptance gives; the runner
    moves them back by the step's rejected drafts on the device.
The runner applies ``left``, then ``joined``, then ``table_edits``, then runs ``work``.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.frozen_init import fast_init
from deepinfer.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class SeqSampling:
    """A sequence's sampling settings (fixed for its life; the runner keeps them per slot)."""

    seed: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_tokens: int
    min_tokens_masked: tuple[int, ...]  # forced to -inf while fewer than min_tokens tokens were generated
    num_logprobs: int | None

    @classmethod
    def of(cls, params: SamplingParams, seed: int, eos_token_ids: tuple[int, ...]) -> "SeqSampling":
        # EOS is masked by min_tokens only without ignore_eos (then EOS stops nothing: nothing to delay).
        eos = () if params.ignore_eos else eos_token_ids
        masked = tuple(sorted(set(eos) | set(params.stop_token_ids))) if params.min_tokens else ()
        return cls(seed=seed, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                   min_p=params.min_p, repetition_penalty=params.repetition_penalty,
                   presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                   min_tokens=params.min_tokens, min_tokens_masked=masked, num_logprobs=params.logprobs)

    @property
    def has_penalty(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True, slots=True)
class JoinedSeq:
    seq_id: str
    sampling: SeqSampling
    prompt_len: int
    prompt_ids: tuple[int, ...]  # filled only with a repetition penalty ("seen in the prompt"), else ()
    output_ids: tuple[int, ...]  # tokens generated before joining (a resumed sequence): penalty counts


@fast_init  # built per sequence per step: deepinfer/frozen_init.py
@dataclass(frozen=True, slots=True)
class TableEdit:
    seq_id: str
    pool: str
    start: int  # first table entry written
    block_ids: tuple[int, ...]  # the entries from ``start`` on (-1: released)
    length: int  # the table's length after the edit (shorter after a rollback)


@dataclass(frozen=True, slots=True)
class PromptLogprobJob:
    """Prompt logprobs computed in this step: token i of the work's inputs scores ``targets[i - offset]``."""

    offset: int  # first input (within the work's tokens) whose logits are scored
    first_target: int  # prompt index of the first target token
    targets: tuple[int, ...]
    num_logprobs: int


@fast_init  # built per sequence per step: deepinfer/frozen_init.py
@dataclass(frozen=True, slots=True)
class SeqWork:
    seq_id: str
    first_pos: int  # position of the first new token
    token_ids: tuple[int, ...]  # the known new tokens
    num_placeholders: int = 0  # trailing new tokens still on the device (drawn by the previous step)
    num_samples: int = 0  # tokens drawn at the last num_samples positions
    prompt_logprobs: PromptLogprobJob | None = None
    # Structured outputs: the allowed tokens of the sequence's last len(grammar_masks) draws, one row each of
    # int32 words (bit t of word t // 32 set: token t allowed), applied to those draws' logits. A verify step
    # carries one per verified position (the grammar advanced over the drafts before it); a draw without a
    # row is unconstrained (a sequence still thinking, up to a drafted ``</think>``).
    grammar_masks: tuple[bytes, ...] = ()
    num_drafts: int = 0  # the last num_drafts inputs are drafts (placeholders or not), verified by this step's draws
    num_proposals: int = 0  # drafts the MTP layer proposes for the next step (0: none)
    next_token: int = -1  # token after the last input when the step draws none (-1: it draws)
    # Bounded replay of a prefix hit: windows closing before this position are cached already, so the step
    # recomputes their positions' window and state rows but emits no compressed entry for them (0: none).
    emit_from: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_placeholders


@fast_init  # deepinfer/frozen_init.py (one a step)
@dataclass(frozen=True, slots=True)
class StepPlan:
    work: tuple[SeqWork, ...] = ()
    joined: tuple[JoinedSeq, ...] = ()
    left: tuple[str, ...] = ()
    table_edits: tuple[TableEdit, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.work)

    @property
    def empty(self) -> bool:
        return not self.work
