"""Batch-1 decode of a DeepSeek-V3-shaped model: scratchlm's engine (latent paged KV cache, absorbed decode) against
HF transformers (its DynamicCache keeps the latents too, but every step expands all of them through kv_b_proj),
side by side, interleaved, at several context lengths.

    python -m benchmarks.mla_decode [--contexts 256 1024 4096] [--new-tokens 16] [--repeats 2] [--clock thread_cpu]

The model: transformers' own `DeepseekV3Config` (random seeded weights, no download), `--layers` layers of width
512, 16 heads with DeepSeek's per-head proportions halved (qk_nope 64, qk_rope 32, v 64), kv_lora_rank 128,
q_lora_rank 192, 8 routed experts (top 2, 2 groups) of width 256 plus one shared expert, the first layer dense
("moe"); and the same with every layer's feed-forward dense (first_k_dense_replace = all: "dense"), which leaves
the attention as the difference (transformers runs its experts one by one in Python).
Both run float32 on one thread. For each context a random prompt of that length is prefilled (not timed) and
`--new-tokens` greedy tokens are decoded; the figure is decoded tokens per second of the decode steps only
(scratchlm: the engine's steps after the first; transformers: the model called once per token with its cache after
the prefill call), timed on `--clock`: "thread_cpu" (default; the calling thread's CPU time, which on one thread is
the work itself, far less sensitive than wall time to the other processes of a shared machine) or "wall". The
ratio is scratchlm's rate over transformers'. The greedy ids of the two are compared too (equal when the random
model has no near ties).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import CLOCKS, Report, set_threads


def hf_config(layers: int, max_len: int, ffn: str):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                            num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                            q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
                            v_head_dim=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                            topk_group=1, first_k_dense_replace=1 if ffn == "moe" else layers,
                            max_position_embeddings=max_len)


@torch.inference_mode()
def hf_decode(model, prompt: list[int], new_tokens: int, clock) -> tuple[float, list[int]]:
    """(decoded tokens per second after the prefill, the greedy ids) of HF's model with its KV cache."""
    out = model(torch.tensor([prompt]), use_cache=True)
    cache, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
    ids = [nxt]
    t0 = clock()
    for _ in range(new_tokens - 1):
        out = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
        cache, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
        ids.append(nxt)
    return (new_tokens - 1) / (clock() - t0), ids


def engine_decode(engine, prompt: list[int], new_tokens: int, request_id: str, clock) -> tuple[float, list[int]]:
    """(decoded tokens per second of the steps after the first (prefill + first token), the greedy ids)."""
    from scratchlm.inference import SamplingParams

    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    out = [o for o in engine.step() if o.finished]
    t0, steps = clock(), 0
    while engine.has_unfinished_requests():
        out += [o for o in engine.step() if o.finished]
        steps += 1
    return steps / (clock() - t0), out[0].outputs[0].token_ids


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--ffn", nargs="+", choices=["moe", "dense"], default=["dense", "moe"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="thread_cpu")
    args = p.parse_args(argv)
    set_threads(1)
    clock = CLOCKS[args.clock]
    from transformers import AutoModelForCausalLM

    from scratchlm.inference import EngineConfig, LLMEngine
    from scratchlm.model import load
    from tests.inference.helpers import CharTokenizer

    max_len = max(args.contexts) + args.new_tokens + 8
    rows, n = [], 0
    for ffn in args.ffn:
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(hf_config(args.layers, max_len, ffn), dtype=torch.float32).eval()
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(Path(tmp))
            loaded = load(tmp)
        engine = LLMEngine(loaded.model, CharTokenizer(loaded.config.vocab_size), loaded.config,
                           EngineConfig(block_size=16, kv_cache_memory=256 << 20, max_model_len=max_len,
                                        max_num_seqs=4))
        gen = torch.Generator().manual_seed(1)
        for ctx in args.contexts:
            prompt = torch.randint(0, 4096, (ctx,), generator=gen).tolist()
            ours, theirs = [], []
            for r in range(args.repeats + 1):  # the first round warms up both
                n += 1
                rate, ids = engine_decode(engine, prompt, args.new_tokens, f"r{n}", clock)
                hf_rate, hf_ids = hf_decode(hf, prompt, args.new_tokens, clock)
                if r:
                    ours.append(rate)
                    theirs.append(hf_rate)
                print(f"  {ffn} context {ctx} round {r}: scratchlm {rate:.1f} tok/s, transformers {hf_rate:.1f} "
                      "tok/s", file=sys.stderr)
            same = sum(a == b for a, b in zip(ids, hf_ids, strict=True))
            mo, mt = statistics.median(ours), statistics.median(theirs)
            rows.append([ffn, ctx, f"{mo:.2f}", f"{mt:.2f}", f"{mo / mt:.2f}x", f"{same}/{args.new_tokens}"])
        del engine, hf
    report = Report("mla_decode", "DeepSeek-V3-shaped batch-1 decode: scratchlm (absorbed MLA) vs transformers", argv)
    c = loaded.config
    report.add(f"Model: DeepseekV3Config, {c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads, kv_lora_rank "
               f"{c.mla.kv_lora_rank}, q_lora_rank {c.mla.q_lora_rank}, qk_nope {c.mla.qk_nope_head_dim}, qk_rope "
               f"{c.mla.qk_rope_head_dim}, v {c.mla.v_head_dim}; moe: {c.moe.n_experts} experts top {c.moe.top_k} "
               f"+ shared after one dense layer; float32, one thread, {args.clock} clock, {args.new_tokens} new "
               f"tokens, median of {args.repeats} interleaved rounds after one warm-up round.")
    headers = ["ffn", "context", "scratchlm tok/s", "transformers tok/s", "scratchlm / transformers",
               "equal greedy ids"]
    report.table(headers, rows, "Decode tokens per second (decode steps only)")
    report.write()


if __name__ == "__main__":
    main(sys.argv[1:])
