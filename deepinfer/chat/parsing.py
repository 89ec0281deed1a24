"""Split DeepSeek-V4 generations into reasoning, content and tool calls.

Grammar of one assistant turn (the prompt already ends in ``<think>`` or
``</think>``, so neither opener is generated):

    [reasoning "</think>"]  content  ["\\n\\n" DSML-block content]*  [EOS ...]

Rules shared by the one-shot and the streaming parser (the streaming one is
tested to agree with the one-shot one at every split point):

* Everything from the first EOS string on is ignored.
* Thinking mode: reasoning runs up to the first ``</think>``; without one the
  whole text is reasoning and content is "" (a generation cut by max_tokens).
* A DSML block starts at ``<｜DSML｜tool_calls>`` (one "\\n\\n" right before it
  belongs to the markup) and ends at the matching close tag.  A block that is
  unterminated or does not parse is kept verbatim in the content; parsing
  never raises on model output.
* ``string="true"`` parameters are raw text; others are JSON.  A non-string
  value that is not valid JSON is kept as a raw string rather than dropping the
  whole call, since the call itself is still well-formed.
* Tool call ids are ``"call_" + sha256(index, name, arguments)[:24]``: stable
  across re-parses and across streaming vs. one-shot parsing, and distinct
  between calls of different turns unless index, name and arguments all match.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from deepinfer.chat.encoding import (
    DSML,
    EOS,
    INVOKE_CLOSE,
    THINK_END,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
)

_BLANK = "\n\n"
_INVOKE_OPEN = re.compile(rf'<{DSML}invoke name="([^"\n]*)">')
_PARAM = re.compile(
    rf'<{DSML}parameter name="([^"\n]*)" string="(true|false)">(.*?)</{DSML}parameter>',
    re.DOTALL,
)
_WS = re.compile(r"\s*")


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object encoded as a string, as OpenAI returns it
    id: str


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    reasoning: str | None
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ChatDelta:
    reasoning: str | None = None
    content: str | None = None
    tool_call: ToolCall | None = None


def make_call_id(index: int, name: str, arguments: str) -> str:
    digest = hashlib.sha256(f"{index}\x00{name}\x00{arguments}".encode()).hexdigest()
    return "call_" + digest[:24]


def _param_value(raw: str, is_string: str) -> object:
    if is_string == "true":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def parse_tool_block(block: str) -> list[tuple[str, str]] | None:
    """Parse a complete ``<tool_calls>…</tool_calls>`` block.

    Returns (name, arguments-json) pairs, or None if the markup is malformed.
    Whitespace between tags is tolerated; the reference is stricter, but the
    model only ever emits the canonical single newlines.
    """
    if not (block.startswith(TOOL_CALLS_OPEN) and block.endswith(TOOL_CALLS_CLOSE)):
        return None
    inner = block[len(TOOL_CALLS_OPEN):len(block) - len(TOOL_CALLS_CLOSE)]
    calls: list[tuple[str, str]] = []
    pos = _WS.match(inner).end()
    while pos < len(inner):
        head = _INVOKE_OPEN.match(inner, pos)
        if head is None:
            return None
        args: dict[str, object] = {}
        pos = _WS.match(inner, head.end()).end()
        while not inner.startswith(INVOKE_CLOSE, pos):
            param = _PARAM.match(inner, pos)
            if param is None or param.group(1) in args:
                return None
            args[param.group(1)] = _param_value(param.group(3), param.group(2))
            pos = _WS.match(inner, param.end()).end()
        pos = _WS.match(inner, pos + len(INVOKE_CLOSE)).end()
        calls.append((head.group(1), json.dumps(args, ensure_ascii=False)))
    return calls or None


def _split_content(text: str, calls: list[ToolCall]) -> str:
    """Pull well-formed DSML blocks out of ``text``; return the content left."""
    parts = []
    while True:
        start = text.find(TOOL_CALLS_OPEN)
        if start < 0:
            parts.append(text)
            return "".join(parts)
        lead = _BLANK if text.endswith(_BLANK, 0, start) else ""
        close = text.find(TOOL_CALLS_CLOSE, start)
        end = len(text) if close < 0 else close + len(TOOL_CALLS_CLOSE)
        parsed = parse_tool_block(text[start:end]) if close >= 0 else None
        if parsed is None:
            parts.append(text[:end])
        else:
            parts.append(text[:start - len(lead)])
            for name, args in parsed:
                calls.append(ToolCall(name, args, make_call_id(len(calls), name, args)))
        text = text[end:]


def parse_assistant_output(text: str, *, thinking: bool) -> ParsedOutput:
    """Parse one complete assistant generation (see module docstring)."""
    text = text.split(EOS, 1)[0]
    reasoning: str | None = None
    if thinking:
        reasoning, sep, text = text.partition(THINK_END)
        if not sep:
            return ParsedOutput(reasoning=reasoning, content="", tool_calls=[])
    calls: list[ToolCall] = []
    content = _split_content(text, calls)
    return ParsedOutput(reasoning=reasoning, content=content, tool_calls=calls)


def _held_suffix(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``buf`` that could start one of ``markers``."""
    longest = max(len(m) for m in markers) - 1
    for n in range(min(len(buf), longest), 0, -1):
        tail = buf[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


class StreamingChatParser:
    """Incremental version of :func:`parse_assistant_output`.

    Text that might be the start of a marker (``</think>``, EOS, the DSML
    opener with its leading blank line) is held back until the next delta
    disambiguates it, so a marker split across tokens never leaks out as
    content.  A DSML block is buffered whole and emitted as tool calls once its
    close tag arrives (or as content if it turns out malformed).
    """

    _REASONING, _CONTENT, _BLOCK, _DONE = range(4)
    _REASONING_MARKERS = (THINK_END, EOS)
    _CONTENT_MARKERS = (EOS, TOOL_CALLS_OPEN, _BLANK + TOOL_CALLS_OPEN)

    def __init__(self, thinking: bool) -> None:
        self._state = self._REASONING if thinking else self._CONTENT
        self._buf = ""
        self._lead = ""  # the "\n\n" taken from content in front of a block
        self._n_calls = 0

    def feed(self, delta_text: str) -> list[ChatDelta]:
        if self._state == self._DONE:
            return []  # past EOS: the rest of the stream is not part of the turn
        self._buf += delta_text
        out: list[ChatDelta] = []
        while self._state != self._DONE and self._step(out):
            pass
        return out

    def finish(self) -> list[ChatDelta]:
        """Flush held-back text: at end of stream no marker can complete."""
        out: list[ChatDelta] = []
        rest, self._buf = self._buf, ""
        if self._state == self._REASONING:
            self._emit(out, reasoning=rest)
        elif self._state == self._CONTENT:
            self._emit(out, content=rest)
        elif self._state == self._BLOCK:
            self._emit(out, content=self._lead + rest)
        self._state = self._DONE
        return out

    # Each step consumes one marker if present, else emits the safe prefix and
    # returns False to wait for more text.
    def _step(self, out: list[ChatDelta]) -> bool:
        if self._state == self._REASONING:
            return self._step_reasoning(out)
        if self._state == self._CONTENT:
            return self._step_content(out)
        return self._step_block(out)

    def _step_reasoning(self, out: list[ChatDelta]) -> bool:
        pos, marker = self._first(self._REASONING_MARKERS)
        if marker is None:
            self._emit_safe(out, "reasoning", self._REASONING_MARKERS)
            return False
        self._emit(out, reasoning=self._buf[:pos])
        self._buf = self._buf[pos + len(marker):]
        self._state = self._CONTENT if marker == THINK_END else self._DONE
        return True

    def _step_content(self, out: list[ChatDelta]) -> bool:
        pos, marker = self._first((EOS, TOOL_CALLS_OPEN))
        if marker is None:
            self._emit_safe(out, "content", self._CONTENT_MARKERS)
            return False
        before = self._buf[:pos]
        if marker == EOS:
            self._emit(out, content=before)
            self._state, self._buf = self._DONE, ""
            return True
        self._lead = _BLANK if before.endswith(_BLANK) else ""
        self._emit(out, content=before[:len(before) - len(self._lead)])
        self._buf = self._buf[pos:]
        self._state = self._BLOCK
        return True

    def _step_block(self, out: list[ChatDelta]) -> bool:
        pos, marker = self._first((EOS, TOOL_CALLS_CLOSE))
        if marker is None:
            return False
        if marker == EOS:
            self._emit(out, content=self._lead + self._buf[:pos])
            self._state, self._buf = self._DONE, ""
            return True
        end = pos + len(TOOL_CALLS_CLOSE)
        block, self._buf = self._buf[:end], self._buf[end:]
        parsed = parse_tool_block(block)
        if parsed is None:
            self._emit(out, content=self._lead + block)
        for name, args in parsed or ():
            call = ToolCall(name, args, make_call_id(self._n_calls, name, args))
            self._n_calls += 1
            out.append(ChatDelta(tool_call=call))
        self._state = self._CONTENT
        return True

    def _first(self, markers: tuple[str, ...]) -> tuple[int, str | None]:
        best, found = len(self._buf), None
        for m in markers:
            pos = self._buf.find(m)
            if 0 <= pos < best:
                best, found = pos, m
        return best, found

    def _emit_safe(self, out: list[ChatDelta], kind: str, markers: tuple[str, ...]) -> None:
        cut = len(self._buf) - _held_suffix(self._buf, markers)
        self._emit(out, **{kind: self._buf[:cut]})
        self._buf = self._buf[cut:]

    @staticmethod
    def _emit(out: list[ChatDelta], **text: str) -> None:
        if any(text.values()):
            out.append(ChatDelta(**text))
