"""Render OpenAI-style chat messages into a DeepSeek-V4 prompt string.

The format follows DeepSeek's reference encoder (``encoding/encoding_dsv4.py``
in the model repo, mirrored by vLLM).  The literal template strings below are
the format the model was trained on and must stay byte-exact; everything else
(validation, structure) is our own.  Pure Python: no torch import.
"""

from __future__ import annotations

import json
from typing import Any

# --- special strings (full-width bars U+FF5C, "▁" is U+2581) ----------------
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAMETER_CLOSE = f"</{DSML}parameter>"
# Task tokens exist in the vocabulary for DeepSeek's internal classification
# tasks; we never render them but a tokenizer must still keep them atomic.
TASK_TOKENS = (
    "<｜action｜>", "<｜query｜>", "<｜authority｜>",
    "<｜domain｜>", "<｜title｜>", "<｜read_url｜>",
)
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, THINK_START, THINK_END, DSML,
    *TASK_TOKENS,
)

# --- trained template text (data, kept verbatim) -----------------------------
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

_TOOLS_SECTION = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

_RESPONSE_FORMAT_SECTION = (
    "## Response Format:\n\n"
    "You MUST strictly adhere to the following schema to reply:\n{schema}"
)

ROLES = ("system", "user", "assistant", "tool", "developer")
REASONING_EFFORTS = ("high", "max")


def to_json(value: Any) -> str:
    # Default separators (", " / ": ") and raw unicode match the trained data.
    return json.dumps(value, ensure_ascii=False)


# --- validation --------------------------------------------------------------
def _fail(field: str, problem: str) -> None:
    raise ValueError(f"{field}: {problem}")


def _text_of(content: Any, field: str) -> str:
    """Flatten string-or-parts content; parts are joined with "\\n" like vLLM."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        _fail(field, f"expected a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        where = f"{field}[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            _fail(f"{where}.type", f"{kind!r} is not supported (only 'text')")
        if not isinstance(part.get("text"), str):
            _fail(f"{where}.text", "missing or not a string")
        texts.append(part["text"])
    return "\n".join(texts)


def _check_tools(tools: Any) -> list[dict]:
    """Return the function schemas of OpenAI-format tools, validated."""
    if not isinstance(tools, list):
        _fail("tools", "expected a list")
    schemas = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            _fail(where, "expected a dict")
        if tool.get("type", "function") != "function":
            _fail(f"{where}.type", f"{tool.get('type')!r} is not 'function'")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            _fail(f"{where}.function", "missing or not a dict")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            _fail(f"{where}.function.name", "missing or not a non-empty string")
        if "description" in fn and not isinstance(fn["description"], str):
            _fail(f"{where}.function.description", "not a string")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            _fail(f"{where}.function.parameters", "not a JSON-schema object")
        try:
            to_json(fn)
        except (TypeError, ValueError) as exc:
            _fail(f"{where}.function", f"not JSON-serialisable ({exc})")
        schemas.append(fn)
    return schemas


def _check_arguments(raw: Any, field: str) -> dict:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            _fail(field, f"not valid JSON ({exc.msg})")
    if not isinstance(raw, dict):
        _fail(field, "must be a JSON object")
    return raw


def _check_tool_calls(calls: Any, field: str) -> list[dict]:
    """Normalise OpenAI tool calls to {"id", "name", "arguments": dict}."""
    if not isinstance(calls, list):
        _fail(field, "expected a list")
    out = []
    for j, call in enumerate(calls):
        where = f"{field}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            _fail(f"{where}.function", "missing or not a dict")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            _fail(f"{where}.function.name", "missing or not a non-empty string")
        args = _check_arguments(fn.get("arguments", "{}"), f"{where}.function.arguments")
        out.append({"id": call.get("id"), "name": fn["name"], "arguments": args})
    return out


def _check_message(i: int, msg: Any, prev: list[dict]) -> dict:
    """Validate one message and return its normalised internal form."""
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        _fail(where, "expected a dict")
    role = msg.get("role")
    if role not in ROLES:
        _fail(f"{where}.role", f"{role!r} is not one of {', '.join(ROLES)}")
    out: dict[str, Any] = {"role": role}
    content = msg.get("content")
    if role == "assistant":
        if msg.get("tool_calls"):
            out["tool_calls"] = _check_tool_calls(msg["tool_calls"], f"{where}.tool_calls")
        elif content is None:
            _fail(f"{where}.content", "missing (required unless tool_calls is given)")
        reasoning = msg.get("reasoning_content", msg.get("reasoning"))
        if reasoning is not None and not isinstance(reasoning, str):
            _fail(f"{where}.reasoning_content", "not a string")
        out["reasoning"] = reasoning or ""
    elif content is None:
        _fail(f"{where}.content", "missing")
    out["content"] = "" if content is None else _text_of(content, f"{where}.content")
    if role == "developer" and not out["content"]:
        _fail(f"{where}.content", "must be non-empty for a developer message")
    if role == "tool":
        out["tool_call_id"] = _check_tool_answer(i, msg, prev)
    return out


def _check_tool_answer(i: int, msg: dict, prev: list[dict]) -> str | None:
    """A tool result must answer a call of the assistant turn right before it."""
    j = len(prev) - 1
    while j >= 0 and prev[j]["role"] == "tool":
        j -= 1
    if j < 0 or prev[j]["role"] != "assistant" or not prev[j].get("tool_calls"):
        _fail(f"messages[{i}]", "tool message has no preceding assistant message with tool_calls")
    call_id = msg.get("tool_call_id")
    ids = {c["id"] for c in prev[j]["tool_calls"] if c["id"]}
    if call_id is not None and ids and call_id not in ids:
        _fail(f"messages[{i}].tool_call_id", f"{call_id!r} matches no tool call of messages[{j}]")
    return call_id


# --- preprocessing -----------------------------------------------------------
def _merge_user_turns(msgs: list[dict]) -> list[dict]:
    """Fold tool results and adjacent user messages into single user turns.

    V4 has no tool role: results travel inside the next user turn as
    <tool_result> blocks, ordered by the calling assistant's call order
    (clients may send them in completion order).  The reference also merges a
    user message that directly follows such a turn, so we do the same.
    """
    merged: list[dict] = []
    order: dict[str, int] = {}
    for m in msgs:
        if m["role"] == "assistant" and m.get("tool_calls"):
            order = {c["id"]: k for k, c in enumerate(m["tool_calls"]) if c["id"]}
        if m["role"] not in ("user", "tool"):
            merged.append(m)
            continue
        block = (m["role"], m["content"], m.get("tool_call_id"))
        if merged and merged[-1]["role"] == "user":
            merged[-1]["blocks"].append(block)
        else:
            merged.append({"role": "user", "blocks": [block], "order": order})
    for m in merged:
        if m["role"] == "user":
            m["content"] = _join_blocks(m.pop("blocks"), m.pop("order"))
    return merged


def _join_blocks(blocks: list[tuple], order: dict[str, int]) -> str:
    # Only tool results are re-sorted; plain text keeps its slot.  Unknown ids
    # sort as 0, and the sort is stable, mirroring the reference.
    results = sorted((b for b in blocks if b[0] == "tool"), key=lambda b: order.get(b[2], 0))
    it = iter(results)
    parts = []
    for b in blocks:
        if b[0] == "tool":
            parts.append(f"<tool_result>{next(it)[1]}</tool_result>")
        else:
            parts.append(b[1])
    return "\n\n".join(parts)


def _last_user_index(msgs: list[dict]) -> int:
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i]["role"] in ("user", "developer"):
            return i
    return -1


def _drop_old_thinking(msgs: list[dict]) -> list[dict]:
    """Strip history the model never saw in training: reasoning of assistant
    turns before the last user turn, and developer turns before it."""
    last = _last_user_index(msgs)
    kept = []
    for i, m in enumerate(msgs):
        if i >= last or m["role"] in ("system", "user"):
            kept.append(m)
        elif m["role"] == "assistant":
            kept.append({**m, "reasoning": ""})
    return kept


# --- rendering ---------------------------------------------------------------
def render_tool_calls(calls: list[dict]) -> str:
    """DSML block for calls given as {"name", "arguments": dict}."""
    invokes = []
    for call in calls:
        params = [
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else to_json(v)}{PARAMETER_CLOSE}"
            for k, v in call["arguments"].items()
        ]
        invokes.append(f'<{DSML}invoke name="{call["name"]}">\n' + "\n".join(params) + f"\n{INVOKE_CLOSE}")
    return f"{TOOL_CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_CLOSE}"


def _render_system(m: dict) -> str:
    text = m["content"]
    if m.get("tools"):
        schemas = "\n".join(to_json(s) for s in m["tools"])
        text += "\n\n" + _TOOLS_SECTION.replace("{schemas}", schemas)
    if m.get("response_format") is not None:
        text += "\n\n" + _RESPONSE_FORMAT_SECTION.format(schema=to_json(m["response_format"]))
    return text


def _render_assistant(m: dict, keep_thinking: bool) -> str:
    text = m["reasoning"] + THINK_END if keep_thinking else ""
    text += m["content"]
    if m.get("tool_calls"):
        text += "\n\n" + render_tool_calls(m["tool_calls"])
    return text + EOS


def _render(msgs: list[dict], thinking: bool, drop: bool, effort: str | None) -> str:
    last_user = _last_user_index(msgs)
    out = []
    if thinking and effort == "max" and msgs:
        out.append(REASONING_EFFORT_MAX)
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "system":
            out.append(_render_system(m))
        elif role in ("user", "developer"):
            out.append(USER + m["content"])
        else:
            # Reasoning is only shown for the turn(s) being continued, unless
            # the caller keeps the whole history of thoughts.
            out.append(_render_assistant(m, thinking and (not drop or i > last_user)))
        nxt = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
        if role in ("user", "developer") and nxt in (None, "assistant"):
            think = thinking and (not drop or i >= last_user)
            out.append(ASSISTANT + (THINK_START if think else THINK_END))
    return "".join(out)


def encode_messages(
    messages: list[dict],
    *,
    thinking: bool = False,
    tools: list[dict] | None = None,
    reasoning_effort: str | None = None,
    add_bos: bool = True,
    drop_thinking: bool = True,
    response_format: dict | None = None,
) -> str:
    """Render ``messages`` as a DeepSeek-V4 prompt ending in the assistant prefix.

    ``tools`` and ``response_format`` are attached to a leading system message
    (an empty one is inserted if there is none).  Passing tools disables
    ``drop_thinking``, as in the reference: agent loops keep their reasoning.
    Raises ValueError naming the offending field on malformed input.
    """
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        _fail("reasoning_effort", f"{reasoning_effort!r} is not one of high, max (or None)")
    if response_format is not None and not isinstance(response_format, dict):
        _fail("response_format", "expected a dict")
    schemas = _check_tools(tools) if tools is not None else []
    if not isinstance(messages, list) or not messages:
        _fail("messages", "expected a non-empty list")
    msgs: list[dict] = []
    for i, raw in enumerate(messages):
        msgs.append(_check_message(i, raw, msgs))
    if schemas or response_format is not None:
        if msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": ""})
        msgs[0] = {**msgs[0], "tools": schemas, "response_format": response_format}
    msgs = _merge_user_turns(msgs)
    drop = drop_thinking and not schemas
    if thinking and drop:
        msgs = _drop_old_thinking(msgs)
    return (BOS if add_bos else "") + _render(msgs, thinking, drop, reasoning_effort)
