"""SamplingParams validation: every bad value names the field and what was expected."""

from __future__ import annotations

import pytest

from scratchlm.inference import SamplingParams


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
        ({"seed": "x"}, "seed"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
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
