"""Random add / abort / step streams with speculation on (hypothesis, derandomized), stories260K: after every
step the pool is consistent and holds no rejected-draft blocks, finished requests equal the naive greedy ids,
and the pool (and the draft's pool) is empty at the end."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.inference.helpers import greedy, make_engine
from tests.inference.speculative.test_engine_spec import check_spec_invariants
from tests.inference.test_engine import CFG, MODEL, STREAM_SETTINGS, action_st, reference


def check_stream(actions, spec, block_size, budget, max_seqs, spare_blocks, caching, k) -> None:
    max_len = 64
    num_blocks = -(-max_len // block_size) + spare_blocks
    engine = make_engine(MODEL, CFG, num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                         max_num_seqs=max_seqs, enable_prefix_caching=caching, max_model_len=max_len,
                         speculative=spec, num_speculative_tokens=k)
    engine.speculator.adaptive = False
    prompts: dict[str, list[int]] = {}
    results: dict[str, list[int]] = {}
    aborted: set[str] = set()

    def run_step() -> None:
        for o in engine.step():
            if o.finished and o.outputs[0].finish_reason != "abort":
                results[o.request_id] = o.outputs[0].token_ids
        check_spec_invariants(engine)

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
                run_step()
    while engine.has_unfinished_requests():
        run_step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    draft_blocks = getattr(engine.speculator.proposer, "blocks", None)
    if draft_blocks is not None:
        assert draft_blocks.num_free_blocks == draft_blocks.num_blocks
    for rid, ids in results.items():
        assert ids == reference(tuple(prompts[rid]), len(ids)), f"request {rid}: prompt {prompts[rid]}"
    assert set(prompts) <= set(results) | aborted


STREAMS = {
    "actions": st.lists(action_st, min_size=1, max_size=30),
    "spec": st.sampled_from(["ngram:3", "layers:2"]),
    "block_size": st.sampled_from([1, 2, 4, 16]),
    "budget": st.integers(1, 48),
    "max_seqs": st.integers(1, 6),
    "spare_blocks": st.integers(0, 12),
    "caching": st.booleans(),
    "k": st.integers(1, 6),
}


@settings(max_examples=3, **STREAM_SETTINGS)
@given(**STREAMS)
def test_random_streams_with_speculation(actions, spec, block_size, budget, max_seqs, spare_blocks, caching, k):
    check_stream(actions, spec, block_size, budget, max_seqs, spare_blocks, caching, k)


@pytest.mark.slow
@settings(max_examples=80, **STREAM_SETTINGS)
@given(**STREAMS)
def test_random_streams_with_speculation_long(actions, spec, block_size, budget, max_seqs, spare_blocks, caching, k):
    check_stream(actions, spec, block_size, budget, max_seqs, spare_blocks, caching, k)
