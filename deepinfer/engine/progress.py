"""Applying a sampled token to a sequence: detokenize, check the stop conditions, record logprobs; and
building the (incremental) RequestOutput a caller sees."""

from __future__ import annotations

from deepinfer.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from deepinfer.engine.sequence import RequestState, Sequence, Status
from deepinfer.sampling import TokenLogprobs


def to_position_logprobs(lp: TokenLogprobs, decode) -> PositionLogprobs:
    out: PositionLogprobs = {}
    for rank, (tok, value) in enumerate(lp.top, start=1):
        out[tok] = Logprob(value, rank, decode(tok))
    if lp.token_id not in out:
        out[lp.token_id] = Logprob(lp.logprob, lp.rank, decode(lp.token_id))
    return out


def append_token(seq: Sequence, token: int, lp: TokenLogprobs | None, eos_id: int, decode) -> None:
    """Add one sampled token and settle whether the sequence is finished (and why)."""
    p = seq.request.params
    ids = seq.token_ids
    ids.append(token)
    if lp is not None:
        seq.logprobs.append(to_position_logprobs(lp, decode))
        seq.cumulative_logprob += lp.logprob
    # EOS and stop token ids end the sequence without entering the text (they stay in token_ids).
    if token == eos_id and not p.ignore_eos:
        finish(seq, "stop", None)
        return
    if p.stop_token_ids and token in p.stop_token_ids:
        if p.include_stop_str_in_output:
            seq.text += seq.detok.step((token,)).text_delta
        finish(seq, "stop", token)
        return
    detok = seq.detok
    if detok.has_stops:
        update = detok.step((token,))
        if update.text_delta:
            seq.text += update.text_delta
        if update.stopped:
            finish(seq, "stop", update.stop_reason)
            return
    else:  # no stop string can end it: the text delta alone (no update object per token)
        delta = detok.step_token(token)
        if delta:
            seq.text += delta
    if len(ids) - seq.num_prompt >= seq.max_output:  # seq.num_output, inline: once per token
        finish(seq, "length", None)


def finish(seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
    if seq.finished:
        return
    if not seq.detok.stopped:
        seq.text += seq.detok.finish().text_delta
    seq.status = Status.FINISHED
    seq.finish_reason = reason
    seq.stop_reason = stop_reason


def build_output(req: RequestState, delta: bool = True) -> RequestOutput:
    """Snapshot of a request; with ``delta`` also the text/tokens added since the previous snapshot."""
    outputs, delta_text, delta_ids = [], [], []
    for s in req.seqs:
        outputs.append(CompletionOutput(
            index=s.index,
            text=s.text,
            token_ids=tuple(s.output_ids),
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
            logprobs=tuple(s.logprobs) if s.params.logprobs is not None else None,
            cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
        ))
        delta_text.append(s.text[s.emitted_text :])
        delta_ids.append(tuple(s.output_ids[s.emitted_tokens :]))
        if delta:
            s.emitted_text, s.emitted_tokens = len(s.text), s.num_output
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=tuple(req.prompt_token_ids),
        outputs=tuple(outputs),
        finished=req.finished,
        prompt_logprobs=tuple(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
        delta_text=tuple(delta_text),
        delta_token_ids=tuple(delta_ids),
        num_cached_tokens=req.num_cached_tokens or 0,
    )


def abort(req: RequestState, remove, build=build_output):
    """Finish every unfinished sequence of ``req`` with 'abort', take each out of its scheduler (``remove``)
    and return the request's final output (made by ``build``, the engine's output builder)."""
    for seq in req.seqs:
        if not seq.finished:
            finish(seq, "abort")
        remove(seq)
    return build(req)

