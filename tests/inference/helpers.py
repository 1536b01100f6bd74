"""Small models and a toy tokenizer for engine tests (real models are in test_oracles.py)."""

from __future__ import annotations

import torch

from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
from scratchlm.inference.kv_cache import bytes_per_block
from scratchlm.model import ModelConfig, TransformerLM


class CharTokenizer:
    """Token i <-> character chr(65 + i): enough for stop strings and streaming on random models."""

    def __init__(self, vocab_size: int, eos_id: int | None = None):
        self.vocab_size = vocab_size
        self.bos_id = None
        self.eos_id = eos_id
        self.add_bos = False
        self.chat_template = None

    def encode(self, text: str) -> list[int]:
        return [(ord(c) - 65) % self.vocab_size for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(65 + i) for i in ids)


def tiny_model(seed: int = 0, vocab: int = 48, n_heads: int = 4, n_kv_heads: int = 2, d_model: int = 32,
               n_layers: int = 2, max_seq_len: int = 96) -> tuple[TransformerLM, ModelConfig]:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      max_seq_len=max_seq_len)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the init's, so greedy ties are rare
        model.tok_embeddings.weight.mul_(4.0)
    return model, cfg


def block_bytes(cfg: ModelConfig, block_size: int, kv_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one KV block in every layer (int8: with its scales), as the engine sizes its pool."""
    return bytes_per_block(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, block_size, kv_dtype)


def make_engine(model, cfg, num_blocks: int = 64, eos_id: int | None = None, **options) -> LLMEngine:
    """An engine whose KV pool holds exactly `num_blocks` blocks of the KV dtype the options pick."""
    block_size = options.get("block_size", 16)
    kv = options.get("kv_cache_dtype", "auto")
    kv_dtype = getattr(torch, options.get("dtype", "float32") if kv == "auto" else kv)
    config = EngineConfig(kv_cache_memory=num_blocks * block_bytes(cfg, block_size, kv_dtype), **options)
    return LLMEngine(model, CharTokenizer(cfg.vocab_size, eos_id), cfg, config)


#: Where the engine's swapped-in modules live: `ModelRunner` swaps a model's layers for these in place (engine_ops'
#: C++ row ops, fast_linear's packed panels), so a model an engine has run no longer computes with plain torch.
ENGINE_SWAP_MODULES = ("scratchlm.inference.engine_ops", "scratchlm.inference.fast_linear")


def assert_plain_oracle(model: torch.nn.Module) -> None:
    """An oracle model must not share the code under test: refuse one whose modules an engine swapped for its own
    kernels (give engines and oracles separate loads of the same weights)."""
    swapped = sorted({type(m).__name__ for m in model.modules() if type(m).__module__ in ENGINE_SWAP_MODULES})
    assert not swapped, (f"the oracle model runs the engine's kernels ({', '.join(swapped)}): an engine was built "
                         "on it; load an independent copy for the reference")


@torch.no_grad()
def naive_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Reference: recompute the whole sequence every token with plain causal attention, on a model no engine has
    swapped (`assert_plain_oracle`)."""
    assert_plain_oracle(model)
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def run_all(engine: LLMEngine, check=None) -> dict[str, list[int]]:
    """Step until done; returns request id -> generated ids of sample 0."""
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for r in engine.step():
            if r.finished:
                out[r.request_id] = r.outputs[0].token_ids
        if check is not None:
            check(engine)
    return out


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def random_paged_cache(ext, dtype: torch.dtype, num_blocks: int, bs: int, hkv: int, d: int, gen: torch.Generator):
    """A random paged K/V cache of `dtype` written through the C++ kernels' own store (rounded / quantized as the
    engine does): k_cache, v_cache (num_blocks, bs, hkv, d), their scales (int8; else None) and their values as
    float64, the oracle's input."""
    k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    scales = (torch.zeros(num_blocks, bs, hkv), torch.zeros(num_blocks, bs, hkv)) if dtype == torch.int8 else (
        None, None)
    slots = torch.arange(num_blocks * bs)
    for cache, sc in zip((k_cache, v_cache), scales, strict=True):
        ext.kv_store(cache, sc, slots, torch.randn(num_blocks * bs, hkv, d, generator=gen))
    values = [c.double() * (s.double()[..., None] if s is not None else 1.0) for c, s in
              zip((k_cache, v_cache), scales, strict=True)]
    return k_cache, v_cache, scales, values
