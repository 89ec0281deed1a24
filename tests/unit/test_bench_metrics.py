"""`deepinfer bench serve` pieces without a server: statistics against hand-computed values, the datasets,
the arrival schedule, flag validation, and the streaming client on canned server responses."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest

from deepinfer.benchmarks.datasets import draw_lengths, jsonl_requests, random_requests, sharegpt_requests
from deepinfer.benchmarks.metrics import (RequestOutcome, compute_metrics, format_table, result_dict, summarize,
                                          tpot)
from deepinfer.benchmarks.options import add_bench_parser, config_from_args
from deepinfer.benchmarks.serve import arrival_offsets
from deepinfer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer()


# ---- statistics ---------------------------------------------------------------------------------------------
def test_summary_by_hand() -> None:
    s = summarize([1.0, 2.0, 3.0, 4.0], [50, 99, 100])  # seconds in, milliseconds out
    assert s.mean == pytest.approx(2500.0) and s.median == pytest.approx(2500.0)
    assert s.std == pytest.approx(math.sqrt(1.25) * 1000)  # population std: mean squared deviation 1.25 s^2
    # Linear interpolation: p99 sits at rank 0.99 * 3 = 2.97, between 3 s and 4 s.
    assert dict(s.percentiles) == pytest.approx({50.0: 2500.0, 99.0: 3970.0, 100.0: 4000.0})
    empty = summarize([], [99])
    assert (empty.mean, empty.median, empty.std, empty.percentiles) == (0.0, 0.0, 0.0, ((99.0, 0.0),))


OUTCOMES = [
    RequestOutcome(True, prompt_len=10, output_len=5, ttft=0.2, itls=(0.1, 0.3), latency=1.0),
    RequestOutcome(True, prompt_len=20, output_len=1, ttft=0.4, itls=(), latency=0.4),
    RequestOutcome(True, prompt_len=30, output_len=4, ttft=0.1, itls=(0.2,), latency=0.7),
    RequestOutcome(False, prompt_len=100, latency=0.05, error="HTTP 500: boom"),
]


def test_tpot_definition() -> None:
    assert tpot(OUTCOMES[0]) == pytest.approx((1.0 - 0.2) / 4)
    assert tpot(OUTCOMES[1]) is None  # one output token: no decode phase
    assert tpot(OUTCOMES[2]) == pytest.approx((0.7 - 0.1) / 3)
    assert tpot(OUTCOMES[3]) is None  # failed


def test_metrics_by_hand() -> None:
    m = compute_metrics(OUTCOMES, duration=2.0, percentiles=[99])
    assert (m.completed, m.failed, m.total_input_tokens, m.total_output_tokens) == (3, 1, 60, 10)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(5.0)
    assert m.total_token_throughput == pytest.approx(35.0)
    ttft = m.stats["ttft"]  # 200, 400, 100 ms (the failure is left out)
    assert (ttft.mean, ttft.median) == pytest.approx((700 / 3, 200.0))
    assert ttft.std == pytest.approx(math.sqrt(sum((x - 700 / 3) ** 2 for x in (200, 400, 100)) / 3))
    tp = m.stats["tpot"]  # 200 ms and 200 ms
    assert (tp.mean, tp.median, tp.std, dict(tp.percentiles)[99.0]) == pytest.approx((200.0, 200.0, 0.0, 200.0))
    itl = m.stats["itl"]  # pooled gaps 100, 300, 200 ms; p99 at rank 1.98 between 200 and 300
    assert (itl.mean, itl.median, dict(itl.percentiles)[99.0]) == pytest.approx((200.0, 200.0, 298.0))
    e2el = m.stats["e2el"]
    assert (e2el.mean, e2el.median) == pytest.approx((700.0, 700.0))
    assert compute_metrics([], 0.0).request_throughput == 0.0


def test_result_json_and_table() -> None:
    m = compute_metrics(OUTCOMES, duration=2.0, percentiles=[90, 99.9])
    r = result_dict(m, OUTCOMES, {"date": "20250101-000000", "backend": "openai", "request_rate": "inf"})
    assert r["date"] == "20250101-000000" and r["completed"] == 3 and r["failed"] == 1
    assert r["input_lens"] == [10, 20, 30, 100] and r["output_lens"] == [5, 1, 4, 0]
    assert r["ttfts"] == [0.2, 0.4, 0.1, 0.0] and r["itls"] == [[0.1, 0.3], [], [0.2], []]
    assert r["errors"] == ["", "", "", "HTTP 500: boom"]
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert {f"{stat}_{name}_ms" for stat in ("mean", "median", "std", "p90", "p99.9")} <= set(r)
    json.dumps(r)  # plain JSON types only
    table = format_table(m, ["ttft", "e2el"], max_concurrency=4)
    lines = table.splitlines()
    assert "Serving Benchmark Result" in lines[0] and set(lines[-1]) == {"="}
    assert all(len(line) == 50 for line in lines)
    assert "Successful requests:                             3" in lines
    assert "Maximum request concurrency:                     4" in lines
    assert "Mean TTFT (ms):                             233.33" in lines and "P99.9 E2EL (ms):" in table
    assert "TPOT" not in table


# ---- datasets -----------------------------------------------------------------------------------------------
def test_random_lengths_within_ratio_and_seeded(tok: Tokenizer) -> None:
    lens = draw_lengths(np.random.default_rng(0), 100, 0.25, 2000)
    assert min(lens) == 75 and max(lens) == 125  # both ends are reachable
    reqs = random_requests(tok, 50, 40, 10, range_ratio=0.5, prefix_len=6, seed=7)
    assert all(6 + 20 <= r.prompt_len <= 6 + 60 and 5 <= r.output_len <= 15 for r in reqs)
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    assert len({r.prompt[:6] for r in reqs}) == 1  # one shared prefix
    assert not any(tok.is_special(i) for r in reqs for i in r.prompt)
    assert random_requests(tok, 50, 40, 10, range_ratio=0.5, prefix_len=6, seed=7) == reqs
    assert random_requests(tok, 50, 40, 10, range_ratio=0.5, prefix_len=6, seed=8) != reqs
    fixed = random_requests(tok, 5, 32, 8, seed=1)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(32, 8)] * 5


def test_random_text_prompts_are_counted(tok: Tokenizer) -> None:
    reqs = random_requests(tok, 20, 32, 8, seed=2, as_text=True)
    assert all(isinstance(r.prompt, str) and r.prompt_len == len(tok.encode(r.prompt)) for r in reqs)
    assert sum(r.prompt_len == 32 for r in reqs) >= 18  # the length fix-up settles nearly always
    assert random_requests(tok, 20, 32, 8, seed=2, as_text=True) == reqs


def test_jsonl_dataset(tmp_path: Path, tok: Tokenizer) -> None:
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": f"def f{i}(x):", "output_len": i + 1} for i in range(6)] + [{"prompt": "import os"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    ordered = jsonl_requests(path, tok, 10, default_output_len=9, shuffle=False)
    assert [r.prompt for r in ordered] == [r["prompt"] for r in rows]
    assert [r.output_len for r in ordered] == [1, 2, 3, 4, 5, 6, 9]
    assert [r.prompt_len for r in ordered] == [len(tok.encode(r["prompt"])) for r in rows]
    sample = jsonl_requests(path, tok, 4, default_output_len=9, seed=5)
    assert len(sample) == 4 and sample == jsonl_requests(path, tok, 4, default_output_len=9, seed=5)
    custom = tmp_path / "c.jsonl"
    custom.write_text(json.dumps({"text": "x = 1", "max_tokens": 3}) + "\n")
    [r] = jsonl_requests(custom, tok, 1, default_output_len=9, prompt_field="text", output_len_field="max_tokens")
    assert (r.prompt, r.output_len) == ("x = 1", 3)
    path.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: .*'prompt'"):
        jsonl_requests(path, tok, 5, default_output_len=9)
    path.write_text("\n")
    with pytest.raises(ValueError, match=r"d\.jsonl: no prompts"):
        jsonl_requests(path, tok, 5, default_output_len=9)
    path.write_text('{"prompt": "a", "output_len": 0}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:1: output_len: expected a positive integer"):
        jsonl_requests(path, tok, 5, default_output_len=9)


def test_sharegpt_dataset(tmp_path: Path, tok: Tokenizer) -> None:
    data = [
        {"id": "a", "conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "hello there"},
                                      {"from": "gpt", "value": "def answer():\n    return 42"},
                                      {"from": "human", "value": "more"}, {"from": "gpt", "value": "no"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "only a question"}]},  # no answer: skipped
        {"id": "c", "conversations": [{"from": "user", "value": "import sys"}, {"from": "assistant", "value": "ok"}]},
        {"id": "d"},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(path, tok, 10, shuffle=False)
    assert [r.prompt for r in reqs] == ["hello there", "import sys"]
    assert [r.output_len for r in reqs] == [len(tok.encode("def answer():\n    return 42")), len(tok.encode("ok"))]
    assert [r.prompt_len for r in reqs] == [len(tok.encode("hello there")), len(tok.encode("import sys"))]
    fixed = sharegpt_requests(path, tok, 10, output_len=7, shuffle=False)  # an override keeps answerless entries
    assert [r.prompt for r in fixed] == ["hello there", "only a question", "import sys"]
    assert all(r.output_len == 7 for r in fixed)
    assert len(sharegpt_requests(path, tok, 1, seed=3)) == 1
    path.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="expected a JSON list"):
        sharegpt_requests(path, tok, 1)


# ---- arrivals -----------------------------------------------------------------------------------------------
def test_arrival_offsets() -> None:
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    assert arrival_offsets(0, 5.0) == []
    t = np.asarray(arrival_offsets(20001, 10.0, 1.0, seed=0))
    gaps = np.diff(t)
    assert t[0] == 0.0 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)  # mean gap 1 / rate
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1.0, rel=0.05)  # exponential: CV^2 = 1
    bursty = np.diff(arrival_offsets(20001, 10.0, 0.25, seed=0))
    assert bursty.mean() == pytest.approx(0.1, rel=0.05)
    assert (bursty.std() / bursty.mean()) ** 2 == pytest.approx(4.0, rel=0.1)  # gamma: CV^2 = 1 / shape
    assert arrival_offsets(50, 3.0, seed=1) == arrival_offsets(50, 3.0, seed=1) != arrival_offsets(50, 3.0, seed=2)


# ---- flags --------------------------------------------------------------------------------------------------
def _config(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return config_from_args(parser.parse_args(["bench", "serve", *argv]))


def test_flags_urls_and_fields() -> None:
    c = _config()
    assert (c.url, c.models_url) == ("http://127.0.0.1:8000/v1/completions", "http://127.0.0.1:8000/v1/models")
    c = _config("--base-url", "http://h:9/v1/", "--backend", "openai-chat", "--temperature", "0", "--ignore-eos",
                "--extra-body", '{"top_k": 5}', "--metric-percentiles", "50, 99.9", "--metadata", "gpu=h200")
    assert (c.url, c.models_url) == ("http://h:9/v1/chat/completions", "http://h:9/v1/models")
    assert dict(c.fields) == {"temperature": 0.0, "ignore_eos": True, "top_k": 5}
    assert c.metric_percentiles == (50.0, 99.9) and dict(c.metadata) == {"gpu": "h200"}
    assert _config("--host", "10.0.0.2", "--port", "81", "--endpoint", "/x").url == "http://10.0.0.2:81/x"


@pytest.mark.parametrize("argv, message", [
    (["--metric-percentiles", "101"], "--metric-percentiles: '101' is not a number in [0, 100]"),
    (["--metric-percentiles", "p99"], "--metric-percentiles: 'p99' is not a number"),
    (["--percentile-metrics", "ttft,latency"], "--percentile-metrics: 'latency' is not one of ttft, tpot, itl, e2el"),
    (["--dataset-name", "sharegpt"], "--dataset-path: required with --dataset-name sharegpt"),
    (["--dataset-name", "jsonl", "--dataset-path", "/no/such.jsonl"], "--dataset-path: no such file: /no/such.jsonl"),
    (["--base-url", "127.0.0.1:8000"], "--base-url: expected http(s)://HOST:PORT"),
    (["--request-rate", "0"], "--request-rate: must be > 0"),
    (["--random-range-ratio", "1"], "--random-range-ratio: must be in [0, 1)"),
    (["--max-concurrency", "0"], "--max-concurrency: must be >= 1"),
    (["--num-client-processes", "0"], "--num-client-processes: must be >= 1"),
    (["--num-client-processes", "3", "--max-concurrency", "2"], "--num-client-processes: must be <= --max-concurrency (2)"),
    (["--seed", "-1"], "--seed: must be >= 0"),
    (["--num-prompts", "0"], "--num-prompts: must be >= 1"),
    (["--burstiness", "0"], "--burstiness: must be a number > 0"),
    (["--extra-body", "[1]"], "--extra-body: must be a JSON object"),
    (["--tokenizer", "/no/such/dir"], "--tokenizer: no tokenizer.json at /no/such/dir"),
])
def test_bad_flags_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError) as e:
        _config(*argv)
    assert str(e.value).startswith(message)


def test_client_processes_share_the_concurrency() -> None:
    from deepinfer.benchmarks.client_processes import concurrency_shares

    assert _config("--num-client-processes", "4").num_client_processes == 4
    assert concurrency_shares(10, 4) == [3, 3, 2, 2] and concurrency_shares(4, 4) == [1, 1, 1, 1]
    assert concurrency_shares(None, 3) == [None, None, None]


def test_unknown_backend_lists_choices(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        _config("--backend", "tgi")
    err = capsys.readouterr().err
    assert "--backend" in err and "openai" in err and "openai-chat" in err


def test_missing_http_client_names_the_extra(monkeypatch, capsys: pytest.CaptureFixture) -> None:
    import importlib.util

    from deepinfer.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "aiohttp" else real(name, *a))
    assert main(["bench", "serve", "--num-prompts", "1"]) == 2
    assert "pip install 'deepinfer[bench]'" in capsys.readouterr().err


# ---- streaming client on canned responses -------------------------------------------------------------------
aiohttp = pytest.importorskip("aiohttp")
from deepinfer.benchmarks import client as bench_client  # noqa: E402
from deepinfer.benchmarks.datasets import BenchRequest  # noqa: E402

REQ = BenchRequest((5, 6, 7), 3, 3)


def _sse(obj) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def _text(t: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": t, "finish_reason": finish}]}


def _send(monkeypatch, events: list[tuple[float, bytes]], status: int = 200, fail_after: bool = False,
          backend: str = "openai") -> RequestOutcome:
    """Serve ``events`` (clock time, bytes) as the response body on a fake clock: the clock is set to each
    event's time just before its bytes arrive, so the measured times are exact."""
    clock = [0.0]
    monkeypatch.setattr(bench_client.time, "perf_counter", lambda: clock[0])
    seen: list[dict] = []

    class Content:  # the response body, as aiohttp's stream reader hands it out
        async def iter_any(self):
            for at, data in events:
                clock[0] = at
                yield data
            if fail_after:
                raise aiohttp.ClientPayloadError("Response payload is not completed")

    class Response:
        content = Content()

        def __init__(self) -> None:
            self.status = status

        async def read(self) -> bytes:
            return b"".join(data for _, data in events)

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc) -> None:
            return None

    class Session:  # what the client uses of aiohttp.ClientSession
        def post(self, url: str, json: dict, headers: dict) -> Response:
            assert url == "http://test/v1/completions" and headers == {"Authorization": "Bearer k"}
            seen.append(json)
            return Response()

    async def go() -> RequestOutcome:
        ep = bench_client.Endpoint("http://test/v1/completions", backend, "m", "k", {"ignore_eos": True})
        req = REQ if backend == "openai" else BenchRequest("hi", 1, 3)
        return await bench_client.send(Session(), ep, req, lambda s: len(s))

    out = asyncio.run(go())
    assert seen[0]["stream"] is True and seen[0]["stream_options"] == {"include_usage": True}
    assert seen[0]["ignore_eos"] is True and seen[0]["model"] == "m"
    return out


def test_client_times_chunks_and_reads_usage(monkeypatch) -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}
    out = _send(monkeypatch, [(0.5, _sse(_text("a"))), (0.7, _sse(_text("b"))), (1.0, _sse(_text("c", "length"))),
                              (1.1, _sse(usage) + _sse("[DONE]"))])
    assert out.success and out.error == "" and out.generated_text == "abc"
    assert (out.prompt_len, out.output_len, out.ttft, out.latency) == (3, 3, 0.5, 1.1)
    assert out.itls == pytest.approx((0.2, 0.3))


def test_client_joins_an_event_split_across_reads(monkeypatch) -> None:
    # A network read may end anywhere in an event: the event counts when its last byte arrives.
    first, second = _sse(_text("a")), _sse(_text("b", "length")) + _sse("[DONE]")
    out = _send(monkeypatch, [(0.2, first[:9]), (0.4, first[9:] + second[:3]), (0.9, second[3:])])
    assert out.success and out.generated_text == "ab" and out.output_len == 2
    assert out.ttft == 0.4 and out.itls == pytest.approx((0.5,)) and out.latency == 0.9


def test_client_chat_skips_chunks_without_text(monkeypatch) -> None:
    def delta(d: dict, finish=None) -> bytes:
        return _sse({"choices": [{"index": 0, "delta": d, "finish_reason": finish}]})

    out = _send(monkeypatch, [(0.3, delta({"role": "assistant", "content": ""}) + delta({"content": "x"})),
                              (0.4, delta({"reasoning_content": "yz"})), (0.6, delta({}, "stop") + _sse("[DONE]"))],
                backend="openai-chat")
    # No usage chunk: the output is counted with the given counter (here: characters).
    assert out.success and out.generated_text == "xyz" and out.output_len == 3 and out.prompt_len == 1
    assert out.ttft == 0.3 and out.itls == pytest.approx((0.1,)) and out.latency == 0.6


def test_client_failures_become_outcomes(monkeypatch) -> None:
    out = _send(monkeypatch, [(0.1, json.dumps({"error": {"message": "model 'm' not found"}}).encode())], status=404)
    assert not out.success and out.error == "HTTP 404: model 'm' not found"
    out = _send(monkeypatch, [(0.1, _sse(_text("a")))], fail_after=True)
    assert not out.success and out.error.startswith("ClientPayloadError: Response payload is not completed")
    assert out.generated_text == "a" and out.latency == 0.1
    out = _send(monkeypatch, [(0.1, _sse(_text("a")))])  # clean close, but no finish and no [DONE]
    assert not out.success and "ended before the response was complete" in out.error
    out = _send(monkeypatch, [(0.1, _sse({"error": {"message": "engine is shutting down"}}))])
    assert not out.success and out.error == "error event: engine is shutting down"
    out = _send(monkeypatch, [(0.1, b"data: {not json\n\n")])
    assert not out.success and out.error.startswith("malformed stream")
