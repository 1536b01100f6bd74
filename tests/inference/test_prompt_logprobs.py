"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`) computed in the prefill. The oracle is transformers'
own model on the same token ids: log_softmax of its logits at position j - 1 scores prompt token j (a tiny random
Llama checkpoint, tests/model/families/tiny.py; the default model in the slow test). Chunked prefill (chunks of a
few tokens over blocks of 4), the prefix cache (identical requests after the prompt's blocks are cached), n > 1,
max_tokens 0, the Python step beside the fused one, speculative decoding and preemption mid-prefill."""

from __future__ import annotations

import pytest
import torch

from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
from scratchlm.parallel.pipeline import split_model_input

pytest.importorskip("transformers")

ATOL = 1e-4
PROMPTS = [
    [3, 17, 42, 99, 5, 8, 120, 33, 64, 1, 2, 77, 150, 11, 9, 40, 41, 42, 43, 44],  # 20: five blocks of 4
    [7, 7, 7, 100, 101, 102, 159, 0, 12, 13, 14],  # 11
    [55],  # a single token: nothing to score
    [9, 8, 7, 6, 5, 4, 3, 2],  # 8: exactly two blocks
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint dir, HF oracle model)."""
    from tests.model.families.tiny import save_tiny

    directory = tmp_path_factory.mktemp("tiny_llama_plp")
    return directory, save_tiny("llama", directory)


def engine(tiny, **options) -> LLMEngine:
    config = dict(max_num_batched_tokens=7, block_size=4, max_model_len=48, max_num_seqs=8) | options
    return LLMEngine.from_pretrained(tiny[0], EngineConfig(**config))


@torch.no_grad()
def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) float64: row p = log_softmax of HF's logits at position p (scores token p + 1)."""
    return hf(torch.tensor([ids])).logits[0].double().log_softmax(dim=-1)


def check(out, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """`out.prompt_logprobs` equals HF: each token's logprob, its top-k alternatives, its rank."""
    lps, ranks = out.prompt_logprobs, out.prompt_logprob_ranks
    assert lps is not None and len(lps) == len(ids) and lps[0] is None
    assert ranks is not None and len(ranks) == len(ids) and ranks[0] is None
    for j in range(1, len(ids)):
        row = ref[j - 1]
        got = lps[j]
        assert abs(got[ids[j]] - float(row[ids[j]])) < ATOL, (j, got[ids[j]], float(row[ids[j]]))
        assert ranks[j] == int((row > row[ids[j]]).sum()) + 1
        top = row.topk(k).indices.tolist() if k else []
        assert set(got) == {ids[j], *top}, (j, sorted(got), top)
        for t, v in got.items():
            assert abs(v - float(row[t])) < ATOL


def run(eng: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, object]:
    """Add every request at once, step until done; the last output of each."""
    for rid, (ids, params) in requests.items():
        eng.add_request(rid, ids, params)
    last = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            last[out.request_id] = out
    return last


def test_chunked_prefill_mixed_batch_equals_hf(tiny):
    """Every prompt at once with chunks of 7 tokens over blocks of 4 (chunks straddle blocks and requests) and a
    request without prompt logprobs decoding beside them: every position is scored, once."""
    eng = engine(tiny)
    reqs = {f"p{i}": (ids, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=i % 3, ignore_eos=True))
            for i, ids in enumerate(PROMPTS)}
    reqs["plain"] = (PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    outs = run(eng, reqs)
    for i, ids in enumerate(PROMPTS):
        out = outs[f"p{i}"]
        check(out, ids, hf_logprobs(tiny[1], ids), i % 3)
        assert len(out.outputs[0].token_ids) == 3
    assert outs["plain"].prompt_logprobs is None
    # the sampled tokens are those of the request without prompt logprobs (the extra rows change nothing)
    assert outs["p1"].outputs[0].token_ids == outs["plain"].outputs[0].token_ids[:3]


def test_python_step_and_fused_step_agree(tiny):
    eng = engine(tiny, max_num_batched_tokens=5)
    assert eng.runner.fused_decoder is not None
    fused = run(eng, {"a": (PROMPTS[0], SamplingParams(max_tokens=0, prompt_logprobs=2))})["a"]
    eng.runner.fused_decoder = None  # the Python step (layer by layer)
    python = run(eng, {"b": (PROMPTS[0], SamplingParams(max_tokens=0, prompt_logprobs=2))})["b"]
    ref = hf_logprobs(tiny[1], PROMPTS[0])
    check(fused, PROMPTS[0], ref, 2)
    check(python, PROMPTS[0], ref, 2)


def test_prefix_cache_does_not_lose_positions(tiny):
    """A prompt whose blocks are cached (by a request without prompt logprobs, then by one with): identical requests
    with prompt logprobs still get every position, computed again (no cache hits for them)."""
    eng = engine(tiny)
    ids = PROMPTS[0]
    run(eng, {"warm": (ids, SamplingParams(temperature=0, max_tokens=1))})
    hits = eng.stats().prefix_cache_hits
    assert run(eng, {"warm2": (ids, SamplingParams(temperature=0, max_tokens=1))}) and \
        eng.stats().prefix_cache_hits > hits  # the cache does hold the prompt's blocks
    ref = hf_logprobs(tiny[1], ids)
    hits = eng.stats().prefix_cache_hits
    first = run(eng, {"a": (ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))})["a"]
    second = run(eng, {"b": (ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))})["b"]
    check(first, ids, ref, 1)
    check(second, ids, ref, 1)
    assert eng.stats().prefix_cache_hits == hits
    # and a later request without prompt logprobs still hits the blocks those two registered
    run(eng, {"c": (ids, SamplingParams(temperature=0, max_tokens=1))})
    assert eng.stats().prefix_cache_hits > hits


def test_n_samples_share_one_prompt_scoring(tiny):
    eng = engine(tiny)
    out = run(eng, {"n": (PROMPTS[1], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=2,
                                                     ignore_eos=True))})["n"]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 4 for c in out.outputs)
    check(out, PROMPTS[1], hf_logprobs(tiny[1], PROMPTS[1]), 2)


def test_max_tokens_zero_scores_the_prompt_alone(tiny):
    eng = engine(tiny, max_model_len=20)
    ids = PROMPTS[0]  # exactly max_model_len tokens: fits, since nothing is generated
    out = run(eng, {"z": (ids, SamplingParams(max_tokens=0, prompt_logprobs=0, n=2))})["z"]
    assert out.finished and [c.finish_reason for c in out.outputs] == ["length", "length"]
    assert all(c.token_ids == [] and c.text == "" for c in out.outputs)
    check(out, ids, hf_logprobs(tiny[1], ids), 0)
    assert eng.stats().generation_tokens_total == 0
    with pytest.raises(ValueError, match="max_model_len"):  # one more token would be generated
        eng.add_request("long", ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_speculative_decoding_keeps_prompt_logprobs(tiny):
    eng = engine(tiny, speculative="ngram", num_speculative_tokens=3)
    ids = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]  # repetitive: the n-gram proposer drafts
    out = run(eng, {"s": (ids, SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1, ignore_eos=True))})["s"]
    check(out, ids, hf_logprobs(tiny[1], ids), 1)
    assert len(out.outputs[0].token_ids) == 8


def test_preemption_mid_prefill_keeps_every_position(tiny):
    """A KV pool too small for both prompts at once: the younger one is preempted in the middle of its prefill and
    recomputes; its prompt logprobs are still complete and equal to HF."""
    from scratchlm.inference.kv_cache import bytes_per_block

    eng = engine(tiny, max_num_batched_tokens=4, max_num_seqs=2,
                 kv_cache_memory=9 * bytes_per_block(3, 2, 16, 4, torch.float32))  # 9 blocks: 36 tokens
    assert eng.block_manager.num_usable_blocks == 9
    a, b = PROMPTS[0], [x + 1 for x in PROMPTS[0]]
    outs = run(eng, {"a": (a, SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1, ignore_eos=True)),
                     "b": (b, SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1, ignore_eos=True))})
    assert eng.stats().num_preemptions > 0
    check(outs["a"], a, hf_logprobs(tiny[1], a), 1)
    check(outs["b"], b, hf_logprobs(tiny[1], b), 1)


def test_pipeline_split_keeps_every_logits_row():
    """Pipeline parallelism cuts a step into micro-batches: a prompt chunk's many logits rows go with it, in order."""
    from scratchlm.inference.runner import ModelInput

    # one decode (row 0, sampled), a chunk of 4 rows with 3 prompt rows + its sampled row, a chunk of 3 without
    inp = ModelInput(token_ids=list(range(8)), positions=[9, 0, 1, 2, 3, 4, 5, 6], slot_mapping=list(range(8)),
                     num_decode_tokens=1, decode_block_tables=[[0, 1, 2]], decode_context_lens=[10],
                     prefills=[(1, 4, 4, [3]), (5, 3, 7, [4, 5])], logits_indices=[0, 1, 2, 3, 4])
    parts = split_model_input(inp, 3)
    got = {}
    for sub, positions in parts:
        assert len(sub.logits_indices) == len(positions)
        for local, pos in zip(sub.logits_indices, positions):
            got[pos] = sub.token_ids[local]
    assert got == {i: inp.token_ids[r] for i, r in enumerate(inp.logits_indices)}


@pytest.mark.distributed
@pytest.mark.parametrize("options", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                     dict(context_parallel_size=2, context_parallel_threshold=4)],
                         ids=["tp2", "pp2", "cp2"])
def test_multi_process_executors_return_every_row(tiny, options):
    """The ranks' runners return the prompt rows too: TP (gathered logits), PP (several prompts in micro-batches,
    each with its rows), CP (chunks sharded by position: each row's hidden state gathered from its owner)."""
    eng = engine(tiny, max_num_batched_tokens=12, **options)
    try:
        outs = run(eng, {f"p{i}": (ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, ignore_eos=True))
                         for i, ids in enumerate(PROMPTS)})
    finally:
        eng.shutdown()
    for i, ids in enumerate(PROMPTS):
        check(outs[f"p{i}"], ids, hf_logprobs(tiny[1], ids), 2)


@pytest.mark.slow
def test_default_model_equals_hf(default_model_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_path.parent, gguf_file=default_model_path.name,
                                              dtype=torch.float32).eval()
    eng = LLMEngine.from_pretrained(default_model_path, EngineConfig(max_num_batched_tokens=16, block_size=8))
    _, ids = eng.encode_prompt("The quick brown fox jumps over the lazy dog. Then it ran into the forest, where a "
                               "small bird was singing.")
    out = run(eng, {"d": (ids, SamplingParams(max_tokens=0, prompt_logprobs=5))})["d"]
    check(out, ids, hf_logprobs(hf, ids), 5)
