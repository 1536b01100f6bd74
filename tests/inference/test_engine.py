"""LLMEngine on the real stories260K model (5 layers, GQA 8/4 heads): exact greedy against a naive
reference under every scheduling choice, block invariants on random request streams (hypothesis),
stops, n > 1, logprobs, aborts.

The engines run MODEL, whose layers their `ModelRunner` swaps for the engine's kernels in place; the oracle is
ORACLE, a second load of the same file that no engine touches, run by plain torch (`naive_greedy` refuses a
swapped model)."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from scratchlm.inference import SamplingParams
from scratchlm.model import load
from tests.conftest import shared_data_path
from tests.inference.helpers import ENGINE_SWAP_MODULES, assert_plain_oracle, greedy, make_engine, naive_greedy, run_all

STORIES = shared_data_path() / "models/stories260K/stories260K.bin"
if not STORIES.is_file():
    pytest.skip(f"stories260K not found at {STORIES}", allow_module_level=True)
MODEL, CFG = load(STORIES)[::2]  # the engines' model
MODEL.eval()
ORACLE = load(STORIES).model.eval()  # the reference's: never given to an engine
PREFIXES = [list(range(5, 5 + 20)), [7, 3, 9, 1, 2, 11, 13, 40, 41, 6, 0]]


@functools.cache
def reference(prompt: tuple[int, ...], n: int) -> list[int]:
    return naive_greedy(ORACLE, list(prompt), n)


def test_the_oracle_is_not_the_engines_model() -> None:
    """An engine swaps its model's layers for its own kernels (so a reference computed through that model would
    run the code under test); ORACLE stays plain torch, with the same weights."""
    make_engine(MODEL, CFG)
    assert any(type(m).__module__ in ENGINE_SWAP_MODULES for m in MODEL.modules())
    assert_plain_oracle(ORACLE)
    with pytest.raises(AssertionError, match="runs the engine's kernels"):
        naive_greedy(MODEL, [1, 2, 3], 1)


def check_blocks(engine) -> None:
    owners = {s.seq_id: s.block_table for r in engine.requests.values() for s in r.seqs if s.block_table}
    engine.block_manager.check_invariants(owners)


prompt_st = st.tuples(st.integers(0, 2), st.lists(st.integers(0, 47), min_size=1, max_size=20)).map(
    lambda t: (PREFIXES[t[0]] if t[0] < 2 else []) + t[1]
)
action_st = st.one_of(
    st.tuples(st.just("add"), prompt_st, st.integers(1, 24)),
    st.tuples(st.just("abort"), st.integers(0, 50), st.just(0)),
    st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
)


STREAM_SETTINGS = {"deadline": None, "derandomize": True, "suppress_health_check": list(HealthCheck),
                   "phases": [Phase.explicit, Phase.generate]}


@settings(max_examples=10, **STREAM_SETTINGS)
@given(
    actions=st.lists(action_st, min_size=1, max_size=25),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(4, 40),
    max_seqs=st.integers(1, 6),
    spare_blocks=st.integers(0, 12),
    caching=st.booleans(),
)
def test_random_request_streams(actions, block_size, budget, max_seqs, spare_blocks, caching) -> None:
    check_request_stream(actions, block_size, budget, max_seqs, spare_blocks, caching)


@pytest.mark.slow
@settings(max_examples=80, **STREAM_SETTINGS)
@given(
    actions=st.lists(action_st, min_size=1, max_size=40),
    block_size=st.sampled_from([1, 2, 3, 4, 8, 16]),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 8),
    spare_blocks=st.integers(0, 20),
    caching=st.booleans(),
)
def test_random_request_streams_long(actions, block_size, budget, max_seqs, spare_blocks, caching) -> None:
    check_request_stream(actions, block_size, budget, max_seqs, spare_blocks, caching)


def check_request_stream(actions, block_size, budget, max_seqs, spare_blocks, caching) -> None:
    """Any add/abort/step stream: no block leaked or double-owned at any point, every finished request
    has exactly the naive greedy ids (batch composition, chunking, block size, prefix hits and
    preemption do not change them), and all blocks are free at the end."""
    max_len = 64
    num_blocks = -(-max_len // block_size) + spare_blocks  # small pools force preemption
    engine = make_engine(MODEL, CFG, num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                         max_num_seqs=max_seqs, enable_prefix_caching=caching, max_model_len=max_len)
    prompts: dict[str, list[int]] = {}
    results: dict[str, list[int]] = {}
    aborted: set[str] = set()

    def collect(outs) -> None:
        for o in outs:
            if o.finished and o.outputs[0].finish_reason != "abort":
                results[o.request_id] = o.outputs[0].token_ids

    for kind, a, b in actions:
        if kind == "add":
            rid = str(len(prompts))
            prompts[rid] = a
            engine.add_request(rid, a, greedy(b))
        elif kind == "abort" and prompts:
            rid = str(a % len(prompts))
            if rid not in results:
                aborted.add(rid)
            engine.abort_request(rid)
        else:
            for _ in range(a):
                collect(engine.step())
                check_blocks(engine)
    while engine.has_unfinished_requests():
        collect(engine.step())
        check_blocks(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for rid, ids in results.items():
        prompt = prompts[rid]
        n = len(ids)
        assert ids == reference(tuple(prompt), n), f"request {rid}: prompt {prompt}"
    assert set(prompts) <= set(results) | aborted


def test_preemption_happens_and_keeps_outputs() -> None:
    engine = make_engine(MODEL, CFG, num_blocks=7, block_size=8, max_num_seqs=8, max_model_len=56)
    prompts = [PREFIXES[0] + [i] for i in range(4)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(24))
    out = run_all(engine, check_blocks)
    assert engine.stats().num_preemptions > 0
    for i, p in enumerate(prompts):
        assert out[str(i)] == reference(tuple(p), 24)


def test_prefix_cache_hits_and_fully_cached_prompt() -> None:
    engine = make_engine(MODEL, CFG, block_size=4)
    prompt = PREFIXES[0][:16]  # exactly 4 full blocks: the last one is recomputed, not written into
    engine.add_request("a", prompt, greedy(8))
    first = run_all(engine)["a"]
    engine.add_request("b", prompt, greedy(8))
    second = run_all(engine)["b"]
    s = engine.stats()
    assert first == second == reference(tuple(prompt), 8)
    assert s.prefix_cache_hits >= 3 and s.prefix_cache_queries >= s.prefix_cache_hits
    assert s.prompt_tokens_total == 32 and s.generation_tokens_total == 16 and s.kv_cache_usage == 0.0
    assert engine.reset_prefix_cache() > 0  # then the same prompt misses and is computed again
    engine.add_request("c", prompt, greedy(8))
    assert run_all(engine)["c"] == first
    assert engine.stats().prefix_cache_hits == s.prefix_cache_hits


@pytest.mark.parametrize("prompt_len", [8, 11])  # full last block, and a partial one (copy-on-write)
def test_n_samples_share_prompt_blocks(prompt_len: int) -> None:
    engine = make_engine(MODEL, CFG, block_size=4)
    prompt = PREFIXES[0][:prompt_len]
    engine.add_request("g", prompt, SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True))
    first = engine.step()  # prefill: three samples drawn from the same logits
    assert len(first[0].outputs) == 3
    shared = engine.requests["g"].seqs[0].block_table[: prompt_len // 4]
    assert all(engine.block_manager.ref_count[b] == 3 for b in shared)
    check_blocks(engine)
    while engine.has_unfinished_requests():
        outs = engine.step()
        check_blocks(engine)
    ref = reference(tuple(prompt), 10)
    assert [o.token_ids for o in outs[0].outputs] == [ref] * 3


def test_seeded_sampling_does_not_depend_on_the_batch() -> None:
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, top_k=20)
    alone = make_engine(MODEL, CFG)
    alone.add_request("x", PREFIXES[1], params)
    a = run_all(alone)["x"]
    busy = make_engine(MODEL, CFG, block_size=4, max_num_batched_tokens=7)
    busy.add_request("o1", PREFIXES[0], SamplingParams(temperature=1.0, max_tokens=12))
    busy.add_request("x", PREFIXES[1], params)
    busy.add_request("o2", [1, 2, 3], SamplingParams(temperature=0.5, max_tokens=20))
    assert run_all(busy)["x"] == a
    n3 = make_engine(MODEL, CFG)
    n3.add_request("x", PREFIXES[1], SamplingParams(temperature=1.0, seed=5, max_tokens=12, n=3, ignore_eos=True,
                                                    top_k=20))
    while n3.has_unfinished_requests():
        outs = n3.step()
    samples = [o.token_ids for o in outs[0].outputs]
    assert samples[0] == a and len({tuple(s) for s in samples}) > 1


def test_stop_string_is_cut_and_never_streamed() -> None:
    prompt = PREFIXES[1]
    ref = reference(tuple(prompt), 12)
    text = "".join(chr(65 + t) for t in ref)
    stop = text[5:7]
    first = text.find(stop)
    engine = make_engine(MODEL, CFG)
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop, "@@@@"]))
    seen = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            t = o.outputs[0].text
            assert t.startswith(seen) and stop not in t
            seen = t
    assert seen == text[:first]
    assert o.outputs[0].finish_reason == "stop" and o.outputs[0].stop_reason == stop
    engine.add_request("k", prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop],
                                                   include_stop_str_in_output=True))
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].outputs[0].text == text[: first + len(stop)]


def test_eos_min_tokens_stop_token_ids_and_length() -> None:
    prompt = PREFIXES[0]
    ref = reference(tuple(prompt), 6)
    eos = ref[0]
    engine = make_engine(MODEL, CFG, eos_id=eos)
    engine.add_request("eos", prompt, SamplingParams(temperature=0, max_tokens=6))
    engine.add_request("min", prompt, SamplingParams(temperature=0, max_tokens=6, min_tokens=3))
    engine.add_request("stopid", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                        stop_token_ids=[ref[2]]))
    engine.add_request("len", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0]
    assert done["eos"].token_ids == [eos] and done["eos"].finish_reason == "stop" and done["eos"].text == ""
    assert len(done["min"].token_ids) >= 3 and eos not in done["min"].token_ids[:3]
    assert done["stopid"].token_ids == ref[:3] and done["stopid"].stop_reason == ref[2]
    assert done["len"].token_ids == ref[:4] and done["len"].finish_reason == "length"


def test_logprobs_match_the_model() -> None:
    prompt = PREFIXES[1]
    engine = make_engine(MODEL, CFG)
    engine.add_request("l", prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2))
    out = [o for o in run_all_outputs(engine) if o.finished][0].outputs[0]
    assert len(out.logprobs) == 5
    ids = list(prompt)
    for tok, entry in zip(out.token_ids, out.logprobs):
        with torch.no_grad():
            lp = torch.log_softmax(ORACLE(torch.tensor([ids]))[0, -1], -1)
        assert entry[tok] == pytest.approx(float(lp[tok]), abs=1e-4)
        assert set(lp.topk(2).indices.tolist()) <= set(entry)
        ids.append(tok)


def run_all_outputs(engine):
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_abort_frees_blocks_at_once_and_reports() -> None:
    engine = make_engine(MODEL, CFG, block_size=4)
    engine.add_request("a", PREFIXES[0], greedy(30))
    engine.add_request("b", PREFIXES[1], greedy(30))
    engine.step()
    engine.step()
    engine.abort_request("a")
    engine.abort_request("unknown")  # ignored
    check_blocks(engine)
    assert engine.stats().num_running == 1
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finished and outs["a"].outputs[0].finish_reason == "abort"
    run_all(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bad_requests_get_clear_errors() -> None:
    engine = make_engine(MODEL, CFG, max_model_len=32)
    engine.add_request("dup", [1, 2], greedy(2))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("dup", [1, 2], greedy(2))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("e", [], greedy(2))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        engine.add_request("v", [1, 999], greedy(2))
    with pytest.raises(ValueError, match="does not fit max_model_len=32"):
        engine.add_request("long", [1] * 40, greedy(2))
    with pytest.raises(ValueError, match="string or a list of token ids"):
        engine.add_request("t", 3.5, greedy(2))
    with pytest.raises(ValueError, match="invalid EngineConfig: block_size=0"):
        make_engine(MODEL, CFG, block_size=0)


def test_text_prompt_and_max_model_len_stop() -> None:
    engine = make_engine(MODEL, CFG, max_model_len=20)
    engine.add_request("t", "HELLO", SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    out = run_all_outputs(engine)[-1]
    assert out.prompt == "HELLO" and out.prompt_token_ids == [7, 4, 11, 11, 14]
    assert len(out.outputs[0].token_ids) == 15 and out.outputs[0].finish_reason == "length"
