"""Export a TransformerLM to a Hugging Face directory (config.json + model.safetensors [+ tokenizer.json]).

Models with q/k/v biases become Qwen2 configs, others Llama. Adjacent-layout (llama2.c) RoPE weights
are permuted to HF's rotate-half layout, so `transformers.AutoModelForCausalLM` gives equal logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from scratchlm import atomic
from scratchlm.model.config import ModelConfig
from scratchlm.model.loading.common import log
from scratchlm.model.loading.hf import hf_name_map
from scratchlm.model.transformer import TransformerLM


def adjacent_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Per head, rows (0,1),(2,3),.. -> (0,2,4,..,1,3,5,..): adjacent-pair RoPE weights in rotate-half order."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_config(config: ModelConfig, tokenizer: Any = None) -> dict[str, Any]:
    """The config.json dict of the equivalent HF Llama (or Qwen2, with q/k/v biases) model."""
    model_type = "qwen2" if config.qkv_bias else "llama"
    cfg: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if config.qkv_bias else "LlamaForCausalLM"],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None)
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
    if config.rope_layout == "none":
        raise ValueError("export_hf: this model has no position embedding (rope_layout='none'); HF's Llama and "
                         "Qwen2 always apply RoPE, so no HF config reproduces it")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tensors = {}
    for ours, theirs in hf_name_map(config).items():
        t = state[ours]
        if config.rope_layout == "adjacent" and any(s in ours for s in ("q_proj", "q_bias", "k_proj", "k_bias")):
            t = adjacent_to_half(t, config.n_heads if ".q_" in ours else config.n_kv_heads)
        tensors[theirs] = t.to("cpu").contiguous()
    _atomic_write(out / "model.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    cfg_text = json.dumps(hf_config(config, tokenizer), indent=2)
    _atomic_write(out / "config.json", lambda p: p.write_text(cfg_text))
    if tokenizer is not None:
        try:
            from scratchlm.tokenizer.formats import save_hf_tokenizer_json
        except ImportError as e:
            log.warning("tokenizer not exported (scratchlm.tokenizer.formats unavailable: %s)", e)
        else:
            _atomic_write(out / "tokenizer.json", lambda p: save_hf_tokenizer_json(tokenizer, p))
    log.info("exported %s model to %s", "qwen2" if config.qkv_bias else "llama", out)
    return out
