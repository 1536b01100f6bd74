"""DeepSeek-V3 and Kimi K2 (model_type `kimi_k2`: DeepSeek-V3's architecture): DeepSeek-V2's block
(`deepseek_v2.py`: multi-head latent attention, shared + routed experts after dense first layers) with V3's router:
a sigmoid score per expert, the `e_score_correction_bias` added for the choice only (`moe.score_bias`), groups
scored by the sum of their best two (noaux_tc; n_group, topk_group), the chosen scores renormalised when
norm_topk_prob and multiplied by routed_scaling_factor (HF `DeepseekV3ForCausalLM`). `rope_interleave` (default
true, every published checkpoint) picks the adjacent RoPE pair layout; false the rotate-half one."""

from __future__ import annotations

from typing import Any

from scratchlm.model.config import ModelConfig
from scratchlm.model.families.base import Family
from scratchlm.model.families.deepseek_v2 import deepseek_config, deepseek_hf_config, deepseek_rules, unused_hf_tensors


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    return deepseek_config(cfg, source, v3=True)


def hf_config(config: ModelConfig) -> dict[str, Any]:
    return deepseek_hf_config(config, v3=True)


FAMILY = Family(
    name="deepseek_v3",
    hf_model_types=("deepseek_v3", "kimi_k2"),
    hf_architectures=("DeepseekV3ForCausalLM",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=deepseek_rules,
    hf_file_rules=lambda c, names: deepseek_rules(c, present=names),
    hf_unused=unused_hf_tensors,
)
