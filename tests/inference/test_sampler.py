"""The sampler against Hugging Face's logits processors, a chi-square test and reproducibility."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from scratchlm.inference import SamplingParams
from scratchlm.inference import sampler as sampler_module
from scratchlm.inference.sampler import (
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_presence_frequency,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
)

V = 50


def logits(seed: int = 0, rows: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3


@pytest.mark.parametrize("k", [1, 3, 17, V])
def test_top_k_matches_hf(k: int) -> None:
    x = logits()
    ours = apply_top_k(x, torch.full((4,), k))
    theirs = TopKLogitsWarper(top_k=k)(None, x.clone())
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.9, 0.999])
def test_top_p_matches_hf(p: float) -> None:
    x = logits(1)
    ours = apply_top_p(x, torch.full((4,), p))
    theirs = TopPLogitsWarper(top_p=p)(None, x.clone())
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_hf(p: float) -> None:
    x = logits(2)
    ours = apply_min_p(x, torch.full((4,), p))
    theirs = MinPLogitsWarper(min_p=p)(None, x.clone())
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_hf(penalty: float) -> None:
    x = logits(3)
    ids = torch.randint(0, V, (4, 12), generator=torch.Generator().manual_seed(3))
    seen = torch.zeros(4, V, dtype=torch.bool).scatter_(1, ids, True)
    ours = apply_repetition_penalty(x, seen, torch.full((4,), penalty))
    theirs = RepetitionPenaltyLogitsProcessor(penalty=penalty)(ids, x.clone())
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_presence_frequency_follow_openai_formula() -> None:
    x = logits(4, rows=1)
    out = [3, 3, 3, 7]
    counts = torch.bincount(torch.tensor(out), minlength=V).float()[None]
    ours = apply_presence_frequency(x, counts, torch.tensor([0.5]), torch.tensor([0.25]))
    expected = x.clone()
    expected[0, 3] -= 0.5 + 3 * 0.25
    expected[0, 7] -= 0.5 + 1 * 0.25
    torch.testing.assert_close(ours, expected)


def test_sampler_chains_processors_like_hf() -> None:
    """Full chain on one row: repetition -> temperature -> top-k -> top-p; the kept support is HF's."""
    x = logits(5, rows=1) / 3
    prompt, output = [1, 2, 3], [4, 5]
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.8, repetition_penalty=1.3, seed=0)
    ids = torch.tensor([prompt + output])
    hf = x.clone()
    for proc in (RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7), TopKLogitsWarper(10),
                 TopPLogitsWarper(0.8)):
        hf = proc(ids, hf)
    support = set(torch.nonzero(hf[0] > float("-inf")).flatten().tolist())
    sampler = Sampler()
    g = torch.Generator().manual_seed(0)
    drawn = {sampler(x, [SamplingRow(params, g, prompt, output)]).token_ids[0] for _ in range(300)}
    assert len(support) > 1
    assert drawn <= support and len(drawn) > 1


def test_chi_square_matches_softmax_over_temperature() -> None:
    x = torch.randn(1, 8, generator=torch.Generator().manual_seed(6)) * 1.5
    temperature = 0.8
    params = SamplingParams(temperature=temperature, seed=123)
    g = torch.Generator().manual_seed(123)
    sampler = Sampler()
    n = 4000
    draws = torch.tensor([sampler(x, [SamplingRow(params, g, [], [])]).token_ids[0] for _ in range(n)])
    observed = torch.bincount(draws, minlength=8).double()
    expected = torch.softmax(x[0].double() / temperature, -1) * n
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    x = logits(7, rows=3)
    p = SamplingParams(temperature=1.0, seed=9)
    sampler = Sampler()

    def draw(rows_before: int) -> list[int]:
        g = torch.Generator().manual_seed(9)
        out = []
        for _ in range(20):
            other = [SamplingRow(SamplingParams(temperature=1.0), torch.Generator().manual_seed(_), [], [])
                     for _ in range(rows_before)]
            res = sampler(torch.cat([x[:rows_before], x[2:3]]), [*other, SamplingRow(p, g, [], [])])
            out.append(res.token_ids[-1])
        return out

    assert draw(0) == draw(2)
    assert len(set(draw(0))) > 1


def test_greedy_min_tokens_ban_and_logprobs() -> None:
    x = logits(8, rows=2)
    top = int(x[0].argmax())
    res = Sampler()(x, [SamplingRow(SamplingParams(temperature=0, logprobs=3), None, [], [], banned_ids=[top]),
                        SamplingRow(SamplingParams(temperature=0), None, [], [])])
    assert res.token_ids[0] != top and res.token_ids[1] == int(x[1].argmax())
    lp = torch.log_softmax(x[0], -1)
    entry = res.logprobs[0]
    assert len(entry) == 3 + (res.token_ids[0] not in lp.topk(3).indices.tolist())
    assert entry[res.token_ids[0]] == pytest.approx(float(lp[res.token_ids[0]]), abs=1e-6)
    for t in lp.topk(3).indices.tolist():
        assert entry[t] == pytest.approx(float(lp[t]), abs=1e-6)
    assert res.logprobs[1] is None


def test_small_temperature_and_huge_logits_stay_finite() -> None:
    """(l - max) / t: a temperature just above the greedy threshold on logits of 1e34 picks the argmax (the
    unshifted l / t overflowed float32 to inf, softmax gave NaN and the race drew a junk token)."""
    x = torch.full((2, V), 1e34)
    x[:, 7] = 3e34
    x[1, 3] = float("-inf")
    rows = [SamplingRow(SamplingParams(temperature=2e-5, seed=i), torch.Generator().manual_seed(i), [], [])
            for i in range(2)]
    assert Sampler()(x, rows).token_ids == [7, 7]


def test_extreme_penalties_and_top_k_above_vocab_do_not_break_the_row() -> None:
    x = logits(9, rows=2) * 1e36  # 1e36 / 0.01 overflows float32: repaired to the float32 maximum
    p = SamplingParams(temperature=0.5, repetition_penalty=0.01, presence_penalty=-2, seed=1)
    top = int(x[0].argmax())
    res = Sampler()(x, [SamplingRow(p, torch.Generator().manual_seed(1), [top], [top]),
                        SamplingRow(SamplingParams(temperature=1.0, top_k=10**9, seed=2),
                                    torch.Generator().manual_seed(2), [], [])])
    assert 0 <= res.token_ids[0] < V and 0 <= res.token_ids[1] < V
    assert res.token_ids[0] == top  # the penalty of 0.01 < 1 rewards the seen, already largest token


# ---------------------------------------------------------------------------------------------- logit_bias


def hf_bias(x: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """HF's SequenceBiasLogitsProcessor with one-token sequences: OpenAI's logit_bias."""
    if not bias:
        return x.clone()
    return SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in bias.items()])(
        torch.zeros(x.shape[0], 1, dtype=torch.long), x.clone())


def test_logit_bias_after_penalties_matches_hf() -> None:
    """Per row: repetition penalty (HF), then the bias (HF's sequence bias); rows without a bias untouched."""
    x = logits(10, rows=3)
    biases = [{3: 2.5, 10: -100.0, 49: 100.0}, {}, {0: -0.5}]
    rows = [SamplingRow(SamplingParams(logit_bias=b or None, repetition_penalty=1.5 if i == 0 else 1.0), None,
                        [3, 4], [5]) for i, b in enumerate(biases)]
    ours = Sampler._penalize(x, rows)
    ids = torch.tensor([[3, 4, 5]])
    for i, b in enumerate(biases):
        want = RepetitionPenaltyLogitsProcessor(1.5)(ids, x[i : i + 1].clone()) if i == 0 else x[i : i + 1]
        torch.testing.assert_close(ours[i : i + 1], hf_bias(want, b))


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_minus_100_bans_and_plus_100_forces(temperature: float) -> None:
    x = logits(11, rows=2)
    top, low = int(x[0].argmax()), int(x[1].argmin())
    rows = [SamplingRow(SamplingParams(temperature=temperature, seed=i, logit_bias=b), torch.Generator().manual_seed(i),
                        [], []) for i, b in enumerate([{top: -100}, {low: 100}])]
    sampler = Sampler()
    for _ in range(50):
        res = sampler(x, rows).token_ids
        assert res[0] != top and res[1] == low


def test_mixed_batch_rows_without_bias_equal_their_unbiased_runs() -> None:
    """Greedy and seeded rows next to a biased row give what they give alone, step after step."""
    x = logits(12, rows=3)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=4, top_p=0.9),
              SamplingParams(temperature=0.8, seed=5, logit_bias={int(x[2].argmax()): -100, 1: 3})]

    def run(which: list[int]) -> list[list[int]]:
        gens = {i: torch.Generator().manual_seed(i) for i in which}
        out = []
        for _ in range(30):
            rows = [SamplingRow(params[i], None if params[i].greedy else gens[i], [], []) for i in which]
            out.append(Sampler()(x[which], rows).token_ids)
        return out

    together = run([0, 1, 2])
    assert [t[0] for t in together] == [t[0] for t in run([0])]
    assert [t[1] for t in together] == [t[0] for t in run([1])]
    assert [t[2] for t in together] == [t[0] for t in run([2])]


def test_no_bias_in_the_batch_costs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """No row with a bias: the bias stage never runs; a bias alone does not run the repetition-penalty stage."""
    calls = {"bias": 0, "penalties": 0}
    real_bias, real_pen = sampler_module.apply_logit_bias, Sampler._repetition_penalties

    def count_bias(*a, **k):
        calls["bias"] += 1
        return real_bias(*a, **k)

    def count_pen(*a, **k):
        calls["penalties"] += 1
        return real_pen(*a, **k)

    monkeypatch.setattr(sampler_module, "apply_logit_bias", count_bias)
    monkeypatch.setattr(Sampler, "_repetition_penalties", staticmethod(count_pen))
    x = logits(13, rows=2)
    plain = [SamplingRow(SamplingParams(temperature=0), None, [1], [2]),
             SamplingRow(SamplingParams(temperature=0, presence_penalty=0.5), None, [1], [2])]
    Sampler()(x, plain)
    assert calls == {"bias": 0, "penalties": 1}
    Sampler()(x, [SamplingRow(SamplingParams(temperature=0, logit_bias={3: 1}), None, [1], [2]), plain[0]])
    assert calls == {"bias": 1, "penalties": 1}


def test_bias_on_an_id_outside_the_vocabulary_raises() -> None:
    row = SamplingRow(SamplingParams(temperature=0, logit_bias={V: 1}), None, [], [])
    with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {V}\): \[{V}\]"):
        Sampler()(logits(14, rows=1), [row])


def test_speculative_target_distribution_includes_the_bias() -> None:
    """Speculative decoding's target logits (processed_logits) go through the same first stage."""
    from scratchlm.inference.speculative.rejection import processed_logits

    x = logits(15, rows=2)
    rows = [SamplingRow(SamplingParams(logit_bias={2: -100.0, 9: 7.0}), None, [], []),
            SamplingRow(SamplingParams(), None, [], [])]
    out = processed_logits(x, rows)
    torch.testing.assert_close(out[:1], hf_bias(x[:1], {2: -100.0, 9: 7.0}))
    torch.testing.assert_close(out[1:], x[1:])
