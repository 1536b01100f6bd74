"""Small random HF models built offline (save_pretrained into tmp dirs) for oracle comparisons."""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_llama(path: Path, *, tie: bool = False, n_kv_heads: int = 2, seed: int = 0, vocab: int = 97) -> Path:
    """A random LlamaForCausalLM (GQA, rope_theta 500) saved as safetensors into `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=n_kv_heads, max_position_embeddings=128,
                      rms_norm_eps=1e-6, rope_theta=500.0, tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1: make them random so that they are really tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def tiny_qwen2(path: Path, seed: int = 0) -> Path:
    """A random Qwen2ForCausalLM (q/k/v biases, untied head) saved into `path`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def hf_logits(path: Path, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return model(tokens).logits
