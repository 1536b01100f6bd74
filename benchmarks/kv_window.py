"""KV memory held against context length: a sliding-window model vs the same model without the window.

    python -m benchmarks.kv_window [--context 4096] [--window 256] [--seqs 4] [--block-size 16] [--threads 2]

A small Mistral-shaped checkpoint is built with transformers' own `MistralConfig` (random seeded weights, no
download): `--layers` layers of `--d-model` width, 8 query / 4 KV heads, `sliding_window=--window`; the "full"
contender is the same weights with `sliding_window=None`. Each contender's engine (block size `--block-size`, a
pool big enough for every sequence at full length) generates `--seqs` greedy sequences together from `--prompt`
random tokens to `--context` tokens (ignore_eos), and after every step records the blocks sequences hold (pool
blocks less free blocks, the windowed pool's reserved null block not counted). The table gives, at each context
length, the KV MiB held by all sequences (blocks x bytes per block: K and V of every layer) and per sequence,
windowed vs full, the bound `BlockManager.max_blocks_held` promises, and the sequences a 1 GiB pool (the default
`kv_cache_memory`) could hold at that length. The windowed engine frees every block that lies before the window of
each sequence's next query (inference/block_manager.py), so its KV stays flat past the window while the full one
grows linearly. Decode steps per second of each run are reported as a side figure (noisy shared machine).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import Report, set_threads

MiB = 2**20


def build_checkpoints(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    """{"windowed": dir, "full": dir}: one seeded random MistralForCausalLM saved with and without its window."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=512, hidden_size=args.d_model, intermediate_size=2 * args.d_model,
                           num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                           max_position_embeddings=args.context + 64, sliding_window=args.window)
    model = MistralForCausalLM(config).eval()
    dirs = {}
    for name, window in (("windowed", args.window), ("full", None)):
        model.config.sliding_window = window
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
    return dirs


def run_engine(path: Path, args: argparse.Namespace) -> dict:
    """Generate `args.seqs` sequences to `args.context` tokens; per step the context length and blocks held."""
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from scratchlm.inference.kv_cache import bytes_per_block_spec
    from scratchlm.model import load

    loaded = load(path)
    per_seq = -(-(args.context + 2) // args.block_size)
    block_bytes = bytes_per_block_spec(loaded.config.kv_spec(), args.block_size, torch.float32)
    config = EngineConfig(block_size=args.block_size, kv_cache_memory=(args.seqs * per_seq + 2) * block_bytes,
                          max_num_seqs=args.seqs, max_num_batched_tokens=args.chunk, max_model_len=args.context + 2)
    engine = LLMEngine(loaded.model, None, loaded.config, config)
    bm = engine.block_manager
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.0, max_tokens=args.context + 2 - args.prompt, ignore_eos=True)
    for i in range(args.seqs):
        engine.add_request(str(i), torch.randint(0, 512, (args.prompt,), generator=gen).tolist(), params)
    trace: list[tuple[int, int]] = []  # (shortest running context, blocks held)
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        running = engine.scheduler.running
        if len(running) == args.seqs:
            trace.append((min(s.num_computed_tokens for s in running), bm.num_usable_blocks - bm.num_free_blocks))
    wall = time.perf_counter() - t0
    return {"trace": trace, "block_bytes": block_bytes, "window": bm.window, "steps_per_s": steps / wall,
            "bound": bm.max_blocks_held(args.context, args.chunk), "dropped": bm.num_dropped,
            "usable": bm.num_usable_blocks}


def held_at(trace: list[tuple[int, int]], context: int) -> int:
    """Blocks held after the step where the shortest sequence reached `context` computed tokens (else the first
    step past it)."""
    at = [b for c, b in trace if c == context] or [b for c, b in trace if c >= context][:1]
    return max(at)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096, help="tokens per sequence at the end")
    ap.add_argument("--window", type=int, default=256, help="the sliding window of every layer")
    ap.add_argument("--seqs", type=int, default=4, help="sequences generated together")
    ap.add_argument("--prompt", type=int, default=32, help="random prompt tokens per sequence")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="kv_window", help="report name (results/<date>-<name>.md)")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    report = Report(args.name, "KV memory held vs context length: sliding window vs full attention",
                    argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        dirs = build_checkpoints(Path(tmp), args)
        runs = {name: run_engine(path, args) for name, path in dirs.items()}
    win, full = runs["windowed"], runs["full"]
    bb = win["block_bytes"]
    assert win["window"] == args.window and full["window"] is None
    points = [c for c in (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384) if args.prompt < c < args.context]
    points.append(args.context)  # sequences run to context + 2 tokens: a step before the last computes `context`
    rows = []
    for c in points:
        w, f = held_at(win["trace"], c), held_at(full["trace"], c)
        per_seq_w, per_seq_f = w / args.seqs, f / args.seqs
        rows.append([c, f"{w * bb / MiB:.2f}", f"{f * bb / MiB:.2f}", f"{f / w:.1f}x", f"{per_seq_w:.1f}",
                     f"{per_seq_f:.1f}", int((1 << 30) // (max(per_seq_w, 1) * bb)),
                     int((1 << 30) // (max(per_seq_f, 1) * bb))])
    report.add(f"Model: Mistral-shaped, {args.layers} layers, d_model {args.d_model}, 8 query / 4 KV heads of "
               f"{args.d_model // 8} dims, float32 KV: {bb} bytes per block of {args.block_size} tokens "
               f"({bb // args.block_size} per token). {args.seqs} sequences decoded together from {args.prompt}-token "
               f"prompts to {args.context} tokens, chunked prefill of {args.chunk}; window {args.window} on every "
               "layer vs none (same weights).")
    report.table(["context (tokens)", "KV MiB held, windowed", "KV MiB held, full", "full / windowed",
                  "blocks / seq, windowed", "blocks / seq, full", "seqs in 1 GiB, windowed", "seqs in 1 GiB, full"],
                 rows, caption="KV held by all sequences after the step that computed `context` tokens of each")
    report.add(f"- Bound per sequence (`max_blocks_held`, window {args.window} + a chunk of {args.chunk}, blocks of "
               f"{args.block_size}): {win['bound']} blocks; decoding needs ceil((window - 1) / block) + 1 = "
               f"{-(-(args.window - 1) // args.block_size) + 1}.\n"
               f"- Blocks freed by the window over the run: {win['dropped']}; the full run frees none until a "
               "sequence finishes.\n"
               f"- Decode steps per second (side figure, whole run incl. prefill): windowed "
               f"{win['steps_per_s']:.1f}, full {full['steps_per_s']:.1f} (the kernels skip the blocks before a "
               "window, so windowed attention reads at most the window).")
    report.write()


if __name__ == "__main__":
    main()
