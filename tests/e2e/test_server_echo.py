"""``echo`` on /v1/completions and the context-length rules, end to end on the bundled demo model.

The echoed prompt logprobs are the engine's prompt logprobs: they must equal, bit for bit, what the offline
``LLM.generate(..., SamplingParams(prompt_logprobs=k))`` returns for the same prompts. JSON carries Python
floats exactly (shortest round-trip repr), so the comparisons below are ``==``, not approximate. The
reference is always run on the same batch (the same prompts and ``n``, submitted together as the server
submits them): the CPU kernels are not batch-invariant, so a prompt scored beside others can differ from the
same prompt scored alone in the last bits.

``test_lm_eval_loglikelihood_request`` sends exactly what lm-eval's ``local-completions`` model sends for a
loglikelihood (multiple-choice) request and reads the response the way it does; lm-eval itself is too heavy
to be a test dependency (eval/README.md records a real run).
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import pytest

# The module-scoped fixtures of test_server.py, imported so this module gets its own server and reference LLM.
from tests.e2e.test_server import API_KEY, MODEL, PROMPTS, Server, client, offline, server  # noqa: F401

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from deepinfer import LLM, SamplingParams  # noqa: E402

MAX_MODEL_LEN = 8192  # the engine default for the demo model (min(max_position_embeddings, 8192))
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, headers=HEADERS, timeout=120)


def _offline(llm: LLM, prompts: list, k: int | None, max_tokens: int = 1, n: int = 1) -> list[Any]:
    """The reference: ``prompts`` together, with the parameters the server gives the engine."""
    params = SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=k,
                            prompt_logprobs=k)
    return llm.generate(prompts, params, use_tqdm=False)


def _expected_prompt_lists(ref: Any) -> tuple[list, list]:
    """token_logprobs and top_logprobs the echo must return for ``ref``'s prompt: null for the first token."""
    values: list[float | None] = [None]
    tops: list[dict | None] = [None]
    for tid, pos in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:]):
        values.append(pos[tid].logprob)
        tops.append({v.decoded_token: v.logprob for v in pos.values()})
    return values, tops


def test_echo_without_logprobs(server: Server, client: openai.OpenAI, offline: LLM) -> None:
    prompts = PROMPTS[10:12]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, echo=True, temperature=0,
                                  extra_body={"ignore_eos": True})
    refs = _offline(offline, prompts, None, 4)
    choices = sorted(r.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [p + ref.outputs[0].text for p, ref in zip(prompts, refs)]
    assert all(c.logprobs is None for c in choices)
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == sum(len(x.prompt_token_ids) for x in refs)


def test_echo_logprobs_equal_offline_prompt_logprobs(server: Server, offline: LLM) -> None:
    prompt, k = PROMPTS[13], 3
    r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": k,
                                          "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    (ref,) = _offline(offline, [prompt], k, 2)
    gen = ref.outputs[0]
    assert choice["text"] == prompt + gen.text
    lp = choice["logprobs"]
    n_prompt = len(ref.prompt_token_ids)
    assert {len(v) for v in lp.values()} == {n_prompt + 2}
    values, tops = _expected_prompt_lists(ref)
    assert lp["token_logprobs"][:n_prompt] == values  # bit for bit, first one null
    assert lp["top_logprobs"][:n_prompt] == tops
    for tid, top in zip(ref.prompt_token_ids[1:], lp["top_logprobs"][1:n_prompt]):
        # k alternatives, plus the prompt's own token where it is not among them (OpenAI's "up to k + 1")
        assert len(top) in (k, k + 1)
    assert lp["token_logprobs"][n_prompt:] == [pos[t].logprob for t, pos in zip(gen.token_ids, gen.logprobs)]
    tok = offline.get_tokenizer()
    assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in ref.prompt_token_ids + gen.token_ids]
    # Offsets index the returned text: the BOS the server added to the text prompt takes no room in it.
    offsets = lp["text_offset"]
    assert offsets[:2] == [0, 0] and offsets[n_prompt] == len(prompt)
    assert all(choice["text"][o:].startswith(t) for o, t in zip(offsets[1:n_prompt], lp["tokens"][1:n_prompt]))


def test_echo_max_tokens_zero_token_id_prompts_batched_with_n(server: Server, offline: LLM) -> None:
    tok = offline.get_tokenizer()
    ids = [tok.encode(p, add_special_tokens=True) for p in PROMPTS[14:17]]
    r = _post(server, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "n": 2,
                                          "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    refs = _offline(offline, ids, 1, n=2)  # max_tokens 0 runs the engine with 1
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "completion_tokens": 0,
                             "total_tokens": sum(map(len, ids)), "prompt_tokens_details": {"cached_tokens": 0}}
    for c in choices:
        p = c["index"] // 2  # OpenAI's numbering: prompt p's samples are p * n .. p * n + n - 1
        ref = refs[p]
        assert c["text"] == tok.decode(ids[p], skip_special_tokens=True) and c["finish_reason"] == "length"
        values, tops = _expected_prompt_lists(ref)
        assert c["logprobs"]["token_logprobs"] == values and c["logprobs"]["top_logprobs"] == tops
        assert len(c["logprobs"]["tokens"]) == len(ids[p])
    # A single token-id prompt (a flat list) and one text prompt, without logprobs.
    single = _post(server, "/v1/completions", {"prompt": ids[0], "max_tokens": 0, "echo": True}).json()
    assert single["choices"][0]["text"] == tok.decode(ids[0]) and single["choices"][0]["logprobs"] is None
    text = _post(server, "/v1/completions", {"prompt": PROMPTS[14], "max_tokens": 0, "echo": True}).json()
    assert text["choices"][0]["text"] == PROMPTS[14] and text["usage"]["completion_tokens"] == 0
    server.wait_idle()


def test_lm_eval_loglikelihood_request(server: Server, offline: LLM) -> None:
    """lm-eval 0.4 ``local-completions``, loglikelihood: context + continuation as token ids (no BOS: its
    add_bos_token defaults to False), several requests batched in one call, and it reads
    ``sorted(choices, key=index)[j]["logprobs"]["token_logprobs"][ctxlen:-1]`` (the last entry is the one
    generated token) and checks greediness against ``max(top_logprobs[...].values())``."""
    tok = offline.get_tokenizer()
    pairs = [("def add(a, b):\n    return", " a + b"), ("import", " os"), ("class Foo", "(object):")]
    contexts = [tok.encode(c) for c, _ in pairs]
    inputs = [ctx + tok.encode(cont) for ctx, (_, cont) in zip(contexts, pairs)]
    payload = {"model": MODEL, "prompt": inputs, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
               "echo": True}
    r = httpx.post(server.url + "/v1/completions", json=payload, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=itemgetter("index"))
    assert len(choices) == len(inputs)
    refs = _offline(offline, inputs, 1)
    for choice, ctx, inp, ref in zip(choices, contexts, inputs, refs):
        ctxlen = len(ctx)
        got = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(v == max(top.values()) for v, top in zip(got, tops))
        want = [pos[t].logprob for t, pos in zip(ref.prompt_token_ids[ctxlen:], ref.prompt_logprobs[ctxlen:])]
        assert got == want and sum(got) == sum(want)
        assert is_greedy == all(pos[t].rank == 1 for t, pos in
                                zip(ref.prompt_token_ids[ctxlen:], ref.prompt_logprobs[ctxlen:]))
        assert len(choice["logprobs"]["token_logprobs"]) == len(inp) + 1


def test_echo_stream_sends_the_prompt_first(server: Server, client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": PROMPTS[17:19], "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    whole = {c.index: c for c in client.completions.create(**kw).choices}
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts: dict[int, str] = {}
    tokens: dict[int, list] = {}
    values: dict[int, list] = {}
    for ch in chunks[:-1]:
        for c in ch.choices:
            if c.index not in texts:
                assert c.text.startswith(kw["prompt"][c.index])  # the first chunk carries the prompt
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
            values.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    for i, c in whole.items():
        assert texts[i] == c.text and tokens[i] == c.logprobs.tokens and values[i] == c.logprobs.token_logprobs
    assert chunks[-1].usage.completion_tokens == 6
    zero = list(client.completions.create(model=MODEL, prompt=PROMPTS[19], max_tokens=0, echo=True, stream=True,
                                          stream_options={"include_usage": True}))
    assert [c.choices[0].text for c in zero[:-1]] == [PROMPTS[19]]
    assert zero[0].choices[0].finish_reason == "length" and zero[-1].usage.completion_tokens == 0


# ---- the context length: 400s naming the field and the limit ---------------------------------------------------
def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_max_tokens_beyond_the_context_is_refused(server: Server, offline: LLM) -> None:
    n_prompt = len(offline.get_tokenizer().encode(PROMPTS[20], add_special_tokens=True))
    err = _error(_post(server, "/v1/completions", {"prompt": PROMPTS[20], "max_tokens": 100_000_000}))
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    msg = err["message"]
    assert msg.startswith("max_tokens: 100000000") and str(MAX_MODEL_LEN) in msg
    assert f"at most {MAX_MODEL_LEN - n_prompt} can be generated" in msg
    # One over the limit is refused too; the longest of several prompts sets the limit and is named.
    err = _error(_post(server, "/v1/completions", {"prompt": ["x", PROMPTS[20]],
                                                   "max_tokens": MAX_MODEL_LEN - n_prompt + 1}))
    assert err["param"] == "max_tokens" and "prompt[1]" in err["message"]
    for body, param in (({"prompt": [5] * MAX_MODEL_LEN}, "prompt"), ({"prompt": ["x", "x " * 9000]}, "prompt[1]"),
                        ({"prompt": [[5], [5] * 9000], "echo": True, "max_tokens": 0}, "prompt[1]")):
        err = _error(_post(server, "/v1/completions", body))
        assert err["param"] == param and err["message"].startswith(param + ": ")
        assert f"context length is {MAX_MODEL_LEN} tokens" in err["message"]
        assert f"at most {MAX_MODEL_LEN - 1}" in err["message"]
    err = _error(_post(server, "/v1/completions", {"prompt": "x", "max_tokens": 0}))
    assert err["param"] == "max_tokens" and "echo" in err["message"]
    err = _error(_post(server, "/v1/completions", {"prompt": [[1, 2], [3, 99999]]}))
    assert err["param"] == "prompt[1][1]"
    server.wait_idle()  # nothing was admitted


def test_chat_max_tokens_beyond_the_context_is_refused(server: Server) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for field in ("max_tokens", "max_completion_tokens"):
        err = _error(_post(server, "/v1/chat/completions", {"messages": messages, field: 10**8}))
        assert err["param"] == field and err["message"].startswith(f"{field}: 100000000 is too large")
        assert f"context length is {MAX_MODEL_LEN} tokens" in err["message"]
    long = [{"role": "user", "content": "x " * 9000}]
    err = _error(_post(server, "/v1/chat/completions", {"messages": long}))
    assert err["param"] == "messages" and f"context length is {MAX_MODEL_LEN}" in err["message"]
    ok = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})  # still serving
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2
    server.wait_idle()
