"""100 requests per constraint kind through the `openai` client against a real `deepinfer serve` (a subprocess on
the bundled demo model): JSON schema (``response_format`` json_schema, strict), any JSON object
(``response_format`` json_object), regex, choice and Lark grammar (``structured_outputs``), each kind 100 times
whole and 40 times streamed, 32 at a time, seeded at temperature 1.0. Every output that ended on its own
obeys its constraint; most do end on their own. Streamed requests are fewer to keep the file under a minute
on two CPU cores (100 streamed too took 77 s of requests plus the server's start; the JSON kinds cost most).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from tests.e2e.test_bench_serve import API_KEY, server_url  # noqa: E402,F401

N = 100
N_STREAMED = 40
MODEL = "deepinfer-demo"
POINT = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
         "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
REGEX = r"[a-z]{2}[0-9]{2}"
CHOICE = ["red", "green", "blue"]
LARK = 'start: "[" N ("," N)* "]"\nN: /[0-9]/'

# kind -> (request fields, endpoint, validator of a finished output)
KINDS = {
    "json": ({"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "point", "schema": POINT, "strict": True}}}, "chat",
             lambda t: jsonschema.validate(json.loads(t), POINT) is None),
    "json_object": ({"response_format": {"type": "json_object"}}, "chat", lambda t: isinstance(json.loads(t), dict)),
    "regex": ({"extra_body": {"structured_outputs": {"regex": REGEX}}}, "completions",
              lambda t: re.fullmatch(REGEX, t) is not None),
    "choice": ({"extra_body": {"structured_outputs": {"choice": CHOICE}}}, "completions", lambda t: t in CHOICE),
    "grammar": ({"extra_body": {"structured_outputs": {"grammar": LARK}}}, "completions",
                lambda t: re.fullmatch(r"\[[0-9](,[0-9])*\]", t) is not None),
}


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:  # noqa: F811
    return openai.OpenAI(base_url=server_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _one(client: openai.OpenAI, kind: str, i: int, stream: bool) -> tuple[str, str]:
    fields, endpoint, _ = KINDS[kind]
    common = dict(model=MODEL, max_tokens=40, seed=i, temperature=1.0, **fields)
    if endpoint == "chat":
        body = dict(common, messages=[{"role": "user", "content": f"{kind} {i}"}])
        if not stream:
            c = client.chat.completions.create(**body).choices[0]
            return c.message.content, c.finish_reason
        chunks = [ch for ch in client.chat.completions.create(**body, stream=True) if ch.choices]
        return ("".join(ch.choices[0].delta.content or "" for ch in chunks),
                next(ch.choices[0].finish_reason for ch in reversed(chunks) if ch.choices[0].finish_reason))
    body = dict(common, prompt=f"{kind}_{i} = ")
    if not stream:
        c = client.completions.create(**body).choices[0]
        return c.text, c.finish_reason
    chunks = [ch for ch in client.completions.create(**body, stream=True) if ch.choices]
    return "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_hundred_requests_obey_their_constraint(client, kind, stream) -> None:
    n = N_STREAMED if stream else N
    with ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda i: _one(client, kind, i, stream), range(n)))
    assert {r for _, r in outs} <= {"stop", "length"}, outs
    done = [t for t, r in outs if r == "stop"]
    assert len(done) >= n // 2, f"only {len(done)} of {n} finished their structure"
    valid = KINDS[kind][2]
    for text in done:
        assert valid(text), text
