"""The OpenAI-compatible server end to end, on the bundled demo model, through the official openai client.

One uvicorn server runs in a background thread for the module (127.0.0.1, a port the kernel picked); an
offline ``LLM`` with the same engine settings is the reference for greedy and seeded outputs. The demo
weights rarely emit tool calls or a closing </think>: the tool-call and reasoning parsers are driven
through the response builders with hand-made engine outputs (test_server_units.py), and the end to end
requests here check what the server can be held to (the tool schemas reach the prompt token for token,
thinking mode routes the text to reasoning_content exactly as the offline chat does).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from deepinfer import LLM, LLMEngine, SamplingParams  # noqa: E402
from deepinfer.chat import encode_messages  # noqa: E402
from deepinfer.config.engine import EngineArgs, EngineConfig  # noqa: E402
from deepinfer.server import build_app  # noqa: E402
from deepinfer.server.app import ServerState  # noqa: E402
from deepinfer.server.engine_client import EngineClient  # noqa: E402
from deepinfer.server.engine_queries import check_cache_integrity, idle_state  # noqa: E402
from deepinfer.testing.serve_thread import serve_in_thread  # noqa: E402
from deepinfer.testing.server_cli import start_server  # noqa: E402

API_KEY = "sk-test-key"
MODEL = "deepinfer-demo"
# 72 history blocks hold a max_model_len (8192) request, so lengths are refused as with the default cache, whose
# allocation (the CPU default of 2 GiB) takes seconds in every engine of these files.
ENGINE = {"device": "cpu", "block_size": 128, "num_cache_blocks": 72, "load_progress": False}
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
WORDS = ["def", "class", "import", "return", "yield", "lambda", "async", "with"]
PROMPTS = [f"{WORDS[i % 8]} f{i}(x):" if i % 2 else f"# {WORDS[i % 8]} {i}\n" for i in range(32)]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write a sort."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


@dataclass
class Server:
    url: str
    state: ServerState

    def engine_call(self, fn, *args):
        return self.state.bridge.call_sync(fn, *args)

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Poll (bounded) until the engine has no request and every cache pool is empty; then check the pools."""
        deadline = time.monotonic() + timeout
        while True:
            busy, usage = self.engine_call(idle_state)
            if not busy and not any(usage.values()):
                self.engine_call(check_cache_integrity)
                return usage
            assert time.monotonic() < deadline, f"engine still busy after {timeout}s: usage {usage}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(**ENGINE)


def launch(mode: str, **engine_args) -> LLMEngine | EngineClient:
    """The engine a server runs in ``mode``: "process" (its own process, deepinfer serve's default) or
    "thread" (``--no-engine-process``)."""
    if mode == "process":
        return EngineClient.launch(EngineConfig.create(EngineArgs.from_kwargs(**engine_args)))
    return LLMEngine.from_engine_args(**engine_args)


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """The server of the broad tests, in the mode of ``--server-mode`` (default: the engine process)."""
    yield from serve(launch(request.config.getoption("--server-mode"), **ENGINE))


@pytest.fixture(scope="module")
def thread_server(request: pytest.FixtureRequest) -> Iterator[Server]:
    yield from serve(launch("thread", **ENGINE))


@pytest.fixture(params=["default", "thread"])
def any_server(request: pytest.FixtureRequest) -> Server:
    """The representative tests run on both engine modes: ``server``'s, and the engine thread."""
    if request.param == "thread" and request.config.getoption("--server-mode") == "thread":
        pytest.skip("--server-mode=thread: the default server already runs the engine thread")
    return request.getfixturevalue("server" if request.param == "default" else "thread_server")


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def serve(engine: LLMEngine | EngineClient) -> Iterator[Server]:
    """Serve ``engine`` from a background thread until the generator is closed (a fixture's teardown)."""
    app = build_app(engine, api_key=API_KEY)
    running = serve_in_thread(app, "server")
    state: ServerState = app.state.server
    yield Server(running.url, state)
    died = state.bridge.error is not None  # a test killed it
    running.stop()
    assert not state.bridge.alive  # the lifespan shutdown stopped the engine
    if isinstance(engine, EngineClient) and not died:
        assert engine.process.exitcode == 0  # the engine process exited by itself


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return _client(server)


def _greedy(llm: LLM, prompts: list, max_tokens: int) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


# ---- basic endpoints ----------------------------------------------------------------------------------------
def test_health_and_models(server: Server, client: openai.OpenAI) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completions_greedy_equal_offline(any_server: Server, offline: LLM) -> None:
    client = _client(any_server)
    prompts = PROMPTS[:3]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, **GREEDY)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.created > 0
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == _greedy(offline, prompts, 8)
    ids = [offline.get_tokenizer().encode(p, add_special_tokens=True) for p in prompts]
    assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24
    by_ids = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=8, **GREEDY)  # token-id prompt
    assert by_ids.choices[0].text == r.choices[0].text and all(c.finish_reason == "length" for c in r.choices)


def test_completions_stream_with_usage(client: openai.OpenAI, offline: LLM) -> None:
    prompts = PROMPTS[3:5]
    texts = {0: "", 1: ""}
    finish, chunks = {}, list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, stream=True,
                                                         stream_options={"include_usage": True}, **GREEDY))
    for ch in chunks[:-1]:
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == _greedy(offline, prompts, 6)
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_greedy_equal_offline_stream_and_not(client: openai.OpenAI, offline: LLM) -> None:
    ref = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=8, **GREEDY)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.choices[0].content
    assert r.usage.prompt_tokens == len(ref.request.prompt_token_ids) and r.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.choices[0].content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_samples_and_seed_reproducible(client: openai.OpenAI, offline: LLM) -> None:
    kw = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 11,
          "extra_body": {"ignore_eos": True}}
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # each sample has its own seed
    ref = offline.generate(PROMPTS[5], SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0]
    assert texts == [c.text for c in ref.outputs]
    chat = [client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, seed=5,
                                           temperature=0.9) for _ in range(2)]
    assert [c.message.content for c in chat[0].choices] == [c.message.content for c in chat[1].choices]


def test_logprobs(client: openai.OpenAI, offline: LLM) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPTS[6], max_tokens=5, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == 5
    ref = offline.generate(PROMPTS[6], SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    for value, top, tid, pos in zip(lp.token_logprobs, lp.top_logprobs, ref.token_ids, ref.logprobs):
        assert value == pytest.approx(pos[tid].logprob, abs=1e-5)
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: the best
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True,
                                          top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        values = [t.logprob for t in item.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert item.logprob == pytest.approx(values[0]) and item.token == item.top_logprobs[0].token
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True,
                                            top_logprobs=1, stream=True, **GREEDY)
    streamed = [t.token for ch in stream for c in ch.choices if c.logprobs for t in c.logprobs.content]
    assert streamed == [t.token for t in content]


def test_tools_are_rendered_into_the_prompt(client: openai.OpenAI, offline: LLM) -> None:
    """What is checked: the prompt the server built is exactly encode_messages(..., tools=...) (equal token
    counts; the count grows by the tool section), tool_choice "none" drops the tools, a forced call of an
    unknown function is refused (forced calls themselves: tests/e2e/test_server_structured.py).
    Parsing the model's tool calls is covered by the builder test above."""
    tok = offline.get_tokenizer()

    def prompt_tokens(**kw) -> int:
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **kw).usage.prompt_tokens

    with_tools = len(tok.encode(encode_messages(MESSAGES, tools=TOOLS), add_special_tokens=False))
    without = len(tok.encode(encode_messages(MESSAGES), add_special_tokens=False))
    assert with_tools > without + 50
    assert prompt_tokens(tools=TOOLS) == with_tools
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == without == prompt_tokens()
    for choice in ({"type": "function", "function": {"name": "no_such_tool"}}, "always"):
        with pytest.raises(openai.BadRequestError) as e:
            prompt_tokens(tools=TOOLS, tool_choice=choice)
        assert e.value.body["param"] == "tool_choice"


def test_thinking_mode_fills_reasoning_content(client: openai.OpenAI, offline: LLM) -> None:
    ref = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), thinking=True,
                       use_tqdm=False)[0].choices[0]
    assert ref.reasoning  # random weights: no </think> in 8 tokens, so everything is reasoning
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, **GREEDY}
    kw["extra_body"] = {**kw["extra_body"], "chat_template_kwargs": {"thinking": True}}
    r = client.chat.completions.create(**kw)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (ref.reasoning, ref.content)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == ref.reasoning
    effort = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, reasoning_effort="high",
                                            **GREEDY)
    assert effort.choices[0].message.reasoning_content == ref.reasoning


# ---- load, disconnects, bad input --------------------------------------------------------------------------
def test_32_concurrent_streams_equal_offline(any_server: Server, offline: LLM) -> None:
    server = any_server
    expected = _greedy(offline, PROMPTS, 8)

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, bool]:
        raw = await aclient.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                                 stream=True, **GREEDY)
        text, done = "", False
        async for line in raw.http_response.aiter_lines():  # raw SSE, to see the [DONE] terminator itself
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        return text, done

    async def main() -> list[tuple[str, bool]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in PROMPTS))

    results = asyncio.run(main())
    assert all(done for _, done in results)
    assert [text for text, _ in results] == expected
    assert set(server.wait_idle().values()) == {0.0}


def test_disconnect_frees_the_cache(any_server: Server) -> None:
    server = any_server
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": PROMPTS[7], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]  # two events and their blank separators
        assert got[0].startswith("data: ") and r.status_code == 200  # it was generating when we left
        server.wait_idle()  # 2000 tokens would take minutes: an empty cache within 20 s means it was aborted
        # Non-streaming: the client gives up (read timeout closes the connection) and the request is aborted.
        with pytest.raises(httpx.ReadTimeout):
            h.post("/v1/completions", json={**body, "stream": False}, timeout=httpx.Timeout(60, read=1.0))
        server.wait_idle()


def _error(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    return err


BAD = [  # (path, body, status, param)
    ("/v1/completions", b'{"prompt": "x", ', 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"prompt": [5] * 9000}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt[0]"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 9000}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "reasoning_effort": "huge"}, 400, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "x"}]}, 400, "tools[0].type"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(any_server: Server) -> None:
    server, client = any_server, _client(any_server)
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, timeout=60) as h:
        for path, body, status, param in BAD:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = h.post(path, content=content, headers=auth)
            assert r.status_code == status, (body, r.text)
            err = _error(r)
            assert err["param"] == param, (body, err)
            if param is not None:
                assert param.split("[")[0].split(".")[0] in err["message"], err
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = h.post("/v1/completions", json={"prompt": "x"}, headers=headers)
            assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key"
        big = h.post("/v1/completions", json={"prompt": "x" * (2 << 20)}, headers=auth)
        assert big.status_code == 413 and _error(big)["code"] == "request_too_large"
        assert h.get("/v1/nothing-here", headers=auth).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=-1)
    assert e.value.body["param"] == "temperature"
    ok = client.completions.create(model=MODEL, prompt=PROMPTS[8], max_tokens=3, **GREEDY)
    assert ok.usage.completion_tokens == 3
    server.wait_idle()


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_move(any_server: Server) -> None:
    server, client = any_server, _client(any_server)
    before = _metrics(server.url)
    client.completions.create(model=MODEL, prompt=PROMPTS[9], max_tokens=4, **GREEDY)
    after = _metrics(server.url)
    ok = ("deepinfer_http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    assert after[ok] == before.get(ok, 0) + 1
    model = (("model_name", MODEL),)
    for name, grew_by in (("deepinfer_generation_tokens_total", 4), ("deepinfer_prompt_tokens_total", 1),
                          ("deepinfer_time_to_first_token_seconds_count", 1), ("deepinfer_e2e_request_latency_seconds_count", 1),
                          ("deepinfer_time_per_output_token_seconds_count", 1)):
        assert after[(name, model)] >= before.get((name, model), 0) + grew_by, name
    pools = {dict(k[1])["pool"] for k in after if k[0] == "deepinfer_cache_usage_ratio"}
    assert pools == {"history", "window", "state"}
    assert after[("deepinfer_num_requests_running", model)] == 0
    assert ("deepinfer_num_requests_waiting", model) in after


def test_prefix_cache_reports_cached_tokens_and_keeps_salts_apart(server: Server, client: openai.OpenAI,
                                                                  offline: LLM) -> None:
    system = {"role": "system", "content": " ".join(f"rule {i}: be brief." for i in range(60))}  # > 2 blocks
    turn1 = [system, {"role": "user", "content": "Say hi."}]
    before = _metrics(server.url)
    first = client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=6, **GREEDY)
    assert first.usage.prompt_tokens > 256
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Again."}]
    ref = offline.chat(turn2, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.choices[0].content
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert cached >= 256 and cached % 128 == 0  # the system prompt's full blocks, at least
    salted = dict(GREEDY, extra_body={**GREEDY["extra_body"], "cache_salt": "tenant-x"})
    other = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=6, **salted)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].message.content == ref.choices[0].content
    again = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=6, **salted)
    assert again.usage.prompt_tokens_details.cached_tokens >= 256
    server.wait_idle()
    after = _metrics(server.url)
    model = (("model_name", MODEL),)
    hits = after[("deepinfer:prefix_cache_hits_total", model)] - before.get(("deepinfer:prefix_cache_hits_total", model), 0)
    queries = after[("deepinfer:prefix_cache_queries_total", model)] - before.get(
        ("deepinfer:prefix_cache_queries_total", model), 0)
    assert hits >= cached + 256 and queries >= 4 * first.usage.prompt_tokens
    assert {dict(k[1])["pool"] for k in after if k[0] == "deepinfer:prefix_cache_blocks"} == {"history", "window", "state"}


def test_serve_cli_sigterm_exits_cleanly() -> None:
    """`python -m deepinfer.server` (= `deepinfer serve`) on port 0; SIGTERM while a long stream is open: the
    stream runs on for the graceful timeout, then ends with finish_reason "abort" and [DONE], and the process
    exits 0."""
    proc, port = start_server(["--served-model-name", "tiny", "--graceful-shutdown-timeout", "1",
                               "--num-cache-blocks", "64",  # a small cache: allocating the default one is seconds
                               "--max-model-len", "8192"])  # room for the 4000-token request (more: a 400)
    try:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"
        body = {"model": "tiny", "prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.TransportError):  # no longer accepting
            httpx.get(url + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stderr.close()
