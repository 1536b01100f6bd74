"""TP=2, PP=2 and TP=2 x PP=2 (real processes, gloo) against the single-process engine on stories260K.

One parallel engine per layout (spawning costs seconds) runs: greedy and seeded sampling equal to
TP=1 with the same scheduling config (a small KV pool: chunked prefill, prefix-cache hits and
preemption all happen and are counted the same), then random add/abort/step streams with the
block-manager invariants checked after every step and greedy ids equal to a naive reference.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
from scratchlm.inference.kv_cache import bytes_per_block
from scratchlm.model import load
from tests.conftest import shared_data_path
from tests.inference.helpers import greedy, naive_greedy

STORIES = shared_data_path() / "models/stories260K/stories260K.bin"
if not STORIES.is_file():
    pytest.skip(f"stories260K not found at {STORIES}", allow_module_level=True)
MODEL, TOKENIZER, CFG = load(STORIES)
MODEL.eval()
BLOCK = 4
PREFIX = [1, 400, 261, 378, 432, 383, 286, 261, 376, 298, 315]


def engine_config(tp: int = 1, pp: int = 1) -> EngineConfig:
    """A small pool (22 blocks of 4 tokens) so that 6 requests of ~50 tokens preempt."""
    blocks = 22
    return EngineConfig(block_size=BLOCK, max_num_batched_tokens=24, max_num_seqs=6, max_model_len=64,
                        kv_cache_memory=blocks * bytes_per_block(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, BLOCK,
                                                                 torch.float32),
                        enable_prefix_caching=True, tensor_parallel_size=tp, pipeline_parallel_size=pp)


@functools.cache
def reference(prompt: tuple[int, ...], n: int) -> list[int]:
    return naive_greedy(MODEL, list(prompt), n)


def check_blocks(engine) -> None:
    owners = {s.seq_id: s.block_table for r in engine.requests.values() for s in r.seqs if s.block_table}
    engine.block_manager.check_invariants(owners)


def workload() -> list[tuple[str, list[int], SamplingParams]]:
    reqs = []
    for i in range(6):
        prompt = PREFIX + [300 + 7 * i, 260 + i]
        if i % 2 == 0:
            params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=100 + i, max_tokens=40,
                                    ignore_eos=True, n=2 if i == 3 else 1)
        reqs.append((f"r{i}", prompt, params))
    return reqs


def run(engine: LLMEngine) -> dict[str, list[list[int]]]:
    for rid, prompt, params in workload():
        engine.add_request(rid, prompt, params)
    out = {}
    while engine.has_unfinished_requests():
        for r in engine.step():
            if r.finished:
                out[r.request_id] = [o.token_ids for o in r.outputs]
        check_blocks(engine)
    return out


@pytest.fixture(scope="module")
def single():
    torch.set_num_threads(1)
    engine = LLMEngine(load(STORIES).model, TOKENIZER, CFG, engine_config())
    out = run(engine)
    return out, engine.stats()


@pytest.fixture(scope="module", params=[(2, 1), (1, 2), pytest.param((2, 2), marks=pytest.mark.distributed)],
                ids=["tp2", "pp2", "tp2xpp2"])  # 4 processes on 2 cores: ~40 s, so off the default suite
def parallel_engine(request):
    torch.set_num_threads(1)
    tp, pp = request.param
    engine = LLMEngine.from_pretrained(STORIES, engine_config(tp, pp))
    yield engine
    engine.runner.shutdown()


def test_greedy_and_seeded_sampling_equal_single_process(parallel_engine, single) -> None:
    ref_out, ref_stats = single
    out = run(parallel_engine)
    assert out == ref_out
    stats = parallel_engine.stats()
    assert ref_stats.num_preemptions > 0 and ref_stats.prefix_cache_hits > 0  # the workload exercises both
    assert stats.num_preemptions == ref_stats.num_preemptions
    assert stats.prefix_cache_hits == ref_stats.prefix_cache_hits
    assert stats.num_free_blocks == stats.num_total_blocks
    for rid, prompt, params in workload():
        if params.temperature == 0:
            assert out[rid][0] == reference(tuple(prompt), 40)


def test_random_request_streams_keep_invariants(parallel_engine) -> None:
    """Adds (shared prefixes), aborts and steps in random order: blocks stay consistent and every finished
    request has the naive greedy ids."""
    engine = parallel_engine
    rng = random.Random(7)
    prompts: dict[str, list[int]] = {}
    results: dict[str, list[int]] = {}

    def collect(outs) -> None:
        for o in outs:
            if o.finished and o.outputs[0].finish_reason != "abort":
                results[o.request_id] = o.outputs[0].token_ids

    for _ in range(30):
        kind = rng.choice(["add", "add", "step", "abort"])
        if kind == "add":
            rid = f"s{len(prompts)}"
            prompts[rid] = (PREFIX[: rng.randint(0, len(PREFIX))] + [rng.randrange(3, 500) for _ in
                                                                     range(rng.randint(1, 9))])
            engine.add_request(rid, prompts[rid], greedy(rng.randint(1, 20)))
        elif kind == "abort" and prompts:
            engine.abort_request(rng.choice(sorted(prompts)))
        else:
            for _ in range(rng.randint(1, 3)):
                collect(engine.step())
                check_blocks(engine)
    while engine.has_unfinished_requests():
        collect(engine.step())
        check_blocks(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert results
    for rid, ids in results.items():
        assert ids == reference(tuple(prompts[rid]), len(ids)), rid
