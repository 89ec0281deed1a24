"""DeepSeek-V4 chat encoding and parsing.

Expected prompts are written out by hand from the format rules (see
deepinfer/chat/encoding.py), never produced by calling the encoder.
"""

import json

import pytest

from deepinfer.chat import (
    SPECIAL_TOKENS,
    ChatDelta,
    StreamingChatParser,
    chat_prompt,
    encode_messages,
    parse_assistant_output,
)

B = "<｜begin▁of▁sentence｜>"
E = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"

TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. "
    'You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. '
    "For all other types (numbers, booleans, arrays, objects), pass the value in JSON format "
    'and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete "
    "reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Weather for a city", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}\n\n'
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem "
    "to resolve the root cause, rigorously stress-testing your logic against all potential "
    "paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no "
    "assumption is left unchecked.\n\n"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


# --- rendering -----------------------------------------------------------------
def test_single_user_turn_chat_and_thinking():
    msgs = [{"role": "user", "content": "Hello"}]
    assert encode_messages(msgs) == f"{B}{U}Hello{A}</think>"
    assert encode_messages(msgs, thinking=True) == f"{B}{U}Hello{A}<think>"
    assert encode_messages(msgs, add_bos=False) == f"{U}Hello{A}</think>"


def test_system_prompt_and_text_parts():
    msgs = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    assert encode_messages(msgs) == f"{B}You are helpful.{U}a\nb{A}</think>"


def test_multi_turn_drops_earlier_reasoning():
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "u2"},
    ]
    assert encode_messages(msgs, thinking=True) == f"{B}S{U}u1{A}</think>a1{E}{U}u2{A}<think>"
    kept = f"{B}S{U}u1{A}<think>r1</think>a1{E}{U}u2{A}<think>"
    assert encode_messages(msgs, thinking=True, drop_thinking=False) == kept
    assert encode_messages(msgs) == f"{B}S{U}u1{A}</think>a1{E}{U}u2{A}</think>"


def test_earlier_developer_turn_dropped_in_thinking_mode():
    msgs = [
        {"role": "developer", "content": "dev"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "u"},
    ]
    assert encode_messages(msgs, thinking=True) == f"{B}ok{E}{U}u{A}<think>"
    assert encode_messages(msgs) == f"{B}{U}dev{A}</think>ok{E}{U}u{A}</think>"


def test_last_assistant_turn_keeps_reasoning_and_gets_no_prefix():
    msgs = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a", "reasoning_content": "r"},
    ]
    assert encode_messages(msgs, thinking=True) == f"{B}{U}u{A}<think>r</think>a{E}"
    assert encode_messages(msgs) == f"{B}{U}u{A}</think>a{E}"


def test_assistant_tool_calls_dsml():
    args = {"city": "Zürich", "days": 3, "metric": True, "hours": [1, 2], "opts": {"a": None}}
    msgs = [
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call("c1", "get_weather", args)]},
    ]
    expected = (
        f"{B}{U}w?{A}</think>Checking.\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Zürich</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="metric" string="false">true</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="hours" string="false">[1, 2]</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="opts" string="false">{"a": null}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{E}"
    )
    assert encode_messages(msgs) == expected


def test_tool_results_merged_in_call_order():
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [call("a", "f", {}), call("b", "g", {"x": "y"})]},
        {"role": "tool", "tool_call_id": "b", "content": "B-out"},
        {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "A-out"}]},
        {"role": "user", "content": "and?"},
    ]
    expected = (
        f"{B}{U}q{A}</think>\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="f">\n\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="g">\n'
        '<｜DSML｜parameter name="x" string="true">y</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{E}"
        f"{U}<tool_result>A-out</tool_result>\n\n<tool_result>B-out</tool_result>\n\nand?{A}</think>"
    )
    assert encode_messages(msgs) == expected


def test_tools_section_in_system_prompt():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert encode_messages(msgs, tools=[WEATHER]) == f"{B}S\n\n{TOOLS_SECTION}{U}hi{A}</think>"
    # Without a system message an empty one is inserted to carry the tools.
    got = encode_messages(msgs[1:], tools=[WEATHER])
    assert got == f"{B}\n\n{TOOLS_SECTION}{U}hi{A}</think>"


def test_tools_disable_drop_thinking():
    msgs = [
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "u2"},
    ]
    got = encode_messages(msgs, thinking=True, tools=[WEATHER])
    assert got == f"{B}\n\n{TOOLS_SECTION}{U}u1{A}<think>r1</think>a1{E}{U}u2{A}<think>"


def test_reasoning_effort_max():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert encode_messages(msgs, thinking=True, reasoning_effort="max") == f"{B}{MAX_EFFORT}S{U}hi{A}<think>"
    # Chat mode ignores it; "high" renders exactly like None.
    assert encode_messages(msgs, reasoning_effort="max") == f"{B}S{U}hi{A}</think>"
    assert encode_messages(msgs, thinking=True, reasoning_effort="high") == f"{B}S{U}hi{A}<think>"


def test_response_format_section():
    fmt = {"type": "json_object"}
    got = encode_messages([{"role": "user", "content": "x"}], response_format=fmt)
    expected = (
        f"{B}\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        f'{{"type": "json_object"}}{U}x{A}</think>'
    )
    assert got == expected


def test_special_tokens_listed():
    for tok in (B, E, U, A, "<｜latest_reminder｜>", "<think>", "</think>", "｜DSML｜"):
        assert tok in SPECIAL_TOKENS
    assert len(set(SPECIAL_TOKENS)) == len(SPECIAL_TOKENS)


# --- parsing -------------------------------------------------------------------
def test_round_trip_tool_calls():
    args1 = {"city": "Zürich", "days": 3, "nested": {"k": [1.5, "s"]}, "flag": False}
    args2 = {"text": 'multi\nline "quoted" </not-a-tag>'}
    msgs = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "Sure.", "reasoning_content": "plan",
         "tool_calls": [call("x", "get_weather", args1), call("y", "note", args2)]},
    ]
    prompt = encode_messages(msgs, thinking=True)
    generated = prompt.split(f"{A}<think>", 1)[1]
    parsed = parse_assistant_output(generated, thinking=True)
    assert parsed.reasoning == "plan"
    assert parsed.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", args1), ("note", args2)]
    assert len({c.id for c in parsed.tool_calls}) == 2
    assert all(c.id.startswith("call_") for c in parsed.tool_calls)
    assert parse_assistant_output(generated, thinking=True) == parsed  # deterministic ids


def test_parse_thinking_and_chat_modes():
    p = parse_assistant_output("r</think>c" + E, thinking=True)
    assert (p.reasoning, p.content, p.tool_calls) == ("r", "c", [])
    p = parse_assistant_output("still thinking", thinking=True)
    assert (p.reasoning, p.content) == ("still thinking", "")
    p = parse_assistant_output("a</think>b" + E + "junk", thinking=False)
    assert (p.reasoning, p.content) == (None, "a</think>b")


def test_parse_string_vs_json_params():
    text = ("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
            '<｜DSML｜parameter name="s" string="true">42</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="n" string="false">42</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="bad" string="false">not json</｜DSML｜parameter>\n'
            "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + E)
    p = parse_assistant_output(text, thinking=False)
    assert p.content == ""
    assert json.loads(p.tool_calls[0].arguments) == {"s": "42", "n": 42, "bad": "not json"}


MALFORMED = [
    "x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\noops</｜DSML｜tool_calls>",
    "x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n",  # never closed
    "x\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>",  # empty block
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_dsml_stays_in_content(text):
    p = parse_assistant_output(text, thinking=False)
    assert p.content == text and p.tool_calls == []


STREAM_CASES = [
    (True, "Let me think </thin about it.</think>The answer\n\nis 4." + E),
    (True, "no end tag <｜end▁of▁sent"),
    (True, "plan</think>Calling.\n\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
           '<｜DSML｜parameter name="a" string="false">[1, 2]</｜DSML｜parameter>\n'
           "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + E),
    (False, "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"g\">\n"
            '<｜DSML｜parameter name="q" string="true">x\n\ny</｜DSML｜parameter>\n'
            "</｜DSML｜invoke>\n</｜DSML｜tool_calls>tail\n\n<｜DSML｜tool_"),
    (False, "r</think>" + MALFORMED[0] + " after\n\n" + E + "ignored"),
    (False, MALFORMED[1] + "\n\n"),
    (False, "ends with newlines\n\n"),
]


def _collect(deltas: list[ChatDelta]):
    reasoning = "".join(d.reasoning or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [d.tool_call for d in deltas if d.tool_call is not None]
    for d in deltas:
        assert sum(x is not None for x in (d.reasoning, d.content, d.tool_call)) == 1
    return reasoning, content, calls


@pytest.mark.parametrize("thinking,text", STREAM_CASES)
def test_streaming_matches_oneshot_at_every_split(thinking, text):
    ref = parse_assistant_output(text, thinking=thinking)
    want = (ref.reasoning or "", ref.content, ref.tool_calls)
    for cut in range(len(text) + 1):
        for mid in (cut, (cut + len(text)) // 2):
            sp = StreamingChatParser(thinking)
            deltas = sp.feed(text[:cut]) + sp.feed(text[cut:mid]) + sp.feed(text[mid:]) + sp.finish()
            assert _collect(deltas) == want, (cut, mid)
    sp = StreamingChatParser(thinking)
    per_char = [d for ch in text for d in sp.feed(ch)] + sp.finish()
    assert _collect(per_char) == want


def test_streaming_never_leaks_partial_marker():
    sp = StreamingChatParser(thinking=True)
    assert sp.feed("abc</th") == [ChatDelta(reasoning="abc")]
    assert sp.feed("ink>hi\n\n<｜DS") == [ChatDelta(content="hi")]
    assert sp.feed("ML｜tool_calls>\n") == []


# --- validation ----------------------------------------------------------------
U1 = {"role": "user", "content": "u"}
INVALID = [
    ({"messages": [{"role": "robot", "content": "x"}]},
     "messages[0].role: 'robot' is not one of system, user, assistant, tool, developer"),
    ({"messages": [U1, {"role": "user"}]}, "messages[1].content"),
    ({"messages": [U1, {"role": "assistant"}]}, "messages[1].content"),
    ({"messages": [{"role": "system", "content": None}, U1]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
    ({"messages": [U1, {"role": "tool", "tool_call_id": "a", "content": "r"}]}, "messages[1]"),
    ({"messages": [U1, {"role": "assistant", "content": "", "tool_calls": [call("a", "f", {})]},
                   {"role": "tool", "tool_call_id": "zzz", "content": "r"}]}, "messages[2].tool_call_id"),
    ({"messages": [U1, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [U1], "tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name"),
    ({"messages": [U1], "tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"messages": [U1], "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"messages": [U1], "tools": {"not": "a list"}}, "tools: expected a list"),
    ({"messages": [U1], "reasoning_effort": "low"}, "reasoning_effort: 'low'"),
    ({"messages": [U1], "response_format": "json"}, "response_format"),
    ({"messages": []}, "messages"),
]


@pytest.mark.parametrize("kwargs,field", INVALID)
def test_invalid_input_names_field(kwargs, field):
    with pytest.raises(ValueError) as exc:
        encode_messages(**kwargs)
    assert field in str(exc.value)


def test_chat_prompt_is_the_rendered_text_and_its_ids():
    """The one prompt builder of LLM.chat, the server and the REPL: the text carries BOS, so the ids get none added."""
    from deepinfer.tokenizer import Tokenizer

    tok = Tokenizer()
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    got = chat_prompt(tok, msgs, thinking=True, reasoning_effort="max")
    assert got["prompt"] == f"{B}{MAX_EFFORT}S{U}hi{A}<think>"
    assert got["prompt_token_ids"] == tok.encode(got["prompt"], add_special_tokens=False)
    assert got["prompt_token_ids"][0] == tok.bos_id and got["prompt_token_ids"].count(tok.bos_id) == 1
    with pytest.raises(ValueError, match="reasoning_effort"):
        chat_prompt(tok, msgs, reasoning_effort="low")
