"""`deepinfer serve` with the engine in its own process: what only that mode has. The engine death test
kills the process mid-stream: the open stream ends with an error event and [DONE], /health and new requests
answer 503, the server's death callbacks run (``serve`` stops and exits 1 on them), and its shutdown is
clean. The broad tests (outputs equal to the offline LLM, greedy and seeded; aborts; errors; metrics) run
in this mode in test_server.py and its sibling modules."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from deepinfer.server.engine_client import EngineClient  # noqa: E402
from deepinfer.server.engine_queries import num_unfinished  # noqa: E402
from tests.e2e.test_server import API_KEY, ENGINE, MODEL, PROMPTS, Server, launch, serve  # noqa: E402

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve(launch("process", **ENGINE))


def test_calls_cross_by_reference_only(server: Server) -> None:
    assert isinstance(server.state.bridge, EngineClient)
    assert server.engine_call(num_unfinished) == 0
    with pytest.raises(TypeError, match="module-level function of deepinfer"):
        server.engine_call(lambda e: e.get_num_unfinished_requests())


def test_engine_death_fails_requests_and_stops_the_server(server: Server) -> None:
    bridge = server.state.bridge
    died = threading.Event()
    bridge.on_death(died.set)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=HEADERS, timeout=60) as r:
        events = (line for line in r.iter_lines() if line)
        assert next(events).startswith("data: ")  # generating
        os.kill(bridge.process.pid, signal.SIGKILL)
        rest = list(events)
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert error["code"] == "engine_unavailable" and "engine process died" in error["message"]
    assert died.wait(30)
    assert not bridge.alive
    assert httpx.get(server.url + "/health").status_code == 503
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                   headers=HEADERS, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
