"""A tiny random Llama that speaks GPT-2's real tokenizer, for the prompt-scoring tests (echo, prompt_logprobs,
lm-evaluation-harness): transformers' own `LlamaConfig` -> `save_pretrained` (seeded random weights, norms perturbed,
an output head wide enough that the distributions are neither flat nor one-hot), and a `tokenizer.json` built with
the `tokenizers` library from the GPT-2 files in ../shared/data (read there, written only into the test's tmp dir).
The HF model it returns is the oracle; its tokenizer folder serves both `scratchlm serve` and HF AutoTokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 50257  # GPT-2's
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def save_scoring_model(directory: Path, gpt2_dir: Path):
    """Write the checkpoint and its tokenizer to `directory`; returns the HF model (float32, eval)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        model.lm_head.weight.normal_(0.0, 0.3)  # logits of std ~2: peaked, not one-hot
    model.save_pretrained(directory)
    bpe = models.BPE.from_file(str(gpt2_dir / "encoder.json"), str(gpt2_dir / "vocab.bpe"))
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(directory)
    return model


@torch.no_grad()
def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) float64: row p = log_softmax of HF's logits at position p (it scores token p + 1)."""
    return hf(torch.tensor([ids])).logits[0].double().log_softmax(dim=-1)
