"""KV cache bytes per token: multi-head latent attention (what scratchlm's paged cache stores for DeepSeek-V2/V3 and
Kimi K2) against the same model's heads cached as K/V (MHA: every query head keeps its key and value, the
expanded form) and as grouped-query attention with 8 KV heads (the usual GQA choice), and the context each fits in
the same memory.

    python -m benchmarks.mla_kv [--budget-gib 1] [--block-size 16]

Measured: a small DeepSeek-V3-shaped checkpoint (transformers' own `DeepseekV3Config`, random weights, no download)
is loaded and the engine sizes its pool from `--budget-gib`; the bytes per token are the allocated cache tensors'
(`KVCache.nbytes`, K/V planes and int8 scales) over the slots they hold, for the MLA cache the engine allocates and
for the MHA / GQA caches of the same layers and heads (`KVCache.for_spec` of their `LayerKV`s, the tensors the
engine would allocate for them), in float32, bfloat16 and int8. Computed: the same per-token formula on the public
config.json values of DeepSeek-V3 and Kimi K2 (written below as dicts), whose caches are too big to allocate here;
the small model's computed and measured figures are checked equal first, so the formula is the allocator's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import Report, set_threads

GiB = 2**30

# Public config.json values (huggingface.co/deepseek-ai/DeepSeek-V3, huggingface.co/moonshotai/Kimi-K2-Instruct):
# only the fields the KV cache depends on.
REAL = {
    "DeepSeek-V3": dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    "Kimi K2": dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=64, q_lora_rank=1536,
                    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
}
SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=16, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
             first_k_dense_replace=1, n_group=2, topk_group=1, max_position_embeddings=4096)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
GQA_KV_HEADS = 8


def specs(cfg: dict) -> dict:
    """{"MLA": ..., "MHA": ..., "GQA-8": ...}: per layer `LayerKV` of the MLA cache and of the same heads as K/V."""
    from scratchlm.model.config import LayerKV

    n, h = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    qk, v = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    return {"MLA": [LayerKV(1, cfg["kv_lora_rank"], None, cfg["qk_rope_head_dim"], latent=True)] * n,
            "MHA": [LayerKV(h, qk, None, v)] * n, f"GQA-{GQA_KV_HEADS}": [LayerKV(GQA_KV_HEADS, qk, None, v)] * n}


def computed_bytes_per_token(spec, dtype: torch.dtype, block: int) -> float:
    from scratchlm.inference.kv_cache import bytes_per_block_spec

    return bytes_per_block_spec(spec, block, dtype) / block


def measured(args) -> list[list[str]]:
    """Rows: kind, dtype, bytes per token of the allocated tensors, tokens in the budget, ratio to MLA."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from scratchlm.inference import EngineConfig, LLMEngine
    from scratchlm.inference.kv_cache import KVCache, num_blocks_for_budget
    from scratchlm.model import load
    from tests.inference.helpers import CharTokenizer

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(DeepseekV3Config(**SMALL)).save_pretrained(Path(tmp))
        loaded = load(tmp)
    c, budget = loaded.config, int(args.budget_gib * GiB)
    rows = []
    for dname, dtype in DTYPES.items():
        engine = LLMEngine(loaded.model, CharTokenizer(c.vocab_size), c,
                           EngineConfig(block_size=args.block_size, kv_cache_memory=budget, max_model_len=4096,
                                        max_num_seqs=4096, kv_cache_dtype=dname))
        cache = engine.executor.runner.cache
        base = None
        for kind, spec in specs(SMALL).items():
            if kind == "MLA":
                assert [s.latent for s in c.kv_spec()] == [True] * c.n_layers
            else:
                from scratchlm.inference.kv_cache import kv_shape, kv_v_dim

                n_layers, heads, dim = kv_shape(spec)
                cache = KVCache.for_spec(spec, num_blocks_for_budget(budget, n_layers, heads, dim, args.block_size,
                                                                     dtype, kv_v_dim(spec)),
                                         args.block_size, dtype, "cpu")
            tokens = cache.num_blocks * cache.block_size
            per_token = cache.nbytes / tokens
            assert per_token == computed_bytes_per_token(spec, dtype, args.block_size), kind
            base = base or per_token
            rows.append([kind, dname, f"{per_token:,.0f}", f"{tokens:,}", f"{per_token / base:.2f}x"])
            del cache
        del engine
    return rows


def computed(budget_gib: float, block: int) -> list[list[str]]:
    rows = []
    for name, cfg in REAL.items():
        for dname in ("bfloat16", "int8"):
            base = None
            for kind, spec in specs(cfg).items():
                per_token = computed_bytes_per_token(spec, DTYPES[dname], block)
                base = base or per_token
                rows.append([name, kind, dname, f"{per_token / 1024:,.1f}", f"{budget_gib * GiB / per_token:,.0f}",
                             f"{per_token / base:.1f}x"])
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-gib", type=float, default=0.25, help="KV memory of the measured engine")
    p.add_argument("--real-budget-gib", type=float, default=40.0, help="KV memory the real configs' rows assume")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    set_threads(args.threads)
    report = Report("mla_kv", "KV cache bytes per token: MLA vs the same heads as K/V (MHA, GQA)", argv)
    small = SMALL
    report.add(f"Measured model: DeepseekV3Config with {small['num_hidden_layers']} layers, "
               f"{small['num_attention_heads']} heads, kv_lora_rank {small['kv_lora_rank']}, qk_nope "
               f"{small['qk_nope_head_dim']}, qk_rope {small['qk_rope_head_dim']}, v {small['v_head_dim']}. MLA "
               "caches per token and layer the latent and the RoPE key; MHA the K (nope + rope) and V of every "
               f"head; GQA-{GQA_KV_HEADS} those of {GQA_KV_HEADS} KV heads. int8: one float32 scale per token and "
               "KV head (per plane for MLA).")
    report.table(["cache", "dtype", "bytes / token (allocated)", f"tokens in {args.budget_gib:g} GiB", "vs MLA"],
                 measured(args), "Measured: the allocated cache tensors of the engine (MLA) and of KVCache.for_spec")
    report.table(["model", "cache", "dtype", "KiB / token", f"tokens in {args.real_budget_gib:g} GiB", "vs MLA"],
                 computed(args.real_budget_gib, args.block_size),
                 "Computed from the public config.json values (the allocator's formula, checked equal above)")
    report.write()


if __name__ == "__main__":
    main(sys.argv[1:])
