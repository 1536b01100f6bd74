"""Training-step time of scratchlm's TransformerLM against HF `LlamaForCausalLM` (same config, same weights).

One step = forward + cross-entropy + backward + torch.optim.AdamW step, identical code around both
models. Workload (issue 4): d_model 256, 4 layers, 8 heads, context 256, batch 16, vocab 10K, fp32,
CPU. Both models start from the same weights (HF's random init loaded into scratchlm), and the run
checks that their first-step losses agree. MFU is against the fp32 GEMM peak measured in the same run.

    python -m benchmarks.model_train_step [--threads 2] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from benchmarks.common import Report, compare, set_threads


def gemm_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    """Best observed fp32 matmul FLOP/s for an n x n x n GEMM."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def make_step(model, forward, batches, lr: float = 1e-3):
    """A closure running one training step on the next batch (cycling over `batches`)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    state = {"i": 0, "losses": []}

    def step():
        x, y = batches[state["i"] % len(batches)]
        state["i"] += 1
        opt.zero_grad(set_to_none=True)
        logits = forward(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        state["losses"].append(loss.item())

    return step, state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads for both contenders")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per contender (interleaved)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per contender first")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=10_000)
    args = parser.parse_args(argv)
    set_threads(args.threads)

    from transformers import LlamaConfig, LlamaForCausalLM

    from scratchlm.model import load

    torch.manual_seed(0)
    hf_cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=args.context,
                         rms_norm_eps=1e-5, rope_theta=10_000.0, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    hf = LlamaForCausalLM(hf_cfg).train()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = load(tmp).model.train()
    for p in ours.parameters():
        p.requires_grad_(True)
    config = ours.config
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        seq = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=g)
        batches.append((seq[:, :-1], seq[:, 1:]))

    with torch.no_grad():
        x0 = batches[0][0][:2, :64]
        diff = (ours(x0) - hf(input_ids=x0).logits).abs().max().item()
    print(f"same weights: max |logit difference| = {diff:.2e}", file=sys.stderr)

    ours_step, ours_state = make_step(ours, lambda x: ours(x), batches)
    hf_step, hf_state = make_step(hf, lambda x: hf(input_ids=x).logits, batches)
    ours_step()
    hf_step()
    first = (ours_state["losses"][0], hf_state["losses"][0])
    print(f"first-step loss: scratchlm {first[0]:.5f}, HF {first[1]:.5f}", file=sys.stderr)

    peak_before = gemm_peak_flops()
    res = compare({"scratchlm TransformerLM": ours_step, "HF LlamaForCausalLM (sdpa)": hf_step},
                  warmup=args.warmup, repeats=args.repeats)
    peak_after = gemm_peak_flops()
    peak = max(peak_before, peak_after)

    tokens = args.batch * args.context
    flops = config.flops_per_token(args.context) * tokens
    ratio = res.ratio("scratchlm TransformerLM", "HF LlamaForCausalLM (sdpa)")
    report = Report("model_train_step", "Training step: scratchlm TransformerLM vs HF LlamaForCausalLM",
                    sys.argv[1:] if argv is None else argv)
    report.add(
        f"Workload: d_model 256, 4 layers, 8 heads, d_ff 704, context {args.context}, batch {args.batch}, "
        f"vocab {args.vocab}, fp32, CPU, {args.threads} threads; {config.num_parameters() / 1e6:.2f}M parameters. "
        "One step = forward + cross-entropy + backward + torch.optim.AdamW(lr 1e-3, wd 0.1) step, "
        f"identical code around both models, same initial weights (max |logit diff| {diff:.1e}; "
        f"first-step loss {first[0]:.5f} vs {first[1]:.5f}). {args.warmup} warm-up + {args.repeats} timed steps "
        "each, interleaved."
    )
    rows = []
    for t in res.timings:
        mfu = flops / t.median / peak
        rows.append([t.name, f"{t.median * 1e3:.0f} ms", f"{t.best * 1e3:.0f} ms", f"{tokens / t.median:,.0f}",
                     f"{flops / t.median / 1e9:.1f}", f"{100 * mfu:.1f}%", f"{t.median / res.timings[1].median:.3f}"])
    report.table(["model", "median step", "best step", "tok/s (median)", "GFLOP/s", "MFU", "time / HF"], rows)
    report.add(
        f"**Ratio scratchlm / HF (median step time): {ratio:.3f}x** (target <= 1.0x; best-of: "
        f"{res.ratio('scratchlm TransformerLM', 'HF LlamaForCausalLM (sdpa)', 'best'):.3f}x).\n\n"
        f"MFU = model FLOPs ({config.flops_per_token(args.context) / 1e6:.1f} MFLOP/token: 6 x matmul weights "
        f"+ attention, PaLM appendix B; {flops / 1e9:.1f} GFLOP/step) / step time / measured fp32 GEMM peak "
        f"({peak / 1e9:.1f} GFLOP/s, best 2048^3 matmul before/after: {peak_before / 1e9:.1f} / "
        f"{peak_after / 1e9:.1f}). Load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}."
    )
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
