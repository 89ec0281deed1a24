"""``deepinfer bench serve``: drive an OpenAI-compatible server with a dataset and measure it.

    deepinfer bench serve --base-url http://127.0.0.1:8000 --random-input-len 512 --random-output-len 128 \\
        --num-prompts 200 --max-concurrency 16 --ignore-eos --save-result

Requests are released on an arrival schedule (all at once, or a seeded Poisson / gamma process), pass a
concurrency gate, and stream; each is timed from the moment it is sent, so time spent waiting at the gate
is not counted as server latency. The run's duration spans the first send to the last completion.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from deepinfer.benchmarks.datasets import BenchRequest, jsonl_requests, random_requests, sharegpt_requests
from deepinfer.benchmarks.metrics import RequestOutcome, compute_metrics, format_table, result_dict
from deepinfer.benchmarks.options import ServeBenchConfig, config_from_args
from deepinfer.tokenizer import DEMO_TOKENIZER_DIR, Tokenizer

if TYPE_CHECKING:
    import aiohttp

DEMO_MODEL_NAME = "deepinfer-demo"  # what deepinfer serve calls the bundled model


def arrival_offsets(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from the start: the first request at 0, then gaps drawn from a gamma
    distribution with shape ``burstiness`` and mean ``1 / rate`` (shape 1 is exponential: a Poisson
    process). An infinite rate sends everything at 0. The generator is seeded apart from the prompts',
    so changing the rate does not change the prompts."""
    if math.isinf(rate) or num == 0:
        return [0.0] * num
    gaps = np.random.default_rng([seed, 1]).gamma(burstiness, 1.0 / (rate * burstiness), size=max(num - 1, 0))
    return [0.0] + [float(t) for t in np.cumsum(gaps)]


def load_requests(cfg: ServeBenchConfig, tokenizer: Tokenizer) -> list[BenchRequest]:
    if cfg.dataset_name == "random":
        return random_requests(tokenizer, cfg.num_prompts, cfg.random_input_len, cfg.random_output_len,
                               range_ratio=cfg.random_range_ratio, prefix_len=cfg.random_prefix_len, seed=cfg.seed,
                               as_text=cfg.backend == "openai-chat")
    assert cfg.dataset_path is not None  # checked by config_from_args
    if cfg.dataset_name == "jsonl":
        return jsonl_requests(cfg.dataset_path, tokenizer, cfg.num_prompts, default_output_len=cfg.jsonl_output_len,
                              prompt_field=cfg.jsonl_prompt_field, output_len_field=cfg.jsonl_output_len_field,
                              seed=cfg.seed, shuffle=cfg.shuffle)
    return sharegpt_requests(cfg.dataset_path, tokenizer, cfg.num_prompts, output_len=cfg.sharegpt_output_len,
                             seed=cfg.seed, shuffle=cfg.shuffle)


async def served_model(cfg: ServeBenchConfig, http: aiohttp.ClientSession) -> str:
    """The name to put in requests: --served-model-name, else --model unless it is a local directory, else
    the first model the server lists."""
    if cfg.served_model_name:
        return cfg.served_model_name
    if cfg.model and not Path(cfg.model).is_dir():
        return cfg.model
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    try:
        async with http.get(cfg.models_url, headers=headers) as r:
            r.raise_for_status()
            return str((await r.json(content_type=None))["data"][0]["id"])
    except Exception as e:  # any failure means the same thing to the user: name the model yourself
        raise ValueError(f"--model: not given, and asking the server failed (GET {cfg.models_url}: "
                         f"{type(e).__name__}: {e}); pass --model or --served-model-name") from None


def served_model_name(cfg: ServeBenchConfig) -> str:
    """``served_model`` through a session of its own (the multi-process client asks once, before it starts)."""
    import aiohttp

    async def ask() -> str:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.request_timeout, sock_read=cfg.request_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            return await served_model(cfg, http)

    return asyncio.run(ask())


async def send_all(cfg: ServeBenchConfig, requests: Sequence[BenchRequest], offsets: Sequence[float],
                   limit: int | None, tokenizer: Tokenizer, model: str | None = None,
                   start_at: float | None = None, on_done: Callable[[], None] | None = None
                   ) -> tuple[str, list[RequestOutcome], float, float]:
    """Send ``requests`` at ``offsets`` seconds from the start, at most ``limit`` in flight, and stream them:
    (the model name used, the outcomes in request order, the wall-clock start and end, ``time.time()``).
    ``model``: asked of the server when None. ``start_at``: the wall-clock start (else now). ``on_done``:
    called as each request completes."""
    import aiohttp

    from deepinfer.benchmarks.client import Endpoint, send

    # The gate below bounds concurrency, so the pool must never make a request wait (or time out) for a
    # connection: as many connections as the gate lets through (0: no limit), kept alive between requests.
    connector = aiohttp.TCPConnector(limit=limit or 0, limit_per_host=limit or 0, ttl_dns_cache=300)
    # Per operation, as a stream may rightly last long: connecting, and each wait for the next bytes.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.request_timeout, sock_read=cfg.request_timeout)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text)) if text else 0

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        model = model or await served_model(cfg, http)
        ep = Endpoint(cfg.url, cfg.backend, model, cfg.api_key, cfg.fields)
        gate = asyncio.Semaphore(limit) if limit else None

        async def one(req: BenchRequest) -> RequestOutcome:
            if gate is None:
                out = await send(http, ep, req, count_tokens)
            else:
                async with gate:
                    out = await send(http, ep, req, count_tokens)
            if on_done is not None:
                on_done()
            return out

        if start_at is not None and start_at > time.time():
            await asyncio.sleep(start_at - time.time())
        wall = time.time()
        start = time.perf_counter()
        tasks = []
        for req, at in zip(requests, offsets):
            wait = start + at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(req)))
        outcomes = list(await asyncio.gather(*tasks))
        end = wall + (time.perf_counter() - start)
    return model, outcomes, wall, end


def _run(cfg: ServeBenchConfig, requests: Sequence[BenchRequest], tokenizer: Tokenizer
         ) -> tuple[str, list[RequestOutcome], float]:
    """(model name, outcomes in request order, the run's duration: first send to last completion)."""
    from tqdm import tqdm

    offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    with tqdm(total=len(requests), disable=cfg.disable_tqdm, desc="requests", unit="req") as bar:
        if cfg.num_client_processes > 1:
            from deepinfer.benchmarks.client_processes import run_processes

            return run_processes(cfg, requests, offsets, lambda: bar.update(1))
        model, outcomes, start, end = asyncio.run(send_all(cfg, requests, offsets, cfg.max_concurrency, tokenizer,
                                                           on_done=lambda: bar.update(1)))
    return model, outcomes, end - start


def _result_path(cfg: ServeBenchConfig, model_id: str, date: str) -> Path:
    if cfg.result_filename:
        return Path(cfg.result_dir) / cfg.result_filename
    rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
    conc = f"-concurrency{cfg.max_concurrency}" if cfg.max_concurrency else ""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model_id.rstrip("/")).name or "model")
    return Path(cfg.result_dir) / f"{cfg.backend}-{rate}qps{conc}-{name}-{date}.json"


def run(cfg: ServeBenchConfig) -> dict[str, Any]:
    """Run the benchmark described by ``cfg``: print the table, save the JSON when asked, return the result."""
    if cfg.tokenizer == str(DEMO_TOKENIZER_DIR) and cfg.model not in (None, DEMO_MODEL_NAME):
        print(f"note: prompts are built and counted with the bundled demo model's tokenizer; pass --tokenizer "
              f"with {cfg.model}'s model directory for its own", file=sys.stderr)
    tokenizer = Tokenizer(cfg.tokenizer)
    requests = load_requests(cfg, tokenizer)
    if len(requests) < cfg.num_prompts:
        print(f"note: {cfg.dataset_path} has {len(requests)} usable prompts; sending {len(requests)}", file=sys.stderr)
    rate = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    print(f"{len(requests)} {cfg.dataset_name} prompts to {cfg.url} ({cfg.backend}); request rate {rate}, "
          f"burstiness {cfg.burstiness}, max concurrency {cfg.max_concurrency or 'unlimited'}"
          + (f", {cfg.num_client_processes} client processes" if cfg.num_client_processes > 1 else ""),
          file=sys.stderr)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    model, outcomes, duration = _run(cfg, requests, tokenizer)
    metrics = compute_metrics(outcomes, duration, cfg.metric_percentiles)
    model_id = cfg.model or model
    info: dict[str, Any] = {
        "date": date, "backend": cfg.backend, "endpoint": cfg.url, "model_id": model_id, "served_model_name": model,
        "tokenizer_id": cfg.tokenizer, "dataset_name": cfg.dataset_name, "seed": cfg.seed,
        "num_prompts": len(requests), "request_rate": rate, "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency, "num_client_processes": cfg.num_client_processes, **cfg.metadata,
    }
    result = result_dict(metrics, outcomes, info)
    errors = Counter(o.error for o in outcomes if not o.success)
    for error, count in errors.most_common(3):  # the same failure tends to repeat: show each once
        print(f"failed x{count}: {error}", file=sys.stderr)
    print(format_table(metrics, cfg.percentile_metrics, cfg.max_concurrency))
    if cfg.save_result:
        path = _result_path(cfg, model_id, date)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"result written to {path}", file=sys.stderr)
    return result


def main(a: argparse.Namespace) -> int:
    """The command: 0 when at least one request completed, 1 when all failed, 2 on bad flags."""
    import importlib.util

    if importlib.util.find_spec("aiohttp") is None:
        print("error: aiohttp is missing; install the bench extra: pip install 'deepinfer[bench]'", file=sys.stderr)
        return 2
    result = run(config_from_args(a))
    return 0 if result["completed"] > 0 else 1
