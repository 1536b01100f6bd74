"""The acceptance rule on its own: chi-square against the target distribution, greedy, the cost formula."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from scratchlm.inference import SamplingParams
from scratchlm.inference.speculative import expected_speedup, sampling_probs, verify

V = 6


def _dists(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(rows, V, generator=g) * 1.5
    q = torch.softmax(torch.randn(rows, V, generator=g) * 1.5, dim=-1)
    return p_logits, q


@pytest.mark.parametrize("draft", ["model", "point"])
def test_emitted_pair_is_distributed_as_target(draft: str) -> None:
    """k = 2 drafts from q (or a fixed point-mass draft); the first two emitted tokens ~ p0 x p1 exactly."""
    p_logits, q = _dists(0, 3)
    params = SamplingParams(temperature=1.0, max_tokens=10)
    p = sampling_probs(p_logits, params)
    gen = torch.Generator().manual_seed(1)
    n = 6_000
    counts = torch.zeros(V, V)
    for _ in range(n):
        if draft == "model":
            d = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
            toks, m = verify(p_logits, d, params, gen, q[:2])
        else:
            d = [2, 4]
            toks, m = verify(p_logits, d, params, gen, None)
        assert len(toks) == m + 1 and toks[:m] == d[:m]
        if len(toks) == 1:  # the first draft was rejected: the second token comes from row 1 (no draft left)
            toks.append(int(torch.multinomial(p[1], 1, generator=gen)))
        counts[toks[0], toks[1]] += 1
    expected = (p[0][:, None] * p[1][None, :]).flatten() * n
    assert chisquare(counts.flatten().numpy(), expected.numpy()).pvalue > 1e-3


def test_filters_apply_to_target_and_draft() -> None:
    """With top-k, tokens outside the target's top-k never come out, whatever the draft proposes."""
    p_logits, _ = _dists(3, 2)
    params = SamplingParams(temperature=0.7, top_k=2, max_tokens=10)
    allowed = set(p_logits[0].topk(2).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(400):
        toks, _ = verify(p_logits, [int(torch.randint(V, (1,), generator=gen))], params, gen, None)
        seen.add(toks[0])
    assert seen == allowed


def test_greedy_accepts_while_equal_to_argmax() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    params = SamplingParams(temperature=0.0)
    assert verify(logits, [1, 0], params, None) == ([1, 0, 2], 2)  # all accepted + bonus
    assert verify(logits, [1, 2], params, None) == ([1, 0], 1)  # second rejected, corrected to the argmax
    assert verify(logits, [0, 0], params, None) == ([1], 0)
    with pytest.raises(ValueError, match="k \\+ 1"):
        verify(logits, [1], params, None)


def test_expected_speedup_formula() -> None:
    assert expected_speedup(0.0, 0, 0.5) == 1.0
    assert expected_speedup(1.0, 3, 0.0) == 4.0
    a, k, c = 0.8, 4, 0.1
    assert expected_speedup(a, k, c) == pytest.approx((1 - a ** (k + 1)) / ((1 - a) * (k * c + 1)))
