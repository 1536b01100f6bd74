"""Sliding-window KV freeing in the engine, against HF transformers' Mistral (which applies the window itself).

A tiny random Mistral checkpoint (every layer windowed, window 8) served with blocks of 4 tokens: the engine frees
the blocks before each sequence's window as it advances (block_manager.py), so what it holds stays bounded while
the context grows past the pool; the greedy ids equal HF `generate(do_sample=False)` and every sampled token's
logprob equals HF's teacher-forced log-softmax, through chunked prefill, batches of different lengths, prefix-cache
hits, preemption and n > 1 forks. The null block (where freed blocks' table entries point) is filled with large
values, so a read of it that the window does not mask would change the logits.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from scratchlm.inference.attention import AttentionMetadata, PagedAttention, PrefillChunk  # noqa: E402
from scratchlm.inference.block_manager import BlockManager  # noqa: E402
from scratchlm.inference.kv_cache import KVCache, bytes_per_block_spec  # noqa: E402
from scratchlm.model.layers import AttentionSpec, spec_attention  # noqa: E402
from tests.model.families.tiny import hf_model, save_tiny  # noqa: E402

WINDOW, BS = 8, 4
DECODE_BOUND = -(-(WINDOW - 1) // BS) + 1  # blocks over the window's keys before a decode step: 3


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(checkpoint dir, the HF model: the oracle)."""
    root = tmp_path_factory.mktemp("mistral")
    hf = save_tiny("mistral", root)
    assert hf.config.sliding_window == WINDOW
    return root, hf


def make_engine(root, blocks: int | None = None, **options) -> LLMEngine:
    """The engine on the tiny Mistral; `blocks`: a pool of exactly that many blocks (the null block included)."""
    config = EngineConfig(block_size=BS, max_num_batched_tokens=options.pop("max_num_batched_tokens", 16),
                          kv_cache_memory=1 << 22, **options)
    engine = LLMEngine.from_pretrained(root, config)
    if blocks is not None:
        per_block = bytes_per_block_spec(engine.model_config.kv_spec(), BS, torch.float32)
        config = EngineConfig(block_size=BS, kv_cache_memory=blocks * per_block,
                              max_num_batched_tokens=config.max_num_batched_tokens, **options)
        engine = LLMEngine(engine.runner.model, None, engine.model_config, config)
    assert engine.block_manager.window == WINDOW
    engine.cache.k[:, 0].fill_(1e3)  # the null block: must only ever be read where the window masks it out
    engine.cache.v[:, 0].fill_(1e3)
    return engine


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], on_step=None) -> dict:
    """Add every request, step until done (calling on_step(engine) after each step); request id -> outputs."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        check_pool(engine)
        if on_step is not None:
            on_step(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks  # nothing leaked
    return outs


def check_pool(engine: LLMEngine) -> None:
    owners = {s.seq_id: s.block_table for r in engine.requests.values() for s in r.seqs if s.block_table}
    engine.block_manager.check_invariants(owners)


def held(seq) -> int:
    return len(seq.block_table) - seq.num_dropped_blocks


@torch.no_grad()
def check_against_hf(hf, prompt: list[int], out, top: int = 0) -> None:
    """Every sampled token's logprob (and the top ones) equal HF's log-softmax given the same prefix; greedy outputs
    are its argmax."""
    ids = prompt + list(out.token_ids)
    lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # (T, V), the window applied by HF
    for j, entry in enumerate(out.logprobs):
        row = lp[len(prompt) + j - 1]
        for tok, value in entry.items():
            assert abs(value - float(row[tok])) < 1e-4, (j, tok, value, float(row[tok]))


def greedy(n: int, logprobs: int = 0, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs, **kw)


PROMPTS = [list(range(3, 23)), [5, 9, 100, 3, 77, 12, 6, 1, 1, 2, 3, 4, 140, 20, 31], list(range(150, 120, -1))]


def test_greedy_equals_hf_generate_and_blocks_stay_bounded(mistral) -> None:
    root, hf = mistral
    engine = make_engine(root)
    most: dict[str, int] = {}

    def observe(eng):
        for s in eng.scheduler.running:
            if s.num_computed_tokens >= s.num_prompt_tokens:  # decoding: the window's blocks and no more
                most[s.request_id] = max(most.get(s.request_id, 0), held(s))
                assert held(s) <= DECODE_BOUND, (s.request_id, len(s), s.block_table)

    outs = run(engine, {str(i): (p, greedy(44, logprobs=2)) for i, p in enumerate(PROMPTS)}, observe)
    assert most and max(most.values()) <= DECODE_BOUND
    assert engine.block_manager.num_dropped >= sum(-(-(len(p) + 44) // BS) - DECODE_BOUND for p in PROMPTS)
    for i, p in enumerate(PROMPTS):
        check_against_hf(hf, p, outs[str(i)].outputs[0])
    prompt = PROMPTS[0]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=44, min_new_tokens=44, do_sample=False)
    assert outs["0"].outputs[0].token_ids == ref[0, len(prompt):].tolist()


def test_contexts_longer_than_the_pool_and_preemption(mistral) -> None:
    """8 blocks of 4 (7 usable) hold 28 tokens, and sequences of 64 run in it: max_model_len is not lowered. Four
    sequences at once do not fit (3 blocks each while decoding): the newest are preempted, recompute, and their
    outputs are unchanged."""
    root, hf = mistral
    engine = make_engine(root, blocks=8, max_num_batched_tokens=8)
    assert engine.block_manager.num_usable_blocks == 7
    assert engine.max_model_len == hf.config.max_position_embeddings
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2][:18], [7] * 12]
    outs = run(engine, {str(i): (p, greedy(40)) for i, p in enumerate(prompts)})
    assert engine.stats().num_preemptions > 0
    for i, p in enumerate(prompts):
        check_against_hf(hf, p, outs[str(i)].outputs[0])
        assert len(outs[str(i)].outputs[0].token_ids) == 40
    # chunks of 64 tokens with the window's 7 keys span up to 19 blocks: the pool cannot promise that, so the
    # longest sequence is what 7 blocks hold, as for a model without a window
    big_chunks = make_engine(root, blocks=8, max_num_batched_tokens=64)
    assert big_chunks.max_model_len == 7 * BS
    with pytest.raises(ValueError, match="does not fit max_model_len=28"):
        big_chunks.add_request("x", list(range(40)), greedy(1))


def test_prefix_cache_hits_across_the_window(mistral) -> None:
    """Requests sharing a 24-token prefix: the later ones hit it, taking only the blocks inside the window of their
    first uncomputed token (null entries before it), while the first still runs and after it finished."""
    root, hf = mistral
    engine = make_engine(root, enable_prefix_caching=True)
    shared = [11, 42, 7, 99, 3, 120, 64, 5, 18, 77, 2, 31, 8, 140, 56, 21, 90, 13, 4, 66, 101, 9, 30, 47]
    first = {"a": (shared + [1, 2], greedy(20))}
    engine.add_request("a", *first["a"])
    for _ in range(4):  # a's prompt is computed and its early blocks dropped
        engine.step()
    hits0 = engine.block_manager.prefix_cache_hits
    rest = {"b": (shared + [3], greedy(20)), "c": (shared + [5, 6, 7, 8, 9], greedy(20))}
    outs = run(engine, rest)
    assert engine.block_manager.prefix_cache_hits - hits0 >= 2 * (len(shared) // BS - 1)
    later = run(engine, {"d": (shared + [3], greedy(20))})  # after every request finished: freed blocks hit too
    assert later["d"].outputs[0].token_ids == outs["b"].outputs[0].token_ids
    for rid, (prompt, _) in rest.items():
        check_against_hf(hf, prompt, outs[rid].outputs[0])


def test_n_samples_fork_with_dropped_blocks(mistral) -> None:
    """n = 3 seeded samples fork from a prompt longer than the window (the forks share its null entries and copy
    the partial block): each sample's logprobs are HF's for its own tokens."""
    root, hf = mistral
    engine = make_engine(root)
    prompt = PROMPTS[2]
    outs = run(engine, {"s": (prompt, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True,
                                                     logprobs=0))})
    samples = outs["s"].outputs
    assert len({tuple(o.token_ids) for o in samples}) > 1
    for o in samples:
        check_against_hf(hf, prompt, o)


@pytest.mark.parametrize("use_kernel", [False, True])
def test_paged_attention_ignores_null_entries_before_the_window(use_kernel: bool) -> None:
    """A decode and a prefill chunk whose table entries before the window are the null block (filled with 1e3)
    give the windowed attention over the true keys: the torch path gathers and masks them, a kernel skips them."""
    torch.manual_seed(0)
    h, hkv, d, n = 4, 2, 8, 30
    bm = BlockManager(12, BS, window=WINDOW)
    table = bm.allocate(-(-n // BS))  # 8 blocks
    cache = KVCache.allocate(1, 12, BS, hkv, d, torch.float32, "cpu")
    cache.k.fill_(1e3)
    cache.v.fill_(1e3)
    q, k, v = torch.randn(n, h, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    spec = AttentionSpec(d**-0.5, window=WINDOW)
    ref = spec_attention(q[None], k[None], v[None], spec)[0]  # (n, H, D)
    for start in (n - 1, n - 4):  # a decode of the last token; a chunk of the last 4
        for p in range(start):
            cache.k[0, table[p // BS], p % BS], cache.v[0, table[p // BS], p % BS] = k[p], v[p]
        dropped = bm.window_start_block(start)  # what the scheduler would have freed by now
        assert dropped >= 4
        nulls = [bm.null_block] * dropped + table[dropped:]
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(start, n)])
        m = n - start
        if m == 1:
            meta = AttentionMetadata(slots, 1, torch.tensor([nulls]), torch.tensor([n]))
        else:
            meta = AttentionMetadata(slots, 0, None, None, [PrefillChunk(0, m, n, torch.tensor(nulls))])
        out = PagedAttention(cache, meta, use_kernel=use_kernel)(0, q[None, start:], k[None, start:], v[None, start:],
                                                                 spec)
        torch.testing.assert_close(out[0], ref[start:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", ["ngram", "layers:2", "draft"])
def test_speculative_decoding_with_dropped_blocks(mistral, spec: str, tmp_path) -> None:
    """Drafts verified over a windowed pool (and, for layers:2 and a draft model, a windowed draft cache that drops
    blocks too): greedy ids equal HF's, rollbacks never touch dropped blocks, the pool stays consistent. The tiny
    model's own layers agree on every token, so "draft" is the same checkpoint with perturbed embeddings: most of
    its drafts are rejected."""
    root, hf = mistral
    if spec == "draft":
        draft = hf_model("mistral")
        with torch.no_grad():
            torch.manual_seed(9)
            draft.model.embed_tokens.weight.add_(torch.randn_like(draft.model.embed_tokens.weight) * 0.3)
        draft.save_pretrained(tmp_path)
        spec = f"draft:{tmp_path}"
    engine = make_engine(root, speculative=spec, num_speculative_tokens=3)
    engine.speculator.adaptive = False  # always draft k (the cost model would rarely let a 2-of-3-layer draft run)
    prompts = {"r": ([4, 8, 15, 16, 23, 42] * 4, greedy(40)), "p": (PROMPTS[1], greedy(30))}
    outs = run(engine, prompts)
    assert engine.speculator.stats.verifies > 0
    for rid, (prompt, _) in prompts.items():
        check_against_hf(hf, prompt, outs[rid].outputs[0])
    if spec != "ngram":
        assert engine.speculator.proposer.blocks.window == WINDOW and engine.speculator.proposer.blocks.num_dropped
    if spec.startswith("draft"):
        assert engine.speculator.stats.rejected > 0


def test_kv_spec_shapes_the_cache_and_names_what_is_unsupported() -> None:
    from scratchlm.inference.kv_cache import kv_shape, kv_window
    from scratchlm.model.config import LayerKV

    spec = [LayerKV(2, 16, 8), LayerKV(2, 16, 8)]
    assert kv_shape(spec) == (2, 2, 16) and kv_window(spec) == 8
    assert KVCache.for_spec(spec, 3, BS, torch.float32, "cpu").k.shape == (2, 3, BS, 2, 16)
    assert kv_window([LayerKV(2, 16, 8), LayerKV(2, 16, None)]) is None  # a full layer reads every block
    assert kv_window([LayerKV(2, 16, 4), LayerKV(2, 16, 8)]) == 8  # the widest window decides
    with pytest.raises(ValueError, match="different KV heads x head_dim .*0: 2x16, 1: 4x16.*not supported"):
        kv_shape([LayerKV(2, 16, None), LayerKV(4, 16, None)])


def test_mixed_layer_models_keep_every_block_and_say_why(tmp_path, caplog) -> None:
    """Gemma 2 alternates windowed and full layers: one block table cannot drop what a full layer reads, so the pool
    has no window, the engine logs why at start-up, and its sizing is that of full attention."""
    save_tiny("gemma2", tmp_path)
    with caplog.at_level("INFO", logger="scratchlm.inference.engine"):
        engine = LLMEngine.from_pretrained(tmp_path, EngineConfig(block_size=BS, kv_cache_memory=1 << 20))
    assert engine.block_manager.window is None and engine.block_manager.null_block is None
    assert any("2 of 4 layers are windowed" in r.message and "hybrid allocator" in r.message for r in caplog.records)
    outs = run(engine, {"g": (PROMPTS[0], greedy(12))})
    seq_blocks = -(-(len(PROMPTS[0]) + 12) // BS)
    assert engine.block_manager.num_dropped == 0 and len(outs["g"].outputs[0].token_ids) == 12
    assert engine.block_manager.max_blocks_held(len(PROMPTS[0]) + 12, 16) == seq_blocks
