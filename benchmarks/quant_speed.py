"""Decode speed of quantized SmolLM2-135M through `LLMEngine`: batch-1 tok/s, achieved GB/s, and throughput.

    python -m benchmarks.quant_speed [--threads 1] [--rounds 5] [--tokens 32]

All variants are built once and measured interleaved (fp32, bf16, int8, int4, ... then again), in
the same run, with an explicit torch thread count. Batch-1 decode: one greedy request, the time of
the decode steps only (the prefill step is excluded), tok/s = decoded tokens / time. Achieved GB/s =
bytes of weights one decode step reads (every linear + the output head; the embedding table only
when it is the head) x tok/s. Throughput: 8 requests of ~48 prompt tokens x 32 greedy tokens,
submitted together (a smaller version of the engine's 32-request workload), output tok/s.
llama.cpp is the peer for int4 only if the `llama_cpp` package is importable (it is not installed here).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import sys
import time

import torch

from benchmarks.common import Report, set_threads, shared_data_dir

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def decode_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights read by one decode step (the embedding table counts only as the tied head)."""
    emb = model.tok_embeddings
    head = getattr(model, "output_head", None) or model.lm_head
    head_ptrs = set() if head is None else {t.data_ptr() for t in list(head.parameters()) + list(head.buffers())}
    skip = set() if head is None else {t.data_ptr() for t in list(emb.parameters()) + list(emb.buffers())}
    seen, total = skip - head_ptrs, 0  # a tied head (GGUF-packed) shares the embedding's tensors: count them
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _kernel_note(default_float: bool) -> str:
    """Which kernel family the quantized variants run by default (and `[float x]` rows, when measured)."""
    from scratchlm.inference.cpp_extensions import load_engine_kernels

    eng = load_engine_kernels()
    if eng is None:
        return ""
    vnni = eng.quant_best_path() == 2
    kind = ("float activations" if default_float else
            f"int4: int8 activations, 8-row {'VNNI' if vnni else 'AVX2'} kernels; int8: float activations")
    return f"; quantized matmuls by default: {kind}; `[float x]`: the float-activation kernels, same engine"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved repetitions per variant")
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per batch-1 measurement")
    parser.add_argument("--skip-throughput", action="store_true", help="only the batch-1 decode measurement")
    parser.add_argument("--float-activations-ab", action="store_true",
                        help="also measure every quantized variant with float activations (kernels."
                             "float_activations(True): the float kernels that were the default before the integer "
                             "8-row kernels), interleaved in the same rounds: the A/B of the two kernel families")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.rounds < 1 or args.tokens < 2:
        parser.error("--threads and --rounds must be >= 1, --tokens >= 2")
    set_threads(args.threads)
    from scratchlm.defaults import default_model_path
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from scratchlm.inference.quantization import kernels, load_gguf_packed, quantize_model
    from scratchlm.model import load

    if not kernels.extension_available():
        print("warning: C++ kernels unavailable, quantized variants use the pure-torch reference", file=sys.stderr)
    path = default_model_path()
    ref = load(path)
    tok, cfg = ref.tokenizer, ref.config
    models = {
        "fp32": (ref.model, "float32"),
        "bf16": (copy.deepcopy(ref.model), "bfloat16"),
        "int8": (quantize_model(ref.model, "int8"), "float32"),
        "int4-g32-sym": (quantize_model(ref.model, "int4-g32-sym"), "float32"),
        "int4-g32-asym": (quantize_model(ref.model, "int4-g32-asym"), "float32"),
        "gguf-packed (Q4_1 + Q8_0 head)": (load_gguf_packed(path).model, "float32"),
    }
    sizes = {name: decode_bytes(m) for name, (m, _) in models.items()}
    sizes["bf16"] = sizes["fp32"] // 2
    engines = {name: LLMEngine(m, tok, cfg, EngineConfig(max_num_seqs=8, kv_cache_memory=64 << 20, dtype=dt))
               for name, (m, dt) in models.items()}
    float_x = {name: False for name in engines}  # whether a contender runs with float activations
    default_float = kernels.float_activations()
    if args.float_activations_ab:
        for name in [n for n in engines if n not in ("fp32", "bf16")]:
            engines[f"{name} [float x]"] = engines[name]
            sizes[f"{name} [float x]"] = sizes[name]
            float_x[f"{name} [float x]"] = True
            float_x[name] = default_float

    def measure(fn, name: str) -> float:
        kernels.float_activations(float_x[name])
        try:
            return fn(engines[name])
        finally:
            kernels.float_activations(default_float)
    counter = iter(range(10**9))
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    def decode_tok_s(engine: LLMEngine) -> float:
        engine.add_request(str(next(counter)), PROMPT, greedy)
        engine.step()  # prefill + first token
        t0, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return steps / (time.perf_counter() - t0)

    stories = (shared_data_dir() / "corpora" / "tinystories" / "tinystories_v1_valid_head.txt").read_text()
    prompts = [" ".join(p.split()[:40]) for p in stories.split("\n\n")[:8]]
    batch_params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def throughput(engine: LLMEngine) -> float:
        t0 = time.perf_counter()
        for p in prompts:
            engine.add_request(str(next(counter)), p, batch_params)
        out = 0
        while engine.has_unfinished_requests():
            out += sum(1 for r in engine.step() if r.finished) * 32
        return out / (time.perf_counter() - t0)

    for name in engines:  # warm-up (first call builds caches / lazily loads the extension)
        measure(decode_tok_s, name)
    decode = {name: [] for name in engines}
    batch = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in engines:
            decode[name].append(measure(decode_tok_s, name))
        print(f"  round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in decode.items()),
              file=sys.stderr)
    if not args.skip_throughput:
        for r in range(max(1, args.rounds // 2)):
            for name in engines:
                batch[name].append(measure(throughput, name))
            print(f"  throughput round {r + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in batch.items()),
                  file=sys.stderr)

    base = statistics.median(decode["fp32"])
    rows = []
    targets = {"int8": 1.4, "int4-g32-sym": 1.8, "int4-g32-asym": 1.8}
    for name in engines:
        med = statistics.median(decode[name])
        ratio = med / base
        target = targets.get(name)
        verdict = "" if target is None else f"{'met' if ratio >= target else 'MISSED'} (≥ {target}x)"
        row = [name, f"{sizes[name] / 2**20:.0f}", f"{med:.1f}", f"{max(decode[name]):.1f}",
               f"{sizes[name] * med / 1e9:.2f}", f"{ratio:.2f}x", verdict]
        if batch[name]:
            tput = statistics.median(batch[name])
            row.append(f"{tput:.1f} ({tput / statistics.median(batch['fp32']):.2f}x)")
        rows.append(row)
    report = Report("quant_speed", "Quantized decode speed on SmolLM2-135M through LLMEngine", argv or sys.argv[1:])
    report.add(f"torch threads: {args.threads}; {args.rounds} interleaved rounds; batch-1: {args.tokens - 1} decode "
               f"steps after the prefill of a {len(tok.encode(PROMPT))}-token prompt; throughput: 8 requests "
               f"(first 40 words of 8 TinyStories) x 32 greedy tokens. C++ kernels: "
               f"{'yes (AVX2)' if kernels.extension_available() and kernels.load_extension().has_avx2() else 'no'}"
               f"{_kernel_note(default_float)}.")
    headers = ["variant", "MiB read / token", "tok/s (median)", "tok/s (best)", "GB/s (median)", "vs fp32",
               "target"] + (["throughput tok/s (vs fp32)"] if not args.skip_throughput else [])
    report.table(headers, rows)
    ab = []
    for name in [n for n in engines if float_x[n] and n.endswith(" [float x]")]:
        base_name = name.removesuffix(" [float x]")
        med = {n: statistics.median(decode[n]) for n in (base_name, name)}
        line = f"{base_name}: batch-1 {med[base_name] / med[name]:.2f}x"
        if batch[name]:
            tput = {n: statistics.median(batch[n]) for n in (base_name, name)}
            line += f", 8-request throughput {tput[base_name] / tput[name]:.2f}x"
        ab.append(line)
    if ab:
        report.add("Default kernels vs the float-activation kernels (same engine, interleaved):\n\n" +
                   "\n".join(f"- {line}" for line in ab))
    peer = importlib.util.find_spec("llama_cpp")
    report.add("llama.cpp peer: " + ("llama_cpp is importable but not wired into this benchmark yet" if peer else
                                     "not measured: the `llama_cpp` package is not installed on this machine "
                                     "(target int4 ≥ 0.7x llama.cpp stays open)"))
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
