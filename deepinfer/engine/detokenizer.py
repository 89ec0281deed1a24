"""Incremental detokenization with stop strings, for streaming one request's output.

Decoding: the prefix-offset / read-offset technique (HF TGI, vLLM). Each step decodes only a short window
``ids[prefix:]`` and emits what it adds beyond ``decode(ids[prefix:read])``. While the window's text ends in
U+FFFD (a multi-byte UTF-8 character split across byte-level tokens), nothing is emitted and the offsets do
not move, so a split character is streamed once, whole. The window starts with up to 5 prompt tokens for
context (byte-level BPE does not need it, but tokenizers with a leading-space rule do); it is dropped when the
prompt ends inside a character. ``finish()`` flushes whatever is still pending, so for byte-level BPE the
concatenated deltas equal ``tokenizer.decode(output_ids)``.

Stop strings (``stop``):
- matched on the decoded text, so they are found across token boundaries;
- when several could end in the same step, the one whose match *ends* first wins (what a char-by-char
  reader would see first); on equal ends the one starting first (the longer) wins -- independent of the
  order of ``stop``;
- the match and everything after it are cut (``include_stop_str_in_output=True`` keeps the match itself);
- text that could still become the start of a stop string (a suffix equal to a proper prefix of one) is
  held back from the stream until the next tokens resolve it, and released by ``finish()``;
- ``min_tokens``: as in vLLM, a stop string must end in text produced after the first ``min_tokens``
  output tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from deepinfer.frozen_init import fast_init

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """What the detokenizer needs: ``tokenizers.Tokenizer`` and ``deepinfer.tokenizer.Tokenizer`` fit."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@fast_init  # built per sequence per step: deepinfer/frozen_init.py
@dataclass(frozen=True, slots=True)
class DetokenizerUpdate:
    """What one ``step()`` / ``finish()`` adds to the stream.

    ``tokens_consumed``: how many of the step's token ids were used; when a stop string completes inside a
    multi-token step (speculative decoding), the tokens after the completing one are ignored.
    """

    text_delta: str
    stopped: bool = False
    stop_reason: str | None = None  # the stop string that matched
    tokens_consumed: int = 0


class IncrementalDetokenizer:
    """Streams the text of one sequence's output tokens. Not thread-safe; one per sequence."""

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        *,
        min_tokens: int = 0,
    ) -> None:
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise ValueError(f"stop must contain only non-empty strings, got {stop!r}")
        self._tokenizer = tokenizer
        # The tokenizer's decode joins the texts of token runs without U+FFFD (``Tokenizer.decodes_by_concatenation``).
        self._concat = getattr(tokenizer, "decodes_by_concatenation", False) is True
        self._singles: dict[int, str] = tokenizer.single_decodes(skip_special_tokens) if self._concat else {}
        self._skip_special = skip_special_tokens
        self._stop = tuple(stop)
        self.has_stops = bool(self._stop)  # without stop strings a step never stops: ``step_token`` serves it
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        # Decoding window state: ids = prompt tail + output ids; text of ids[prefix:read] is cached.
        self._ids: list[int] = [int(t) for t in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]]
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: output bytes would merge into it, and the stream would
            # no longer equal decode(output ids). Decode the output on its own instead.
            self._ids, self._prefix_text = [], ""
        self._prefix = 0
        self._read = len(self._ids)
        self._num_output = 0
        # Output text state: _text is everything decoded (cut at a stop), _released what was streamed,
        # _scanned how far stop-string *ends* have been checked.
        self._text = ""
        self._released = 0
        self._scanned = 0
        self._stop_reason: str | None = None
        self._stopped = False
        self._finished = False

    # ----------------------------------------------------------------------------------------- public
    @property
    def output_text(self) -> str:
        """All output text so far (including held-back text; cut at the stop string once stopped)."""
        return self._text

    @property
    def num_output_tokens(self) -> int:
        return self._num_output

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    def step(self, new_token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Consume newly generated token ids; return the text that is now safe to stream."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.step() called after finish()")
        if self._stopped:
            # The engine may still hold tokens of the step that hit the stop; they add nothing.
            return DetokenizerUpdate("", True, self._stop_reason, 0)
        if not self._stop:  # no stop strings (the common case): nothing to scan, nothing held back
            for token_id in new_token_ids:
                self._num_output += 1
                self._text += self._decode_next(int(token_id))
            self._scanned = len(self._text)
            return DetokenizerUpdate(self._release(self._scanned), False, None, len(new_token_ids))
        for i, token_id in enumerate(new_token_ids):
            self._num_output += 1
            self._text += self._decode_next(int(token_id))
            if self._check_stop():
                return DetokenizerUpdate(self._release(len(self._text)), True, self._stop_reason, i + 1)
        return DetokenizerUpdate(self._release(len(self._text) - self._holdback()), False, None, len(new_token_ids))

    def step_token(self, token_id: int) -> str:
        """``step((token_id,)).text_delta`` for a detokenizer without stop strings (``has_stops`` False),
        which never stops and holds nothing back: what ``step`` gives, without building the update (the
        engine's path for every token of such a sequence)."""
        if self._finished or self.has_stops:
            raise RuntimeError("IncrementalDetokenizer.step_token() called after finish() or with stop strings")
        self._num_output += 1
        delta = self._decode_next(token_id)
        if delta:  # everything decoded is released at once (as ``step``'s path without stop strings does)
            self._text += delta
            self._scanned = self._released = len(self._text)
        return delta

    def finish(self) -> DetokenizerUpdate:
        """End of the sequence: flush pending bytes and held-back text. Call once."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.finish() called twice")
        self._finished = True
        if not self._stopped and self._read < len(self._ids):
            # Pending text (a trailing partial character, or tokens that decoded to nothing yet).
            self._text += self._decode(self._ids[self._prefix :])[len(self._prefix_text) :]
            self._prefix, self._read = len(self._ids), len(self._ids)
            self._check_stop()
        return DetokenizerUpdate(self._release(len(self._text)), self._stopped, self._stop_reason, 0)

    # ---------------------------------------------------------------------------------------- private
    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._concat and self._read == len(self._ids) - 1:  # no ids pending before this one
            tail = self._singles.get(token_id)  # the tokenizer's cache, read without a call per token
            if tail is None:
                tail = self._decode([token_id])  # (which fills it)
            if REPLACEMENT_CHAR not in tail and REPLACEMENT_CHAR not in self._prefix_text:
                # The window is ids[prefix:read] + [token_id]; its text is the prefix text + tail: what the
                # general path below finds, without decoding the window (no U+FFFD at its end, the same
                # offsets moved).
                if not tail:
                    return ""
                self._prefix, self._read = self._read, len(self._ids)
                self._prefix_text = tail if self._read - self._prefix == 1 else \
                    self._decode(self._ids[self._prefix : self._read])
                return tail
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # Nothing visible yet (special token skipped) or a split UTF-8 character: wait for more ids.
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        return delta

    def _check_stop(self) -> bool:
        """Look for a stop string ending after ``_scanned``; on a match cut the text and mark stopped."""
        if not self._stop or self._num_output <= self._min_tokens:
            self._scanned = len(self._text)
            return False
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self._stop:
            start = self._text.find(s, max(0, self._scanned - len(s) + 1))
            if start != -1 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        self._scanned = len(self._text)
        if best is None:
            return False
        end, start, s = best
        self._text = self._text[: end if self._include_stop else start]
        self._stopped, self._stop_reason = True, s
        return True

    def _holdback(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string (0 if included)."""
        if self._include_stop:
            return 0  # a partial stop string may be streamed: if it completes, it is kept anyway
        text = self._text
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def _release(self, upto: int) -> str:
        upto = max(upto, self._released)  # released text is never taken back
        delta = self._text[self._released : upto]
        self._released = upto
        return delta
