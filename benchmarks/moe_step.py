"""The fused MoE step (csrc/moe.h): what a batch-1 step reads, and fp32 scratchlm against HF transformers' MoE.

One Qwen3-MoE-shaped random model for both parts (d_model 1024, 8 layers, 16 heads / 4 KV heads of 64, 16 experts
of width 512, top-4 with renormalised weights, vocabulary 32000, untied head), built by transformers'
`Qwen3MoeConfig` / `Qwen3MoeForCausalLM` (its own init), saved and loaded into scratchlm's `TransformerLM` (the same
weights, through scratchlm's qwen3_moe loader; the greedy ids of the two are compared and reported).

(a) `active`: one greedy request decoding at batch 1 through the engine (fused C++ step), experts in fp32, int8
    and int4 (`quantize_model`; the router stays float32). A step reads the attention, the router, the top_k
    chosen experts of each layer and the head: the *active* bytes (the other experts are not touched: the
    GB/s on *all* the weights' bytes would exceed the machine's streaming read). GB/s = active bytes / step time,
    against a plain streaming read (torch.sum over 256 MiB, as benchmarks/llamacpp_decode.py's worker) timed
    in the same rounds, interleaved.
(b) `hf`: fp32 HF `generate` (greedy, static batches of equal-length prompts, batch 1, 4 and 16) against
    scratchlm `LLM.generate` (continuous batching, the fused step) on the same prompts, interleaved rounds, the
    same threads; the ratio of output tokens per second at HF's best batch size.
(c) `layer`: the MoE layers alone at 1-64 rows: the chosen experts' bytes per CPU-second against the streaming
    read per CPU-second (is the grouped step at the memory roofline?).

    python -m benchmarks.moe_step                      # both parts, 1 thread
    python -m benchmarks.moe_step --parts hf --repeats 3 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.common import Report, engine_decode_tok_s, set_threads

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_experts=16,
             num_experts_per_tok=4, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             norm_topk_prob=True, max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-6,
             rope_theta=1e6)


class _Tokenizer:
    """Token ids only (the prompts are ids): what the engine asks of a tokenizer."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.add_bos = vocab_size, False
        self.bos_id = self.eos_id = self.chat_template = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def build_models(seed: int = 0):
    """(HF Qwen3MoeForCausalLM, scratchlm TransformerLM with the same weights), both fp32, eval: the HF model saved
    and loaded by scratchlm's loader (the qwen3_moe family)."""
    import tempfile

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from scratchlm.model.loading import load

    torch.manual_seed(seed)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = load(tmp).model
    return hf, ours.eval()


def make_llm(model, max_seqs: int = 16):
    from scratchlm.inference import EngineConfig, LLMEngine
    from scratchlm.inference.llm import LLM

    engine = LLMEngine(model, _Tokenizer(model.config.vocab_size), model.config,
                       EngineConfig(kv_cache_memory=256 << 20, max_num_seqs=max_seqs))
    return LLM.from_engine(engine)


def _bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def active_bytes(model) -> tuple[int, int]:
    """(bytes a batch-1 step reads: attention, norms, router, top_k experts per layer, final norm, head; bytes of all
    the weights but the embedding table), of an engine's (swapped, packed) model."""
    from scratchlm.model.moe import MoE

    c = model.config
    active = total = 0
    for block in model.layers:
        dense = _bytes(block) - (_bytes(block.ffn) if isinstance(block.ffn, MoE) else 0)
        active += dense
        total += dense
        if isinstance(block.ffn, MoE):
            experts = [_bytes(e) for e in block.ffn.experts]
            router = _bytes(block.ffn) - sum(experts)  # gate (+ shared expert, score bias)
            active += router + c.moe.top_k * statistics.mean(experts)
            total += router + sum(experts)
    head = getattr(model, "output_head", None) or model.lm_head
    tail = _bytes(model.norm) + _bytes(head)
    return active + tail, total + tail


def part_active(report: Report, model, args) -> None:
    from scratchlm.inference import SamplingParams  # noqa: F401  (engine_decode_tok_s imports it)
    from scratchlm.inference.quantization import quantize_model

    buf = torch.ones(64 << 20)  # 256 MiB, beyond every cache

    def stream_gbps() -> float:
        t0 = time.perf_counter()
        buf.sum()
        return buf.numel() * 4 / (time.perf_counter() - t0) / 1e9

    engines = {}
    for fmt in args.formats:
        m = model if fmt == "fp32" else quantize_model(model, fmt)
        llm = make_llm(m if fmt != "fp32" else _clone(model), max_seqs=1)
        assert llm.engine.runner.fused_decoder is not None, "the fused step did not take the MoE model"
        engines[fmt] = llm.engine
    prompt = list(range(1, 33))
    rates = {fmt: [] for fmt in engines}
    cpu_rates = {fmt: [] for fmt in engines}
    streams = []
    for fmt, eng in engines.items():  # warm-up
        engine_decode_tok_s(eng, prompt, 4, f"warm-{fmt}")
    for r in range(args.repeats):
        streams.append(stream_gbps())
        for fmt, eng in engines.items():
            c0 = time.process_time()
            rates[fmt].append(engine_decode_tok_s(eng, prompt, args.tokens, f"{fmt}-{r}"))
            cpu_rates[fmt].append(args.tokens / (time.process_time() - c0))  # prefill included: a bound
        print(f"  round {r + 1}: " + ", ".join(f"{f} {v[-1]:.1f} tok/s" for f, v in rates.items()), file=sys.stderr)
    stream = statistics.median(streams)
    rows = []
    for fmt, eng in engines.items():
        act, total = active_bytes(eng.runner.model)
        tok_s = statistics.median(rates[fmt])
        gbps, cpu_gbps = act * tok_s / 1e9, act * statistics.median(cpu_rates[fmt]) / 1e9
        rows.append([fmt, f"{act / 2**20:.1f}", f"{total / 2**20:.1f}", f"{tok_s:.1f}", f"{1e3 / tok_s:.2f}",
                     f"{gbps:.1f} ({100 * gbps / stream:.0f} %)", f"{cpu_gbps:.1f}", f"{total * tok_s / 1e9:.1f}"])
    report.table(["experts", "active MiB / step", "all weights MiB", "tok/s (median)", "ms / step",
                  "GB/s on active bytes (% of stream)", "GB/s on active bytes per CPU-s (prefill incl.)",
                  "GB/s if all were read"], rows,
                 caption=f"(a) batch-1 decode, {args.tokens} tokens after a 32-token prompt, {args.repeats} "
                         f"interleaved rounds; streaming read median {stream:.1f} GB/s (one thread)")


def part_layer(report: Report, model, args) -> None:
    """(c) the fp32 MoE layers alone (`MoELayer.forward`, the fused step's, every sparse layer in turn) at B rows:
    the bytes of the experts the rows chose (each read once) per CPU-second, against the streaming read per
    CPU-second, interleaved (CPU time: the machine's other load deschedules this process, which wall time counts)."""
    from scratchlm.inference.cpp_extensions import load_engine_kernels
    from scratchlm.inference.fast_linear import use_skinny_linears
    from scratchlm.inference.runner import _moe_layer
    from scratchlm.model.moe import MoE

    ext = load_engine_kernels()
    m = _clone(model)
    use_skinny_linears(m)
    blocks = [b.ffn for b in m.layers if isinstance(b.ffn, MoE)]
    layers = [_moe_layer(ext, f, m.config) for f in blocks]
    c = m.config
    expert_bytes = 3 * c.d_model * c.d_expert * 4
    buf = torch.ones(64 << 20)

    def cpu_s(fn, n: int = 3) -> float:
        c0 = time.process_time()
        for _ in range(n):
            fn()
        return (time.process_time() - c0) / n

    g = torch.Generator().manual_seed(3)
    inputs = {b: torch.randn(b, c.d_model, generator=g) for b in args.layer_rows}
    read = {}
    with torch.inference_mode():
        for b, h in inputs.items():  # the experts each layer's router picks for these rows
            read[b] = sum(len(set(f.route(h)[1].flatten().tolist())) for f in blocks) * expert_bytes
            for layer in layers:  # warm-up
                layer.forward(h)
    streams, secs = [], {b: [] for b in inputs}
    for _ in range(args.repeats):
        streams.append(buf.numel() * 4 / cpu_s(buf.sum) / 1e9)
        for b, h in inputs.items():
            secs[b].append(cpu_s(lambda h=h: [layer.forward(h) for layer in layers]))
    stream = statistics.median(streams)
    rows = []
    for b in inputs:
        t = statistics.median(secs[b])
        gbps = read[b] / t / 1e9
        rows.append([b, f"{read[b] / expert_bytes / len(layers):.1f}", f"{read[b] / 2**20:.0f}", f"{t * 1e3:.1f}",
                     f"{gbps:.1f}", f"{100 * gbps / stream:.0f} %"])
    report.table(["rows", "experts read / layer", "expert MiB read", "CPU ms (all MoE layers)",
                  "GB/s per CPU-s", "% of streaming read"], rows,
                 caption=f"(c) the fp32 MoE layers alone, {len(layers)} layers, {args.repeats} interleaved rounds; "
                         f"streaming read median {stream:.1f} GB/s per CPU-second (one thread)")


def _clone(model):
    import copy

    return copy.deepcopy(model)


def part_hf(report: Report, hf, model, args) -> None:
    from scratchlm.inference import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, SHAPE["vocab_size"], (args.requests, args.prompt_len), generator=g)
    llm = make_llm(_clone(model), max_seqs=args.requests)
    assert llm.engine.runner.fused_decoder is not None
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    def run_ours():
        return [o.outputs[0].token_ids for o in llm.generate([p.tolist() for p in prompts], params, use_tqdm=False)]

    def run_hf(batch: int):
        out = []
        with torch.inference_mode():
            for i in range(0, args.requests, batch):
                x = prompts[i:i + batch]
                y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.tokens,
                                min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
                out += [r[args.prompt_len:].tolist() for r in y]
        return out

    ours_ids, hf_ids = run_ours(), run_hf(max(args.hf_batches))  # warm-up, and the ids compared
    same = sum(a == b for a, b in zip(ours_ids, hf_ids))
    first = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), args.tokens) for x, y in zip(ours_ids, hf_ids)]
    contenders = {"scratchlm": run_ours} | {f"hf_b{b}": (lambda b=b: run_hf(b)) for b in args.hf_batches}
    wall = {n: [] for n in contenders}
    cpu = {n: [] for n in contenders}
    for r in range(args.repeats):
        for name, fn in contenders.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
        print(f"  round {r + 1}: " + ", ".join(f"{n} {t[-1]:.2f}s ({cpu[n][-1]:.2f} CPU-s)" for n, t in wall.items()),
              file=sys.stderr)
    work = args.requests * args.tokens
    med = {n: statistics.median(t) for n, t in wall.items()}
    best_hf = min((n for n in med if n.startswith("hf_")), key=med.get)

    def round_ratio(clock: dict[str, list[float]], name: str) -> float:  # median over rounds of best_hf / name
        return statistics.median(h / o for h, o in zip(clock[best_hf], clock[name]))

    rows = [[n, f"{med[n]:.2f}", f"{min(wall[n]):.2f}", f"{statistics.median(cpu[n]):.2f}", f"{work / med[n]:.1f}",
             f"{round_ratio(wall, n):.2f}", f"{round_ratio(cpu, n):.2f}"] for n in contenders]
    report.table(["contender", "median s", "best s", "median CPU-s", "output tok/s (median)",
                  f"speed / {best_hf} (wall)", f"speed / {best_hf} (CPU-s)"], rows,
                 caption=f"(b) fp32, {args.requests} requests x {args.prompt_len}-token prompts -> {args.tokens} "
                         f"greedy tokens, {args.repeats} interleaved rounds; speed ratios: the median of the "
                         f"per-round ratios")
    ratio = round_ratio(wall, "scratchlm")
    report.add(f"scratchlm / HF at HF's best batch ({best_hf}): **{ratio:.2f}x** output tokens per second "
               f"(wall; {round_ratio(cpu, 'scratchlm'):.2f}x in process CPU seconds, which a loaded machine's "
               f"descheduling does not inflate). "
               f"Greedy ids equal to HF's for {same} / {len(hf_ids)} requests (the first differing position per "
               f"request: {first}; a random HF init has near-flat logits, so one ulp can swap a greedy choice).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["active", "layer", "hf"], choices=["active", "layer", "hf"])
    ap.add_argument("--layer-rows", type=int, nargs="+", default=[1, 4, 16, 64], help="rows for part layer")
    ap.add_argument("--formats", nargs="+", default=["fp32", "int8", "int4"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--hf-batches", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args(argv)
    threads = set_threads(args.threads)
    import transformers

    hf, model = build_models()
    report = Report("moe_step", "The fused MoE step: batch-1 active bytes, and fp32 against HF transformers",
                    argv if argv is not None else sys.argv[1:])
    report.add(f"Model: Qwen3-MoE-shaped, random (transformers {transformers.__version__} `Qwen3MoeConfig` init): "
               f"{SHAPE}. HF experts implementation: {hf.config._experts_implementation!r}. Threads: {threads}.")
    if "active" in args.parts:
        part_active(report, model, args)
    if "layer" in args.parts:
        part_layer(report, model, args)
    if "hf" in args.parts:
        part_hf(report, hf, model, args)
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
