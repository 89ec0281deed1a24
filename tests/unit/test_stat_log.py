"""The server's periodic stats line (``server/stat_log.py``): each figure is the interval's, from the outputs and
counters it was given; nothing is written before the interval is over."""

from __future__ import annotations

import logging

import pytest

from deepinfer.engine.outputs import CompletionOutput, RequestOutput
from deepinfer.server.engine_stats import EngineStats, PrefixCounts, SpecCounts
from deepinfer.server.stat_log import StatLog


def _out(rid: str, prompt: int, new: int, cached: int = 0, finished: bool = False) -> RequestOutput:
    ids = tuple(range(new))
    return RequestOutput(rid, None, tuple(range(prompt)), (CompletionOutput(0, "", ids, "stop" if finished else None),), finished,
                         delta_token_ids=(ids,), num_cached_tokens=cached)


def _stats(running: int = 0, waiting: int = 0, usage: float = 0.0, prefix: tuple[int, int] | None = None,
           spec: tuple[int, int, int, tuple[int, ...]] | None = None) -> EngineStats:
    return EngineStats(running, waiting, {"history": usage, "window": usage / 2},
                       PrefixCounts(prefix[0], prefix[1], {}, {}) if prefix else None,
                       spec=SpecCounts(*spec) if spec else None)


def test_throughputs_load_and_hit_rate_are_the_intervals(caplog) -> None:
    log = StatLog(interval=10.0)
    with caplog.at_level(logging.INFO, logger="deepinfer.server"):
        assert log.step([_out("a", 100, 1, cached=40)], _stats(1, 2, prefix=(100, 40)), now=0.0) == []
        assert log.step([_out("a", 100, 3), _out("b", 50, 1)], _stats(2, 1, 0.25, prefix=(150, 40)), now=5.0) == []
        lines = log.step([_out("a", 100, 2, finished=True)], _stats(1, 0, 0.5, prefix=(200, 90)), now=10.0)
    # prompt tokens: a computed 100 - 40 at its first token, b 50; generation: 1 + 3 + 1 + 2 tokens over 10 s
    assert lines == ["Avg prompt throughput: 11.0 tokens/s, Avg generation throughput: 0.7 tokens/s, Running: 1 "
                     "reqs, Waiting: 0 reqs, KV cache usage: 50.0%, Prefix cache hit rate: 50.0%"]
    assert [r.getMessage() for r in caplog.records] == lines and caplog.records[0].levelno == logging.INFO
    # the next interval starts from here: b's later tokens are not a new prompt; the hit rate is this interval's
    assert log.step([_out("b", 50, 4)], _stats(1, 0, prefix=(200, 90)), now=15.0) == []
    lines = log.step([_out("c", 30, 1, cached=30)], _stats(2, 0, prefix=(230, 120)), now=20.0)
    assert lines[0].startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.5 tokens/s")
    assert lines[0].endswith("Prefix cache hit rate: 100.0%")


def test_speculative_decoding_line() -> None:
    log = StatLog(interval=1.0)
    log.step([], _stats(spec=(10, 20, 12, (8, 4))), now=0.0)
    lines = log.step([_out("a", 8, 5)], _stats(1, spec=(30, 60, 42, (26, 16))), now=2.0)
    # the interval's 20 drafts of 2 tokens: 30 accepted (18 at position 0, 12 at position 1)
    assert lines[1] == ("SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 15.00 tokens/s, "
                        "Drafted throughput: 20.00 tokens/s, Accepted: 30 tokens, Drafted: 40 tokens, "
                        "Per-position acceptance rate: 0.900, 0.600, Avg Draft acceptance rate: 75.0%")
    assert "Prefix cache" not in lines[0]  # prefix caching off: no hit rate
    # an interval without verify steps writes no speculative line
    assert len(log.step([_out("a", 8, 1)], _stats(1, spec=(30, 60, 42, (26, 16))), now=4.0)) == 1


def test_idle_intervals_log_at_debug_only(caplog) -> None:
    log = StatLog(interval=1.0)
    with caplog.at_level(logging.INFO, logger="deepinfer.server"):
        log.step([], _stats(), now=0.0)
        assert log.step([], _stats(), now=5.0)  # the lines are made ...
    assert not caplog.records  # ... but an interval without work or load is not worth an INFO line


def test_interval_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="interval"):
        StatLog(interval=-1)


def test_serve_flag() -> None:
    from deepinfer.cli import build_parser

    assert build_parser().parse_args(["serve", "--disable-log-stats"]).disable_log_stats
    assert not build_parser().parse_args(["serve"]).disable_log_stats
