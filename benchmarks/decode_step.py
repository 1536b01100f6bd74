"""Where an fp32 decode step's time goes outside its GEMMs, and the decode attention against a streaming read.

The 32-request workload of `benchmarks/engine_phases.py` (SmolLM2-135M fp32, prompts U[16, 256], outputs
U[16, 128], greedy, one pinned thread) runs through three scratchlm engines in one process, alternating:

- **before**: the KV cache on 4 KiB pages and decode rows through the tile kernel, one (row, KV head) work item
  each (`set_decode_rows(0)`, `SCRATCHLM_HUGE_PAGES=0` when its cache is allocated): the kernels of before;
- **row kernel, 4 KiB pages**: decode rows through `decode_row_avx2` (csrc/paged_attention.h: one work item per
  row over all KV heads, blocks prefetched into L2), the cache on 4 KiB pages: the kernel's share alone;
- **now**: the same kernel and the KV cache on 2 MiB transparent huge pages (inference/huge_pages.py).

All compute the same floats (the two kernels are bit-equal; the greedy ids are compared). Every decode step
(every row one new token) is split on the thread CPU clock (`time.thread_time`; other agents' load does not count):
the fused C++ step's stages (decoder.h's `decoder_profile`: norms, q/k/v, o, gate/up and down GEMMs, RoPE, K/V
store, attention, SiLU-mul, residual adds), the head (`runner._logits`), and the Python rest of
`ModelRunner.execute` (input tensors, embedding, RoPE tables, final norm). "The rest" is everything but the
body GEMMs and the head, the quantity `engine_phases` reports as the decode steps' rest.

Then the decode attention alone: the workload's own decode steps (block tables and context lengths as the
scheduler made them, 16-32 rows, contexts ~20-380) replayed over all 30 layers of each engine's real cache, the
two kernels on both page sizes, interleaved with a streaming read (torch.sum) of as many bytes on 4 KiB and on huge
pages (512 MiB each): achieved GB/s of K/V read and the fraction of the streaming read.

    python -m benchmarks.decode_step [--repeats 2] [--attention-repeats 5] [--steps 24]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

from benchmarks.common import Report, compare, set_threads

GEMM_STAGES = ("qkv_gemm", "o_gemm", "gate_up_gemm", "down_gemm")
STREAM_BYTES = 512 << 20
ROW_4K = "row kernel, 4 KiB pages"


def log(msg: str) -> None:
    print(f"[decode_step {time.strftime('%H:%M:%S')}] {msg} (load {os.getloadavg()[0]:.1f})", file=sys.stderr)


class ProfiledEngine:
    """A scratchlm engine whose decode steps are split by stage on the thread CPU clock."""

    def __init__(self, model_dir, max_seqs: int, max_batched: int, huge_pages: bool, decode_rows: bool, ext):
        from scratchlm.inference import EngineConfig, LLMEngine
        from scratchlm.inference.huge_pages import ENV

        old = os.environ.get(ENV)
        os.environ[ENV] = "1" if huge_pages else "0"
        try:
            self.engine = LLMEngine.from_pretrained(model_dir, EngineConfig(max_num_seqs=max_seqs,
                                                                            max_num_batched_tokens=max_batched))
        finally:
            os.environ.pop(ENV) if old is None else os.environ.__setitem__(ENV, old)
        self.ext, self.decode_rows = ext, decode_rows
        runner = self.engine.runner
        assert runner.fused_decoder is not None, "the fused C++ decode step is not available"
        self.parts: dict[str, float] = defaultdict(float)
        self.decode_inputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tables, lens) per decode step
        self._decode = False
        execute, logits, fused = runner.execute, runner._logits, runner.fused_decoder
        parts = self.parts

        def timed_logits(h):
            t0 = time.thread_time()
            out = logits(h)
            if self._decode:
                parts["head"] += time.thread_time() - t0
            return out

        class TimedFused:  # the fused step's forward, timed as a whole (its stages come from decoder_profile)
            def forward(self_, *args):
                t0 = time.thread_time()
                out = fused.forward(*args)
                if self._decode:
                    parts["fused step"] += time.thread_time() - t0
                    self.decode_inputs.append((args[6].clone(), args[7].clone()))
                return out

        def timed_execute(inp):
            self._decode = bool(inp.token_ids) and inp.num_decode_tokens == len(inp.token_ids)
            ext.decoder_profile(1 if self._decode else 0)
            t0 = time.thread_time()
            out = execute(inp)
            if self._decode:
                parts["execute"] += time.thread_time() - t0
                parts["steps"] += 1
                parts["rows"] += len(inp.token_ids)
            ext.decoder_profile(0)
            return out

        runner._logits, runner.fused_decoder, runner.execute = timed_logits, TimedFused(), timed_execute

    def run(self, prompts, outputs) -> dict:
        """One pass of the workload: {part: thread seconds over the decode steps}, ids, total thread CPU."""
        from scratchlm.inference import LLM, SamplingParams

        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
        self.engine.reset_prefix_cache()
        self.parts.clear()
        self.decode_inputs.clear()
        self.ext.decoder_profile(0, True)
        old = self.ext.set_decode_rows(int(self.decode_rows))
        c0 = time.thread_time()
        try:
            outs = LLM.from_engine(self.engine).generate(prompts, params, use_tqdm=False)
        finally:
            self.ext.set_decode_rows(int(old))
        total = time.thread_time() - c0
        stages = self.ext.decoder_profile(0, True)
        res = dict(self.parts)
        res.update({k: v for k, v in stages.items() if k != "steps"})
        res["python"] = res["execute"] - res["fused step"] - res["head"]  # inputs, embedding, RoPE, final norm
        res["profiler + call"] = res["fused step"] - sum(v for k, v in stages.items() if k != "steps")
        res["gemm"] = sum(res[k] for k in GEMM_STAGES)
        res["rest"] = res["execute"] - res["gemm"] - res["head"]
        return {"parts": res, "ids": [o.outputs[0].token_ids for o in outs], "total": total}


def kv_bytes(lens: torch.Tensor, layers: int, hkv: int, d: int, itemsize: int) -> int:
    """K and V bytes one step's decode attention reads over `layers` layers."""
    return 2 * int(lens.sum()) * layers * hkv * d * itemsize


def attention_replay(engines: dict[str, ProfiledEngine], steps, repeats: int, ext) -> tuple:
    """The decode attention of `steps` (tables, lens) over every layer of each engine's cache, both kernels, plus
    streaming reads (STREAM_BYTES each): (Comparison, K/V bytes per attention pass)."""
    cfg = engines["now"].engine.model_config
    g = torch.Generator().manual_seed(0)
    qs = [torch.randn(len(lens), cfg.n_heads, cfg.head_dim, generator=g) for _, lens in steps]
    caches = {k: e.engine.runner.cache for k, e in engines.items()}
    scale = cfg.head_dim ** -0.5
    nbytes = sum(kv_bytes(lens, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 4) for _, lens in steps)

    def attend(cache, rows: bool):
        def run():
            old = ext.set_decode_rows(int(rows))
            for (tables, lens), q in zip(steps, qs, strict=True):
                for layer in range(cfg.n_layers):
                    ext.paged_decode_attention(q, cache.k[layer], cache.v[layer], tables, lens, scale, True)
            ext.set_decode_rows(int(old))
        return run

    from scratchlm.inference import huge_pages

    n = STREAM_BYTES // 4  # the streaming reads: a buffer 16x the L3 each (their GB/s from their own size)
    plain = torch.randn(n, generator=g)
    huge = huge_pages.zeros((n,), torch.float32)
    huge.copy_(plain)
    contenders = {
        "before: tile kernel, 4 KiB pages": attend(caches["before"], False),
        "tile kernel, huge pages": attend(caches["now"], False),
        "row kernel, 4 KiB pages": attend(caches["before"], True),
        "now: row kernel, huge pages": attend(caches["now"], True),
        "streaming read (torch.sum), 4 KiB pages": plain.sum,
        "streaming read (torch.sum), huge pages": huge.sum,
    }
    return compare(contenders, warmup=1, repeats=repeats, clock="thread_cpu"), nbytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="workload passes per engine, alternating, after a warm-up")
    ap.add_argument("--attention-repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=24, help="decode steps of the workload replayed in the attention part")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--core", type=int, default=0, help="CPU core the run is pinned to (one thread)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    args = ap.parse_args(argv)
    for name in ("num_requests", "repeats", "attention_repeats", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    set_threads(1)
    os.sched_setaffinity(0, {args.core})
    from benchmarks.engine_throughput import export_for_vllm, make_workload
    from scratchlm.defaults import default_model_path
    from scratchlm.inference.cpp_extensions import load_engine_kernels

    ext = load_engine_kernels()
    if ext is None:
        raise SystemExit("the engine's C++ kernels did not build: no fused step to profile")
    model_dir = export_for_vllm(default_model_path())
    load0 = os.getloadavg()
    report = Report("decode_step" + (f"-{args.tag}" if args.tag else ""),
                    "Decode steps outside the GEMMs: before vs now (SmolLM2-135M fp32, 1 thread)",
                    argv=sys.argv[1:] if argv is None else argv)
    log("loading three engines")
    max_seqs = max(32, args.num_requests)
    engines = {"before": ProfiledEngine(model_dir, max_seqs, args.max_num_batched_tokens, False, False, ext),
               ROW_4K: ProfiledEngine(model_dir, max_seqs, args.max_num_batched_tokens, False, True, ext),
               "now": ProfiledEngine(model_dir, max_seqs, args.max_num_batched_tokens, True, True, ext)}
    prompts, outputs = make_workload(args.num_requests, engines["now"].engine.model_config.vocab_size, args.seed)
    log("warm-up")
    for e in engines.values():
        e.run(prompts, outputs)
    runs: dict[str, list[dict]] = {k: [] for k in engines}
    for r in range(args.repeats):
        for k, e in engines.items():
            runs[k].append(e.run(prompts, outputs))
            p = runs[k][-1]["parts"]
            log(f"repeat {r + 1}: {k}: decode steps {p['execute']:.2f} s, rest {p['rest']:.2f} s, attention "
                f"{p['attention']:.2f} s")
    same = sum(a == b for a, b in zip(runs["before"][-1]["ids"], runs["now"][-1]["ids"], strict=True))

    # the workload's decode steps, evenly spaced, for the attention replay
    dec = engines["now"].decode_inputs
    picked = [dec[round(i * (len(dec) - 1) / max(1, args.steps - 1))] for i in range(min(args.steps, len(dec)))]
    log(f"attention replay over {len(picked)} decode steps")
    att, nbytes = attention_replay(engines, picked, args.attention_repeats, ext)

    best = {k: min(rs, key=lambda r: r["parts"]["execute"])["parts"] for k, rs in runs.items()}
    med = {k: {p: statistics.median(r["parts"][p] for r in rs) for p in rs[0]["parts"]} for k, rs in runs.items()}
    a, m4, b = best["before"], best[ROW_4K], best["now"]
    labels = [("decode steps (runner.execute)", "execute"), ("  body GEMMs (in the step)", "gemm"),
              ("  head (runner._logits)", "head"), ("  **the rest**", "rest"), ("    attention", "attention"),
              ("    RMSNorms (2 per layer)", None), ("    RoPE", "rope"), ("    K/V store", "kv_store"),
              ("    SiLU-mul", "silu_mul"), ("    residual adds", "residual"), ("    step set-up (checks, buffers)",
                                                                                "setup"),
              ("    profiler marks + the C++ call", "profiler + call"),
              ("    Python (inputs, embedding, RoPE tables, final norm)", "python")]
    rows = []
    for label, key in labels:
        def val(d, key=key):
            return d["attn_norm"] + d["ffn_norm"] if key is None else d[key]
        rows.append([label, f"{val(a):.3f} s", f"{val(m4):.3f} s", f"{val(b):.3f} s",
                     f"{val(a) / val(b):.2f}x" if val(b) > 0 else "-",
                     f"{val(med['before']):.3f} / {val(med[ROW_4K]):.3f} / {val(med['now']):.3f} s"])
    n_steps, n_rows = int(b["steps"]), int(b["rows"])
    report.add(f"Workload: {args.num_requests} requests (engine_throughput's, seed {args.seed}), max "
               f"{args.max_num_batched_tokens} tokens per step, {n_steps} decode steps with {n_rows} rows "
               f"({n_rows / n_steps:.1f} rows per step); one thread pinned to core {args.core}; the {len(engines)} "
               f"engines alternate ({args.repeats} pass(es) each after a warm-up). Load average at start "
               f"{' '.join(f'{x:.1f}' for x in load0)}, at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())} "
               f"(2 cores shared with other agents; the thread CPU clock is the measure).")
    report.table(["decode steps, thread CPU", "before", ROW_4K, "now", "before / now",
                  f"medians (before / {ROW_4K} / now)"], rows,
                 caption="Decode steps by part (the pass with the least decode-step time of each engine)")
    report.add(f"- Greedy ids of before and now identical on {same}/{len(prompts)} requests.\n"
               f"- The rest: {a['rest']:.2f} s before, {m4['rest']:.2f} s with the row kernel on 4 KiB pages, "
               f"{b['rest']:.2f} s now ({a['rest'] / b['rest']:.2f}x); the attention {a['attention']:.2f} s -> "
               f"{m4['attention']:.2f} s -> {b['attention']:.2f} s ({a['attention'] / b['attention']:.2f}x).\n"
               f"- Stages are timed inside the fused step (clock_gettime per stage, ~13 marks per layer; their own "
               f"cost is in 'profiler marks + the C++ call'); GEMMs are the in-step panel GEMMs, not a replay.")
    per_step = nbytes / len(picked)
    att_rows = []
    def read_bytes(t):
        return STREAM_BYTES if t.name.startswith("streaming") else nbytes

    for t in att.timings:
        stream_row = t.name.startswith("streaming")
        att_rows.append([t.name, f"{t.median * 1e3:.1f} ms", f"{t.best * 1e3:.1f} ms",
                         f"{read_bytes(t) / t.best / 1e9:.1f} GB/s",
                         "-" if stream_row else f"{t.median / att.timings[0].median:.3f}"])
    stream = max(read_bytes(t) / t.best / 1e9 for t in att.timings if t.name.startswith("streaming"))
    now_gbps = nbytes / att["now: row kernel, huge pages"].best / 1e9
    before_gbps = nbytes / att["before: tile kernel, 4 KiB pages"].best / 1e9
    lens = torch.cat([lens for _, lens in picked])
    report.table(["contender", "median", "best", "GB/s read (best)", "time / before"], att_rows,
                 caption=f"Decode attention alone: {len(picked)} of the workload's decode steps ({len(lens)} rows, "
                         f"contexts {int(lens.min())}-{int(lens.max())}, mean {lens.double().mean():.0f}), all "
                         f"{engines['now'].engine.model_config.n_layers} layers, {per_step / 1e6:.0f} MB of fp32 K/V "
                         f"per step; thread CPU, {args.attention_repeats} interleaved repeats")
    report.add(f"- Decode attention: {before_gbps:.1f} GB/s before, {now_gbps:.1f} GB/s now "
               f"({now_gbps / before_gbps:.2f}x), {100 * now_gbps / stream:.0f} % of the best streaming read in this "
               f"run ({stream:.1f} GB/s; before: {100 * before_gbps / stream:.0f} %).")
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
