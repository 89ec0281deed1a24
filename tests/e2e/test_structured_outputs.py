"""Structured outputs on the bundled demo model at temperature 1.0: every output obeys its constraint.

100 requests per constraint kind (JSON schema, any JSON object, regex, choice, Lark grammar), each with its
own seed, through the offline API. An output that ended on its own ("stop") must parse and validate
(``jsonschema``, ``re.fullmatch``, membership); one cut by ``max_tokens`` ("length") must be a prefix the
grammar still accepts. Bad constraints are ValueErrors naming the field, before anything is queued.
"""

from __future__ import annotations

import json
import re

import pytest

from deepinfer import LLM, SamplingParams

jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")

N = 100
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICE = ["yes", "no", "maybe so", "def f():"]
LARK = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'
LARK_RE = r"\([0-9]{1,3}(\+[0-9]{1,3})*\)"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", load_progress=False, block_size=128, max_num_seqs=100, max_num_batched_tokens=4096,
               num_cache_blocks=128)  # a block for each of 100 short requests, not the 2 GiB default


def _run(llm: LLM, prompt: str, constraint: dict, max_tokens: int = 48, **kw):
    params = [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=max_tokens, structured_outputs=constraint,
                             **kw) for i in range(N)]
    return [o.outputs[0] for o in llm.generate([prompt] * N, params, use_tqdm=False)]


def _prefix_ok(llm: LLM, constraint: dict, token_ids) -> bool:
    intake = llm.engine.intake
    from deepinfer.structured import StructuredOutputsParams

    m = intake._grammars.matcher(intake._grammars.compile(StructuredOutputsParams.from_dict(constraint)))
    return all(m.consume_token(t) for t in token_ids) and not m.is_error()


def _check(llm, constraint, outs, valid) -> None:
    done = [o for o in outs if o.finish_reason == "stop"]
    assert len(done) >= N // 2, f"only {len(done)} of {N} finished their structure"
    for o in done:
        assert valid(o.text), o.text
    for o in outs:
        if o.finish_reason == "length":
            assert _prefix_ok(llm, constraint, o.token_ids), o.text


def test_json_schema(llm) -> None:
    constraint = {"json": PERSON}
    _check(llm, constraint, _run(llm, "# a person record\nperson = ", constraint, 64),
           lambda t: jsonschema.validate(json.loads(t), PERSON) is None)


def test_any_json_object(llm) -> None:
    _check(llm, {"json_object": True}, _run(llm, "config = ", {"json_object": True}, 64),
           lambda t: isinstance(json.loads(t), dict))


def test_regex(llm) -> None:
    _check(llm, {"regex": REGEX}, _run(llm, "code = ", {"regex": REGEX}, 16), lambda t: re.fullmatch(REGEX, t))


def test_choice(llm) -> None:
    outs = _run(llm, "answer = ", {"choice": CHOICE}, 16)
    _check(llm, {"choice": CHOICE}, outs, lambda t: t in CHOICE)
    assert len({o.text for o in outs}) > 1  # sampling, not one forced answer


def test_lark_grammar(llm) -> None:
    _check(llm, {"grammar": LARK}, _run(llm, "total = ", {"grammar": LARK}, 24), lambda t: re.fullmatch(LARK_RE, t))


def test_max_tokens_mid_structure_is_a_valid_prefix(llm) -> None:
    constraint = {"json": PERSON}
    outs = [o.outputs[0] for o in llm.generate(["person = "] * 4, [SamplingParams(
        temperature=1.0, seed=s, max_tokens=5, structured_outputs=constraint) for s in range(4)], use_tqdm=False)]
    assert {o.finish_reason for o in outs} == {"length"}
    assert all(o.text.startswith("{") and _prefix_ok(llm, constraint, o.token_ids) for o in outs)


def test_n_and_stop_strings(llm) -> None:
    out = llm.generate("code = ", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16, stop=["-"],
                                                 structured_outputs={"regex": REGEX}), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:  # the stop string ends each sample before its dash
        assert c.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}", c.text), c.text


@pytest.mark.parametrize("constraint, field", [
    ({"regex": "a(b"}, "structured_outputs.regex"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "structured_outputs.json"),
    ({"grammar": "start: (("}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs"),
    ({"jsn": {}}, "structured_outputs.jsn"),
])
def test_bad_constraints_name_the_field(llm, constraint, field) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=constraint), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing was queued
    assert llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_thinking_mode_constrains_only_the_answer(llm) -> None:
    """In thinking mode the reasoning is free and the answer after </think> obeys the constraint. The demo
    model never closes a thinking block by itself, so its draw at the third output position is steered to
    </think> (a logit bias in the runner); greedy decoding makes the rest deterministic."""
    from deepinfer.runner.model_runner import ModelRunner

    from deepinfer.chat import encode_messages

    think_end = llm.get_tokenizer().token_to_id("</think>")
    messages = [{"role": "user", "content": "a code?"}]
    prompt_len = len(llm.get_tokenizer().encode(encode_messages(messages, thinking=True)))
    original = ModelRunner._draw

    def steered(self, logits, work, slots, positions, *rest):
        logits = logits.float().clone()
        for row, pos in enumerate(positions):
            if pos == prompt_len + 2:
                logits[row, think_end] = 1e4
        return original(self, logits, work, slots, positions, *rest)

    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs={"regex": REGEX})
    ModelRunner._draw = steered
    try:
        out = llm.chat(messages, params, thinking=True, use_tqdm=False)[0]
    finally:
        ModelRunner._draw = original
    ids = out.request.outputs[0].token_ids
    assert ids[2] == think_end and think_end not in ids[:2]
    assert re.fullmatch(REGEX, out.choices[0].content), out.choices[0].content
    assert out.choices[0].reasoning is not None
