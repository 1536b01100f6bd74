"""Speculative decoding inside the engine: greedy equals plain greedy, sampling keeps the target's distribution,
rollback frees blocks and never hashes rejected tokens, and it mixes with every other kind of request."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
from scratchlm.inference.speculative import NgramProposer, Speculator, parse_speculative, truncate_layers
from tests.inference.helpers import make_engine, run_all, tiny_model

REPEAT = [3, 7, 1, 9, 4, 7, 1, 9, 4, 2, 3, 7, 1]  # n-gram lookup finds continuations in it


def check_spec_invariants(engine: LLMEngine) -> None:
    """Block invariants, no rejected-token blocks kept, and every hashed block holds the sequence's own tokens."""
    bm = engine.block_manager
    bm.check_invariants(engine.scheduler.owners())
    bs = bm.block_size
    for seq in engine.scheduler.running:
        assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens), "blocks beyond the computed tokens"
        for k in range(len(seq.block_hashes)):
            tokens = tuple(seq.token_ids[k * bs : (k + 1) * bs])
            key = bm.key_of[seq.block_table[k]]
            assert key is None or key[1] == tokens, "a block was hashed with tokens the sequence does not hold"


def _engine(spec: str | None, adaptive: bool = True, k: int = 4, num_blocks: int = 64, seed: int = 0,
            **options) -> LLMEngine:
    model, cfg = tiny_model(seed=seed, vocab=12)
    engine = make_engine(model, cfg, num_blocks=num_blocks, speculative=spec, num_speculative_tokens=k, **options)
    if engine.speculator is not None:
        engine.speculator.adaptive = adaptive
    return engine


def _mixed_workload(engine: LLMEngine, n: int = 6) -> None:
    for i in range(n):
        prompt = REPEAT[i % 4 :] * (1 + i % 2)
        engine.add_request(f"g{i}", prompt, SamplingParams(temperature=0.0, max_tokens=20 + 3 * i, ignore_eos=True))
    engine.add_request("n2", REPEAT[:6], SamplingParams(temperature=0.0, max_tokens=12, n=2, ignore_eos=True))
    engine.add_request("same", REPEAT[2:] * 2, SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True))


@pytest.mark.parametrize("spec", ["ngram", "layers:1", "draft"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_equals_plain_greedy_in_a_mixed_batch(spec: str, block_size: int, tmp_path: Path) -> None:
    """Many requests at once (prefills, decodes, an n=2 request, prefix hits): ids equal the engine without
    speculation; after every step the pool is consistent and holds no rejected-draft blocks."""
    if spec == "draft":  # a different, smaller model with the same vocabulary, loaded from a checkpoint
        from scratchlm.model.loading.checkpoint import save_model

        draft, _ = tiny_model(seed=5, vocab=12, n_layers=1)
        spec = f"draft:{save_model(tmp_path / 'draft.pt', draft)}"
    plain = _engine(None, block_size=block_size, max_num_batched_tokens=24)
    _mixed_workload(plain)
    want = run_all(plain)
    eng = _engine(spec, adaptive=False, block_size=block_size, max_num_batched_tokens=24)
    _mixed_workload(eng)
    got = run_all(eng, check_spec_invariants)
    assert got == want
    assert eng.speculator.stats.verifies > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    if spec.startswith("draft") or spec.startswith("layers"):
        assert not eng.speculator.proposer.states  # draft KV freed with the sequences
        dbm = eng.speculator.proposer.blocks
        assert dbm.num_free_blocks == dbm.num_blocks


def test_preemption_and_small_pool() -> None:
    """A pool too small for all requests: preemption by recompute and drafts that do not fit still match."""
    plain = _engine(None, num_blocks=10, block_size=4, max_num_batched_tokens=16)
    _mixed_workload(plain)
    want = run_all(plain)
    eng = _engine("ngram", adaptive=False, num_blocks=10, block_size=4, max_num_batched_tokens=16)
    _mixed_workload(eng)
    assert run_all(eng, check_spec_invariants) == want
    assert eng.stats().num_preemptions > 0


def test_stops_inside_accepted_drafts() -> None:
    """EOS, stop ids, stop strings and max_tokens that fall among accepted drafts end the output there; logprobs
    and penalties (which depend on the tokens before each drafted position) equal the plain engine's."""
    model, cfg = tiny_model(seed=2, vocab=12)
    free = make_engine(model, cfg)
    free.add_request("x", REPEAT, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    ref = run_all(free)["x"]  # pick stops that occur a few tokens in, where drafts are being accepted
    eos, stop_id, stop_str = ref[6], ref[9], "".join(chr(65 + t) for t in ref[11:13])
    cases = [
        SamplingParams(temperature=0.0, max_tokens=30),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_id], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop=[stop_str], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=8, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3, presence_penalty=0.4,
                       frequency_penalty=0.2, ignore_eos=True),  # penalties see the drafts before each position
    ]
    outs = {}
    for spec in (None, "layers:1"):
        eng = make_engine(model, cfg, eos_id=eos, speculative=spec, num_speculative_tokens=6)
        if eng.speculator:
            eng.speculator.adaptive = False
        for i, p in enumerate(cases):
            eng.add_request(str(i), REPEAT, p)
        res = {}
        while eng.has_unfinished_requests():
            for r in eng.step():
                if r.finished:
                    o = r.outputs[0]
                    res[r.request_id] = (o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs)
        outs[spec] = res
        if eng.speculator:
            assert eng.speculator.stats.accepted > 5
    assert {r[2] for r in outs[None].values()} == {"stop", "length"}
    for i in outs[None]:
        a, b = outs[None][i], outs["layers:1"][i]
        assert a[:4] == b[:4], f"case {i}"
        if a[4] is not None:
            assert len(a[4]) == len(b[4])
            for x, y in zip(a[4], b[4]):
                assert x.keys() == y.keys()
                assert all(abs(x[t] - y[t]) < 1e-4 for t in x)


def _exact_sequence_probs(model, prompt: list[int], length: int, vocab: int) -> dict[tuple[int, ...], float]:
    """P(first `length` generated tokens) at temperature 1, enumerated with plain causal forwards."""
    probs = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=length - 1):
            ids = prompt + list(seq)
            p_all = torch.softmax(model(torch.tensor([ids]))[0].double(), dim=-1)  # (T, V)
            pre = 1.0
            for j, t in enumerate(seq):
                pre *= float(p_all[len(prompt) - 1 + j, t])
            last = p_all[-1]
            for t in range(vocab):
                probs[(*seq, t)] = pre * float(last[t])
    return probs


@pytest.mark.parametrize("spec", ["layers:1", "ngram"])
def test_sampled_outputs_follow_the_target_distribution(spec: str) -> None:
    """Chi-square over the first 3 generated tokens (4^3 outcomes) of 1500 seeded requests against the exact
    probabilities of the target (the draft is a 1-layer truncation, so q differs from p; n-gram: point masses)."""
    vocab, length, n = 4, 3, 1500
    model, cfg = tiny_model(seed=3, vocab=vocab, n_layers=2)
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(0.25)  # flatter distributions: every outcome has mass
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    exact = _exact_sequence_probs(model, prompt, length, vocab)
    eng = make_engine(model, cfg, num_blocks=512, block_size=4, max_num_seqs=256, max_num_batched_tokens=4096,
                      speculative=spec, num_speculative_tokens=2)
    eng.speculator.adaptive = False
    for i in range(n):
        eng.add_request(str(i), prompt, SamplingParams(temperature=1.0, max_tokens=length, seed=i, ignore_eos=True))
    got = run_all(eng)
    st = eng.speculator.stats  # both outcomes happen often: accepted drafts and resampled rejections
    assert st.accepted > 30 and st.drafted - st.accepted > 30
    keys = sorted(exact)
    observed = [sum(1 for v in got.values() if tuple(v) == key) for key in keys]
    expected = [exact[key] * n for key in keys]
    assert sum(observed) == n
    assert chisquare(observed, [e * n / sum(expected) for e in expected]).pvalue > 1e-3


def test_adaptive_k_backs_off_and_recovers() -> None:
    eng = _engine("ngram")
    spec = eng.speculator
    assert spec.choose_k(1) >= 2  # the prior (alpha 0.6) favours drafting when drafting is free
    for _ in range(10):
        spec._observe(1, 4, 0)
    ks = [spec.choose_k(1) for _ in range(spec.probe_every)]
    assert ks[:-1] == [0] * (spec.probe_every - 1) and ks[-1] == 1  # backs off to 0, probes with k = 1
    ks = [spec.choose_k(1) for _ in range(2 * spec.probe_every)]
    assert ks.count(1) == 1 and ks[-1] == 1  # a failed probe doubles the interval
    for _ in range(10):
        spec._observe(1, 4, 4)
    assert spec.choose_k(1) == spec.k_max


def test_open_ended_ngram_stops_drafting() -> None:
    """On a random model (drafts almost never right) adaptive k drafts few tokens per generated token."""
    eng = _engine("ngram")
    eng.add_request("a", REPEAT, SamplingParams(temperature=1.0, seed=0, max_tokens=80, ignore_eos=True))
    run_all(eng, check_spec_invariants)
    st = eng.speculator.stats
    assert st.drafted < 0.5 * 80


def test_ngram_lookup() -> None:
    ng = NgramProposer(max_n=3, min_n=2)
    assert ng.lookup([5, 1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # latest earlier match of the bigram [1, 2]
    assert ng.lookup([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], 2) == [9, 2]  # the trigram wins over the later bigram
    assert ng.lookup([1, 2, 3, 4], 3) == []
    assert ng.lookup([1, 2, 1, 2], 0) == []


def test_bad_settings_are_clear_errors(tmp_path: Path) -> None:
    for bad, match in [("beam", "unknown method"), ("layers:x", "layers needs"), ("draft:", "needs a model path"),
                       ("ngram:0", "n-gram length")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(speculative=bad)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="between 1 and"):
        _engine("layers:2")  # the tiny model has 2 layers
    with pytest.raises(ValueError, match="not found"):
        _engine(f"draft:{tmp_path / 'missing.pt'}")
    model, _ = tiny_model(vocab=20)
    with pytest.raises(ValueError, match="between 1 and 3"):
        truncate_layers(model, 4) if len(model.layers) == 4 else truncate_layers(tiny_model(n_layers=4)[0], 4)
    assert parse_speculative("ngram:3").ngram_max == 3
    assert isinstance(_engine("ngram").speculator, Speculator)


def test_draft_vocab_mismatch(tmp_path: Path) -> None:
    from scratchlm.model.loading.checkpoint import save_model

    other, _ = tiny_model(vocab=20)
    path = save_model(tmp_path / "other.pt", other)
    with pytest.raises(ValueError, match="vocab_size 20"):
        _engine(f"draft:{path}")


def test_a_draft_that_cannot_pay_never_probes() -> None:
    """layers:K with K close to the target's depth costs ~the target per draft: adaptive k stays at 0 for good."""
    model, cfg = tiny_model(seed=0, vocab=12, n_layers=4)
    eng = make_engine(model, cfg, speculative="layers:3")
    spec = eng.speculator
    assert spec.ceiling <= 1.0
    assert [spec.choose_k(1) for _ in range(10 * spec.probe_every)] == [0] * (10 * spec.probe_every)
    cheap = make_engine(model, cfg, speculative="layers:1").speculator
    assert cheap.ceiling > 1.0
