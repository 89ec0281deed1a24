"""`deepinfer serve --async-scheduling`: the served tokens are the offline synchronous engine's.

Concurrent streamed and whole completions (greedy and seeded, with a stop string) against a server whose
engine plans step N+1 before reading step N's tokens must return exactly what the offline `LLM` (the
synchronous loop) returns for each prompt alone; a client that disconnects mid-stream has its request
aborted, and the cache ends empty.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from deepinfer import SamplingParams  # noqa: E402
from deepinfer.server.engine_queries import async_scheduling  # noqa: E402
from tests.e2e.test_server import API_KEY, ENGINE, MODEL, PROMPTS, Server, launch, offline, serve  # noqa: E402,F401

CASES = [(PROMPTS[i], {"temperature": 0}) for i in range(0, 8, 2)] + \
    [(PROMPTS[i], {"temperature": 0.9, "top_p": 0.9, "seed": 11 + i}) for i in range(1, 8, 2)]


@pytest.fixture(scope="module")
def async_server(request: pytest.FixtureRequest) -> Iterator[Server]:
    yield from serve(launch(request.config.getoption("--server-mode"), **ENGINE, async_scheduling=True))


def _complete(client: openai.OpenAI, prompt: str, params: dict, stream: bool) -> str:
    body = dict(model=MODEL, prompt=prompt, max_tokens=24, stop=["\n\n"], **params)
    if not stream:
        return client.completions.create(**body).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices)


def test_served_async_equals_offline_sync(async_server: Server, offline) -> None:
    client = openai.OpenAI(base_url=async_server.url + "/v1", api_key=API_KEY, max_retries=0)
    assert not offline.engine.async_scheduling and async_server.engine_call(async_scheduling)
    want = [offline.generate(p, SamplingParams(max_tokens=24, stop=["\n\n"], **kw), use_tqdm=False)[0].outputs[0].text
            for p, kw in CASES]
    with ThreadPoolExecutor(len(CASES)) as pool:
        got = list(pool.map(lambda i: _complete(client, *CASES[i], stream=i % 2 == 0), range(len(CASES))))
    assert got == want
    async_server.wait_idle()


def test_disconnect_mid_stream_aborts(async_server: Server) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", async_server.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        events = (line for line in r.iter_lines() if line)  # SSE events are separated by blank lines
        for _ in range(3):
            assert next(events).startswith("data: ")
    async_server.wait_idle()
