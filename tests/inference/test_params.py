"""SamplingParams validation: every bad value names the field and what was expected."""

from __future__ import annotations

import re

import pytest

from scratchlm.inference import SamplingParams
from scratchlm.inference.params import StructuredOutputs


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -5}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"n": 0}, "n"),
        ({"logprobs": 50}, "logprobs"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # overflowed float32 in the sampler
        ({"top_k": 100000000000000000000}, "top_k"),  # overflowed int64 in the sampler
        ({"temperature": 1e300}, "temperature"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": ["x" * 257]}, "stop"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
        ({"seed": "x"}, "seed"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {1: -101}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"logit_bias": {1: True}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"logit_bias": {1.0: 1}}, "logit_bias"),
        ({"logit_bias": {1: 1, "1": 2}}, "logit_bias"),
        ({"logit_bias": [(1, 1)]}, "logit_bias"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{message}"):
        SamplingParams(**kwargs)


def test_normalization() -> None:
    p = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert p.stop == ["###"] and p.top_k is None and p.greedy
    assert SamplingParams(top_k=0).top_k is None
    assert SamplingParams(repetition_penalty=1.2).has_penalties


def test_bounds_message_names_the_range() -> None:
    with pytest.raises(ValueError, match=r"repetition_penalty: got 1e-300, expected a number in \[0.01, 10\]"):
        SamplingParams(repetition_penalty=1e-300)
    with pytest.raises(ValueError, match=r"at most 16"):
        SamplingParams(stop=[str(i) for i in range(10_000)])


def test_tiny_temperature_is_greedy_as_vllm() -> None:
    assert SamplingParams(temperature=1e-39).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_logit_bias_normalization() -> None:
    """JSON's string keys and ints both become int ids; an empty map is off; a bias alone counts as a penalty
    stage (the sampler's first stage, shared with speculative decoding) but not as a repetition penalty."""
    p = SamplingParams(logit_bias={"5": -100, 7: 2.5, "0012": 100})
    assert p.logit_bias == {5: -100.0, 7: 2.5, 12: 100.0} and all(type(k) is int for k in p.logit_bias)
    assert p.has_penalties and not p.has_repetition_penalties
    assert SamplingParams(logit_bias={}).logit_bias is None and not SamplingParams(logit_bias={}).has_penalties
    with pytest.raises(ValueError, match=r"got 101 for token id 3, expected a number in \[-100, 100\]"):
        SamplingParams(logit_bias={"3": 101})


def test_engine_refuses_logit_bias_outside_the_vocabulary():
    from scratchlm.inference import SamplingParams
    from tests.inference.helpers import make_engine, tiny_model

    model, cfg = tiny_model()
    engine = make_engine(model, cfg)
    with pytest.raises(ValueError, match=r"logit_bias: token id\(s\) \[48\] outside the vocabulary \[0, 48\)"):
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, logit_bias={48: 5.0}))
    engine.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=2, logit_bias={47: 5.0}))


def test_structured_outputs_validation() -> None:
    """Exactly one field, each of its type; a schema's JSON text and its dict are the same spec (the cache's key)."""
    bad = [({}, "exactly one"), ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
           ({"json": "[1, 2]"}, "StructuredOutputs.json"), ({"json": "{nope"}, "StructuredOutputs.json"),
           ({"json": 3}, "StructuredOutputs.json"), ({"regex": ""}, "StructuredOutputs.regex"),
           ({"choice": []}, "StructuredOutputs.choice"), ({"choice": ["a", 2]}, "StructuredOutputs.choice"),
           ({"choice": "ab"}, "StructuredOutputs.choice"), ({"grammar": 5}, "StructuredOutputs.grammar"),
           ({"json_object": "yes"}, "StructuredOutputs.json_object"),
           ({"json": {"maximum": float("nan")}}, "not JSON data"), ({"json": {"x": object()}}, "not JSON data")]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            StructuredOutputs(**kwargs)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    assert StructuredOutputs(json={"a": 1}) == StructuredOutputs(json='{"a":1}')
    assert StructuredOutputs(choice=("x", "y")).choice == ["x", "y"]
