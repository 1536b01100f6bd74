"""Greedy ids with x rounded to int8 per 32-block (the default integer kernels) against float x, SmolLM2-135M on the
shared prompts, on the ISA this process runs (tests/inference/test_isa_avx2.py runs the same check for GGUF under
SCRATCHLM_ISA=avx2, and checks there that float x gives the same ids on both ISAs).

Measured (32 tokens, 5 prompts batched; docs/quantization.md "Rounding x, and greedy ids"): the default does NOT
keep the float path's ids on every prompt. GGUF Q4_1 (Q8_0 head): AVX-512 4 of 5 prompts diverge (tokens 6, 10,
19, 25), AVX2 5 of 5 (5, 10, 12, 25, 27); int8: AVX-512 4 of 5 (13, 19, 23, 26), AVX2 none (int8 has no integer
kernel there: it is the float path). Every divergence is at a near tie of the float path: its log-probability
margin between its own token and the integer path's is 0.006-0.22 nats. So this checks what holds: on every prompt
the two agree up to a near tie (margin below NEAR_TIE at the first divergent token), which a wrong kernel, whose
logits move by far more than x's rounding, does not pass.
"""

from __future__ import annotations

import pytest

from scratchlm.inference import SamplingParams
from scratchlm.inference.quantization import kernels
from tests.inference.quantization.helpers import engine_kernels_or_fail
from tests.inference.quantization.test_models import SHARED_PROMPTS, first_divergence

NEAR_TIE = 0.5  # nats: float-path margin below which x's rounding may flip a greedy id (measured at most 0.22)
TOKENS = 24
TOP = 5  # log-probabilities returned per token (the integer path's token is among them at a near tie)


def greedy(llm, float_x: bool) -> list[tuple[list[int], list[dict[int, float]]]]:
    """(ids, top log-probabilities per token) of each shared prompt, x rounded or float."""
    previous = kernels.float_activations()
    try:
        kernels.float_activations(float_x)
        params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=TOP)
        outs = llm.generate(SHARED_PROMPTS, params, use_tqdm=False)
    finally:
        kernels.float_activations(previous)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def check_near_ties(label: str, rounded: list, exact: list) -> str:
    """Assert that on every prompt integer-x ids equal float-x ids up to a near tie of the float path; the report."""
    report = []
    for prompt, (ids, _), (fids, flps) in zip(SHARED_PROMPTS, rounded, exact):
        at = first_divergence(ids, fids)
        if at is None:
            report.append(f"{prompt!r}: equal")
            continue
        lps = flps[at]
        # the float path's margin of its token over the integer path's (a lower bound if that is not in its top 5)
        margin = lps[fids[at]] - lps.get(ids[at], min(lps.values()))
        report.append(f"{prompt!r}: token {at}, float margin {margin:.3f}")
        assert margin < NEAR_TIE, f"{label}: integer x leaves the float path's ids away from a near tie: " + \
            "; ".join(report)
    return f"{label}: " + "; ".join(report)


@pytest.mark.parametrize("scheme", ["gguf", "int8"])
def test_integer_x_agrees_with_float_x_up_to_near_ties(default_model_path, scheme: str) -> None:
    from scratchlm.inference import LLM

    eng = engine_kernels_or_fail()
    llm = LLM(default_model_path, quantization=scheme, block_size=8, max_num_batched_tokens=64)
    print(check_near_ties(f"{scheme} on {eng.isa_name()}", greedy(llm, False), greedy(llm, True)))
