"""/v1/completions responses (whole and streamed), with ``echo`` and legacy logprobs.

Engine request ``f"{id}-{p}"`` serves prompt p; its sample s is choice ``p * n + s`` (OpenAI's numbering
for several prompts with n > 1). Each choice's text and tokens are read from the cumulative
``CompletionOutput`` against what this builder already sent, so a choice can be held back for a step and
then sent whole.

With ``echo`` a choice's text starts with its prompt and, with ``logprobs``, its logprobs start with one
entry per prompt token: the engine's prompt logprobs, the first token's value and alternatives null (there
is nothing before it to predict it from). Streaming sends the prompt with each choice's first chunk.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from deepinfer.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from deepinfer.server.prompts import PromptEcho
from deepinfer.server.protocol import SYSTEM_FINGERPRINT, finite_logprob, sampled_entry, usage

LogprobLists = dict[str, list[Any]]  # tokens, token_logprobs, top_logprobs, text_offset


def completion_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs],
                        offset: int) -> LogprobLists:
    """Legacy completions logprobs of generated tokens. top_logprobs holds the top N plus the sampled token
    (OpenAI documents "up to logprobs + 1" entries); ``offset`` is the text offset of the first token."""
    tokens, values, tops, offsets = [], [], [], []
    for tid, pos in zip(token_ids, positions):
        tok, value = sampled_entry(tid, pos)
        tokens.append(tok)
        values.append(value)
        tops.append({(v.decoded_token or ""): finite_logprob(v.logprob) for v in pos.values()})
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(echo: PromptEcho, token_ids: Sequence[int],
                    positions: Sequence[PositionLogprobs | None] | None) -> LogprobLists:
    """The same lists for the prompt tokens. A position the engine has not scored (the first one, or all
    after an abort during prefill) has null logprob and alternatives."""
    positions = positions or ()
    tokens, values, tops, offsets = list(echo.tokens), [], [], []
    offset = 0
    for k, (tid, width) in enumerate(zip(token_ids, echo.widths)):
        pos = positions[k] if k < len(positions) else None
        chosen = pos.get(tid) if pos is not None else None
        values.append(finite_logprob(chosen.logprob) if chosen is not None else None)
        tops.append({(v.decoded_token or ""): finite_logprob(v.logprob) for v in pos.values()}
                    if pos is not None else None)
        offsets.append(offset)
        offset += width
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _prompt_scored(out: RequestOutput) -> bool:
    return out.finished or len(out.prompt_logprobs or ()) >= len(out.prompt_token_ids)


class CompletionBuilder:
    def __init__(self, request_id: str, model: str, n: int, logprobs: int | None,
                 echoes: Sequence[PromptEcho | None] | None = None, prompt_only: bool = False) -> None:
        """``echoes[p]``: what to echo in front of prompt p's choices (None: no echo). ``prompt_only``: the
        engine's one generated token is left out (echo with max_tokens 0)."""
        self.id, self.model, self.n, self.logprobs = request_id, model, n, logprobs
        self.echoes = list(echoes) if echoes is not None else None
        self.prompt_only = prompt_only
        self.created = int(time.time())
        self._sent: dict[int, tuple[int, int]] = {}  # choice -> (tokens, characters of generated text) sent
        self._offsets: dict[int, int] = {}  # choice -> text offset of its next generated token
        self._done: set[int] = set()

    def engine_id(self, prompt_index: int) -> str:
        return f"{self.id}-{prompt_index}"

    def _wrap(self, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "system_fingerprint": SYSTEM_FINGERPRINT, **extra}

    def _choice(self, out: RequestOutput, p: int, c: CompletionOutput) -> dict[str, Any] | None:
        """What choice ``p * n + c.index`` has not sent yet, or None when it has nothing new (or must wait)."""
        i = p * self.n + c.index
        if i in self._done:
            return None
        first = i not in self._sent
        echo = self.echoes[p] if self.echoes is not None and first else None
        if echo is not None and self.logprobs is not None and not _prompt_scored(out):
            return None  # a sibling sample got ahead of the prompt's scoring: send the prompt complete, later
        n_ids, n_chars = self._sent.get(i, (0, 0))
        ids, text = c.token_ids[n_ids:], c.text[n_chars:]
        if not (ids or text or c.finished):
            return None  # a sibling sample moved; this one has nothing new
        self._sent[i] = (len(c.token_ids), len(c.text))
        positions = (c.logprobs or ())[n_ids:]
        if self.prompt_only:
            ids, text, positions = (), "", ()
        lp = None
        if echo is not None:
            text = echo.text + text
            self._offsets[i] = len(echo.text)
        if self.logprobs is not None:
            offset = self._offsets.get(i, 0)
            lp = completion_logprobs(ids, positions, offset)
            self._offsets[i] = offset + sum(len(t) for t in lp["tokens"])
            if echo is not None:
                head = prompt_logprobs(echo, out.prompt_token_ids, out.prompt_logprobs)
                lp = {key: head[key] + lp[key] for key in head}
        finish = c.finish_reason
        if c.finished:
            self._done.add(i)
            if self.prompt_only and finish != "abort":
                finish = "length"  # the one token the engine made was not asked for
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish,
                "stop_reason": None if self.prompt_only else c.stop_reason}

    def _prompt_index(self, out: RequestOutput) -> int:
        return int(out.request_id.rsplit("-", 1)[1])

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        p = self._prompt_index(out)
        choices = (self._choice(out, p, c) for c in out.outputs)
        return [self._wrap([ch]) for ch in choices if ch is not None]

    def usage_chunk(self, finals: list[RequestOutput]) -> dict[str, Any]:
        return self._wrap([], usage=usage(finals, count_generated=not self.prompt_only))

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for out in finals:
            p = self._prompt_index(out)
            choices.extend(ch for c in out.outputs if (ch := self._choice(out, p, c)) is not None)
        choices.sort(key=lambda ch: ch["index"])
        return self._wrap(choices, usage=usage(finals, count_generated=not self.prompt_only))
