"""Rounding x to int8 in the quantized kernels: fused-vs-unfused greedy agreement and ΔPPL, integer x vs float x.

    python -m benchmarks.quant_rounding [--tokens 24] [--windows 4] [--threads 1]

SmolLM2-135M (the default GGUF) as the packed GGUF model (Q4_1 linears, Q8_0 head) and as per-channel int8,
each with the default kernels (the 8-row integer kernels that round x to int8 per 32-block, where they are the
default on this CPU) and with float activations (`float_activations(True)`), in the same run:

1. **Greedy agreement**: the 5 shared prompts batched, `--tokens` greedy tokens through the engine with the
   fused C++ step and with it off (`runner.fused_decoder = None`), the unfused path either as the engine runs
   it (the fused step's row ops and per-row paged attention, `inference/engine_ops.py`) or as before
   (the model's torch layers, SDPA prefill). Reported: prompts identical, the first divergent token of the others.
2. **ΔPPL**: WikiText-2 test windows of `--window` tokens, every quantized linear (the head too) called on at
   most 64 rows at a time, i.e. what decode and chunked prefill run (above 64 rows the kernels dequantize the
   weight and x stays float, so a plain full-window forward would not exercise the rounding); against the fp32
   reference (the GGUF's values dequantized), the integer kernels against float activations.

3. **Speed** (`--rounds`, 0: skip): batch-1 decode tok/s (`--decode-tokens` steps after a 16-token prompt) and the
   throughput of 8 requests x 32 greedy tokens submitted together, each engine with the default kernels and
   with float activations, interleaved round by round; the ratio integer / float. Against llama.cpp:
   `benchmarks.llamacpp_decode`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from collections.abc import Iterator

import torch

from benchmarks.common import (
    Report,
    engine_batch_tok_s,
    engine_decode_tok_s,
    set_threads,
    shared_data_dir,
    tinystories_prompts,
)

SHARED_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
                  "List three colors:", "The three laws of thermodynamics are"]
ROWS = 64  # the kernels' largest row count (qlinear.h kMaxRows); above it x stays float


@contextlib.contextmanager
def torch_row_ops() -> Iterator[None]:
    """The unfused path as it was before engine_ops.py: the model's torch layers and SDPA prefill attention."""
    from scratchlm.inference import runner
    from scratchlm.inference.attention import PagedAttention

    saved = runner.use_engine_ops, runner.RowPagedAttention
    runner.use_engine_ops = lambda model: 0
    runner.RowPagedAttention = lambda cache, meta, tables, lens: PagedAttention(cache, meta)
    try:
        yield
    finally:
        runner.use_engine_ops, runner.RowPagedAttention = saved


@contextlib.contextmanager
def float_x(enabled: bool) -> Iterator[None]:
    from scratchlm.inference.quantization import kernels

    previous = kernels.float_activations()
    kernels.float_activations(enabled)
    try:
        yield
    finally:
        kernels.float_activations(previous)


@contextlib.contextmanager
def rows_at_most(n: int) -> Iterator[None]:
    """Every QuantLinear called on at most `n` rows at a time (each row's result is independent of the others)."""
    from scratchlm.inference.quantization.modules import QuantLinear

    forward = QuantLinear.forward

    def chunked(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (M, K)
        y = torch.cat([forward(self, flat[i:i + n]) for i in range(0, flat.shape[0], n)])  # (M, N)
        return y.view(*x.shape[:-1], y.shape[-1])

    QuantLinear.forward = chunked
    try:
        yield
    finally:
        QuantLinear.forward = forward


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def greedy_agreement(path, scheme: str, tokens: int, old_unfused: bool) -> list[int | None]:
    """First divergent token per shared prompt, fused vs unfused (None: identical)."""
    from scratchlm.inference import LLM, SamplingParams

    with torch_row_ops() if old_unfused else contextlib.nullcontext():
        llm = LLM(path, quantization=scheme, block_size=8, max_num_batched_tokens=64)
        runner = llm.engine.runner
        fused = runner.fused_decoder
        if fused is None:
            raise SystemExit(f"{scheme}: the fused step did not build here; nothing to compare")
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        outs = []
        for decoder in (fused, None):
            runner.fused_decoder = decoder
            outs.append([o.outputs[0].token_ids for o in llm.generate(SHARED_PROMPTS, params, use_tqdm=False)])
    return [first_divergence(a, b) for a, b in zip(*outs)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt (default 24)")
    parser.add_argument("--windows", type=int, default=4, help="WikiText-2 windows for ΔPPL (default 4; 0: skip)")
    parser.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved speed rounds (default 3; 0: skip)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="timed batch-1 decode steps (default 64)")
    parser.add_argument("--name", default="quant_rounding", help="results file name")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.windows < 0 or args.window < 2 or args.rounds < 0 or args.decode_tokens < 1:
        parser.error("--tokens and --decode-tokens must be >= 1, --windows and --rounds >= 0, --window >= 2")
    set_threads(args.threads)
    from scratchlm.defaults import default_model_path
    from scratchlm.inference.cpp_extensions import load_engine_kernels
    from scratchlm.inference.quantization import load_gguf_packed, quantize_model
    from scratchlm.model import load

    ext = load_engine_kernels()
    if ext is None:
        raise SystemExit("the engine's C++ kernels did not build: there are no integer kernels to measure")
    path = default_model_path()
    ref = load(path)
    models = {"gguf": load_gguf_packed(path).model, "int8": quantize_model(ref.model, "int8")}
    paths = {}
    for scheme, model in models.items():  # the code path each weight kind takes at 1 and 8 rows, default kernels
        with float_x(False):
            lin = model.layers[0].ffn.w1
            ts = [lin.qweight, lin.scales] + ([] if lin.mins is None else [lin.mins])
            paths[scheme] = [ext.quant_resolved_path(ts, lin.group_size, lin.d_in, m, -1) for m in (1, 8)]

    report = Report(args.name, "Rounding x to int8: fused-vs-unfused greedy agreement and ΔPPL on SmolLM2-135M",
                    argv if argv is not None else sys.argv[1:])
    report.add(f"Model: {path.name}. Kernel paths of a layer-0 gate weight with the default kernels at 1 / 8 "
               f"rows: gguf (Q4_1) {paths['gguf']}, int8 {paths['int8']} (quant_gemm.h: 6 = 8-row VNNI integer, "
               f"7 = 8-row maddubs integer, 3 / 4 = float FMA, x in float32).")

    rows = []
    t0 = time.perf_counter()
    for scheme in models:
        for float_act in (False, True):
            for old in (True, False):
                with float_x(float_act):
                    div = greedy_agreement(path, scheme, args.tokens, old)
                same = sum(d is None for d in div)
                rows.append([scheme, "float" if float_act else "default (see paths)",
                             "torch layers, SDPA prefill (before)" if old else "fused step's row ops (engine_ops)",
                             f"**{same}/{len(div)}**", ", ".join("=" if d is None else str(d) for d in div)])
                print(rows[-1], flush=True)
    report.table(["model", "x in the kernels", "unfused path", "prompts identical", "first divergent token"],
                 rows, caption=f"Greedy ids, fused vs unfused: {len(SHARED_PROMPTS)} shared prompts batched, "
                               f"{args.tokens} tokens, blocks of 8, 64-token prefill chunks "
                               f"({time.perf_counter() - t0:.0f} s)")
    report.add("Prompts: " + "; ".join(repr(p) for p in SHARED_PROMPTS) + ".")

    if args.windows:
        text = (shared_data_dir() / "corpora" / "wikitext2" / "test.txt").read_text(encoding="utf-8")
        need = args.windows * args.window
        ids: list[int] = []
        pos = 0
        while len(ids) < need and pos < len(text):
            ids += ref.tokenizer.encode(text[pos:pos + 20_000])
            pos += 20_000
        windows = torch.tensor(ids[:need]).view(args.windows, args.window)  # (W, T)
        nll: dict[str, float] = {}
        n = args.windows * (args.window - 1)
        t0 = time.perf_counter()
        with torch.inference_mode(), rows_at_most(ROWS):
            for name, model, float_act in [("fp32", ref.model, True)] + [
                    (f"{s} {'float x' if f else 'default kernels'}", m, f) for s, m in models.items()
                    for f in (False, True)]:
                with float_x(float_act):
                    total = 0.0
                    for w in range(args.windows):
                        tokens = windows[w:w + 1]  # (1, T)
                        logp = torch.log_softmax(model(tokens)[0, :-1].float(), dim=-1)  # (T-1, V)
                        total += float(-logp.gather(1, tokens[0, 1:, None]).sum())
                nll[name] = total
                print(name, math.exp(total / n), flush=True)
        base = math.exp(nll["fp32"] / n)
        ppl_rows = []
        for name, total in nll.items():
            ppl = math.exp(total / n)
            scheme = name.split()[0]
            vs_float = ""
            if name.endswith("default kernels"):
                vs_float = f"{100 * (ppl / math.exp(nll[scheme + ' float x'] / n) - 1):+.3f}%"
            ppl_rows.append([name, f"{ppl:.4f}", f"{100 * (ppl / base - 1):+.3f}%", vs_float])
        report.table(["model", "PPL", "ΔPPL vs fp32", "ΔPPL vs float x"], ppl_rows,
                     caption=f"WikiText-2 test, {args.windows} windows of {args.window} tokens ({n} predicted), "
                             f"every quantized linear on at most {ROWS} rows per call "
                             f"({time.perf_counter() - t0:.0f} s)")
    if args.rounds:
        report.table(["model", "batch-1 tok/s default", "float x", "ratio", "8 x 32 tok/s default", "float x",
                      "ratio"], speed_rows(models, ref, args.rounds, args.decode_tokens),
                     caption=f"Decode speed, default kernels vs float activations, {args.rounds} interleaved rounds "
                             f"(medians), {args.threads} thread(s)")
    report.write()
    return 0


def speed_rows(models: dict, ref, rounds: int, tokens: int) -> list[list[str]]:
    """Batch-1 decode and 8-request throughput per model, default kernels vs float activations, interleaved."""
    import statistics

    from scratchlm.inference import EngineConfig, LLMEngine

    engines = {name: LLMEngine(m, ref.tokenizer, ref.config, EngineConfig(max_num_seqs=8, kv_cache_memory=64 << 20))
               for name, m in models.items()}
    prompts = tinystories_prompts()
    counter = iter(range(10**9))

    def decode(engine) -> float:
        return engine_decode_tok_s(engine, list(range(100, 116)), tokens + 1, str(next(counter)))

    def batch(engine) -> float:
        return engine_batch_tok_s(engine, prompts, 32, [str(next(counter)) for _ in prompts])

    results = {(n, f, k): [] for n in engines for f in (False, True) for k in ("b1", "b8")}
    for r in range(rounds + 1):  # round 0 warms up
        for name, engine in engines.items():
            for float_act in (False, True):
                with float_x(float_act):
                    b1, b8 = decode(engine), batch(engine)
                if r:
                    results[name, float_act, "b1"].append(b1)
                    results[name, float_act, "b8"].append(b8)
        print(f"speed round {r}/{rounds}", flush=True)
    rows = []
    for name in engines:
        med = {key: statistics.median(results[(name, *key)]) for key in [(f, k) for f in (False, True)
                                                                          for k in ("b1", "b8")]}
        rows.append([name, f"{med[False, 'b1']:.1f}", f"{med[True, 'b1']:.1f}",
                     f"**{med[False, 'b1'] / med[True, 'b1']:.2f}x**", f"{med[False, 'b8']:.1f}",
                     f"{med[True, 'b8']:.1f}", f"**{med[False, 'b8'] / med[True, 'b8']:.2f}x**"])
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
