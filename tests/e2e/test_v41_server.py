"""The OpenAI-compatible server answers a chat request on a tiny DeepSeek-V4.1 checkpoint (the released cache
formats on: ``kv_cache_dtype="auto"``), with the greedy answer an offline ``LLM`` on the same checkpoint gives."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from deepinfer import LLM, LLMEngine, SamplingParams  # noqa: E402
from tests.e2e.test_server import API_KEY, serve  # noqa: E402
from tests.e2e.v41_tiny import write_tiny_v41  # noqa: E402

ENGINE = {"device": "cpu", "block_size": 128, "max_model_len": 512, "num_cache_blocks": 8, "load_progress": False}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write a sort."}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_v41(tmp_path_factory.mktemp("v41_server"), seed=4)


def test_chat_request_on_v41(checkpoint) -> None:
    ref = LLM(model=str(checkpoint), **ENGINE).chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8,
                                                                            ignore_eos=True), use_tqdm=False)[0]
    server = serve(LLMEngine.from_engine_args(model=str(checkpoint), **ENGINE))
    s = next(server)
    try:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        name = httpx.get(s.url + "/v1/models", headers=headers).json()["data"][0]["id"]
        r = httpx.post(s.url + "/v1/chat/completions", headers=headers, timeout=120, json={
            "model": name, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["choices"][0]["message"]["content"] == ref.choices[0].content
        assert body["usage"]["prompt_tokens"] == len(ref.request.prompt_token_ids)
        assert body["usage"]["completion_tokens"] == 8
    finally:
        next(server, None)  # the teardown: stop the server and its engine thread
