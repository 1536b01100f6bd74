"""Export a TransformerLM to a Hugging Face directory (config.json + model.safetensors [+ tokenizer.json]).

The target family is the first of `model/families/` whose HF config translates back to the model's exact
`ModelConfig` (`families.for_export`): plain models become Llama, q/k/v biases Qwen2, q/k-norm Qwen3, Gemma's
features Gemma, and so on; the family's tensor rules write the names and inverse transforms (fused tensors joined,
Conv1D weights transposed, norm offsets taken back out). Adjacent-layout (llama2.c / CS336) RoPE weights are
permuted to HF's rotate-half layout first (not MLA's: DeepSeek's HF models rotate adjacent pairs), so
`transformers.AutoModelForCausalLM` gives equal logits.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from scratchlm import atomic
from scratchlm.model import families
from scratchlm.model.config import ModelConfig
from scratchlm.model.families.base import permute_to_half
from scratchlm.model.loading.common import log
from scratchlm.model.transformer import TransformerLM


def _half_layout(config: ModelConfig, state: dict[str, torch.Tensor]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """An adjacent-pair RoPE model as the equal rotate-half one (q/k rows permuted per head). MLA models stay as
    they are: DeepSeek's HF checkpoints rotate interleaved (adjacent) pairs themselves."""
    if config.rope_layout != "adjacent" or config.mla.kv_lora_rank:
        return config, state
    out = dict(state)
    for name, t in state.items():
        if any(s in name for s in ("q_proj", "q_bias", "k_proj", "k_bias")):
            out[name] = permute_to_half(t, config.n_heads if ".q_" in name else config.n_kv_heads)
    return dataclasses.replace(config, rope_layout="half"), out


def hf_config(config: ModelConfig, tokenizer: Any = None, family: families.Family | None = None) -> dict[str, Any]:
    """The config.json dict of the HF model that equals `config` (see the module docstring); `family`: the one
    `families.for_export` chose, when the caller already has it."""
    config, _ = _half_layout(config, {})
    cfg = (family or families.for_export(config)).hf_config(config)
    if tokenizer is not None:
        for key, attr in (("bos_token_id", "bos_id"), ("eos_token_id", "eos_id")):
            if getattr(tokenizer, attr, None) is not None:
                cfg[key] = getattr(tokenizer, attr)
    return cfg


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    atomic.replace(tmp, path)


def export_hf(model: TransformerLM, config: ModelConfig | None = None, tokenizer: Any = None,
              out_dir: str | Path = "hf_export") -> Path:
    """Write `model` as an HF directory loadable by `transformers.AutoModelForCausalLM`; returns out_dir."""
    config = config or model.config
    if config.rope_layout == "none" and not config.learned_positions:
        raise ValueError("export_hf: this model has no position embedding (rope_layout='none'); the HF families "
                         "with RoPE always apply it, so no HF config reproduces it")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    config, state = _half_layout(config, state)
    try:
        family = families.for_export(config)
    except families.FamilyError as e:
        raise ValueError(f"export_hf: {e}") from None
    tensors = {rule.theirs: rule.to_theirs(state).to("cpu").contiguous() for rule in family.hf_rules(config)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / "model.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    cfg_text = json.dumps(hf_config(config, tokenizer, family), indent=2)
    _atomic_write(out / "config.json", lambda p: p.write_text(cfg_text))
    if tokenizer is not None:
        try:
            from scratchlm.tokenizer.formats import save_hf_tokenizer_json
        except ImportError as e:
            log.warning("tokenizer not exported (scratchlm.tokenizer.formats unavailable: %s)", e)
        else:
            _atomic_write(out / "tokenizer.json", lambda p: save_hf_tokenizer_json(tokenizer, p))
    log.info("exported %s model to %s", family.name, out)
    return out
