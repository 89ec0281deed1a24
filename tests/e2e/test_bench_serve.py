"""`deepinfer bench serve` against a real `deepinfer serve` on the bundled demo model.

The server runs as a subprocess on a port the kernel picks (read from its log); the benchmark runs in this
process through the command's own entry point, so flags, the HTTP client, metrics and the saved JSON are
all exercised. Outputs use --ignore-eos, so every request yields exactly the tokens it asks for.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("aiohttp")

from deepinfer.benchmarks.datasets import random_requests  # noqa: E402
from deepinfer.cli import main  # noqa: E402
from deepinfer.tokenizer import Tokenizer  # noqa: E402

API_KEY = "sk-bench"
KEYS = ["date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency", "duration",
        "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
        "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "errors"]
LATENCY_KEYS = [f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    cmd = [sys.executable, "-m", "deepinfer.server", "--device", "cpu", "--block-size", "128", "--port", "0",
           "--num-cache-blocks", "64", "--api-key", API_KEY, "--log-level", "info",
           "--graceful-shutdown-timeout", "1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log: list[str] = []
    try:
        port, deadline = None, time.monotonic() + 90
        while port is None:
            line = proc.stderr.readline()
            assert line and time.monotonic() < deadline, "server did not start:\n" + "".join(log)
            log.append(line)
            m = re.search(r"running on http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
        # Keep reading the log (access lines), so the server never blocks on a full pipe.
        drain = threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True)
        drain.start()
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _bench(tmp_path: Path, url: str, *flags: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    rc = main(["bench", "serve", "--base-url", url, "--api-key", API_KEY, "--disable-tqdm", "--save-result",
               "--result-dir", str(tmp_path), "--result-filename", out.name, *flags])
    return rc, json.loads(out.read_text()) if out.exists() else {}


RANDOM = ["--num-prompts", "8", "--random-input-len", "32", "--random-output-len", "8", "--ignore-eos",
          "--max-concurrency", "4", "--seed", "3", "--temperature", "0"]


def _check_latencies(r: dict, n: int, out_len: int) -> None:
    assert all(k in r for k in KEYS + LATENCY_KEYS), sorted(set(KEYS + LATENCY_KEYS) - set(r))
    assert r["errors"] == [""] * n and r["output_lens"] == [out_len] * n
    assert r["duration"] > 0 and r["request_throughput"] > 0 and r["output_throughput"] > 0
    assert all(t > 0 for t in r["ttfts"])
    for m in ("ttft", "tpot", "e2el"):
        assert r[f"mean_{m}_ms"] > 0 and 0 < r[f"median_{m}_ms"] <= r[f"p99_{m}_ms"] and r[f"std_{m}_ms"] >= 0
    assert r["mean_e2el_ms"] > r["mean_ttft_ms"]
    assert r["mean_itl_ms"] > 0 and all(g >= 0 for gaps in r["itls"] for g in gaps)


def test_completions_backend(server_url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # No --model: the name comes from the server's /v1/models.
    rc, r = _bench(tmp_path, server_url, *RANDOM, "--metric-percentiles", "50,99")
    assert rc == 0
    assert (r["completed"], r["failed"], r["num_prompts"], r["max_concurrency"]) == (8, 0, 8, 4)
    assert r["backend"] == "openai" and r["model_id"] == "deepinfer-demo" and r["request_rate"] == "inf"
    assert r["total_output_tokens"] == 64
    # Token-id prompts: the server's input count is exactly what was generated for this seed.
    expected = random_requests(Tokenizer(), 8, 32, 8, seed=3)
    assert r["input_lens"] == [q.prompt_len for q in expected] == [32] * 8
    assert r["total_input_tokens"] == sum(q.prompt_len for q in expected)
    assert r["total_token_throughput"] == pytest.approx((r["total_input_tokens"] + 64) / r["duration"])
    _check_latencies(r, 8, 8)
    assert "p50_ttft_ms" in r and r["p50_ttft_ms"] == pytest.approx(r["median_ttft_ms"])
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and re.search(r"Successful requests:\s+8\n", table)
    assert "P99 TTFT (ms):" in table and "Mean TPOT (ms):" in table and "Mean E2EL" not in table


def test_several_client_processes_pool_their_requests(server_url: str, tmp_path: Path) -> None:
    """--num-client-processes 2: process w sends requests w, w + 2, ...; the result lists them in request order
    as one process would (the same prompts, every token)."""
    rc, r = _bench(tmp_path, server_url, *RANDOM, "--random-range-ratio", "0.5", "--num-client-processes", "2")
    assert rc == 0
    expected = random_requests(Tokenizer(), 8, 32, 8, range_ratio=0.5, seed=3)
    assert len({q.prompt_len for q in expected}) > 4  # lengths that tell the requests apart
    assert (r["completed"], r["failed"], r["num_client_processes"]) == (8, 0, 2)
    assert r["input_lens"] == [q.prompt_len for q in expected]
    assert r["output_lens"] == [q.output_len for q in expected]
    assert r["errors"] == [""] * 8 and all(t > 0 for t in r["ttfts"])
    assert r["duration"] >= max(r["mean_e2el_ms"], r["median_e2el_ms"]) / 1000


def test_chat_backend(server_url: str, tmp_path: Path) -> None:
    rc, r = _bench(tmp_path, server_url, *RANDOM, "--backend", "openai-chat", "--model", "deepinfer-demo",
                   "--percentile-metrics", "ttft,e2el")
    assert rc == 0
    assert (r["completed"], r["failed"], r["backend"]) == (8, 0, "openai-chat")
    assert r["total_output_tokens"] == 64
    # Text prompts in the chat template: the server counts the template's tokens too.
    assert all(n >= 32 for n in r["input_lens"]) and r["total_input_tokens"] == sum(r["input_lens"])
    _check_latencies(r, 8, 8)


def test_jsonl_with_poisson_arrivals(server_url: str, tmp_path: Path) -> None:
    rows = [{"prompt": "def f(x):", "output_len": 3}, {"prompt": "import os\n"},
            {"prompt": "class A:", "output_len": 5}]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    rc, r = _bench(tmp_path, server_url, "--dataset-name", "jsonl", "--dataset-path", str(data), "--num-prompts", "3",
                   "--jsonl-output-len", "2", "--ignore-eos", "--request-rate", "50", "--burstiness", "0.5",
                   "--disable-shuffle", "--temperature", "0")
    assert rc == 0
    assert (r["completed"], r["failed"], r["request_rate"], r["burstiness"]) == (3, 0, 50.0, 0.5)
    assert r["output_lens"] == [3, 2, 5] and r["total_output_tokens"] == 10
    tok = Tokenizer()  # text prompts: the server adds BOS
    assert r["input_lens"] == [len(tok.encode(row["prompt"])) + 1 for row in rows]


def test_http_errors_are_counted_not_raised(server_url: str, tmp_path: Path) -> None:
    rc, r = _bench(tmp_path, server_url, "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "2",
                   "--model", "deepinfer-demo", "--api-key", "wrong-key")
    assert rc == 1  # nothing completed
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (0, 3, 0)
    assert all(e.startswith("HTTP 401:") for e in r["errors"])
    assert r["mean_ttft_ms"] == 0.0
