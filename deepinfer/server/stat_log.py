"""The server's periodic log line: what vLLM users read in their server log every 10 seconds, under the same
field names (``--disable-log-stats`` turns it off).

    Avg prompt throughput: 5120.3 tokens/s, Avg generation throughput: 210.4 tokens/s, Running: 12 reqs,
    Waiting: 0 reqs, KV cache usage: 8.1%, Prefix cache hit rate: 61.5%
    SpecDecoding metrics: Mean acceptance length: 2.41, Accepted throughput: 123.45 tokens/s, Drafted
    throughput: 175.80 tokens/s, Accepted: 1235 tokens, Drafted: 1758 tokens, Per-position acceptance rate:
    0.820, 0.585, Avg Draft acceptance rate: 70.3%

Every figure covers the interval since the previous line. The bridge that runs the engine (the engine thread,
or the server side of the engine process) calls ``step`` after each engine step with that step's outputs and
the engine's counters (``engine_stats.EngineStats``); a line is written at the first step after ``interval``
seconds, so an idle server writes nothing. Prompt throughput counts the prompt tokens a request computed
(its prompt less its prefix-cache hit) when its first token arrives; generation throughput every token
emitted. KV cache usage is the fullest pool's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from deepinfer.engine.outputs import RequestOutput
from deepinfer.server.engine_stats import EngineStats

log = logging.getLogger("deepinfer.server")

LOG_STATS_INTERVAL_S = 10.0  # vLLM's default interval


class StatLog:
    def __init__(self, interval: float = LOG_STATS_INTERVAL_S, logger: logging.Logger = log) -> None:
        if interval < 0:
            raise ValueError(f"interval: must be >= 0 seconds, got {interval}")
        self.interval, self.logger = interval, logger
        self._since: float | None = None  # start of the interval (the first step seen)
        self._prompt = self._generation = 0  # tokens in the interval
        self._started: set[str] = set()  # requests that have their first token and are not finished
        self._last: EngineStats | None = None  # the counters at the previous line

    def step(self, outputs: Iterable[RequestOutput], stats: EngineStats, now: float) -> list[str]:
        """Count one step's outputs; write (and return) the lines when the interval is over."""
        for out in outputs:
            new = sum(len(d) for d in out.delta_token_ids)
            self._generation += new
            rid = out.request_id
            if new and rid not in self._started:
                self._started.add(rid)
                self._prompt += max(0, len(out.prompt_token_ids) - out.num_cached_tokens)
            if out.finished:
                self._started.discard(rid)
        if self._since is None:
            self._since, self._last = now, stats
            return []
        elapsed = now - self._since
        if elapsed < self.interval or elapsed <= 0:
            return []
        lines = self.lines(stats, elapsed)
        active = self._prompt or self._generation or stats.running or stats.waiting
        for line in lines:
            self.logger.log(logging.INFO if active else logging.DEBUG, "%s", line)
        self._since, self._last, self._prompt, self._generation = now, stats, 0, 0
        return lines

    def lines(self, stats: EngineStats, elapsed: float) -> list[str]:
        """The interval's lines: engine throughput and load, then speculative decoding (when it runs)."""
        last = self._last
        usage = max(stats.cache_usage.values(), default=0.0)
        head = (f"Avg prompt throughput: {self._prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self._generation / elapsed:.1f} tokens/s, "
                f"Running: {stats.running} reqs, Waiting: {stats.waiting} reqs, KV cache usage: {100 * usage:.1f}%")
        if stats.prefix is not None:
            before = last.prefix if last is not None and last.prefix is not None else None
            queries = stats.prefix.queries - (before.queries if before else 0)
            hits = stats.prefix.hits - (before.hits if before else 0)
            head += f", Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        out = [head]
        s = stats.spec
        if s is None:
            return out
        b = last.spec if last is not None and last.spec is not None else None
        drafts = s.num_drafts - (b.num_drafts if b else 0)
        drafted = s.num_draft_tokens - (b.num_draft_tokens if b else 0)
        accepted = s.num_accepted_tokens - (b.num_accepted_tokens if b else 0)
        if not drafts:
            return out
        per_pos = [n - (b.accepted_per_pos[i] if b else 0) for i, n in enumerate(s.accepted_per_pos)]
        out.append(f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                   f"Accepted throughput: {accepted / elapsed:.2f} tokens/s, "
                   f"Drafted throughput: {drafted / elapsed:.2f} tokens/s, "
                   f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
                   f"Per-position acceptance rate: {', '.join(f'{n / drafts:.3f}' for n in per_pos)}, "
                   f"Avg Draft acceptance rate: {100 * accepted / drafted if drafted else 0.0:.1f}%")
        return out
