"""Server pieces without a socket: the engine bridge driven by a scripted engine, and the chat response
builders (tool calls, reasoning) driven by hand-made engine outputs — text a random demo model never emits."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytest.importorskip("fastapi")

from deepinfer.chat import EOS, THINK_END  # noqa: E402
from deepinfer.chat.encoding import render_tool_calls  # noqa: E402
from deepinfer.engine.outputs import CompletionOutput, RequestOutput, merge_deltas  # noqa: E402
from deepinfer.server.commands import EngineRequest  # noqa: E402
from deepinfer.server.protocol import ChatBuilder  # noqa: E402

MODEL = "deepinfer-demo"


# ---- the bridge on its own, with a scripted engine ----------------------------------------------------------
class _ScriptedEngine:
    """Just enough of LLMEngine for AsyncEngine: each request yields 3 one-token outputs."""

    def __init__(self, fail_on_step: int | None = None) -> None:
        self.requests: dict[str, int] = {}
        self.steps, self.fail_on_step, self._pending = 0, fail_on_step, []
        self.scheduler = type("S", (), {"running": [], "waiting": []})()
        self.cache = type("C", (), {"usage": staticmethod(lambda: {"history": 0.0})})()

    @staticmethod
    def _out(rid: str, n: int, reason: str | None) -> RequestOutput:
        c = CompletionOutput(0, "x" * n, (7,) * n, reason)
        return RequestOutput(rid, "p", (1,), (c,), reason is not None, None, ("x",), ((7,),))

    def add_request(self, rid: str, prompt: str, params: object) -> None:
        if prompt == "bad":
            raise ValueError("prompt: scripted rejection")
        self.requests[rid] = 0

    def abort_request(self, ids: list[str]) -> None:
        for rid in ids:
            if self.requests.pop(rid, None) is not None:
                self._pending.append(self._out(rid, 0, "abort"))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.steps == self.fail_on_step:
            raise RuntimeError("scripted failure")
        outs, self._pending = self._pending, []
        for rid in list(self.requests):
            self.requests[rid] += 1
            done = self.requests[rid] == 3
            outs.append(self._out(rid, self.requests[rid], "length" if done else None))
            if done:
                del self.requests[rid]
        return outs


def test_bridge_streams_idles_without_spinning_and_reports_failures() -> None:
    from deepinfer.server.async_engine import AsyncEngine, EngineClosed

    async def run(bridge: AsyncEngine) -> list[list[RequestOutput]]:
        streams = [await bridge.submit([EngineRequest(f"r{i}", "p")]) for i in range(4)]
        with pytest.raises(ValueError, match="prompt"):
            await bridge.submit([EngineRequest("r9", "p"), EngineRequest("r10", "bad")])  # all or nothing
        return [[o async for o in s] for s in streams]

    fake = _ScriptedEngine()
    bridge = AsyncEngine(fake)
    bridge.start()
    results = asyncio.run(run(bridge))
    for r in results:  # 3 one-token steps; a reader that fell behind gets some merged into one output
        assert [o.finished for o in r] == [False] * (len(r) - 1) + [True]
        assert "".join(o.delta_text[0] for o in r) == "xxx" and sum((o.delta_token_ids[0] for o in r), ()) == (7,) * 3
    assert "r9" not in fake.requests  # the half-admitted batch was rolled back
    # A call runs between two steps; after the second one the step that flushed the rolled-back batch's
    # outputs (if it had not run when the streams ended) is done too, and nothing is left to step for.
    bridge.call_sync(lambda e: e.steps)
    steps = bridge.call_sync(lambda e: e.steps)
    time.sleep(0.2)
    assert fake.steps == steps  # idle: the thread waits on its condition, it does not step or spin
    bridge.shutdown()
    assert not bridge.alive

    broken = AsyncEngine(_ScriptedEngine(fail_on_step=2))
    broken.start()

    async def doomed() -> None:
        stream = await broken.submit([EngineRequest("a", "p")])
        async for _ in stream:
            pass

    with pytest.raises(EngineClosed, match="scripted failure"):
        asyncio.run(doomed())
    assert not broken.alive and isinstance(broken.error, RuntimeError)
    with pytest.raises(EngineClosed):
        asyncio.run(doomed())  # refused at once, not hung


def test_a_reader_behind_gets_the_waiting_outputs_of_its_request_merged() -> None:
    from deepinfer.server.async_engine import RequestStream

    def out(rid: str, k: int, last: bool) -> RequestOutput:
        c = CompletionOutput(0, "ab"[:1] * k, (5,) * k, "stop" if last else None)
        return RequestOutput(rid, None, (1,), (c,), last, ((None,) if k == 1 else None), ("a",), ((5,),))

    async def run() -> list[RequestOutput]:
        stream = RequestStream(bridge=None, loop=asyncio.get_running_loop())
        stream.request_ids, stream.unfinished = ["a", "b"], {"a", "b"}
        for item in (out("a", 1, False), out("a", 2, False), out("b", 1, False), out("a", 3, True),
                     out("b", 2, True)):
            stream.queue.put_nowait(item)  # all waiting before the reader looks: it fell behind
        return [o async for o in stream]

    got = asyncio.run(run())
    assert [(o.request_id, o.delta_text, o.delta_token_ids, o.finished) for o in got] == [
        ("a", ("aa",), ((5, 5),), False),  # a's first two steps as one, stopping at b's output (order kept)
        ("b", ("a",), ((5,),), False),
        ("a", ("a",), ((5,),), True),
        ("b", ("a",), ((5,),), True),
    ]
    assert got[0].prompt_logprobs == (None,)  # carried over from the first of the merged outputs
    assert got[0].outputs[0].token_ids == (5, 5)  # the newer output's cumulative state
    with pytest.raises(ValueError, match="merge_deltas"):
        merge_deltas(out("a", 1, False), out("b", 1, False))


# ---- tool calls and reasoning: the builders with controlled text, plus what holds end to end -----------------
def _fake_outputs(text: str, piece: int) -> list[RequestOutput]:
    """The RequestOutputs an engine would emit for ``text`` generated ``piece`` characters per step."""
    outs, ids = [], []
    for k in range(0, len(text), piece):
        ids.append(k)
        last = k + piece >= len(text)
        c = CompletionOutput(0, text[:k + piece], tuple(ids), "stop" if last else None)
        outs.append(RequestOutput("chatcmpl-x", None, (0, 1, 2), (c,), last, None, (text[k:k + piece],), ((k,),)))
    return outs


def _run_builder(text: str, thinking: bool, piece: int) -> tuple[dict, dict]:
    """(non-streaming response, streaming totals) for one generated text."""
    outs = _fake_outputs(text, piece)
    full = ChatBuilder("chatcmpl-x", MODEL, 1, thinking, None).response(outs[-1])
    b, got = ChatBuilder("chatcmpl-x", MODEL, 1, thinking, None), {"reasoning": "", "content": "", "calls": []}
    for out in outs:
        for chunk in b.chunks(out):
            (choice,) = chunk["choices"]
            d = choice["delta"]
            got["reasoning"] += d.get("reasoning_content") or ""
            got["content"] += d.get("content") or ""
            got["calls"] += d.get("tool_calls") or []
            got["finish"] = choice["finish_reason"] or got.get("finish")
    return full, got


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_tool_calls_and_reasoning_parsed_by_the_builders(piece: int) -> None:
    call = render_tool_calls([{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}])
    text = "Need weather." + THINK_END + "Checking.\n\n" + call + EOS + "ignored"
    full, streamed = _run_builder(text, thinking=True, piece=piece)
    (choice,) = full["choices"]
    msg = choice["message"]
    assert msg["reasoning_content"] == "Need weather." and msg["content"] == "Checking."
    (tc,) = msg["tool_calls"]
    assert tc["type"] == "function" and tc["function"]["name"] == "get_weather"
    assert json.loads(tc["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert choice["finish_reason"] == "tool_calls"
    assert streamed["reasoning"] == "Need weather." and streamed["content"] == "Checking."
    assert [c["id"] for c in streamed["calls"]] == [tc["id"]] and streamed["calls"][0]["index"] == 0
    assert streamed["calls"][0]["function"] == tc["function"] and streamed["finish"] == "tool_calls"
    plain, plain_streamed = _run_builder("Just an answer.", thinking=False, piece=piece)
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "Just an answer."}
    assert plain["choices"][0]["finish_reason"] == "stop" and plain_streamed["content"] == "Just an answer."
    cut, cut_streamed = _run_builder("still thinking", thinking=True, piece=piece)  # no </think>: all reasoning
    assert cut["choices"][0]["message"]["reasoning_content"] == "still thinking" == cut_streamed["reasoning"]


# ---- /v1/completions echo: the builder with hand-made outputs ------------------------------------------------
def _lp(token_id: int, value: float, text: str) -> dict:
    from deepinfer.engine.outputs import Logprob

    return {token_id: Logprob(value, 1, text)}


def test_echo_waits_for_the_prompt_scores_when_a_sibling_sample_gets_ahead() -> None:
    """With n=2 the engine scores the prompt on sample 0; if sample 1 produces a token first (sample 0 was
    preempted), sample 1's first chunk is held until the prompt's logprobs are complete, then sent whole."""
    from deepinfer.server.completions import CompletionBuilder
    from deepinfer.server.prompts import PromptEcho

    echo = PromptEcho("ab", ("<s>", "a", "b"), (0, 1, 1))
    prompt_ids = (0, 10, 11)

    def out(s0: tuple, s1: tuple, scored: int, done: bool) -> RequestOutput:
        outs = tuple(CompletionOutput(k, "".join(chr(120 + t) for t in ids), ids, "length" if done else None,
                                      logprobs=tuple(_lp(t, -1.0, chr(120 + t)) for t in ids))
                     for k, ids in enumerate((s0, s1)))
        positions = (None, _lp(10, -2.5, "a"), _lp(11, -0.5, "b"))[:scored]
        return RequestOutput("cmpl-x-0", "ab", prompt_ids, outs, done, positions)

    b = CompletionBuilder("cmpl-x", MODEL, 2, 0, [echo])
    assert b.chunks(out((), (1,), scored=2, done=False)) == []  # sample 1 ran ahead: held back
    first = b.chunks(out((2,), (1, 3), scored=3, done=False))
    assert [c["choices"][0]["index"] for c in first] == [0, 1]
    for chunk, gen in zip(first, ("z", "y{")):
        choice = chunk["choices"][0]
        assert choice["text"] == "ab" + gen
        lp = choice["logprobs"]
        assert lp["token_logprobs"][:3] == [None, -2.5, -0.5] and lp["top_logprobs"][0] is None
        assert lp["text_offset"] == [0, 0, 1, 2, 3][:len(lp["tokens"])]
    (last,) = b.chunks(out((2,), (1, 3), scored=3, done=True))[:1]
    assert last["choices"][0] == {"index": 0, "text": "", "logprobs": {"tokens": [], "token_logprobs": [],
                                  "top_logprobs": [], "text_offset": []}, "finish_reason": "length",
                                  "stop_reason": None}


def test_check_context_limits() -> None:
    from deepinfer.server.errors import ApiError
    from deepinfer.server.prompts import check_context

    check_context([10], ["prompt"], 90, 100, max_tokens_param="max_tokens")  # exactly the context: fine
    check_context([99], ["prompt"], None, 100, max_tokens_param="max_tokens")  # default: the rest of it
    check_context([99], ["prompt"], 0, 100, max_tokens_param="max_tokens")  # echo, nothing generated
    with pytest.raises(ApiError) as e:
        check_context([10], ["prompt"], 91, 100, max_tokens_param="max_tokens")
    assert e.value.param == "max_tokens" and "at most 90 can be generated" in e.value.message
    with pytest.raises(ApiError) as e:
        check_context([5, 100], ["prompt[0]", "prompt[1]"], None, 100, max_tokens_param="max_tokens")
    assert e.value.param == "prompt[1]" and "at most 99" in e.value.message
    with pytest.raises(ApiError) as e:
        check_context([20], ["messages"], 81, 100, max_tokens_param="max_completion_tokens",
                      what="the rendered conversation")
    assert e.value.param == "max_completion_tokens" and "the rendered conversation has 20 tokens" in e.value.message


def test_tier_metrics_follow_the_store_counters() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from deepinfer.kv.tiers import TierCounters, TierStats
    from deepinfer.server.metrics import ServerMetrics

    def snapshot(hits: int, failures: int, used: int) -> TierStats:
        disk = TierCounters("disk", 1 << 30, used, 3, queried=10 + hits, hits=hits, hit_tokens=256 * hits, stored=5,
                            evictions=1, checksum_failures=failures)
        return TierStats((disk,), spilled=0, write_drops=0, pending_writes=0, prefetched=0, prefetch_drops=0)

    m = ServerMetrics("demo")
    m.publish_tiers(snapshot(2, 0, 100))
    m.publish_tiers(snapshot(5, 1, 300))
    samples = {(s.name, s.labels.get("tier")): s.value
               for fam in text_string_to_metric_families(generate_latest(m.registry).decode()) for s in fam.samples}
    assert samples[("deepinfer:kv_tier_hits_total", "disk")] == 5
    assert samples[("deepinfer:kv_tier_hit_tokens_total", "disk")] == 1280
    assert samples[("deepinfer:kv_tier_checksum_failures_total", "disk")] == 1
    assert samples[("deepinfer:kv_tier_used_bytes", "disk")] == 300
    m.publish_tiers(snapshot(7, 0, 50), rank=1)  # another rank's store: series of its own, rank 0's unchanged
    samples = {(s.name, s.labels.get("tier"), s.labels.get("rank")): s.value
               for fam in text_string_to_metric_families(generate_latest(m.registry).decode()) for s in fam.samples}
    assert samples[("deepinfer:kv_tier_hits_total", "disk", "0")] == 5
    assert samples[("deepinfer:kv_tier_hits_total", "disk", "1")] == 7
    assert samples[("deepinfer:kv_tier_used_bytes", "disk", "1")] == 50
