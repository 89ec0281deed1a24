"""Statistics over timed requests, the printed result table and the result JSON.

Definitions (times per request, from the moment its HTTP request is sent):

* TTFT: until the first chunk that carries generated text.
* ITL: the gaps between successive chunks that carry generated text (one list per request; all requests'
  gaps pooled for the statistics). A chunk may hold several tokens, and a token whose text the server holds
  back (a partial UTF-8 character, a skipped special token) arrives with the next chunk, so these are the
  gaps a streaming client sees.
* E2EL: until the end of the stream.
* TPOT: (E2EL - TTFT) / (output tokens - 1), the mean decode time per token after the first; requests
  with a single output token have no decode phase and are left out.

Throughputs divide by the run's wall time (first send to last completion); only completed requests count.
Statistics are in milliseconds: mean, median, population standard deviation and linearly interpolated
percentiles (numpy's defaults); an empty sample gives 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
_WIDTH = 50  # the table's width; labels are left-aligned, values right of column 40


@dataclass(frozen=True)
class RequestOutcome:
    """What one request measured. Times are in seconds; lengths in tokens as the server reported them
    (or, when it did not, as the benchmark's tokenizer counts them)."""

    success: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    itls: tuple[float, ...] = ()
    latency: float = 0.0
    generated_text: str = ""
    error: str = ""


@dataclass(frozen=True)
class Summary:
    """One metric's statistics in milliseconds; ``percentiles`` pairs each requested percentile with its value."""

    mean: float
    median: float
    std: float
    percentiles: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class BenchMetrics:
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    duration: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    stats: Mapping[str, Summary]


def percentile_label(p: float) -> str:
    """``99`` -> ``"99"``, ``99.9`` -> ``"99.9"``: the NN of the ``pNN_X_ms`` keys."""
    return str(int(p)) if float(p).is_integer() else str(p)


def summarize(seconds: Sequence[float], percentiles: Sequence[float]) -> Summary:
    if len(seconds) == 0:
        return Summary(0.0, 0.0, 0.0, tuple((float(p), 0.0) for p in percentiles))
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    return Summary(float(ms.mean()), float(np.median(ms)), float(ms.std()),
                   tuple((float(p), float(np.percentile(ms, p))) for p in percentiles))


def tpot(o: RequestOutcome) -> float | None:
    """Seconds per output token after the first, or None for a request with fewer than two tokens."""
    if not o.success or o.output_len < 2:
        return None
    return (o.latency - o.ttft) / (o.output_len - 1)


def compute_metrics(outcomes: Sequence[RequestOutcome], duration: float,
                    percentiles: Sequence[float] = (99.0,)) -> BenchMetrics:
    done = [o for o in outcomes if o.success]
    total_in = sum(o.prompt_len for o in done)
    total_out = sum(o.output_len for o in done)
    samples = {
        "ttft": [o.ttft for o in done],
        "tpot": [t for t in map(tpot, done) if t is not None],
        "itl": [gap for o in done for gap in o.itls],
        "e2el": [o.latency for o in done],
    }

    def rate(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    return BenchMetrics(
        completed=len(done), failed=len(outcomes) - len(done), total_input_tokens=total_in,
        total_output_tokens=total_out, duration=duration, request_throughput=rate(len(done)),
        output_throughput=rate(total_out), total_token_throughput=rate(total_in + total_out),
        stats={name: summarize(samples[name], percentiles) for name in METRICS},
    )


def result_dict(m: BenchMetrics, outcomes: Sequence[RequestOutcome], run: Mapping[str, Any]) -> dict[str, Any]:
    """The result JSON: ``run`` (date, backend, model_id, request_rate, ...) first, then the totals, the
    per-request lists (in prompt order; seconds, as the totals' ``duration``) and each metric's statistics
    (``mean_ttft_ms``, ``median_ttft_ms``, ``std_ttft_ms``, ``p99_ttft_ms``, ...)."""
    out: dict[str, Any] = dict(run)
    out.update(
        duration=m.duration, completed=m.completed, failed=m.failed, total_input_tokens=m.total_input_tokens,
        total_output_tokens=m.total_output_tokens, request_throughput=m.request_throughput,
        output_throughput=m.output_throughput, total_token_throughput=m.total_token_throughput,
        input_lens=[o.prompt_len for o in outcomes], output_lens=[o.output_len for o in outcomes],
        ttfts=[o.ttft for o in outcomes], itls=[list(o.itls) for o in outcomes],
        generated_texts=[o.generated_text for o in outcomes], errors=[o.error for o in outcomes],
    )
    for name in METRICS:
        s = m.stats[name]
        out[f"mean_{name}_ms"], out[f"median_{name}_ms"], out[f"std_{name}_ms"] = s.mean, s.median, s.std
        for p, value in s.percentiles:
            out[f"p{percentile_label(p)}_{name}_ms"] = value
    return out


def _row(label: str, value: Any) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40}{text:>{_WIDTH - 40}}"


def format_table(m: BenchMetrics, selected: Sequence[str] = ("ttft", "tpot", "itl"),
                 max_concurrency: int | None = None) -> str:
    """The human-readable block printed at the end of a run; ``selected`` picks the latency sections."""
    lines = [" Serving Benchmark Result ".center(_WIDTH, "="),
             _row("Successful requests:", m.completed),
             _row("Failed requests:", m.failed)]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    lines += [_row("Benchmark duration (s):", m.duration),
              _row("Total input tokens:", m.total_input_tokens),
              _row("Total generated tokens:", m.total_output_tokens),
              _row("Request throughput (req/s):", m.request_throughput),
              _row("Output token throughput (tok/s):", m.output_throughput),
              _row("Total token throughput (tok/s):", m.total_token_throughput)]
    for name in selected:
        title, short = _TITLES[name]
        s = m.stats[name]
        lines += [f" {title} ".center(_WIDTH, "-"),
                  _row(f"Mean {short} (ms):", s.mean),
                  _row(f"Median {short} (ms):", s.median)]
        lines += [_row(f"P{percentile_label(p)} {short} (ms):", v) for p, v in s.percentiles]
    lines.append("=" * _WIDTH)
    return "\n".join(lines)
