"""A request's outputs across the process boundary as deltas.

The engine's ``RequestOutput`` is cumulative (every sample's whole text, token ids and logprobs so far),
so sending it as is costs O(length) per step and request: O(length^2) bytes over a generation, and worse
with logprobs. The core sends what is new since its previous message for that request (``DeltaBuilder``)
and the server rebuilds the very same cumulative ``RequestOutput`` (``OutputAssembler``); the engine's
outputs only ever grow, which is what makes this exact (tests/unit/test_output_wire.py).

The deltas are built straight from the request's sequences (``DeltaBuilder``, installed as the engine's
output builder): the cumulative output is never made in the core, where building it and then slicing it
again was a third of the per-token host work.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields

from deepinfer.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from deepinfer.engine.sequence import RequestState, Status
from deepinfer.frozen_init import fast_init


@fast_init  # built per sequence per step: deepinfer/frozen_init.py
@dataclass(frozen=True, slots=True)
class SampleDelta:
    index: int
    text: str  # appended to the text
    token_ids: tuple[int, ...]  # appended to the token ids
    logprobs: tuple[PositionLogprobs, ...] | None  # appended; None: the request asked for none
    finish_reason: str | None
    stop_reason: str | int | None
    cumulative_logprob: float | None
    delta_text: str  # the engine's own streaming deltas (what the response builders read)
    delta_token_ids: tuple[int, ...]


@fast_init  # built per sequence per step: deepinfer/frozen_init.py
@dataclass(frozen=True, slots=True)
class OutputDelta:
    request_id: str
    samples: tuple[SampleDelta, ...]
    finished: bool
    num_cached_tokens: int
    prompt_logprobs: tuple[PositionLogprobs | None, ...] | None  # appended; None: not asked for
    # The request's first message only: the prompt (never changes afterwards).
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None


@fast_init  # built per request per step: deepinfer/frozen_init.py
@dataclass(frozen=True, slots=True)
class PlainDelta:
    """``OutputDelta`` of a one-sample request without logprobs after its first message (the common case):
    the sample's fields inline, one object to build, encode and decode per request and step instead of two.
    Its ``OutputDelta``: index 0, no logprobs or prompt logprobs, the engine's deltas equal to what is
    appended (``full``)."""

    request_id: str
    text: str  # appended to the text (and the engine's text delta)
    token_ids: tuple[int, ...]  # appended to the token ids (and the engine's token-id delta)
    finish_reason: str | None
    stop_reason: str | int | None
    finished: bool
    num_cached_tokens: int

    def full(self) -> OutputDelta:
        return OutputDelta(self.request_id, (SampleDelta(0, self.text, self.token_ids, None, self.finish_reason,
                                                         self.stop_reason, None, self.text, self.token_ids),),
                           self.finished, self.num_cached_tokens, None)


# A PlainDelta's field values as a plain tuple (``PlainDelta(*values)`` rebuilds it): its wire form.
plain_fields = operator.attrgetter(*(f.name for f in fields(PlainDelta)))


class DeltaBuilder:
    """The core side, from the engine's own request state: what each sample gained since the previous call
    for its request. Installed as the engine's output builder (``engine.build_output``), so it is called
    exactly where the engine would build a cumulative output, and advances the engine's own streaming
    counters the same way (``delta_text`` / ``delta_token_ids`` are what is new, as there)."""

    def __init__(self) -> None:
        # request id -> [prompt logprobs sent, per sample logprobs sent]; what each sample's text and tokens
        # sent is the sequence's own streaming counters (``emitted_text`` / ``emitted_tokens``).
        self._sent: dict[str, list] = {}

    def build(self, req: RequestState) -> OutputDelta:
        rid = req.request_id
        state = self._sent.get(rid)
        first = state is None
        if first:
            state = self._sent[rid] = [0, [0] * len(req.seqs)]
        with_lp = req.params.logprobs is not None
        if len(req.seqs) == 1 and not with_lp and req.prompt_logprobs is None:
            return self._build_plain(req, first)
        samples = []
        for k, s in enumerate(req.seqs):
            text, ids, start = s.text, s.token_ids, s.num_prompt + s.emitted_tokens
            new_text = text[s.emitted_text:]
            new_ids = tuple(ids[start:])
            if with_lp:
                lps, state[1][k] = tuple(s.logprobs[state[1][k]:]), len(s.logprobs)
                cum = s.cumulative_logprob
            else:
                lps = cum = None
            samples.append(SampleDelta(s.index, new_text, new_ids, lps, s.finish_reason, s.stop_reason, cum,
                                       new_text, new_ids))
            s.emitted_text, s.emitted_tokens = len(text), len(ids) - s.num_prompt
        plp = req.prompt_logprobs
        new_plp = None if plp is None else tuple(plp[state[0]:])
        finished = req.finished
        if finished:
            del self._sent[rid]
        elif plp is not None:
            state[0] = len(plp)
        return OutputDelta(rid, tuple(samples), finished, req.num_cached_tokens or 0, new_plp,
                           req.prompt if first else None, tuple(req.prompt_token_ids) if first else None)


    def _build_plain(self, req: RequestState, first: bool) -> OutputDelta | PlainDelta:
        """``build`` of a request with one sample and no logprobs (the common case), what the loop above
        gives for it without the per-sample bookkeeping: it runs for every request of every step. After the
        first message (which carries the prompt) a ``PlainDelta``."""
        s = req.seqs[0]
        text, ids, num_prompt = s.text, s.token_ids, s.num_prompt
        new_text = text[s.emitted_text:]
        new_ids = tuple(ids[num_prompt + s.emitted_tokens:])
        s.emitted_text, s.emitted_tokens = len(text), len(ids) - num_prompt
        finished = s.status is Status.FINISHED
        if finished:
            del self._sent[req.request_id]
        if not first and s.index == 0:
            return PlainDelta(req.request_id, new_text, new_ids, s.finish_reason, s.stop_reason, finished,
                              req.num_cached_tokens or 0)
        return OutputDelta(req.request_id, (SampleDelta(s.index, new_text, new_ids, None, s.finish_reason,
                                                        s.stop_reason, None, new_text, new_ids),),
                           finished, req.num_cached_tokens or 0, None, req.prompt if first else None,
                           tuple(req.prompt_token_ids) if first else None)


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    prompt_logprobs: list | None
    texts: list[str]
    token_ids: list[tuple[int, ...]]  # tuples, grown by concatenation: the output's own tuple, one copy a step
    logprobs: list[list | None]


class OutputAssembler:
    """The server side: the cumulative ``RequestOutput`` of each delta, as the engine built it."""

    def __init__(self) -> None:
        self._requests: dict[str, _Request] = {}

    def assemble(self, d: OutputDelta | PlainDelta) -> RequestOutput:
        if type(d) is PlainDelta:
            return self._assemble_plain(d)
        r = self._requests.get(d.request_id)
        if r is None:
            assert d.prompt_token_ids is not None, f"{d.request_id}: the first delta carries the prompt"
            r = _Request(d.prompt, d.prompt_token_ids, None, [""] * len(d.samples), [()] * len(d.samples),
                         [None] * len(d.samples))
            if not d.finished:
                self._requests[d.request_id] = r
        elif d.finished:
            del self._requests[d.request_id]
        if d.prompt_logprobs is not None:
            r.prompt_logprobs = r.prompt_logprobs or []
            r.prompt_logprobs.extend(d.prompt_logprobs)
        outputs = []
        for k, s in enumerate(d.samples):
            r.texts[k] += s.text
            r.token_ids[k] += s.token_ids
            if s.logprobs is not None:
                r.logprobs[k] = r.logprobs[k] or []
                r.logprobs[k].extend(s.logprobs)
            outputs.append(CompletionOutput(
                s.index, r.texts[k], r.token_ids[k], s.finish_reason, s.stop_reason,
                None if s.logprobs is None else tuple(r.logprobs[k]), s.cumulative_logprob))
        return RequestOutput(
            d.request_id, r.prompt, r.prompt_token_ids, tuple(outputs), d.finished,
            None if d.prompt_logprobs is None else tuple(r.prompt_logprobs),
            tuple([s.delta_text for s in d.samples]), tuple([s.delta_token_ids for s in d.samples]),
            d.num_cached_tokens)

    def _assemble_plain(self, d: PlainDelta) -> RequestOutput:
        """``assemble(d.full())``, without building the full delta (the server's path for most messages)."""
        rid = d.request_id
        r = self._requests[rid] if not d.finished else self._requests.pop(rid)  # a first message came before
        text = r.texts[0] = r.texts[0] + d.text
        ids = r.token_ids[0] = r.token_ids[0] + d.token_ids
        out = CompletionOutput(0, text, ids, d.finish_reason, d.stop_reason, None, None)
        return RequestOutput(rid, r.prompt, r.prompt_token_ids, (out,), d.finished, None, (d.text,), (d.token_ids,),
                             d.num_cached_tokens)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
