"""Layouts, stage balancing, micro-batch splitting and fail-fast configuration errors (no processes)."""

from __future__ import annotations

import pytest

import scratchlm.parallel.launch as launch
from scratchlm.inference import EngineConfig, LLMEngine
from scratchlm.inference.runner import ModelInput
from scratchlm.model import ModelConfig
from scratchlm.parallel.layout import balanced_stages, check_parallel_config, plan_layout, split_range
from scratchlm.parallel.pipeline import split_model_input
from scratchlm.parallel.tensor import shard_spec
from tests.conftest import shared_data_path

STORIES = shared_data_path() / "models/stories260K/stories260K.bin"
SMOL = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536, max_seq_len=8192)
STORIES_CFG = ModelConfig(vocab_size=512, d_model=64, n_layers=5, n_heads=8, n_kv_heads=4, d_ff=172, max_seq_len=512)


def test_split_range_covers_evenly() -> None:
    assert split_range(9, 2) == [(0, 5), (5, 9)]
    assert split_range(3, 3) == [(0, 1), (1, 2), (2, 3)]


def test_smollm2_tp2_shards_whole_kv_groups() -> None:
    a, b = (plan_layout(SMOL, 2, 1, r) for r in range(2))
    assert (a.kv_heads, a.q_heads, b.kv_heads, b.q_heads) == ((0, 2), (0, 6), (2, 3), (6, 9))
    assert a.ff == (0, 768) and b.ff == (768, 1536)
    assert a.vocab == (0, 24576) and b.vocab == (24576, 49152) and a.vocab_shard == 24576


def test_tp_pp_layout_ranks_and_specs() -> None:
    lay = plan_layout(STORIES_CFG, 2, 2, 3)  # stage 1, tp rank 1
    assert (lay.stage, lay.tp_rank, lay.is_last_stage) == (1, 1, True)
    assert lay.layers[1] == 5 and lay.stage_ranks(1) == [2, 3]
    d = STORIES_CFG.head_dim
    assert shard_spec("layers.4.attn.q_proj.weight", STORIES_CFG, lay) == (0, 4 * d, 8 * d)
    assert shard_spec("layers.4.attn.o_proj.weight", STORIES_CFG, lay) == (1, 4 * d, 8 * d)
    assert shard_spec("layers.4.ffn.w2.weight", STORIES_CFG, lay) == (1, 86, 172)
    assert shard_spec("layers.0.ffn.w1.weight", STORIES_CFG, lay) is None  # stage 0's layer
    assert shard_spec("tok_embeddings.weight", STORIES_CFG, lay) == (0, 256, 512)  # tied head on the last stage


def test_balanced_stages_by_parameters() -> None:
    assert sum(balanced_stages(SMOL, 4)) == 30
    sizes = balanced_stages(SMOL, 2)
    assert sizes[0] == sizes[1] == 15  # embedding on stage 0 and the tied head on stage 1 cost the same
    assert balanced_stages(STORIES_CFG, 5) == [1, 1, 1, 1, 1]


def _input() -> ModelInput:
    # 3 decodes (rows 0..2) then two prefill chunks (rows 3..6, 7..8); the first chunk does not sample
    return ModelInput(
        token_ids=list(range(9)), positions=[5, 6, 7, 0, 1, 2, 3, 4, 5], slot_mapping=list(range(100, 109)),
        num_decode_tokens=3, decode_block_tables=[[1, 2], [3, 0], [4, 0]], decode_context_lens=[6, 3, 4],
        prefills=[(3, 4, 4, [5]), (7, 2, 6, [6, 7])], logits_indices=[0, 1, 2, 8], block_copies=[(1, 9)])


def test_split_model_input_is_a_disjoint_cover() -> None:
    inp = _input()
    parts = split_model_input(inp, 2)
    assert len(parts) == 2
    seen_rows, seen_pos = [], []
    for sub, positions in parts:
        assert sub.num_decode_tokens == len(sub.decode_block_tables) == len(sub.decode_context_lens)
        assert all(ql > 1 for _, ql, _, _ in sub.prefills)
        for row, pos in zip(sub.logits_indices, positions):
            assert sub.token_ids[row] == inp.token_ids[inp.logits_indices[pos]]
        seen_rows += sub.token_ids
        seen_pos += positions
        for qs, ql, cl, table in sub.prefills:  # rebased chunk rows point at the same tokens
            orig = next(p for p in inp.prefills if p[3] == table)
            assert sub.token_ids[qs:qs + ql] == inp.token_ids[orig[0]:orig[0] + orig[1]] and cl == orig[2]
    assert sorted(seen_rows) == inp.token_ids and sorted(seen_pos) == [0, 1, 2, 3]
    assert parts[0][0].block_copies == [(1, 9)] and parts[1][0].block_copies == []
    assert split_model_input(inp, 1)[0][0] is inp


def test_check_names_every_factor() -> None:
    with pytest.raises(ValueError) as info:
        check_parallel_config(SMOL, 4, 40, world_size=8)
    msg = str(info.value)
    assert "tensor_parallel_size (4) x pipeline_parallel_size (40) = 160 != world size 8" in msg
    assert "n_kv_heads=3" in msg and "n_layers=30" in msg
    with pytest.raises(ValueError, match=r"pipeline_stage_layers=\[3, 1\] must be positive and sum to n_layers=5"):
        check_parallel_config(STORIES_CFG, 1, 2, stage_layers=[3, 1])


def test_engine_config_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="parallel_timeout_s"):
        EngineConfig(parallel_timeout_s=0)


@pytest.mark.skipif(not STORIES.is_file(), reason="stories260K not in the shared data")
@pytest.mark.parametrize(("options", "expected"), [
    ({"tensor_parallel_size": 8}, "exceeds the model's n_kv_heads=4"),
    ({"pipeline_parallel_size": 6}, "exceeds the model's n_layers=5"),
    ({"pipeline_parallel_size": 2, "pipeline_stage_layers": "4,2"}, "sum to n_layers=5"),
    ({"tensor_parallel_size": 2, "quantization": "int8"}, "quantization='int8' is not supported"),
])
def test_bad_config_fails_before_any_weight_loads(monkeypatch, options, expected) -> None:
    def no_load(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(launch, "load_shard", no_load)
    monkeypatch.setattr(launch, "WorkerProcess", no_load)  # nor any worker spawned
    with pytest.raises(ValueError, match=expected):
        LLMEngine.from_pretrained(STORIES, EngineConfig(**options))


@pytest.mark.skipif(not STORIES.is_file(), reason="stories260K not in the shared data")
def test_torchrun_world_size_mismatch(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr(launch, "load_shard", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) x pipeline_parallel_size \(1\) = 2 "
                                         r"!= world size 3"):
        LLMEngine.from_pretrained(STORIES, EngineConfig(tensor_parallel_size=2))
