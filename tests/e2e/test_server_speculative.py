"""`deepinfer serve --speculative-config '{"method": "mtp", ...}'`: streamed and whole completions (greedy and
seeded, with a stop string) equal the offline engine without speculation, /metrics exports the speculative
decoding counters under vLLM's names, and the periodic stats line reports the mean acceptance length."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from deepinfer import SamplingParams  # noqa: E402
from deepinfer.server.stat_log import StatLog  # noqa: E402
from tests.e2e.test_server import API_KEY, ENGINE, MODEL, PROMPTS, Server, launch, offline, serve  # noqa: E402,F401

CASES = [(PROMPTS[0], {"temperature": 0}), (PROMPTS[2], {"temperature": 0}),
         (PROMPTS[1], {"temperature": 0.9, "seed": 12}), (PROMPTS[3], {"temperature": 0.8, "top_p": 0.9, "seed": 4})]


@pytest.fixture(scope="module")
def spec_server(request: pytest.FixtureRequest) -> Iterator[Server]:
    yield from serve(launch(request.config.getoption("--server-mode"), **ENGINE,
                            speculative_config='{"method": "mtp", "num_speculative_tokens": 2}'))


def _complete(client: openai.OpenAI, prompt: str, params: dict, stream: bool) -> str:
    body = dict(model=MODEL, prompt=prompt, max_tokens=16, stop=["\n\n"], **params)
    if not stream:
        return client.completions.create(**body).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices)


def test_served_speculative_equals_offline_and_exports_metrics(spec_server: Server, offline) -> None:
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key=API_KEY, max_retries=0)
    want = [offline.generate(p, SamplingParams(max_tokens=16, stop=["\n\n"], **kw), use_tqdm=False)[0].outputs[0].text
            for p, kw in CASES]
    with ThreadPoolExecutor(len(CASES)) as pool:
        got = list(pool.map(lambda i: _complete(client, *CASES[i], stream=i % 2 == 0), range(len(CASES))))
    assert got == want
    spec_server.wait_idle()
    text = httpx.get(spec_server.url + "/metrics").text
    samples = {(s.name, s.labels.get("position")): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    drafts = samples[("deepinfer:spec_decode_num_drafts_total", None)]
    draft_tokens = samples[("deepinfer:spec_decode_num_draft_tokens_total", None)]
    accepted = samples[("deepinfer:spec_decode_num_accepted_tokens_total", None)]
    per_pos = [samples[("deepinfer:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(2)]
    assert 0 < drafts and 0 < accepted <= draft_tokens <= 2 * drafts
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1]


def test_periodic_log_line_reports_acceptance(spec_server: Server, caplog) -> None:
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key=API_KEY, max_retries=0)
    spec_server.state.bridge.stat_log = StatLog(interval=0.0)  # a line after every step (the server's: 10 s)
    with caplog.at_level(logging.INFO, logger="deepinfer.server"):
        _complete(client, PROMPTS[0], {"temperature": 0}, stream=False)
        spec_server.wait_idle()
    lines = [r.getMessage() for r in caplog.records if r.name == "deepinfer.server"]
    assert any(line.startswith("Avg prompt throughput: ") and "Running: " in line for line in lines)
    spec = [line for line in lines if line.startswith("SpecDecoding metrics: Mean acceptance length: ")]
    assert spec, lines
    lengths = [float(line.split("Mean acceptance length: ")[1].split(",")[0]) for line in spec]
    assert all(1.0 <= x <= 3.0 for x in lengths)  # k = 2: one to three tokens per verify step
