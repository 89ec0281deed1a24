"""Structured outputs through `deepinfer serve` with the `openai` client: response_format (json_schema with
strict, json_object) and structured_outputs (vLLM's spelling: json, regex, choice, grammar), streamed and
not, concurrent; bad constraints are 400s naming the field the client sent, and the server keeps serving."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from tests.e2e.test_server import API_KEY, MODEL, TOOLS, Server, server  # noqa: E402,F401

N = 20
POINT = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
         "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _chat(client, i: int, stream: bool, **kw) -> tuple[str, str]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"point {i}"}], "max_tokens": 48, "seed": i,
            "temperature": 1.0, **kw}
    if not stream:
        c = client.chat.completions.create(**body).choices[0]
        return c.message.content, c.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(**body, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def _many(fn):
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(fn, range(N)))


def test_response_format_json_schema(client, server) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT, "strict": True}}
    outs = _many(lambda i: _chat(client, i, i % 2 == 0, response_format=rf))
    done = [t for t, r in outs if r == "stop"]
    assert len(done) >= N // 2
    for text in done:
        jsonschema.validate(json.loads(text), POINT)
    server.wait_idle()


def test_response_format_json_object(client) -> None:
    outs = _many(lambda i: _chat(client, i, i % 2 == 1, response_format={"type": "json_object"}, max_tokens=64))
    assert all(isinstance(json.loads(t), dict) for t, r in outs if r == "stop") and any(r == "stop" for _, r in outs)


@pytest.mark.parametrize("constraint, valid", [
    ({"regex": r"[a-z]{2}[0-9]{2}"}, lambda t: re.fullmatch(r"[a-z]{2}[0-9]{2}", t)),
    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"grammar": 'start: "[" N ("," N)* "]"\nN: /[0-9]/'}, lambda t: re.fullmatch(r"\[[0-9](,[0-9])*\]", t)),
    ({"json": POINT}, lambda t: jsonschema.validate(json.loads(t), POINT) is None),
])
def test_structured_outputs_on_completions(client, constraint, valid) -> None:
    def one(i: int) -> tuple[str, str]:
        body = dict(model=MODEL, prompt=f"value_{i} = ", max_tokens=32, seed=i, temperature=1.0,
                    extra_body={"structured_outputs": constraint})
        if i % 2:
            c = client.completions.create(**body).choices[0]
            return c.text, c.finish_reason
        chunks = [ch for ch in client.completions.create(**body, stream=True) if ch.choices]
        return "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason

    outs = _many(one)
    assert any(r == "stop" for _, r in outs)
    for text, reason in outs:
        if reason == "stop":
            assert valid(text), text


@pytest.mark.parametrize("body, param", [
    ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"choice": "red"}}}, "structured_outputs.choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nope"}}}},
     "response_format.json"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
     "structured_outputs"),
])
def test_bad_constraints_are_400s(client, server, body, param) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
    server.wait_idle()


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_parse_and_validate(client, tool_choice) -> None:
    schema = TOOLS[0]["function"]["parameters"]
    outs = _many(lambda i: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"weather {i}?"}], tools=TOOLS, tool_choice=tool_choice,
        max_tokens=96, seed=i, temperature=1.0).choices[0])
    done = [c for c in outs if c.finish_reason == "tool_calls"]
    assert len(done) >= N // 2, [c.finish_reason for c in outs]
    for c in done:
        assert c.message.tool_calls
        for call in c.message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), schema)
