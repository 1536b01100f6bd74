"""Decode speed of quantized SmolLM2-135M through `LLMEngine`: batch-1 tok/s, achieved GB/s, and throughput.

    python -m benchmarks.quant_speed [--threads 1] [--rounds 5] [--tokens 32]
    python -m benchmarks.quant_speed --prefill-kernels [--rounds 3] [--prefill-rows 65 128 256 512] [--no-head]
    python -m benchmarks.quant_speed --prefill [--rounds 3] [--prompt-lens 128 512] [--ppl-windows 4]
    python -m benchmarks.quant_speed --workload [--rounds 3] [--num-requests 32]

All variants are built once and measured interleaved (fp32, bf16, int8, int4, ... then again), in
the same run, with an explicit torch thread count. Batch-1 decode: one greedy request, the time of
the decode steps only (the prefill step is excluded), tok/s = decoded tokens / time. Achieved GB/s =
bytes of weights one decode step reads (every linear + the output head; the embedding table only
when it is the head) x tok/s. Throughput: 8 requests of ~48 prompt tokens x 32 greedy tokens,
submitted together (a smaller version of the engine's 32-request workload), output tok/s.
llama.cpp is the peer for int4 only if the `llama_cpp` package is importable (it is not installed here).

--prefill-kernels: the matmuls of a prefill chunk (more than 64 rows of x), per weight format (Q4_0, Q4_1, Q8_0,
int4-g128 sym / asym, per-channel int8) and SmolLM2 shape (a decoder layer's seven, and the head): the integer panel
kernels (quant_gemm.h paths 8 / 9, the default for int4) against the previous default (the weight dequantized to
float32 per call, then the fp32 GEMM), float x with FMA tiles, and the 8-row decode kernel; thread CPU time.
--prefill: prompt processing end to end through LLMEngine per format, integer against dequantize + fp32 prefill,
beside llama.cpp's prompt processing (llama-cpp-python in .peers) of the same ids on the same GGUF, and the ΔPPL
of the integer prefill on WikiText-2 windows.
--workload: the engine issue's 32-request offline workload with `--quantization gguf`, integer against dequantize
+ fp32 prefill (decode kernels unchanged), and fp32.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import (
    Report,
    engine_batch_tok_s,
    engine_decode_tok_s,
    set_threads,
    shared_data_dir,
    tinystories_prompts,
)

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
    int8 = "int8 activations, 8-row VNNI kernels (1 row: path 2)" if vnni else "float activations"
    kind = ("float activations" if default_float else
            f"int4: int8 activations, 8-row {'VNNI' if vnni else 'AVX2'} kernels; int8: {int8}; above 64 rows the "
            f"integer panel kernels where the decode kernel rounds x")
    return f"; quantized matmuls by default: {kind}; `[float x]`: the float-activation kernels, same engine"


# ----------------------------------------------------------------------------------------------- prefill kernels
PREFILL_SHAPES = [(576, 576, 2), (192, 576, 2), (1536, 576, 2), (576, 1536, 1)]  # (N, K, per layer): one layer
HEAD_SHAPE = (49152, 576)
PREFILL_FORMATS = {  # name: (scheme for reference.quantize_*, group or None)
    "Q4_0 (int4-g32-sym)": ("int4-sym", 32), "Q4_1 (int4-g32-asym)": ("int4-asym", 32),
    "int4-g128-sym": ("int4-sym", 128), "int4-g128-asym": ("int4-asym", 128),
    "Q8_0 (int8-g32)": ("int8", 32), "int8 (per channel)": ("int8", None),
}


def _prefill_weight(scheme: str, group: int | None, n: int, k: int, seed: int):
    """(tensors for quant_linear, group size) of a random (n, k) weight in one of the formats."""
    from scratchlm.inference.quantization import reference as ref

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    if scheme == "int8":
        q, s = ref.quantize_int8(w, group)
        return [q, s], group or k
    q, d, m = ref.quantize_int4(w, group, scheme == "int4-sym")
    return [q, d] + ([] if m is None else [m]), group


def prefill_kernels(args) -> Report:
    """The quantized matmuls of a prefill chunk (> 64 rows), every contender on the same weights and x, interleaved:
    thread CPU seconds, the minimum over rounds (see --prefill-kernels)."""
    from scratchlm.inference.cpp_extensions import load_engine_kernels

    eng = load_engine_kernels()
    if eng is None:
        raise SystemExit("the engine's C++ kernels could not be built")
    vnni = eng.quant_best_path() == 2
    # contender: path of quant_linear (0: the weight dequantized to float32 once per call, then oneDNN / MKL)
    contenders = {"dequant+fp32 GEMM": 0, "float x: FMA tiles": 3, "8-row int kernel": 6 if vnni else 7}
    contenders["panel int (VNNI)" if vnni else "panel int (AVX2)"] = 8 if vnni else 9
    if vnni:  # the AVX2 kernels too (what a CPU without VNNI runs), on the same machine
        contenders["8-row int kernel (AVX2)"] = 7
        contenders["panel int (AVX2)"] = 9
    shapes = PREFILL_SHAPES + ([(*HEAD_SHAPE, 1)] if args.head else [])
    weights = {(f, n, k): _prefill_weight(*PREFILL_FORMATS[f], n, k, seed=n + k)
               for f in PREFILL_FORMATS for n, k, _ in shapes}
    xs = {(m, k): torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) for m in args.prefill_rows
          for k in {k for _, k, _ in shapes}}
    times: dict[tuple, float] = {}  # (format, contender, rows, n, k) -> best thread seconds

    def run(f: str, c: str, m: int, n: int, k: int) -> None:
        tensors, g = weights[(f, n, k)]
        if c.endswith("(AVX2)") and f.startswith(("Q8", "int8")):
            return  # int8 has no AVX2 8-row or panel kernel (maddubs would saturate on x + 128)
        x = xs[(m, k)]
        t0 = time.thread_time()
        eng.quant_linear(x, tensors, g, contenders[c])
        dt = time.thread_time() - t0
        key = (f, c, m, n, k)
        times[key] = min(times.get(key, float("inf")), dt)

    for r in range(args.rounds + 1):  # round 0: warm-up, not kept
        for f in PREFILL_FORMATS:
            for m in args.prefill_rows:
                for n, k, _ in shapes:
                    for c in contenders:
                        run(f, c, m, n, k)
        if r == 0:
            times.clear()
        print(f"  prefill kernels: round {r}/{args.rounds}", file=sys.stderr)

    report = Report("quant_prefill_kernels", "Quantized prefill matmuls (> 64 rows): integer panels vs dequantize + "
                    "fp32 GEMM", argv_of(args))
    report.add(f"One thread, pinned to core {args.bind_core}; thread CPU time, minimum over {args.rounds} interleaved "
               f"rounds (a warm-up round not kept); x random (M, K), weights random N(0, 0.02) quantized with "
               f"`quantization.reference`. CPU paths: {'AVX512-VNNI' if vnni else 'AVX2'}. One decoder layer of "
               f"SmolLM2-135M = 2 x 576x576 (q, o) + 2 x 192x576 (k, v) + 2 x 1536x576 (gate, up) + 576x1536 "
               f"(down). Contenders (`quant_linear` paths): dequant+fp32 GEMM = path 0 above 64 rows, the previous "
               f"default (the weight dequantized to float32 once per call, then oneDNN / MKL); float x: FMA tiles = "
               f"path 3 (4-row tiles dequantized into L1, float x, FMA register tiles: the float-activation "
               f"alternative); 8-row int kernel = path {6 if vnni else 7} (the decode kernel, weight tiles "
               f"re-transposed per 8 x rows; path 7 is its AVX2 twin); panel int = paths 8 (VNNI) / 9 (AVX2): "
               f"the new prefill kernels.")
    names = list(contenders)
    best = "panel int (VNNI)" if vnni else "panel int (AVX2)"
    groups = (("one decoder layer (7 matmuls)", PREFILL_SHAPES), ("output head 49152x576", [(*HEAD_SHAPE, 1)]))
    for title, sel in groups:
        if sel[0] not in shapes:
            continue
        rows = []
        for f in PREFILL_FORMATS:
            for m in args.prefill_rows:
                tot = {}
                for c in names:
                    ks = [(f, c, m, n, k, cnt) for n, k, cnt in sel]
                    if all((f, c, m, n, k) in times for f, c, m, n, k, _ in ks):
                        tot[c] = sum(times[(f, c, m, n, k)] * cnt for f, c, m, n, k, cnt in ks)
                macs = sum(m * n * k * cnt for n, k, cnt in sel)
                avx2 = (f"{tot['dequant+fp32 GEMM'] / tot['panel int (AVX2)']:.2f}x"
                        if vnni and "panel int (AVX2)" in tot else "-")
                rows.append([f, str(m)] + [f"{tot[c] * 1e3:.2f}" if c in tot else "-" for c in names] +
                            [f"{macs / tot[best] / 1e9:.0f}", f"{tot['dequant+fp32 GEMM'] / tot[best]:.2f}x",
                             f"{tot['float x: FMA tiles'] / tot[best]:.2f}x"] + ([avx2] if vnni else []))
        report.add(f"### {title}: milliseconds per call")
        report.table(["format", "rows"] + [f"{c} ms" for c in names] +
                     [f"{best} GMAC/s", f"{best} vs dequant+fp32", f"{best} vs float x"] +
                     (["panel int (AVX2) vs dequant+fp32"] if vnni else []), rows)
    return report


def argv_of(args) -> list[str]:
    return list(getattr(args, "argv", None) or sys.argv[1:])


# ------------------------------------------------------------------------------------- prefill end to end, ΔPPL
PREFILL_WORKER = r'''
import json, sys, time
from llama_cpp import Llama
threads = int(sys.argv[3])
llm = Llama(model_path=sys.argv[1], n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512,
            n_ubatch=512, verbose=False)
print("READY", flush=True)
for line in sys.stdin:
    ids = json.loads(line)
    llm.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    llm.eval(ids)
    print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0}), flush=True)
'''


def _prefill_note() -> str:
    """Which formats take the integer prefill by default on this CPU (quant_linear's dispatch at 65 rows)."""
    from scratchlm.inference.cpp_extensions import load_engine_kernels

    eng = load_engine_kernels()
    takes = {f: eng.quant_resolved_path(*_prefill_weight(*PREFILL_FORMATS[f], 32, 576, 0), 576, 65, -1)
             for f in ("Q4_1 (int4-g32-asym)", "Q8_0 (int8-g32)", "int8 (per channel)")}
    ints = [f for f, p in takes.items() if p in (8, 9)]
    floats = [f for f, p in takes.items() if p not in (8, 9)]
    return (f"Default prefill kernels here: integer panels for {', '.join(ints) or 'none'}; dequantize + fp32 for "
            f"{', '.join(floats) or 'none'} (those rows run the same kernels in both columns).")


def prefill_e2e(args) -> Report:
    """Prompt processing through LLMEngine (one request, max_tokens 1: the prefill step and its first token) per
    format, integer-activation prefill (the new default) against the dequantize + fp32 prefill (float activations)
    and llama.cpp's prompt processing of the same token ids on the same GGUF; then ΔPPL of the two prefills."""
    from benchmarks import llamacpp_decode as lcd
    from benchmarks.quant_fidelity import add_window
    from scratchlm.defaults import default_model_path
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from scratchlm.inference.quantization import kernels, load_gguf_packed, quantize_model
    from scratchlm.model import load

    if not kernels.extension_available():
        raise SystemExit("the C++ kernels could not be built: the measurement would be of the torch fallback")
    path = default_model_path()
    ref = load(path)
    tok, cfg = ref.tokenizer, ref.config
    models = {"fp32": ref.model, "int8 (per channel)": quantize_model(ref.model, "int8"),
              "int4-g32-asym": quantize_model(ref.model, "int4-g32-asym"),
              "gguf Q4_1 (packed)": load_gguf_packed(path).model}
    if lcd.Q8_0_GGUF.exists():
        models["gguf Q8_0 (packed)"] = load_gguf_packed(lcd.Q8_0_GGUF).model
    engines = {name: LLMEngine(m, tok, cfg, EngineConfig(max_num_seqs=4, kv_cache_memory=64 << 20,
                                                         enable_prefix_caching=False))
               for name, m in models.items()}
    default_integer = kernels.integer_prefill()
    contenders = {}  # label -> (engine name, whether the prefill is the dequantize + fp32 one)
    for name in engines:
        contenders[name] = (name, not default_integer)
        if name != "fp32":
            contenders[f"{name} [dequant+fp32 prefill]"] = (name, True)
    peers = {}
    if (lcd.VENV / "bin" / "python").exists():
        for label, gguf in (("llama.cpp Q4_1", path), ("llama.cpp Q8_0", lcd.Q8_0_GGUF)):
            if Path(gguf).exists():
                peers[label] = lcd.LlamaCppWorker(str(gguf), str(args.bind_core), 1, script=PREFILL_WORKER,
                                                  script_name="llamacpp_prefill_worker.py")
    counter = iter(range(10**9))
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def scratchlm_prefill(label: str, ids: list[int]) -> tuple[float, float]:
        name, dequant = contenders[label]
        engine = engines[name]
        kernels.integer_prefill(not dequant)
        try:
            engine.add_request(str(next(counter)), ids, one)
            t0, c0 = time.perf_counter(), time.process_time()
            while engine.has_unfinished_requests():
                engine.step()
            return time.perf_counter() - t0, time.process_time() - c0
        finally:
            kernels.integer_prefill(default_integer)

    res: dict[tuple[str, int], list[tuple[float, float]]] = {}
    rng = torch.Generator().manual_seed(0)
    for r in range(args.rounds + 1):  # round 0: warm-up
        for length in args.prompt_lens:
            ids = torch.randint(100, cfg.vocab_size - 100, (length,), generator=rng).tolist()  # fresh every round
            for label in contenders:
                t = scratchlm_prefill(label, ids)
                if r:
                    res.setdefault((label, length), []).append(t)
            for label, worker in peers.items():
                out = worker.request(json.dumps(ids))
                if r:
                    res.setdefault((label, length), []).append((out["seconds"], out["cpu"]))
        print(f"  prefill round {r}/{args.rounds}", file=sys.stderr)
    for worker in peers.values():
        worker.close()

    report = Report("quant_prefill", "Quantized prefill on SmolLM2-135M: integer-activation GEMMs vs dequantize + "
                    "fp32, and llama.cpp's prompt processing", argv_of(args))
    peer_of = {"gguf Q4_1 (packed)": "llama.cpp Q4_1", "gguf Q8_0 (packed)": "llama.cpp Q8_0",
               "int8 (per channel)": "llama.cpp Q8_0", "int4-g32-asym": "llama.cpp Q4_1"}
    report.add(f"One thread per contender; scratchlm pinned to core {args.bind_core} and llama.cpp's worker process "
               f"(llama-cpp-python on the .peers build, n_threads = n_threads_batch = 1, n_batch = n_ubatch = 512) to "
               f"the same core; {args.rounds} interleaved rounds after a warm-up, fresh random token ids per round "
               f"and prompt length (prefix caching off). scratchlm: one request with max_tokens = 1 through LLMEngine "
               f"(the prefill step, the head on the last position, one sampled token); llama.cpp: `Llama.eval` of the "
               f"same ids (logits of the last position). tok/s = prompt tokens / wall seconds (median); CPU: prompt "
               f"tokens / process CPU seconds (median). `[dequant+fp32 prefill]`: the same engine with "
               f"kernels.integer_prefill(False): every quantized weight dequantized to float32 per call above 64 "
               f"rows and the fp32 GEMM, the previous default (other kernels unchanged). {_prefill_note()}")
    rows = []
    for label in list(contenders) + list(peers):
        for length in args.prompt_lens:
            def med(key: tuple[str, int], i: int) -> float:  # i = 0: wall seconds, 1: CPU seconds
                return statistics.median(t[i] for t in res[key])

            me = (label, length)
            base = label.removesuffix(" [dequant+fp32 prefill]")
            old = (f"{base} [dequant+fp32 prefill]", length)
            peer = peer_of.get(base) if label == base else None
            ratios = []
            for other in (old, (peer, length)):
                ok = label == base and other in res
                ratios.append(f"{med(other, 0) / med(me, 0):.2f}x / {med(other, 1) / med(me, 1):.2f}x" if ok else "")
            rows.append([label, str(length), f"{length / med(me, 0):.0f}", f"{length / med(me, 1):.0f}", ratios[0],
                         f"{ratios[1]} ({peer})" if ratios[1] else ""])
    report.table(["contender", "prompt tokens", "tok/s (wall)", "tok/s (CPU)", "vs dequant+fp32 prefill (wall / CPU)",
                  "vs llama.cpp (wall / CPU)"], rows)
    if not peers:
        report.add("llama.cpp not measured: .peers/llamacpp missing (python -m benchmarks.llamacpp_decode "
                   "--setup-peers)")

    if args.ppl_windows:
        text = (shared_data_dir() / "corpora" / "wikitext2" / "test.txt").read_text(encoding="utf-8")
        ids: list[int] = []
        pos, need = 0, args.ppl_windows * 512
        while len(ids) < need:
            ids += tok.encode(text[pos:pos + 20_000])
            pos += 20_000
        windows = torch.tensor(ids[:need]).view(args.ppl_windows, 512)  # (W, T)
        stats = {}
        with torch.inference_mode():
            for w in range(args.ppl_windows):
                tokens, targets = windows[w:w + 1], windows[w, 1:]
                ref_logp = torch.log_softmax(ref.model(tokens)[0, :-1].float(), -1)
                stats.setdefault("fp32", {"nll": 0.0, "kl": 0.0, "top1": 0.0, "n": 0})
                add_window(stats["fp32"], ref_logp, ref_logp, targets)
                for name in [n for n in models if n != "fp32"]:
                    logps = {}
                    for float_x in (True, False):  # True: the dequantize + fp32 prefill
                        kernels.integer_prefill(not float_x)
                        try:
                            logps[float_x] = torch.log_softmax(models[name](tokens)[0, :-1].float(), -1)  # (T-1, V)
                        finally:
                            kernels.integer_prefill(default_integer)
                    for float_x, tag in ((True, "dequant+fp32 prefill"), (False, "integer prefill")):
                        s = stats.setdefault((name, tag), {"nll": 0.0, "kl": 0.0, "top1": 0.0, "n": 0})
                        add_window(s, logps[float_x], ref_logp, targets)
                    s = stats.setdefault((name, "integer vs dequant"), {"nll": 0.0, "kl": 0.0, "top1": 0.0, "n": 0})
                    add_window(s, logps[False], logps[True], targets)
        base_ppl = math.exp(stats["fp32"]["nll"] / stats["fp32"]["n"])
        prow = []
        for name in [n for n in models if n != "fp32"]:
            ppl = {tag: math.exp(stats[(name, tag)]["nll"] / stats[(name, tag)]["n"])
                   for tag in ("dequant+fp32 prefill", "integer prefill")}
            pair = stats[(name, "integer vs dequant")]
            old_ppl, new_ppl = ppl["dequant+fp32 prefill"], ppl["integer prefill"]
            prow.append([name, f"{old_ppl:.3f} ({100 * (old_ppl / base_ppl - 1):+.2f}%)",
                         f"{new_ppl:.3f} ({100 * (new_ppl / base_ppl - 1):+.2f}%)",
                         f"{100 * (ppl['integer prefill'] / ppl['dequant+fp32 prefill'] - 1):+.3f}%",
                         f"{pair['kl'] / pair['n']:.5f}", f"{100 * pair['top1'] / pair['n']:.2f}%"])
        report.add(f"### Quality of the integer prefill: WikiText-2 test, {args.ppl_windows} windows of 512 tokens "
                   f"(the model's forward over each window: every linear above 64 rows), fp32 PPL {base_ppl:.3f}\n\n"
                   "The same quantized weights with x rounded to int8 per 32-block in every matmul (integer prefill) "
                   "and with float x (dequant+fp32 prefill); ΔPPL in brackets against fp32, and the integer "
                   "prefill against the dequantized one: PPL change, KL(dequant || integer) per token, top-1 "
                   f"agreement. {_prefill_note()}")
        report.table(["weights", "PPL dequant+fp32 prefill", "PPL integer prefill", "integer vs dequant ΔPPL",
                      "KL", "top-1 agreement"], prow)
    return report


# ------------------------------------------------------------------------------ the 32-request offline workload
def workload(args) -> Report:
    """The engine issue's offline workload (benchmarks/engine_throughput.make_workload: prompts U[16, 256] of random
    ids, outputs U[16, 128], greedy, ignore_eos) through LLMEngine with `--quantization gguf`, the integer prefill
    against the dequantize + fp32 prefill (kernels.integer_prefill: prefill chunks only, decode unchanged), and
    fp32; interleaved repeats, output tok/s by wall clock and per process CPU second."""
    from benchmarks.engine_throughput import make_workload, run_scratchlm
    from scratchlm.defaults import default_model_path
    from scratchlm.inference import EngineConfig, LLMEngine
    from scratchlm.inference.quantization import kernels

    if not kernels.extension_available():
        raise SystemExit("the C++ kernels could not be built: the measurement would be of the torch fallback")
    path = default_model_path()
    engines = {q: LLMEngine.from_pretrained(path, EngineConfig(max_num_seqs=32, max_num_batched_tokens=512,
                                                               quantization=q))
               for q in ("gguf", None)}
    prompts, outputs = make_workload(args.num_requests, engines["gguf"].model_config.vocab_size, 0)
    contenders = {"gguf, integer prefill (default)": ("gguf", True), "gguf, dequant+fp32 prefill": ("gguf", False),
                  "fp32": (None, True)}
    default = kernels.integer_prefill()
    res: dict[str, list[tuple[float, float]]] = {c: [] for c in contenders}
    ids: dict[str, list[list[int]]] = {}
    for r in range(args.rounds + 1):  # round 0: warm-up
        for label, (q, integer) in contenders.items():
            kernels.integer_prefill(integer)
            try:
                c0 = time.process_time()
                seconds, ids[label] = run_scratchlm(engines[q], prompts, outputs)
                cpu = time.process_time() - c0
            finally:
                kernels.integer_prefill(default)
            if r:
                res[label].append((seconds, cpu))
        print(f"  workload round {r}/{args.rounds}: " + ", ".join(
            f"{c} {sum(outputs) / v[-1][0]:.1f}" for c, v in res.items() if v), file=sys.stderr)
    n_out = sum(outputs)
    report = Report("quant_workload", f"The {args.num_requests}-request workload with --quantization gguf: integer "
                    "vs dequantize + fp32 prefill", argv_of(args))
    report.add(f"{args.num_requests} requests, prompts U[16, 256] random ids (seed 0; {sum(map(len, prompts))} prompt "
               f"tokens), outputs U[16, 128] ({n_out} tokens), greedy, ignore_eos; LLMEngine max_num_seqs 32, "
               f"max_num_batched_tokens 512, prefix cache reset per repeat (benchmarks/engine_throughput.py's "
               f"run_scratchlm); one thread pinned to core {args.bind_core}; {args.rounds} interleaved repeats after "
               f"a warm-up. `dequant+fp32 prefill`: the same engine with kernels.integer_prefill(False) (prefill "
               f"chunks dequantize each weight per call for the fp32 GEMM; decode kernels unchanged). The server "
               f"comparison with llama-server is benchmarks/serve.py (the lead's).")
    base = statistics.median(t for t, _ in res["gguf, dequant+fp32 prefill"])
    rows = []
    for label, ts in res.items():
        wall = statistics.median(t for t, _ in ts)
        cpu = statistics.median(c for _, c in ts)
        rows.append([label, f"{n_out / wall:.1f}", f"{n_out / min(t for t, _ in ts):.1f}", f"{n_out / cpu:.1f}",
                     f"{base / wall:.2f}x"])
    report.table(["contender", "output tok/s (median)", "output tok/s (best)", "output tok/s per CPU s (median)",
                  "vs dequant+fp32 prefill (wall)"], rows)
    same = sum(a == b for a, b in zip(ids["gguf, integer prefill (default)"], ids["gguf, dequant+fp32 prefill"]))
    report.add(f"Greedy outputs of the two gguf prefills identical on {same} of {len(prompts)} requests (the integer "
               f"prefill rounds x to int8 per 32-block, as decode does; an early different token changes the rest).")
    return report


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
    parser.add_argument("--prefill-kernels", action="store_true",
                        help="instead of decode: the prefill matmuls (> 64 rows) of every format and SmolLM2 shape, "
                             "the integer panel kernels against dequantize + fp32 GEMM, float-x FMA tiles and the "
                             "8-row kernel (benchmarks/results/DATE-quant_prefill_kernels.md)")
    parser.add_argument("--prefill-rows", type=int, nargs="+", default=[65, 128, 256, 512],
                        help="rows of x (prefill chunk lengths) for --prefill-kernels")
    parser.add_argument("--head", action=argparse.BooleanOptionalAction, default=True,
                        help="--prefill-kernels: also the 49152x576 output head")
    parser.add_argument("--prefill", action="store_true",
                        help="instead of decode: prompt processing tok/s through LLMEngine per format, integer vs "
                             "dequantize + fp32 prefill, and llama.cpp on the same ids and GGUF "
                             "(benchmarks/results/DATE-quant_prefill.md)")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512], help="--prefill: prompt lengths")
    parser.add_argument("--ppl-windows", type=int, default=4,
                        help="--prefill: WikiText-2 test windows of 512 tokens for the ΔPPL of the integer prefill "
                             "(0: none)")
    parser.add_argument("--workload", action="store_true",
                        help="instead of decode: the 32-request offline workload with --quantization gguf, integer vs "
                             "dequantize + fp32 prefill, and fp32 (benchmarks/results/DATE-quant_workload.md)")
    parser.add_argument("--num-requests", type=int, default=32, help="--workload: requests")
    parser.add_argument("--bind-core", type=int, default=0,
                        help="--prefill*, --workload: the core every contender is pinned to")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.rounds < 1 or args.tokens < 2:
        parser.error("--threads and --rounds must be >= 1, --tokens >= 2")
    if any(m <= 64 for m in args.prefill_rows) or any(n < 1 or n > 1024 for n in args.prompt_lens):
        parser.error("--prefill-rows must be > 64 (the prefill path), --prompt-lens in 1 .. 1024")
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if args.prefill_kernels or args.prefill or args.workload:
        if args.threads != 1:
            parser.error("--prefill, --prefill-kernels and --workload measure one pinned thread (--threads 1)")
        set_threads(1)
        if args.bind_core >= 0:
            os.sched_setaffinity(0, {args.bind_core})
        run = prefill_kernels if args.prefill_kernels else prefill_e2e if args.prefill else workload
        run(args).write()
        return 0
    set_threads(args.threads)
    from scratchlm.defaults import default_model_path
    from scratchlm.inference import EngineConfig, LLMEngine
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
    prompts = tinystories_prompts()

    def decode_tok_s(engine: LLMEngine) -> float:
        return engine_decode_tok_s(engine, PROMPT, args.tokens, str(next(counter)))

    def throughput(engine: LLMEngine) -> float:
        return engine_batch_tok_s(engine, prompts, 32, [str(next(counter)) for _ in prompts])

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
