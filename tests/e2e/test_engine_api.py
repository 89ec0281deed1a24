"""The offline API and engine on the bundled demo model: outputs, seeds, n > 1, logprobs, stops, aborts,
and bad input that is rejected without disturbing the requests already running."""

from __future__ import annotations

import math

import pytest

from deepinfer import LLM, LLMEngine, SamplingParams

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "# a comment", "x = [1, 2, 3]"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", load_progress=False, block_size=128, num_cache_blocks=72)  # a max_model_len request fits


def _engine(llm: LLM) -> LLMEngine:
    return llm.engine


def _run(engine: LLMEngine, until=None) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
        engine.cache.check_integrity()
    return finals


def test_generate_returns_in_input_order_with_prompt_fields(llm: LLM) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    tok = llm.get_tokenizer()
    for o in outs:
        assert list(o.prompt_token_ids) == tok.encode(o.prompt, add_special_tokens=True)
        (c,) = o.outputs
        assert c.index == 0 and len(c.token_ids) == 5 and c.finish_reason == "length"
        assert c.text == tok.decode(list(c.token_ids))


def test_prompt_token_ids_input_and_greedy_is_deterministic(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("def f(x):", add_special_tokens=True)
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = llm.generate({"prompt_token_ids": ids}, p, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate([ids], p, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and len(a) == 8


def test_seeded_request_is_batch_independent(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seq_seed=1234, ignore_eos=True)
    alone = llm.generate("def fibonacci(n):", seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, max_tokens=n, seed=n, ignore_eos=True) for n in (3, 20, 9)]
    batch = llm.generate(["import os"] + ["def fibonacci(n):"] + PROMPTS[2:4],
                         [others[0], seeded, others[1], others[2]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    reordered = llm.generate(PROMPTS[2:4] + ["def fibonacci(n):"], [others[2], others[1], seeded], use_tqdm=False)
    assert reordered[2].outputs[0].token_ids == alone


def test_n_samples_logprobs_and_prompt_logprobs(llm: LLM) -> None:
    p = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    (out,) = llm.generate("def fibonacci(n):", p, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({c.token_ids for c in out.outputs}) > 1  # different seeds per sample
    for c in out.outputs:
        assert len(c.logprobs) == 6
        for tok, pos in zip(c.token_ids, c.logprobs):
            assert tok in pos and len(pos) in (2, 3)
            assert all(v.logprob <= 0 for v in pos.values())
        assert math.isclose(c.cumulative_logprob, sum(pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs)),
                            rel_tol=1e-6)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for tok, pos in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert tok in pos


def test_stop_string_is_excluded_and_matches_across_tokens(llm: LLM) -> None:
    free = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = free.text
    stop = text[7:12]  # a stop string that very likely spans a token boundary
    cut = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=30, stop=[stop],
                                                           ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    free = llm.generate("x = 1", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    target = free.token_ids[3]
    out = llm.generate("x = 1", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[target],
                                               ignore_eos=True), use_tqdm=False)[0].outputs[0]
    first = free.token_ids.index(target)
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.token_ids == free.token_ids[: first + 1]
    late = llm.generate("x = 1", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[target],
                                                min_tokens=first + 2, ignore_eos=True), use_tqdm=False)
    assert target not in late[0].outputs[0].token_ids[: first + 2]


def test_abort_mid_generation_frees_every_block(llm: LLM) -> None:
    engine = _engine(llm)
    p = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"ab{i}", prompt, p)
    for _ in range(4):
        engine.step()
        engine.cache.check_integrity()
    engine.abort_request(["ab1", "ab3"])
    engine.cache.check_integrity()
    outs = {o.request_id: o for o in engine.step()}
    assert outs["ab1"].finished and outs["ab1"].outputs[0].finish_reason == "abort"
    finals = _run(engine)
    assert set(finals) == {"ab0", "ab2", "ab4"}
    assert engine.cache.num_requests == 0
    for pool, used in engine.cache.usage().items():
        assert used == 0.0, pool


@pytest.mark.parametrize("prompt, params, field", [
    ("", None, "prompt"),
    ({"prompt_token_ids": []}, None, "prompt_token_ids"),
    ({"prompt_token_ids": [1, 99999]}, None, "prompt_token_ids"),
    ({"prompt_token_ids": [1, -1]}, None, "prompt_token_ids"),
    ({"prompt_token_ids": [1, "a"]}, None, "prompt_token_ids"),
    ({"text": "hi"}, None, "prompt"),
    (3.5, None, "prompt"),
    ("hi", {"temperature": 0}, "sampling_params"),
    ("x " * 9000, None, "prompt"),
])
def test_bad_requests_are_rejected_and_others_keep_running(llm: LLM, prompt, params, field) -> None:
    engine = _engine(llm)
    engine.add_request("good", "def fibonacci(n):", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match=rf"^{field}"):
        engine.add_request("bad", prompt, params)
    finals = _run(engine)
    assert list(finals) == ["good"] and len(finals["good"].outputs[0].token_ids) == 6


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 1.5}, "n"),
    ({"logprobs": 50}, "logprobs"),
    ({"bogus": 1}, "bogus"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
])
def test_invalid_sampling_params_name_the_field(llm: LLM, kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        params = SamplingParams(**kwargs)
        llm.engine.add_request("sp", "hi", params)
    assert "sp" not in llm.engine.requests


def test_duplicate_request_id_and_unknown_engine_arg(llm: LLM) -> None:
    engine = _engine(llm)
    engine.add_request("dup", "hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", "hi", SamplingParams(max_tokens=2))
    _run(engine)
    with pytest.raises(ValueError, match="^max_num_seq: unknown engine argument"):
        LLM(max_num_seq=4)


def test_chat_separates_reasoning_and_answer(llm: LLM) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (plain,) = llm.chat(msgs, p, thinking=False, use_tqdm=False)
    assert plain.choices[0].reasoning is None
    assert plain.choices[0].completion.text.startswith(plain.choices[0].content)
    assert plain.request.prompt.endswith("<｜Assistant｜></think>")
    (think,) = llm.chat(msgs, p, thinking=True, use_tqdm=False)
    c = think.choices[0]
    # Random weights rarely emit </think>: then everything generated is reasoning and the answer is empty.
    assert c.reasoning is not None and (c.content == "" or "</think>" in c.completion.text)
    assert think.request.prompt.endswith("<｜Assistant｜><think>")
