"""Context parallelism in the engine (`scratchlm.parallel.context`): the ownership arithmetic and step plan
(no processes), fail-fast configuration errors, then real gloo engines with CP=2 (and CP=2 x TP=2, SmolLM2
over a ~3K-token prompt: `distributed`) against the single-process engine: greedy and seeded ids equal on a
mix of long (ring-prefilled) and short prompts, prefix-cache hits, forks and preemption, and each rank
holding ~1/C of a long sequence's KV."""

from __future__ import annotations

import random

import pytest
import torch

from scratchlm.inference import LLM, EngineConfig, LLMEngine, SamplingParams
from scratchlm.inference.kv_cache import bytes_per_block
from scratchlm.inference.runner import ModelInput
from scratchlm.model import load
from scratchlm.parallel.context import local_len, plan_cp_step, split_slot
from scratchlm.parallel.layout import check_parallel_config, plan_layout
from tests.conftest import shared_data_path

STORIES = shared_data_path() / "models/stories260K/stories260K.bin"
if not STORIES.is_file():
    pytest.skip(f"stories260K not found at {STORIES}", allow_module_level=True)
_, TOKENIZER, CFG = load(STORIES)
BLOCK = 4
THRESHOLD = 48  # prefill chunks of >= 48 tokens run sharded (ring attention)


# --- no processes ---------------------------------------------------------------------------------


def test_ownership_is_interleaved_and_slots_are_dense() -> None:
    cp, bs = 3, 4
    table = [7, 2, 5]  # a sequence's logical blocks (C x bs = 12 tokens each)
    seen: dict[int, set[int]] = {r: set() for r in range(cp)}
    for p in range(30):
        logical = table[p // (cp * bs)] * cp * bs + p % (cp * bs)
        owner, phys = split_slot(logical, cp, bs)
        assert owner == p % cp
        j = p // cp  # the token's index among its owner's tokens
        assert phys == table[j // bs] * bs + j % bs  # the owner's local block table is the same table
        seen[owner].add(phys)
    assert [len(s) for s in seen.values()] == [local_len(30, cp, r) for r in range(cp)] == [10, 10, 10]
    assert [local_len(7, 4, r) for r in range(4)] == [2, 2, 2, 1] and local_len(2, 4, 3) == 0


def test_step_plan_shards_long_chunks_and_replicates_the_rest() -> None:
    cp, bs = 2, 2
    big = cp * bs

    def slots(table, start, n):
        return [table[p // big] * big + p % big for p in range(start, start + n)]

    # 1 decode at position 5 (table [3, 4]), a short chunk (3 tokens, positions 0..2), a long chunk
    # (8 tokens, positions 4..11 after a 4-token cached prefix), which samples its last row.
    t_dec, t_short, t_long = [3, 4], [6], [0, 1, 2]
    inp = ModelInput(
        token_ids=list(range(12)), positions=[5, 0, 1, 2, *range(4, 12)],
        slot_mapping=slots(t_dec, 5, 1) + slots(t_short, 0, 3) + slots(t_long, 4, 8),
        num_decode_tokens=1, decode_block_tables=[t_dec], decode_context_lens=[6],
        prefills=[(1, 3, 3, t_short), (4, 8, 12, t_long)], logits_indices=[0, 3, 11])
    plans = [plan_cp_step(inp, cp, r, bs, threshold=8) for r in range(cp)]
    for r, plan in enumerate(plans):
        mine = [g for g in range(4, 12) if inp.positions[g] % cp == r]
        assert plan.rows == [0, 1, 2, 3, *mine]  # replicated rows everywhere, then this rank's half of the long chunk
        assert plan.sharded == [(4, 4, 12, t_long)] and plan.replicated == [(1, 3, 3, t_short)]
        assert plan.decode_lens == [3]  # 6 tokens of context: 3 on each rank
        written = [plan.rows[i] for i in plan.write_rows]
        assert all(inp.positions[g] % cp == r for g in written)
        assert set(written) == {g for g in plan.rows if inp.positions[g] % cp == r}
        assert plan.logits_owner == [-1, -1, 11 % cp]
    assert plans[1].logits_rows[2] == 7 and plans[0].logits_rows[2] == -1  # position 11 lives on rank 1
    # every stored slot is distinct across the long chunk's owners (per rank)
    for plan in plans:
        assert len(set(plan.write_slots)) == len(plan.write_slots)
    # below the threshold the long chunk is replicated too
    assert plan_cp_step(inp, cp, 0, bs, threshold=9).sharded == []


def test_layout_and_config_errors() -> None:
    lay = plan_layout(CFG, 2, 1, 3, cp=2)  # TP=2 x CP=2: rank 3 = cp rank 1, tp rank 1
    assert (lay.cp_rank, lay.tp_rank, lay.stage, lay.world_size) == (1, 1, 0, 4)
    assert lay.stage_ranks(0) == [2, 3] and lay.cp_ranks() == [1, 3]
    with pytest.raises(ValueError, match=r"x context_parallel_size \(2\) = 4 != world size 3"):
        check_parallel_config(CFG, 2, 1, 3, cp=2)
    with pytest.raises(ValueError, match="context_parallel_size=2 with pipeline_parallel_size=2 is not supported"):
        check_parallel_config(CFG, 1, 2, cp=2)
    for bad in ({"context_parallel_size": 0}, {"context_parallel_threshold": 0},
                {"context_parallel_size": "2"}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}=.* must be a positive integer"):
            EngineConfig(**bad)
    for opt, match in (({"quantization": "int8"}, "quantization='int8' is not supported with .*context_parallel_si"),
                       ({"speculative": "ngram"}, "speculative='ngram' is not supported with .*context_parallel_siz"),
                       ({"pipeline_parallel_size": 2}, "context_parallel_size=2 with pipeline_parallel_size=2")):
        with pytest.raises(ValueError, match=match):  # raised before any process starts
            LLMEngine.from_pretrained(STORIES, EngineConfig(context_parallel_size=2, **opt))
    with pytest.raises(ValueError, match="context_parallel_size=2 needs the multi-process runner"):
        LLMEngine(load(STORIES).model, TOKENIZER, CFG, EngineConfig(context_parallel_size=2))


def test_cli_flags_reach_the_engine_config() -> None:
    import argparse

    from scratchlm.config import add_dataclass_arguments, dataclass_from_args

    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, EngineConfig)
    args = parser.parse_args(["--context-parallel-size", "2", "--context-parallel-threshold", "1024",
                              "--tensor-parallel-size", "2"])
    cfg = dataclass_from_args(EngineConfig, args)
    assert (cfg.context_parallel_size, cfg.context_parallel_threshold, cfg.tensor_parallel_size) == (2, 1024, 2)


# --- real processes -------------------------------------------------------------------------------


def engine_config(cp: int = 1, tp: int = 1, blocks: int = 200, **kw) -> EngineConfig:
    """`blocks` blocks of BLOCK tokens at CP=1; the same bytes at CP=C hold blocks / C logical blocks of C x BLOCK."""
    options = dict(block_size=BLOCK, max_num_batched_tokens=128, max_num_seqs=6, max_model_len=512,
                   kv_cache_memory=blocks * bytes_per_block(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, BLOCK,
                                                            torch.float32),
                   enable_prefix_caching=True, context_parallel_threshold=THRESHOLD, context_parallel_size=cp,
                   tensor_parallel_size=tp)
    options.update(kw)
    return EngineConfig(**options)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 500, (40,), generator=g).tolist()
    long_a = torch.randint(3, 500, (300,), generator=g).tolist()  # chunks of 128, 128, 44: ring, ring, replicated
    return [long_a, [1, 400, 261], shared + [7, 8, 9], torch.randint(3, 500, (100,), generator=g).tolist(),
            [5], shared + [11, 12], long_a[:200] + [13]]  # the last one hits the prefix cache of long_a


def params(i: int) -> SamplingParams:
    if i == 4:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=24, ignore_eos=True, n=2)
    if i == 2:
        return SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run(engine: LLMEngine, check=None) -> dict[str, list[list[int]]]:
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", p, params(i))
    out = {}
    while engine.has_unfinished_requests():
        for r in engine.step():
            if r.finished:
                out[r.request_id] = [o.token_ids for o in r.outputs]
        owners = {s.seq_id: s.block_table for r in engine.requests.values() for s in r.seqs if s.block_table}
        engine.block_manager.check_invariants(owners)
        if check is not None:
            check(engine)
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    torch.set_num_threads(1)
    return run(LLM(STORIES, **vars(engine_config())).engine)


_LIVE: list[LLMEngine] = []  # spawned engines of this module (one torch.distributed group per process)


def _release_process_group() -> None:
    """Stop the module's CP=2 engine (if any) so that a test can start another distributed engine."""
    while _LIVE:
        _LIVE.pop().runner.shutdown()


@pytest.fixture(scope="module")
def cp2():
    torch.set_num_threads(1)
    engine = LLMEngine.from_pretrained(STORIES, engine_config(cp=2))
    _LIVE.append(engine)
    yield engine
    _release_process_group()


def _long_prompt_kv(engine: LLMEngine, n: int = 400) -> tuple[int, list[dict]]:
    """Prefill one n-token prompt alone (fresh engine): peak blocks used, and every rank's stats."""
    ids = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(3)).tolist()
    engine.add_request("long", ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.stats()
        peak = max(peak, s.num_total_blocks - s.num_free_blocks)
    return peak, engine.runner.rank_stats()


def test_each_rank_holds_half_of_a_long_sequence(cp2) -> None:
    """Runs first, on the fresh engine: a 400-token prompt (+3 decoded tokens) stores 403 K/V rows in all,
    split 202 / 201 over the two ranks; blocks used per rank and the per-rank pool are half of CP=1's."""
    peak, stats = _long_prompt_kv(cp2)
    written = [s["kv_slots_written"] for s in stats]
    assert written == [local_len(403, 2, r) for r in range(2)] == [202, 201]
    assert peak == -(-403 // (2 * BLOCK)) == 51  # per rank: 51 blocks of 4 tokens vs 101 at CP=1
    ref_pool = 200 * bytes_per_block(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, BLOCK, torch.float32)
    assert all(s["kv_pool_bytes"] == ref_pool // 2 for s in stats)
    assert all(s["comm"]["cp_ring_wait"][1] > 0 for s in stats)  # the prompt's 128-token chunks took the ring


def test_cp2_equals_single_process(cp2, reference) -> None:
    """Long prompts (ring), short ones (replicated), a prefix-cache hit on a long prompt, n=2 forks and seeded
    sampling: the same ids as one process."""
    hits = []
    out = run(cp2, lambda e: hits.append(e.stats().prefix_cache_hits))
    assert out == reference
    assert hits[-1] > 0
    assert cp2.stats().num_free_blocks == cp2.stats().num_total_blocks


def test_cp2_random_streams(cp2, reference) -> None:
    """Random add/abort/step streams (prompts of 3 to 130 tokens) keep the block invariants and give the
    single-process greedy ids."""
    del reference
    engine = cp2
    rng = random.Random(5)
    live: dict[str, list[int]] = {}
    results: dict[str, list[int]] = {}
    for _ in range(25):
        kind = rng.choice(["add", "add", "step", "abort"])
        if kind == "add":
            rid = f"s{len(live)}"
            live[rid] = [rng.randrange(3, 500) for _ in range(rng.choice([3, 20, 60, 130]))]
            engine.add_request(rid, live[rid], SamplingParams(temperature=0, max_tokens=rng.randint(1, 12),
                                                              ignore_eos=True))
        elif kind == "abort" and live:
            engine.abort_request(rng.choice(sorted(live)))
        else:
            for o in engine.step():
                if o.finished and o.outputs[0].finish_reason != "abort":
                    results[o.request_id] = o.outputs[0].token_ids
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished and o.outputs[0].finish_reason != "abort":
                results[o.request_id] = o.outputs[0].token_ids
    assert results and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    single = LLM(STORIES, **vars(engine_config())).engine
    for rid, ids in results.items():
        single.add_request(rid, live[rid], SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True))
    expect = {}
    while single.has_unfinished_requests():
        for o in single.step():
            if o.finished:
                expect[o.request_id] = o.outputs[0].token_ids
    assert results == expect


@pytest.mark.distributed
def test_small_pool_preempts_under_cp2(reference) -> None:
    """A small pool (45 logical blocks of 8 tokens, 45 blocks of 4 per rank; the 300-token prompt + 24 tokens
    still fits max_model_len): sequences are preempted and recomputed, and the ids still match."""
    _release_process_group()
    engine = LLMEngine.from_pretrained(STORIES, engine_config(cp=2, blocks=90, max_num_batched_tokens=64))
    try:
        out = run(engine)
        assert engine.stats().num_preemptions > 0
    finally:
        engine.runner.shutdown()
    assert out == reference


@pytest.mark.distributed
def test_cp2_x_tp2_equals_single_process(reference) -> None:
    """4 ranks: TP=2 (2 of stories260K's 4 KV heads each) x CP=2."""
    _release_process_group()
    engine = LLMEngine.from_pretrained(STORIES, engine_config(cp=2, tp=2))
    try:
        out = run(engine)
        stats = engine.runner.rank_stats()
    finally:
        engine.runner.shutdown()
    assert out == reference
    assert [(s["cp_rank"], s["tp_rank"]) for s in stats] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.distributed
def test_smollm2_long_prompt_cp2(default_model_path, data_dir) -> None:
    """SmolLM2-135M, a ~3K-token prompt prefilled by ring attention in one chunk and in 1024-token chunks
    (the ring then carries each rank's cached prefix too), plus a short prompt: greedy ids equal CP=1."""
    _release_process_group()
    torch.set_num_threads(1)
    loaded_tok = load(default_model_path).tokenizer
    text = (data_dir / "corpora/tinyshakespeare/input.txt").read_text()[:30_000]
    ids = loaded_tok.encode(text)[:3000]
    assert len(ids) == 3000
    prompts_ = [ids, "The capital of France is"]
    p = SamplingParams(temperature=0, max_tokens=16)
    ref_llm = LLM(default_model_path, max_num_batched_tokens=4096, max_num_seqs=2, kv_cache_memory=1 << 28)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts_, p, use_tqdm=False)]
    for budget in (4096, 1024):
        llm = LLM(default_model_path, context_parallel_size=2, context_parallel_threshold=512,
                  max_num_batched_tokens=budget, max_num_seqs=2, kv_cache_memory=1 << 28)
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts_, p, use_tqdm=False)]
            stats = llm.engine.runner.rank_stats()
        finally:
            llm.engine.runner.shutdown()
        assert got == ref, f"max_num_batched_tokens={budget}"
        written = [s["kv_slots_written"] for s in stats]
        assert max(written) <= (3000 + 16 + 20) // 2 + 1, written  # each rank holds half the long prompt's KV


def test_generate_cli_with_context_parallelism() -> None:
    """`scratchlm generate --context-parallel-size 2` (its own process: ranks spawned from the CLI) prints the
    single-process greedy text."""
    import os
    import subprocess
    import sys

    prompt = "Once upon a time there was a little girl named Lily. She loved to play outside"
    want = LLM(STORIES).generate([prompt], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    out = subprocess.run([sys.executable, "-m", "scratchlm", "generate", "--model", str(STORIES), "--threads", "1",
                          "--context-parallel-size", "2", "--context-parallel-threshold", "8", "--max-tokens", "20",
                          prompt], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == want.outputs[0].text.strip()


@pytest.mark.parametrize(("tq", "tk", "stride", "offset", "pad"), [(300, 310, 2, 1, 0), (40, 700, 3, 0, 5),
                                                                   (513, 257, 2, 0, 3), (7, 4, 1, 9, 2)])
def test_sorted_partial_attention_equals_reference(tq, tk, stride, offset, pad) -> None:
    """`attention_lse_sorted` (fused kernel per query run, prefix unmasked, band masked) = the plain
    `attention_with_lse` on interleaved / prefix / padded key sets, including queries that see no key."""
    from scratchlm.parallel.context import _PAD_POS, attention_lse_sorted
    from scratchlm.parallel.sequence import attention_with_lse

    g = torch.Generator().manual_seed(tq)
    q, k, v = torch.randn(tq, 6, 16, generator=g), torch.randn(tk + pad, 2, 16, generator=g), \
        torch.randn(tk + pad, 2, 16, generator=g)
    q_pos = torch.arange(tq) * stride + (tk * stride - tq * stride) // 2 * (tk > tq)  # queries inside the keys' span
    k_pos = torch.cat((torch.arange(tk) * stride + offset, torch.full((pad,), int(_PAD_POS))))
    o, lse = attention_lse_sorted(q, q_pos, k, v, k_pos, run=64)
    ref_o, ref_lse = attention_with_lse(q[None], k[None], v[None], q_pos, k_pos)
    torch.testing.assert_close(o, ref_o[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse[0], atol=1e-5, rtol=1e-5)
    assert bool(torch.isinf(lse[q_pos < k_pos[0]]).all())


def test_paged_partial_decode_equals_reference() -> None:
    """Decode partial attention over a rank's paged shard (block tables padded, lengths 0..) = attention_with_lse
    over the gathered rows; a sequence with no key on this rank drops out (lse = -inf)."""
    from scratchlm.parallel.context import paged_partial_decode
    from scratchlm.parallel.sequence import attention_with_lse

    g = torch.Generator().manual_seed(0)
    bs, hkv, h, d = 4, 2, 6, 8
    k_cache, v_cache = torch.randn(10, bs, hkv, d, generator=g), torch.randn(10, bs, hkv, d, generator=g)
    tables = torch.tensor([[3, 7, 1], [2, 0, 0], [5, 6, 0]])
    lens = torch.tensor([11, 0, 5])
    q = torch.randn(3, h, d, generator=g)
    o, lse = paged_partial_decode(q, k_cache, v_cache, tables, lens)
    for b in range(3):
        n = int(lens[b])
        if n == 0:
            assert bool(torch.isinf(lse[b]).all()) and bool((o[b] == 0).all())
            continue
        keys = k_cache[tables[b]].reshape(-1, hkv, d)[:n]
        vals = v_cache[tables[b]].reshape(-1, hkv, d)[:n]
        ro, rl = attention_with_lse(q[b][None, None], keys[None], vals[None])
        torch.testing.assert_close(o[b], ro[0, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[b], rl[0, 0], atol=1e-5, rtol=1e-5)
