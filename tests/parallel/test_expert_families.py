"""Expert parallelism on the MoE families' tiny random HF checkpoints (`tests/model/families/tiny.py`), against HF
transformers (its forward and `generate` are the oracle; the ranks read the safetensors through the family's
tensor rules, each only its experts).

`distributed` (real ranks, gloo): Mixtral (4 experts), Qwen2-MoE (6 experts, gated shared expert), Qwen3-MoE
(8 experts, dense layers through decoder_sparse_step) and DeepSeek-V2 / V3 (MLA: the replicas exchange latents and
RoPE keys; group-limited routing, V3's correction bias) at EP=2, Qwen3-MoE and DeepSeek-V2 / V3 at EP=2 x TP=2 and
DeepSeek-V2 / V3 at TP=2 (MLA split by query head, the whole latent cached on every rank): the logits of every row
of a prompt within 1e-4 of HF's forward, greedy ids of a batch of prompts equal to HF `generate` (gpt-oss:
tests/model/families/test_gpt_oss.py). Default suite: MLA's shard plan under EP x TP.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
from scratchlm.inference.runner import ModelInput
from scratchlm.model import families
from scratchlm.parallel.launch import check_engine_config
from scratchlm.parallel.layout import plan_layout
from scratchlm.parallel.tensor import WHOLE, shard_plan
from tests.model.families.tiny import MLA_FAMILIES, MOE_FAMILIES, save_tiny

pytest.importorskip("transformers")
PROMPTS = [[5, 17, 3, 99, 42, 7, 150, 8, 23, 61, 2, 77, 9, 31, 44, 12, 100, 6, 59], [11, 4, 120],
           [90, 91, 92, 93, 94, 95, 96, 97, 98, 1, 2, 3]]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ep_families"))


@functools.cache
def _checkpoint(name: str, root: str):
    directory = Path(root) / name
    return directory, save_tiny(name, directory)


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.distributed
@pytest.mark.parametrize("name, ep, tp", [("mixtral", 2, 1), ("qwen2_moe", 2, 1), ("qwen3_moe", 2, 1),
                                          ("qwen3_moe", 2, 2), ("deepseek_v2_groups", 2, 1), ("deepseek_v3", 2, 1),
                                          ("deepseek_v2", 1, 2), ("deepseek_v3", 1, 2), ("deepseek_v2_groups", 2, 2),
                                          ("deepseek_v3", 2, 2)],
                         ids=["mixtral-ep2", "qwen2_moe-ep2", "qwen3_moe-ep2", "qwen3_moe-ep2xtp2",
                              "deepseek_v2_groups-ep2", "deepseek_v3-ep2", "deepseek_v2-tp2", "deepseek_v3-tp2",
                              "deepseek_v2_groups-ep2xtp2", "deepseek_v3-ep2xtp2"])
def test_expert_parallel_equals_hf(name, ep, tp, root) -> None:
    assert name in MOE_FAMILIES or name in MLA_FAMILIES
    _check_against_hf(*_checkpoint(name, root), name, ep, tp)


def _check_against_hf(directory: Path, hf, name: str, ep: int, tp: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = LLMEngine.from_pretrained(directory, EngineConfig(expert_parallel_size=ep, tensor_parallel_size=tp,
                                                               block_size=4, max_num_seqs=4))
    try:
        prompt = PROMPTS[0]
        n = len(prompt)
        table = list(range(-(-n // 4)))
        inp = ModelInput(prompt, list(range(n)), list(range(n)), 0, [], [], [(0, n, n, table)], list(range(n)))
        got = engine.runner.execute(inp)  # (n, vocab): every row of the prompt
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        err = (got - ref).abs().max().item()
        print(f"{name} ep={ep} tp={tp}: max |logit - HF| {err:.2e} over {n} rows")
        assert err < 1e-4
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, params)
        out = {}
        while engine.has_unfinished_requests():
            for r in engine.step():
                if r.finished:
                    out[int(r.request_id)] = r.outputs[0].token_ids
        assert [out[i] for i in range(len(PROMPTS))] == [_hf_greedy(hf, p) for p in PROMPTS]
    finally:
        engine.runner.shutdown()
        torch.set_num_threads(before)


def test_mla_shards_by_query_head_under_ep_x_tp() -> None:
    """EP x TP on an MLA model starts: q / k_b / v_b / o_proj split by query head, the latent projections whole."""
    config = families.config_from_hf(MLA_FAMILIES["deepseek_v3"]().to_dict())
    check_engine_config(EngineConfig(expert_parallel_size=2, tensor_parallel_size=2), config, 4)
    m, h = config.mla, config.n_heads
    plan = shard_plan(config, plan_layout(config, 2, 1, 1, ep=2))  # tp rank 1: the second half of the heads
    attn = "layers.0.attn."
    assert plan[attn + "q_b_proj.weight"] == (0, h // 2 * (m.qk_nope_head_dim + m.qk_rope_head_dim),
                                              h * (m.qk_nope_head_dim + m.qk_rope_head_dim))
    assert plan[attn + "k_b_proj.weight"] == (0, h // 2 * m.qk_nope_head_dim, h * m.qk_nope_head_dim)
    assert plan[attn + "o_proj.weight"] == (1, h // 2 * m.v_head_dim, h * m.v_head_dim)
    for name in ("kv_a_proj.weight", "kv_a_norm.weight", "q_a_proj.weight", "q_a_norm.weight"):
        assert plan[attn + name] == WHOLE
