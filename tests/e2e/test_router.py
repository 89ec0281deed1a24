"""``deepinfer router`` in front of two real ``deepinfer serve`` replicas of the demo model (CPU), through the
official openai client.

The replicas run as subprocesses (``--no-engine-process``, prefix caching on, 128-token blocks); the router
runs in a background thread of this process, so its replicas' state and metrics can be read. Multi-turn
chats (a long system prompt of its own per conversation, 3 turns, sequential) through the cache-aware router
stay on the replica of their first turn and hit its cache on every later turn (the replica's own
``usage.prompt_tokens_details.cached_tokens``); round robin over the same kind of workload hits less. A
replica that is down costs a retry and is taken out; bad requests get the replica's own 400.
"""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from deepinfer.config.router import RouterConfig  # noqa: E402
from deepinfer.router.app import Router, build_router_app  # noqa: E402
from deepinfer.testing.serve_thread import ThreadedServer, serve_in_thread  # noqa: E402
from deepinfer.testing.server_cli import start_server  # noqa: E402
from deepinfer.tokenizer import Tokenizer  # noqa: E402

API_KEY = "sk-router"
WORDS = ["alpha", "beta", "gamma", "delta", "sorting", "graphs", "parser", "tokens", "cache", "vector", "matrix"]


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[str]]:
    procs: list = [None, None]

    def start(i: int) -> None:
        procs[i] = start_server(["--no-engine-process", "--num-cache-blocks", "64", "--api-key", API_KEY,
                                 "--graceful-shutdown-timeout", "1"])

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert all(procs), "a replica did not start"
        for proc, _ in procs:  # keep reading their logs so they never block on a full pipe
            threading.Thread(target=proc.stderr.read, daemon=True).start()
        yield [f"http://127.0.0.1:{port}" for _, port in procs]
    finally:
        for p in procs:
            if p is not None:
                p[0].terminate()
                p[0].wait(30)


@dataclass
class RouterServer:
    url: str
    router: Router

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture
def start_router() -> Iterator:
    servers: list[ThreadedServer] = []

    def start(urls: list[str], **kw) -> RouterServer:
        app = build_router_app(RouterConfig(tuple(urls), block_size=128, **kw), Tokenizer())
        servers.append(serve_in_thread(app, "router", timeout=30))
        return RouterServer(servers[-1].url, app.state.router)

    yield start
    for running in servers:
        running.stop()


def _closed_port_url() -> str:
    """A URL nothing listens on (connections are refused at once)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def _system(seed: int) -> str:
    rng = random.Random(seed)
    return "You answer about " + " ".join(rng.choice(WORDS) for _ in range(400)) + "."


def _chats(client: openai.OpenAI, seeds: list[int], turns: int = 3) -> list[list[int]]:
    """Each conversation's cached prompt tokens per turn, the conversations taking turns one request at a time."""
    history = {s: [{"role": "system", "content": _system(s)}] for s in seeds}
    cached: dict[int, list[int]] = {s: [] for s in seeds}
    for turn in range(turns):
        for s in seeds:
            history[s].append({"role": "user", "content": f"Question {turn}: explain {WORDS[(s + turn) % 11]}."})
            r = client.chat.completions.create(model="deepinfer-demo", messages=history[s], max_tokens=6,
                                               temperature=0, extra_body={"ignore_eos": True})
            history[s].append({"role": "assistant", "content": r.choices[0].message.content})
            details = r.usage.prompt_tokens_details
            cached[s].append(details.cached_tokens if details is not None else 0)
    return [cached[s] for s in seeds]


def test_cache_aware_keeps_each_chat_on_the_replica_that_holds_it(replicas, start_router) -> None:
    rs = start_router(replicas)
    cached = _chats(rs.client(), [11, 12, 13])
    # Later turns went where the conversation's blocks are, and that replica had them.
    assert rs.metric("deepinfer_router_requests_total", reason="cache") == 6
    assert rs.metric("deepinfer_router_requests_total", reason="least_load") == 3
    assert all(c[0] == 0 and 0 < c[1] <= c[2] for c in cached), cached
    # The three new conversations were spread over both replicas.
    routed = [w.routed for w in rs.router.workers.all]
    assert sorted(routed) == [3, 6], routed
    assert rs.metric("deepinfer_router_matched_tokens_total") > 0.5 * rs.metric("deepinfer_router_prompt_tokens_total")
    assert all(w.outstanding == 0 for w in rs.router.workers.all)


def test_round_robin_scatters_the_same_chats_and_hits_less(replicas, start_router) -> None:
    aware = _chats(start_router(replicas).client(), [21, 22, 23])
    rr = _chats(start_router(replicas, policy="round_robin").client(), [31, 32, 33])
    assert sum(map(sum, aware)) > 1.5 * sum(map(sum, rr)), (aware, rr)


def test_outputs_and_streams_pass_through_unchanged(replicas, start_router) -> None:
    rs = start_router(replicas, policy="round_robin")
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    direct = openai.OpenAI(base_url=replicas[1] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    want = direct.chat.completions.create(model="deepinfer-demo", messages=messages, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    client = rs.client()
    got = [client.chat.completions.create(model="deepinfer-demo", messages=messages, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
           for _ in range(2)]  # round robin: one per replica
    stream = client.chat.completions.create(model="deepinfer-demo", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert got == [want, want] and "".join(chunks) == want and len(chunks) > 2
    text = client.completions.create(model="deepinfer-demo", prompt="import os\n", max_tokens=5, temperature=0)
    assert text.choices[0].text and text.usage.completion_tokens == 5
    assert [m.id for m in client.models.list().data] == ["deepinfer-demo"]


def test_a_replica_that_is_down_costs_a_retry_and_is_taken_out(replicas, start_router) -> None:
    dead = _closed_port_url()
    rs = start_router([dead, *replicas], policy="round_robin", max_failures=1, health_check_interval_secs=3600)
    assert [w.healthy for w in rs.router.workers.all] == [False, True, True]  # the start-up check found it
    rs.router.workers.all[0].checked(True)  # as if it had passed a check, then died
    client = rs.client()
    for _ in range(3):
        r = client.completions.create(model="deepinfer-demo", prompt="x = 1\n", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
    assert not rs.router.workers.all[0].healthy
    assert rs.metric("deepinfer_router_retries_total", worker=dead) == 1
    assert rs.metric("deepinfer_router_worker_healthy", worker=dead) == 0
    assert httpx.get(rs.url + "/health").json()["healthy_replicas"] == 2


def test_bad_requests_get_the_replicas_error_and_no_replica_is_a_503(replicas, start_router) -> None:
    client = start_router(replicas).client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="deepinfer-demo", messages=[{"role": "user"}], max_tokens=3)
    assert "messages" in str(e.value)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).completions.create(
            model="deepinfer-demo", prompt="x", max_tokens=1)
    nobody = start_router([_closed_port_url()])
    r = httpx.post(nobody.url + "/v1/completions", json={"model": "deepinfer-demo", "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"
    assert httpx.get(nobody.url + "/health").status_code == 503
