"""``deepinfer bench serve`` flags and their validation into a frozen :class:`ServeBenchConfig`.

Flag names follow the serving benchmarks people already use against OpenAI-compatible servers, so an
existing command line carries over. Every bad value is a ``ValueError`` that names the flag and what it
accepts (the command prints it and exits 2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepinfer.benchmarks.datasets import DATASETS
from deepinfer.benchmarks.metrics import METRICS
from deepinfer.tokenizer import DEMO_TOKENIZER_DIR, TOKENIZER_FILE

BACKENDS = ("openai", "openai-chat")
DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class ServeBenchConfig:
    url: str                      # the endpoint's full URL
    models_url: str               # GET here to learn the served model name when none is given
    backend: str
    api_key: str | None
    request_timeout: float
    model: str | None
    served_model_name: str | None
    tokenizer: str
    dataset_name: str
    dataset_path: str | None
    num_prompts: int
    seed: int
    shuffle: bool
    random_input_len: int
    random_output_len: int
    random_range_ratio: float
    random_prefix_len: int
    jsonl_prompt_field: str
    jsonl_output_len_field: str
    jsonl_output_len: int
    sharegpt_output_len: int | None
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    num_client_processes: int     # client processes sharing the requests and the concurrency (1: this one)
    fields: Mapping[str, Any]     # merged into every request body (sampling options, --extra-body)
    percentile_metrics: tuple[str, ...]
    metric_percentiles: tuple[float, ...]
    save_result: bool
    result_dir: str
    result_filename: str | None
    metadata: Mapping[str, str]
    disable_tqdm: bool


def add_bench_parser(sub: Any) -> argparse.ArgumentParser:
    """``deepinfer bench`` with its ``serve`` subcommand (more benchmarks can hang off ``bench`` later)."""
    bench = sub.add_parser("bench", help="benchmarks: 'bench serve' measures an OpenAI-compatible server")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    p = kinds.add_parser(
        "serve", help="serving benchmark against an OpenAI-compatible server (TTFT, TPOT, ITL, throughput)",
        description="Send a dataset of prompts to a running OpenAI-compatible server (deepinfer serve or any "
                    "other) as streamed requests, and report throughput and TTFT / TPOT / ITL / E2EL latencies.")
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    g.add_argument("--host", default="127.0.0.1", help="server host when --base-url is not given (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="server port when --base-url is not given (default: 8000)")
    g.add_argument("--endpoint", default=None,
                   help="API path (default: /v1/completions for openai, /v1/chat/completions for openai-chat)")
    g.add_argument("--backend", default="openai", choices=BACKENDS,
                   help="openai: /v1/completions (random prompts go as token ids); openai-chat: /v1/chat/completions")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    g.add_argument("--request-timeout", type=float, default=6 * 3600.0,
                   help="seconds a request may wait to connect or for its next chunk before it fails (default: 21600)")
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="model name sent to the server, or a local model directory (then also the tokenizer); "
                        "default: the first model the server lists at /v1/models")
    g.add_argument("--served-model-name", default=None,
                   help="name sent in requests when it differs from --model (e.g. --model is a directory)")
    g.add_argument("--tokenizer", default=None,
                   help=f"directory with {TOKENIZER_FILE} for building and counting prompts (default: --model when it "
                        "is a local directory with one, else the bundled demo model's tokenizer)")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=DATASETS,
                   help="random: random token ids; jsonl: one JSON object per line; sharegpt: ShareGPT JSON")
    g.add_argument("--dataset-path", default=None, help="the file for --dataset-name jsonl or sharegpt")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests to send (default: 1000)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed for prompts, file shuffling and arrival times (default: 0)")
    g.add_argument("--disable-shuffle", action="store_true",
                   help="jsonl/sharegpt: take the file's first prompts instead of a seeded sample")
    g.add_argument("--random-input-len", type=int, default=1024,
                   help="random: prompt tokens after the prefix (default: 1024)")
    g.add_argument("--random-output-len", type=int, default=128, help="random: output tokens to ask for (default: 128)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: draw lengths uniformly from [len*(1-r), len*(1+r)], 0 <= r < 1 (default: 0, fixed)")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="random: tokens of a random prefix shared by every prompt (default: 0)")
    g.add_argument("--jsonl-prompt-field", default="prompt", help="jsonl: the prompt's field (default: prompt)")
    g.add_argument("--jsonl-output-len-field", default="output_len",
                   help="jsonl: the optional output-length field (default: output_len)")
    g.add_argument("--jsonl-output-len", type=int, default=128,
                   help="jsonl: output tokens for rows without the output-length field (default: 128)")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: output tokens for every prompt (default: the first answer's token count)")
    g = p.add_argument_group("traffic")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, arriving as a Poisson process (default: inf, all at once)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps between arrivals: 1 = Poisson, < 1 burstier, > 1 more even "
                        "(default: 1)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight; later arrivals wait (default: no limit)")
    g.add_argument("--num-client-processes", type=int, default=1,
                   help="client processes sharing the requests (request i goes to process i mod N, at its arrival "
                        "time) and the concurrency: one process reading tens of thousands of streamed events a "
                        "second can be what a run measures (default: 1)")
    g = p.add_argument_group("sampling (sent only when given)")
    g.add_argument("--ignore-eos", action="store_true", help="ask the server to generate every requested token")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (0 = greedy)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens")
    g.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p * p(best)")
    g.add_argument("--repetition-penalty", type=float, default=None, help="> 1 discourages repeats")
    g.add_argument("--extra-body", default=None,
                   help="JSON object merged into every request body, "
                        "e.g. '{\"chat_template_kwargs\": {\"thinking\": true}}'")
    g = p.add_argument_group("results")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help=f"comma-separated latency sections of the printed table, of {', '.join(METRICS)} "
                        "(default: ttft,tpot,itl; the JSON always has all four)")
    g.add_argument("--metric-percentiles", default="99",
                   help="comma-separated percentiles in [0, 100] reported per metric, e.g. 50,90,99 (default: 99)")
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument("--result-dir", default=".", help="with --save-result: directory for the JSON (default: .)")
    g.add_argument("--result-filename", default=None,
                   help="with --save-result: file name (default: BACKEND-RATEqps-concurrencyN-MODEL-DATE.json)")
    g.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                   help="extra KEY=VALUE pair stored in the result JSON (repeatable)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def _need(ok: bool, flag: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{flag}: {message}")


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _percentiles(text: str) -> tuple[float, ...]:
    values = []
    for part in _csv(text):
        try:
            p = float(part)
        except ValueError:
            p = math.nan
        _need(0.0 <= p <= 100.0, "--metric-percentiles", f"{part!r} is not a number in [0, 100]")
        values.append(p)
    _need(bool(values), "--metric-percentiles", "give at least one percentile in [0, 100], e.g. 99 or 50,90,99")
    return tuple(values)


def _tokenizer_dir(a: argparse.Namespace) -> str:
    if a.tokenizer is not None:
        path = Path(a.tokenizer)
        ok = (path / TOKENIZER_FILE).is_file() or (path.is_file() and path.name == TOKENIZER_FILE)
        _need(ok, "--tokenizer", f"no {TOKENIZER_FILE} at {a.tokenizer}")
        return str(path)
    if a.model is not None and (Path(a.model) / TOKENIZER_FILE).is_file():
        return a.model
    return str(DEMO_TOKENIZER_DIR)


def _urls(a: argparse.Namespace) -> tuple[str, str]:
    if a.base_url is not None:
        base = a.base_url.rstrip("/")
        _need(base.startswith(("http://", "https://")), "--base-url",
              f"expected http(s)://HOST:PORT, got {a.base_url!r}")
    else:
        _need(1 <= a.port <= 65535, "--port", f"must be in 1..65535, got {a.port}")
        base = f"http://{a.host}:{a.port}"
    endpoint = a.endpoint or DEFAULT_ENDPOINTS[a.backend]
    _need(endpoint.startswith("/"), "--endpoint", f"must start with '/', got {endpoint!r}")
    # --base-url http://h:8000/v1 with the default /v1/... endpoint: do not ask for /v1/v1/...
    root = base[:-3] if base.endswith("/v1") else base
    url = root + endpoint if base.endswith("/v1") and endpoint.startswith("/v1/") else base + endpoint
    return url, root + "/v1/models"


def _fields(a: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if getattr(a, name) is not None:
            fields[name] = getattr(a, name)
    if a.ignore_eos:
        fields["ignore_eos"] = True
    if a.extra_body is not None:
        try:
            extra = json.loads(a.extra_body)
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-body: not valid JSON ({e.msg})") from None
        _need(isinstance(extra, dict), "--extra-body", "must be a JSON object")
        fields.update(extra)
    return fields


def config_from_args(a: argparse.Namespace) -> ServeBenchConfig:
    url, models_url = _urls(a)
    _need(a.num_prompts >= 1, "--num-prompts", f"must be >= 1, got {a.num_prompts}")
    _need(a.seed >= 0, "--seed", f"must be >= 0, got {a.seed}")
    _need(a.request_rate > 0, "--request-rate", f"must be > 0 (or inf), got {a.request_rate}")
    _need(a.burstiness > 0 and math.isfinite(a.burstiness), "--burstiness", f"must be a number > 0, got {a.burstiness}")
    _need(a.max_concurrency is None or a.max_concurrency >= 1, "--max-concurrency",
          f"must be >= 1, got {a.max_concurrency}")
    _need(a.num_client_processes >= 1, "--num-client-processes", f"must be >= 1, got {a.num_client_processes}")
    _need(a.max_concurrency is None or a.num_client_processes <= a.max_concurrency, "--num-client-processes",
          f"must be <= --max-concurrency ({a.max_concurrency}): each process takes a share of it, got "
          f"{a.num_client_processes}")
    _need(a.request_timeout > 0, "--request-timeout", f"must be > 0, got {a.request_timeout}")
    _need(a.random_input_len >= 0, "--random-input-len", f"must be >= 0, got {a.random_input_len}")
    _need(a.random_prefix_len >= 0, "--random-prefix-len", f"must be >= 0, got {a.random_prefix_len}")
    _need(a.random_input_len + a.random_prefix_len >= 1, "--random-input-len",
          "must be >= 1 when --random-prefix-len is 0")
    _need(a.random_output_len >= 1, "--random-output-len", f"must be >= 1, got {a.random_output_len}")
    _need(0.0 <= a.random_range_ratio < 1.0, "--random-range-ratio", f"must be in [0, 1), got {a.random_range_ratio}")
    _need(a.jsonl_output_len >= 1, "--jsonl-output-len", f"must be >= 1, got {a.jsonl_output_len}")
    _need(a.sharegpt_output_len is None or a.sharegpt_output_len >= 1, "--sharegpt-output-len",
          f"must be >= 1, got {a.sharegpt_output_len}")
    if a.dataset_name != "random":
        _need(a.dataset_path is not None, "--dataset-path", f"required with --dataset-name {a.dataset_name}")
        _need(Path(a.dataset_path).is_file(), "--dataset-path", f"no such file: {a.dataset_path}")
    selected = tuple(_csv(a.percentile_metrics))
    for name in selected:
        _need(name in METRICS, "--percentile-metrics", f"{name!r} is not one of {', '.join(METRICS)}")
    metadata = {}
    for item in a.metadata:
        key, eq, value = item.partition("=")
        _need(bool(eq and key), "--metadata", f"expected KEY=VALUE, got {item!r}")
        metadata[key] = value
    return ServeBenchConfig(
        url=url, models_url=models_url, backend=a.backend, api_key=a.api_key or None,
        request_timeout=a.request_timeout, model=a.model, served_model_name=a.served_model_name,
        tokenizer=_tokenizer_dir(a), dataset_name=a.dataset_name, dataset_path=a.dataset_path,
        num_prompts=a.num_prompts, seed=a.seed, shuffle=not a.disable_shuffle, random_input_len=a.random_input_len,
        random_output_len=a.random_output_len, random_range_ratio=a.random_range_ratio,
        random_prefix_len=a.random_prefix_len, jsonl_prompt_field=a.jsonl_prompt_field,
        jsonl_output_len_field=a.jsonl_output_len_field, jsonl_output_len=a.jsonl_output_len,
        sharegpt_output_len=a.sharegpt_output_len, request_rate=a.request_rate, burstiness=a.burstiness,
        max_concurrency=a.max_concurrency, num_client_processes=a.num_client_processes, fields=_fields(a), percentile_metrics=selected,
        metric_percentiles=_percentiles(a.metric_percentiles), save_result=a.save_result,
        result_dir=a.result_dir, result_filename=a.result_filename, metadata=metadata, disable_tqdm=a.disable_tqdm,
    )
