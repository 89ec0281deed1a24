"""SamplingParams: defaults, normalisation, the seed alias and field-named validation errors."""

from __future__ import annotations

import dataclasses
import math
import pickle

import numpy as np
import pytest

from deepinfer.sampling import SamplingParams


def test_defaults_match_vllm_shape() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, (), ())
    assert (p.ignore_eos, p.logprobs, p.prompt_logprobs, p.seq_seed, p.skip_special_tokens) == (
        False, None, None, None, True,
    )
    assert not p.is_greedy


def test_frozen_hashable_and_picklable() -> None:
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[3], seed=7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(3,), seq_seed=7))
    assert pickle.loads(pickle.dumps(p)) == p
    assert dataclasses.replace(p, temperature=0.5).temperature == 0.5
    assert not hasattr(p, "__dict__")  # slots


def test_seed_alias() -> None:
    assert SamplingParams(seed=5).seq_seed == 5
    assert SamplingParams(seq_seed=5).seq_seed == 5
    assert SamplingParams(seed=5) == SamplingParams(seq_seed=5)
    assert SamplingParams(seed=5).seed == 5
    assert SamplingParams(seed=5, seq_seed=5).seq_seed == 5
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=5, seq_seed=6)
    assert SamplingParams(seed=2**63 - 1).seq_seed == 2**63 - 1
    for bad in (-1, 2**63, 1.0, True, "1"):
        with pytest.raises(ValueError, match="seq_seed"):
            SamplingParams(seed=bad)


def test_normalisation() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=np.int64(4)).top_k == 4
    assert type(SamplingParams(top_k=np.int64(4)).top_k) is int
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["x", "y", "x"]).stop == ("x", "y")
    assert SamplingParams(stop_token_ids=[1, 2]).stop_token_ids == (1, 2)
    t = SamplingParams(temperature=1).temperature
    assert t == 1.0 and type(t) is float
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2).is_greedy  # those are irrelevant then
    assert SamplingParams(temperature=1e-6).is_greedy  # below vLLM's epsilon: logits / T would overflow
    assert not SamplingParams(temperature=1e-4).is_greedy


@pytest.mark.parametrize(
    ("kwargs", "field", "allowed"),
    [
        ({"temperature": math.nan}, "temperature", ">= 0"),
        ({"temperature": math.inf}, "temperature", ">= 0"),
        ({"temperature": -0.1}, "temperature", ">= 0"),
        ({"temperature": "hot"}, "temperature", ">= 0"),
        ({"temperature": True}, "temperature", ">= 0"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.01}, "top_p", "(0, 1]"),
        ({"top_p": math.nan}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", "0 / -1"),
        ({"top_k": 2.0}, "top_k", ">= 1"),
        ({"top_k": True}, "top_k", ">= 1"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"min_p": 1.5}, "min_p", "[0, 1]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
        ({"repetition_penalty": math.inf}, "repetition_penalty", "> 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
        ({"n": 0}, "n", ">= 1"),
        ({"n": 1.5}, "n", ">= 1"),
        ({"n": True}, "n", ">= 1"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"max_tokens": 3.0}, "max_tokens", ">= 1"),
        ({"min_tokens": -1}, "min_tokens", ">= 0"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "<= max_tokens"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"stop": [1]}, "stop", "non-empty"),
        ({"stop": 5}, "stop", "string"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", ">= 0"),
        ({"stop_token_ids": [True]}, "stop_token_ids", ">= 0"),
        ({"stop_token_ids": 3}, "stop_token_ids", ">= 0"),
        ({"ignore_eos": 1}, "ignore_eos", "bool"),
        ({"skip_special_tokens": None}, "skip_special_tokens", "bool"),
        ({"logprobs": 21}, "logprobs", "[0, 20]"),
        ({"logprobs": -1}, "logprobs", "[0, 20]"),
        ({"prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
    ],
)
def test_invalid_values_name_field_and_range(kwargs: dict, field: str, allowed: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    msg = str(info.value)
    assert msg.startswith(field), msg
    assert allowed in msg, msg


def test_nan_message_exact() -> None:
    with pytest.raises(ValueError, match=r"^temperature must be a finite number >= 0, got nan$"):
        SamplingParams(temperature=float("nan"))


def test_min_tokens_with_unbounded_max() -> None:
    assert SamplingParams(min_tokens=100, max_tokens=None).min_tokens == 100
    assert SamplingParams(min_tokens=10, max_tokens=10).min_tokens == 10


def test_unknown_keyword_is_value_error() -> None:
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(best_of=2)
    with pytest.raises(ValueError, match="foo, zzz"):
        SamplingParams(zzz=1, foo=2)


def test_from_dict_and_to_dict() -> None:
    p = SamplingParams.from_dict({"temperature": 0.7, "seed": 3, "stop": ["\n"], "top_k": -1})
    assert (p.temperature, p.seq_seed, p.stop, p.top_k) == (0.7, 3, ("\n",), 0)
    assert SamplingParams.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="unknown sampling parameter.*wat"):
        SamplingParams.from_dict({"temperature": 0.7, "wat": 1})
    with pytest.raises(ValueError, match="mapping"):
        SamplingParams.from_dict([("temperature", 1.0)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="names must be strings"):
        SamplingParams.from_dict({1: 2})  # type: ignore[dict-item]


def test_helpers() -> None:
    assert SamplingParams(max_tokens=None).max_new_tokens(prompt_len=10, max_model_len=64) == 54
    assert SamplingParams(max_tokens=8).max_new_tokens(prompt_len=10, max_model_len=64) == 8
    assert SamplingParams(max_tokens=80).max_new_tokens(prompt_len=10, max_model_len=64) == 54
    SamplingParams(stop_token_ids=[9]).check_vocab(10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[10]).check_vocab(10)
