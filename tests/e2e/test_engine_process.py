"""`deepinfer serve` with the engine in its own process: what only that mode has. The engine death test
kills the process mid-stream: the open stream ends with an error event and [DONE], /health and new requests
answer 503, the server's death callbacks run (``serve`` stops and exits 1 on them), and its shutdown is
clean. A data-parallel world runs behind the engine process as it does in-process. The broad tests (outputs equal to the offline LLM, greedy and seeded; aborts; errors; metrics) run
in this mode in test_server.py and its sibling modules."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from deepinfer.server.engine_client import EngineClient  # noqa: E402
from deepinfer.server.engine_queries import num_unfinished  # noqa: E402
from deepinfer.testing.server_cli import start_server  # noqa: E402
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


def _engine_pid(server_pid: int) -> int:
    """The engine core among the server's child processes (multiprocessing's resource tracker is another)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        if ppid == server_pid and b"spawn_main" in cmdline:
            return int(stat.parent.name)
    raise AssertionError("no engine process among the server's children")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the engine process through /proc")
def test_serve_cli_exits_1_when_the_engine_process_dies() -> None:
    proc, port = start_server(["--num-cache-blocks", "64"])
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        os.kill(_engine_pid(proc.pid), signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 1
        assert "the engine process died" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_data_parallel_world_behind_the_engine_process() -> None:
    """The engine process starts the ranks of a DP x EP world itself; greedy outputs equal the offline LLM's,
    and shutdown stops the world (the process exits 0)."""
    import asyncio

    from deepinfer import LLM, SamplingParams
    from deepinfer.config.engine import EngineArgs, EngineConfig
    from deepinfer.server.commands import EngineRequest
    from tests.e2e.test_parallel_engine import ARGS

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["def f(x):", "import os", "class A:"]
    client = EngineClient.launch(EngineConfig.create(EngineArgs.from_kwargs(
        **ARGS, data_parallel_size=2, enable_expert_parallel=True)))

    async def generate() -> list[tuple[int, ...]]:
        client.start()
        streams = [await client.submit([EngineRequest(f"r{i}", p, params)]) for i, p in enumerate(prompts)]
        return [[o async for o in s][-1].outputs[0].token_ids for s in streams]

    try:
        got = asyncio.run(generate())
        assert client.call_sync(num_unfinished) == 0
    finally:
        client.shutdown()
    assert client.process.exitcode == 0
    assert got == [o.outputs[0].token_ids for o in LLM(**ARGS).generate(prompts, params, use_tqdm=False)]
