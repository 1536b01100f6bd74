"""KV cache dtype on SmolLM2-135M: fidelity, bytes, decode-attention speed and end-to-end decode at long context.

    python -m benchmarks.kv_cache [--windows 8] [--threads 1] [--repeats 7] [--quick]

Every figure compares the KV dtypes float32 (the peer: what the engine stored before), bfloat16, float16 and
int8 (one float32 scale per token and KV head, inference/kv_cache.py) in one run, interleaved.

1. Fidelity: WikiText-2 test, the first `--windows` non-overlapping windows of 512 tokens (the windows of
   benchmarks/quant_fidelity.py, same rule: tokenized in 20k-character pieces from the start of test.txt), each
   window prefilled through the engine's runner (the fused C++ step: every row attends to the K/V as stored in
   the cache, exactly as decode reads them). Perplexity, ΔPPL, KL(fp32 KV ‖ dtype) and top-1 agreement per token.
   Weights: the default GGUF dequantized to fp32 (quant_fidelity's reference).
2. Greedy agreement with fp32 KV through `LLM` on the shared prompts (tests/inference/test_oracles.py's four),
   `--greedy-tokens` each: tokens until the first difference and the fraction of positions equal.
3. KV bytes per token (all layers, K and V, scales included), and blocks in the same kv_cache_memory.
4. Decode attention alone (the C++ paged kernel, SmolLM2's 9 query / 3 KV heads of 64 dims) at 2k and 4k tokens
   of context, batch 1 and 8: one timed call runs the kernel over as many layers of cache as make >= 192 MB of
   float32 K/V (6x the 32 MB L3), so every read comes from DRAM; a plain streaming read (torch.sum) of a float32
   buffer of that size is timed in the same interleaved loop: the streaming-read roofline of this run.
5. End-to-end decode steps (the whole fused C++ step: weights + attention) at `--e2e-context` tokens of
   context, batch 1 and 4 (`--e2e-batches`): tok/s per dtype.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time

import torch

from benchmarks.common import Report, compare, set_threads, shared_data_dir
from benchmarks.quant_fidelity import add_window

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot", "List three colors:"]
MB = 1e6


def wikitext_windows(tokenizer, windows: int, window: int) -> torch.Tensor:
    """(windows, window) token ids from the start of WikiText-2 test (quant_fidelity.py's rule)."""
    text = (shared_data_dir() / "corpora" / "wikitext2" / "test.txt").read_text(encoding="utf-8")
    need = windows * window
    ids: list[int] = []
    pos = 0
    while len(ids) < need and pos < len(text):
        ids += tokenizer.encode(text[pos:pos + 20_000])
        pos += 20_000
    if len(ids) < need:
        raise SystemExit(f"the corpus has only {len(ids)} tokens, fewer than {need}")
    return torch.tensor(ids[:need]).view(windows, window)


def _prefill_input(tokens: list[int], table: list[int], block_size: int, logits_all: bool):
    from scratchlm.inference.runner import ModelInput

    n = len(tokens)
    slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
    return ModelInput(tokens, list(range(n)), slots, 0, [], [], [(0, n, n, table)],
                      list(range(n)) if logits_all else [n - 1])


def fidelity(model, windows: torch.Tensor, block_size: int = 16) -> dict[str, dict[str, float]]:
    """NLL / KL / top-1 of every KV dtype on the same windows, through ModelRunner (fused C++ prefill)."""
    from scratchlm.inference.kv_cache import KVCache
    from scratchlm.inference.runner import ModelRunner

    c = model.config
    n_blocks = -(-windows.shape[1] // block_size)
    runners = {}
    for name, dtype in KV_DTYPES.items():
        cache = KVCache.allocate(c.n_layers, n_blocks, block_size, c.n_kv_heads, c.head_dim, dtype, "cpu")
        runners[name] = ModelRunner(model, cache)
    paths = {name: "fused C++ step" if r._runs_fused(_prefill_input(windows[0].tolist(), list(range(n_blocks)),
                                                                     block_size, True)) else "torch ops"
             for name, r in runners.items()}
    stats = {name: {"nll": 0.0, "kl": 0.0, "top1": 0.0, "n": 0, "path": paths[name]} for name in KV_DTYPES}
    for w in range(windows.shape[0]):
        toks = windows[w].tolist()
        targets = windows[w, 1:]
        inp = _prefill_input(toks, list(range(n_blocks)), block_size, True)
        ref = None
        for name, runner in runners.items():
            logp = torch.log_softmax(runner.execute(inp)[:-1].float(), dim=-1)  # (T-1, V)
            if ref is None:
                ref = logp
            add_window(stats[name], logp, ref, targets)
        print(f"  window {w + 1}/{windows.shape[0]}", file=sys.stderr, flush=True)
    return stats


def greedy_agreement(n_tokens: int) -> dict[str, tuple[list[int], float]]:
    """Per KV dtype: tokens until the first difference from fp32 KV on each prompt, and the equal fraction."""
    from scratchlm.inference import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    outs = {}
    for name in KV_DTYPES:
        llm = LLM(None, kv_cache_memory=64 << 20, kv_cache_dtype=name, threads=torch.get_num_threads())
        outs[name] = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params, use_tqdm=False)]
        del llm
        gc.collect()
    res = {}
    for name, got in outs.items():
        firsts = []
        equal = 0
        for a, b in zip(outs["float32"], got, strict=True):
            n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            firsts.append(n)
            equal += sum(x == y for x, y in zip(a, b, strict=True))
        res[name] = (firsts, equal / sum(len(a) for a in outs["float32"]))
    return res


def attention_speed(c, contexts: list[int], batches: list[int], repeats: int, clock: str, block_size: int = 16,
                    min_bytes: float = 192 * MB):
    """Per (batch, context): the interleaved Comparison of the kernel over L layers per dtype + a streaming read,
    and the bytes each contender reads."""
    from scratchlm.inference.attention import load_kernels
    from scratchlm.inference.kv_cache import KVCache, bytes_per_token_head

    ext = load_kernels()
    if ext is None:
        raise SystemExit("the C++ kernels did not build: no decode-attention figures")
    out = []
    for batch in batches:
        for ctx in contexts:
            per_layer_fp32 = 2 * batch * ctx * c.n_kv_heads * c.head_dim * 4
            layers = max(1, min(c.n_layers, math.ceil(min_bytes / per_layer_fp32)))
            blocks_per_seq = -(-ctx // block_size)
            nb = batch * blocks_per_seq
            tables = torch.randperm(nb).view(batch, blocks_per_seq)  # scattered blocks, as after churn
            lens = torch.full((batch,), ctx, dtype=torch.long)
            g = torch.Generator().manual_seed(0)
            q = torch.randn(batch, c.n_heads, c.head_dim, generator=g)
            caches, fns, nbytes = {}, {}, {}
            for name, dtype in KV_DTYPES.items():
                cache = KVCache.allocate(layers, nb, block_size, c.n_kv_heads, c.head_dim, dtype, "cpu")
                slots = torch.arange(nb * block_size)
                for layer in range(layers):  # SmolLM2-like magnitudes do not matter for speed: random K/V
                    cache.write(layer, slots, torch.randn(nb * block_size, c.n_kv_heads, c.head_dim, generator=g),
                                torch.randn(nb * block_size, c.n_kv_heads, c.head_dim, generator=g))
                caches[name] = cache

                def run(cache=cache, layers=layers, q=q, tables=tables, lens=lens):
                    for layer in range(layers):
                        scales = (cache.k_scale[layer], cache.v_scale[layer]) if cache.quantized else (None, None)
                        ext.paged_decode_attention(q, cache.k[layer], cache.v[layer], tables, lens,
                                                   c.head_dim ** -0.5, True, *scales)
                fns[name] = run
                nbytes[name] = 2 * layers * batch * ctx * c.n_kv_heads * bytes_per_token_head(c.head_dim, dtype)
            buf = torch.randn(int(per_layer_fp32 * layers // 4))
            fns["stream read (torch.sum)"] = buf.sum
            nbytes["stream read (torch.sum)"] = buf.numel() * 4
            print(f"attention: batch {batch}, context {ctx}, {layers} layers", file=sys.stderr, flush=True)
            res = compare(fns, warmup=1, repeats=repeats, clock=clock)
            out.append((batch, ctx, layers, res, nbytes))
            del caches, fns, buf
            gc.collect()
    return out


def e2e_decode(model, context: int, batches: list[int], repeats: int, steps: int, clock: str, block_size: int = 16):
    """Decode-step tok/s of the whole fused step per dtype at `context` tokens of context: the context is a real
    WikiText prefill (fp32 KV), copied into every sequence of every dtype's cache (rounded / quantized)."""
    from scratchlm.inference.kv_cache import KVCache
    from scratchlm.inference.runner import ModelInput, ModelRunner

    c = model.config
    tok_ids = wikitext_windows(model_tokenizer, 1, context)[0].tolist()
    per_seq = -(-(context + 1) // block_size)
    src = KVCache.allocate(c.n_layers, per_seq, block_size, c.n_kv_heads, c.head_dim, torch.float32, "cpu")
    ModelRunner(model, src).execute(_prefill_input(tok_ids, list(range(per_seq)), block_size, False))
    out = {}
    for batch in batches:
        fns = {}
        runners = {}
        for name, dtype in KV_DTYPES.items():
            cache = KVCache.allocate(c.n_layers, batch * per_seq, block_size, c.n_kv_heads, c.head_dim, dtype, "cpu")
            slots = torch.arange(per_seq * block_size)
            for b in range(batch):
                for layer in range(c.n_layers):
                    k = src.k[layer].reshape(-1, c.n_kv_heads, c.head_dim)
                    v = src.v[layer].reshape(-1, c.n_kv_heads, c.head_dim)
                    cache.write(layer, slots + b * per_seq * block_size, k, v)
            runner = ModelRunner(model, cache)
            assert runner.fused_decoder is not None, "the fused C++ step is not available"
            tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
            inp = ModelInput([tok_ids[-1]] * batch, [context] * batch,
                             [t[context // block_size] * block_size + context % block_size for t in tables], batch,
                             tables, [context + 1] * batch, [], list(range(batch)))

            def run(runner=runner, inp=inp):
                for _ in range(steps):
                    runner.execute(inp)
            fns[name] = run
            runners[name] = runner
        print(f"e2e decode: batch {batch}, context {context}", file=sys.stderr, flush=True)
        out[batch] = compare(fns, warmup=1, repeats=repeats, clock=clock)
        del fns, runners
        gc.collect()
    return out


model_tokenizer = None


def main(argv: list[str] | None = None) -> int:
    global model_tokenizer
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=8, help="WikiText-2 windows of 512 tokens for ΔPPL")
    ap.add_argument("--greedy-tokens", type=int, default=64, help="greedy tokens per shared prompt")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (pinned)")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved timing repeats")
    ap.add_argument("--contexts", default="2048,4096", help="contexts of the decode-attention timing")
    ap.add_argument("--batches", default="1,8", help="batch sizes of the decode timings")
    ap.add_argument("--e2e-context", type=int, default=2048, help="context of the end-to-end decode timing")
    ap.add_argument("--e2e-steps", type=int, default=4, help="decode steps per end-to-end timing")
    ap.add_argument("--e2e-batches", default="1,4",
                    help="batch sizes of the end-to-end timing (all four dtypes' caches are held at once: batch 4 at "
                         "2k context is 0.7 GB of KV next to the 0.5 GB fp32 model)")
    ap.add_argument("--clock", default="thread_cpu", choices=["thread_cpu", "wall"],
                    help="timing clock: thread_cpu (default: this thread's CPU time; with one torch thread every "
                         "kernel "
                         "runs in it, and time spent descheduled on a loaded machine is not counted) or wall")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 window, 8 greedy tokens, 512 context, 2 repeats")
    ap.add_argument("--name", default="kv_cache", help="results file name (benchmarks/results/DATE-NAME.md)")
    args = ap.parse_args(argv)
    if args.quick:
        args.windows, args.greedy_tokens, args.repeats, args.contexts, args.e2e_context = 1, 8, 2, "512", 512
        args.e2e_steps = 1
    set_threads(args.threads)
    from scratchlm.defaults import default_model_path
    from scratchlm.inference.fast_linear import use_skinny_linears
    from scratchlm.inference.kv_cache import bytes_per_block, num_blocks_for_budget
    from scratchlm.model import load

    path = default_model_path()
    loaded = load(path)
    model, c = loaded.model.eval(), loaded.config
    model_tokenizer = loaded.tokenizer
    use_skinny_linears(model)
    report = Report(args.name, "KV cache dtype on SmolLM2-135M: fidelity, bytes, decode attention speed",
                    argv if argv is not None else sys.argv[1:])
    report.add(f"Model: {path.name} (weights dequantized to fp32), {c.n_layers} layers, {c.n_heads} query / "
               f"{c.n_kv_heads} KV heads of {c.head_dim} dims; {args.threads} torch thread(s). KV dtypes: float32 "
               "(the reference and the peer: the engine's cache before `--kv-cache-dtype`), bfloat16, float16, "
               "int8 (symmetric, one float32 scale per token and KV head). Timings interleaved (A B C D ...), "
               f"{args.repeats} repeats after a warm-up, on the {args.clock} clock; ratios are medians.")

    # 3. bytes (cheap, first)
    rows = []
    fp32_bpt = bytes_per_block(c.n_layers, c.n_kv_heads, c.head_dim, 16, torch.float32) / 16
    for name, dtype in KV_DTYPES.items():
        bpt = bytes_per_block(c.n_layers, c.n_kv_heads, c.head_dim, 16, dtype) / 16
        blocks = num_blocks_for_budget(1 << 30, c.n_layers, c.n_kv_heads, c.head_dim, 16, dtype)
        rows.append([name, f"{bpt:,.0f}", f"{bpt / fp32_bpt:.3f}", f"{blocks * 16:,}"])
    report.table(["KV dtype", "bytes / token (all layers, K+V, scales)", "÷ float32", "tokens in 1 GiB"], rows,
                 caption="KV bytes per token")

    # 1. fidelity
    t0 = time.perf_counter()
    windows = wikitext_windows(loaded.tokenizer, args.windows, 512)
    with torch.inference_mode():
        stats = fidelity(model, windows)
    base = math.exp(stats["float32"]["nll"] / stats["float32"]["n"])
    rows = []
    for name, s in stats.items():
        ppl = math.exp(s["nll"] / s["n"])
        rows.append([name, f"{ppl:.4f}", f"{100 * (ppl / base - 1):+.3f}%", f"{s['kl'] / s['n']:.2e}",
                     f"{100 * s['top1'] / s['n']:.2f}%", s["path"]])
    report.table(["KV dtype", "PPL", "ΔPPL vs fp32 KV", "KL(fp32 KV ‖ dtype) / token", "top-1 = fp32 KV", "path"],
                 rows, caption=f"WikiText-2 test, {args.windows} windows of 512 tokens ({stats['float32']['n']} "
                               f"predicted tokens; {time.perf_counter() - t0:.0f} s)")

    # 2. greedy agreement
    agree = greedy_agreement(args.greedy_tokens)
    report.table(["KV dtype", "tokens until the first difference (per prompt)", "positions equal"],
                 [[n, " / ".join(map(str, f)), f"{100 * e:.1f}%"] for n, (f, e) in agree.items()],
                 caption=f"Greedy agreement with fp32 KV, SmolLM2 through `LLM`, {args.greedy_tokens} tokens on each "
                         f"of the {len(PROMPTS)} shared prompts ({', '.join(repr(p) for p in PROMPTS)})")

    # 4. decode attention
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    rows = []
    for batch, ctx, layers, res, nbytes in attention_speed(c, contexts, batches, args.repeats, args.clock):
        stream = res["stream read (torch.sum)"].median
        stream_gbps = nbytes["stream read (torch.sum)"] / stream / 1e9
        for t in res.timings:
            gbps = nbytes[t.name] / t.median / 1e9
            is_kv = t.name in KV_DTYPES
            rows.append([batch, ctx, layers, t.name, f"{t.median * 1e3 / (layers if is_kv else 1):.3f}"
                         + ("" if is_kv else " (whole buffer)"), f"{nbytes[t.name] / MB:.1f}", f"{gbps:.1f}",
                         f"{100 * gbps / stream_gbps:.0f}%",
                         f"{res.ratio(t.name, 'float32'):.3f}" if is_kv else ""])
    report.table(["batch", "context", "layers / call", "contender", "ms per layer (median)", "MB read per call",
                  "GB/s", "of stream read", "time ÷ float32"], rows,
                 caption="Decode attention alone (C++ paged kernel), one call = the kernel over `layers` layers "
                         "(>= 192 MB of fp32 K/V), scattered blocks; the stream read is torch.sum over a float32 "
                         "buffer of the fp32 working set's size, in the same interleaved loop")

    # 5. end-to-end decode
    with torch.inference_mode():
        e2e = e2e_decode(model, args.e2e_context, [int(x) for x in args.e2e_batches.split(",")], args.repeats,
                         args.e2e_steps, args.clock)
    rows = []
    for batch, res in e2e.items():
        for t in res.timings:
            rows.append([batch, t.name, f"{t.median / args.e2e_steps * 1e3:.1f}",
                         f"{batch * args.e2e_steps / t.median:.2f}", f"{res.ratio('float32', t.name):.3f}"])
    report.table(["batch", "KV dtype", "ms / decode step (median)", "tok/s", "speed-up vs float32"], rows,
                 caption=f"End-to-end decode steps (fused C++ step, fp32 weights) at {args.e2e_context} tokens of "
                         f"context (a WikiText-2 prefill copied into every sequence), {args.e2e_steps} steps per "
                         "timing")
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
