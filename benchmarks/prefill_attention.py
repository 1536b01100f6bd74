"""Prefill attention over the paged cache: the tiled kernel against its tiles of before, row by row and torch SDPA.

The engine's prefill chunks attend through csrc/paged_attention.h: every row of a chunk is one query over its own
causal context. Contenders, on the same chunks (SmolLM2-135M's attention shapes: 9 query / 3 KV heads of 64,
block size 16, every layer its own cache so nothing stays in cache across layers), interleaved per repeat, thread
CPU time, one pinned thread:

- `tiled 8` (the engine's default), `tiled 4`, `tiled 16`: rows of one block table in tiles of that many rows,
  each K/V block read once per tile, the scores with keys in lanes (each K block transposed once per chunk, one
  FMA per feature for 16 keys);
- `tiled 8, lanes over D (before)`: the same tiles with the score kernel of before (`prefill_keys_in_lanes(0)`:
  dot products over D reduced across lanes, 8-lane exp, no query prefetch), the same floats;
- `row by row`: `tile_rows=1` (each row streams its whole prefix, as before the tiles);
- `..., AVX2`: the same with 8-lane FMAs (`avx512=False`; `row by row, AVX2` is the kernel of before);
- `torch SDPA`: gather the sequence's K/V out of the blocks, then `scaled_dot_product_attention(is_causal)` on
  the contiguous tensors (what an unpaged prefill runs; the gather is part of the time).

Every contender's output is checked against `tiled 8` first (SDPA to 1e-4, AVX2 to 1e-5; the others bit for bit).
GFLOP/s counts the causal work only (4 * D FLOP per row, query head and key of its context); the fraction of peak
is against the core's register-only FMA loop (`fp32_peak_fmas`, as benchmarks/fp32_gemm.py), measured in the run.

    python -m benchmarks.prefill_attention                       # 2 x 256-token prompts, 30 layers
    python -m benchmarks.prefill_attention --prompts 1 --len 512
    python -m benchmarks.prefill_attention --engine 1024,2048,4000
    python -m benchmarks.prefill_attention --workload

`--engine LENS`: long prompts through the engine instead (SmolLM2-135M-Instruct, chunks of 512 tokens, one
prompt of each length, max_tokens 1): the fused C++ step for every chunk (the tiles; the default since
`runner.FUSED_PREFILL_MAX_CONTEXT` is None) against the limit of before (512: chunks whose context is longer run
the Python step, torch SDPA), interleaved, thread CPU of the steps; the greedy first token is compared.

`--workload`: the prefill of engine_throughput's 32-request workload (prompts U[16, 256], seed 0, max_tokens 1:
9 steps of up to 512 rows, SmolLM2-135M, the fused step) with the tiles' keys in lanes on and off
(`prefill_keys_in_lanes`), interleaved: the whole prefill's thread CPU, and its attention's share estimated from
the difference and from the micro benchmark's ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import Report, compare, set_threads
from benchmarks.fp32_gemm import peak_gflops

H, HKV, HD, BS = 9, 3, 64, 16


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30, help="layers, each with its own cache (30: SmolLM2-135M)")
    ap.add_argument("--prompts", type=int, default=2, help="fresh prompts in the chunk (one step)")
    ap.add_argument("--len", type=int, default=256, help="tokens per prompt")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats")
    ap.add_argument("--engine", default="", metavar="LENS",
                    help="comma-separated prompt lengths: the engine's fused step vs the Python step (SDPA) instead")
    ap.add_argument("--workload", action="store_true",
                    help="the 32-request workload's prefill in the engine, keys in lanes on vs off, instead")
    args = ap.parse_args(argv)
    for name in ("layers", "prompts", "len", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    set_threads(1)
    if args.engine:
        try:
            lens = [int(x) for x in args.engine.split(",")]
        except ValueError:
            raise SystemExit(f"--engine takes comma-separated prompt lengths, got {args.engine!r}") from None
        if not lens or min(lens) < 1:
            raise SystemExit(f"--engine lengths must be >= 1, got {args.engine!r}")
        return engine_long(lens, args.repeats, sys.argv[1:] if argv is None else argv)
    if args.workload:
        return workload_prefill(args.repeats, sys.argv[1:] if argv is None else argv)
    from scratchlm.inference.attention import load_kernels

    ext = load_kernels()
    if ext is None:
        raise SystemExit("the C++ kernels did not build: nothing to measure")
    torch.manual_seed(0)
    per_seq = -(-args.len // BS)
    num_blocks = per_seq * args.prompts
    caches = [(torch.randn(num_blocks, BS, HKV, HD), torch.randn(num_blocks, BS, HKV, HD)) for _ in range(args.layers)]
    perm = torch.randperm(num_blocks)
    seq_tables = [perm[i * per_seq : (i + 1) * per_seq] for i in range(args.prompts)]
    tables = torch.cat([t[None].expand(args.len, -1) for t in seq_tables])  # (N, per_seq): a row's table
    lens = torch.arange(1, args.len + 1).repeat(args.prompts)  # (N,): row j of a prompt sees j + 1 tokens
    n_rows = len(lens)
    qs = [torch.randn(n_rows, H, HD) for _ in range(args.layers)]
    scale = HD**-0.5

    def kernel(tile_rows: int, avx512: bool = True, keys_in_lanes: bool = True):
        def run():
            old = ext.prefill_keys_in_lanes(int(keys_in_lanes))
            try:
                return [ext.paged_decode_attention(q, k, v, tables, lens, scale, True, tile_rows=tile_rows,
                                                   avx512=avx512) for q, (k, v) in zip(qs, caches)]
            finally:
                ext.prefill_keys_in_lanes(int(old))
        return run

    def sdpa():
        outs = []
        for q, (k, v) in zip(qs, caches):
            parts = []
            for i, t in enumerate(seq_tables):
                kk, vv = (c[t].reshape(-1, HKV, HD)[: args.len].transpose(0, 1) for c in (k, v))  # (Hkv, T, D)
                qq = q[i * args.len : (i + 1) * args.len].transpose(0, 1)  # (H, T, D)
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True)
                parts.append(o.transpose(0, 1))
            outs.append(torch.cat(parts))  # (N, H, D)
        return outs

    before = "tiled 8, lanes over D (before)"
    contenders = {"tiled 8": kernel(8), before: kernel(8, keys_in_lanes=False), "row by row": kernel(1),
                  "tiled 4": kernel(4), "tiled 16": kernel(16), "tiled 8, AVX2": kernel(8, False),
                  "row by row, AVX2": kernel(1, False), "torch SDPA": sdpa}
    ref = contenders["tiled 8"]()
    for name, fn in contenders.items():
        got = fn()
        for a, b in zip(ref, got):
            if name == "torch SDPA":
                torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
            elif "AVX2" in name:
                torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
            elif not torch.equal(a, b):
                raise SystemExit(f"{name} differs from tiled 8: the tiling must not change a bit")
    cmp = compare(contenders, warmup=1, repeats=args.repeats, clock="thread_cpu")
    peak = peak_gflops(ext, True)
    flop = 4 * HD * H * int(lens.sum()) * args.layers  # q.k and p.v per (row, head, key)
    rep = Report("prefill_attention", "Prefill attention: tiled paged kernel vs its tiles of before, row by row, "
                 "torch SDPA", argv=sys.argv[1:] if argv is None else argv)
    rep.add(f"{args.prompts} fresh prompt(s) of {args.len} tokens in one chunk ({n_rows} rows), {args.layers} "
            f"layers, {H} query / {HKV} KV heads of {HD}, block size {BS}, float32 cache; thread CPU time, 1 "
            f"thread, {args.repeats} interleaved repeats; GFLOP/s counts the causal work (4 * D per row, head "
            f"and key: {flop / 1e9:.2f} GFLOP).")
    gf = {name: flop / 1e9 / cmp[name].median for name in contenders}
    heads = cmp.headers("GFLOP")
    rep.table(heads[:4] + ["of peak"] + heads[4:], [r[:3] + [f"{gf[r[0]]:.1f}", f"{gf[r[0]] / peak:.0%}"] + r[3:]
                                                    for r in cmp.rows()])
    rep.add(f"Core peak (register-only FMA loop, best of 5, in this run): {peak:.1f} GFLOP/s (16-lane AVX-512).")
    rep.add(f"**tiles of before / tiled 8 = {cmp.ratio(before, 'tiled 8'):.3f}x (median), "
            f"{cmp.ratio(before, 'tiled 8', 'best'):.3f}x (best)**; "
            f"row by row / tiled 8 = {cmp.ratio('row by row', 'tiled 8'):.2f}x (median), "
            f"{cmp.ratio('row by row', 'tiled 8', 'best'):.2f}x (best); torch SDPA / tiled 8 = "
            f"{cmp.ratio('torch SDPA', 'tiled 8'):.2f}x (median); AVX2 / AVX-512 tiles = "
            f"{cmp.ratio('tiled 8, AVX2', 'tiled 8'):.2f}x; row by row AVX2 (the kernel of before) / tiled 8 = "
            f"{cmp.ratio('row by row, AVX2', 'tiled 8'):.2f}x (median), "
            f"{cmp.ratio('row by row, AVX2', 'tiled 8', 'best'):.2f}x (best).")
    rep.write()
    return 0


def engine_long(lens: list[int], repeats: int, argv: list[str]) -> int:
    """One prompt of each length through the engine: every chunk in the fused step vs the limit of before."""
    import random
    import time

    from scratchlm.defaults import default_model_path
    from scratchlm.inference import LLM, EngineConfig, LLMEngine, SamplingParams, runner

    model = default_model_path()
    engine = LLMEngine.from_pretrained(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=512,
                                                           max_model_len=max(lens) + 8))
    if engine.runner.fused_decoder is None:
        raise SystemExit("the engine has no fused step (C++ kernels not built?): nothing to compare")
    llm = LLM.from_engine(engine)
    execute, spent = engine.runner.execute, [0.0]

    def timed(inp):  # the steps' thread CPU time
        t0 = time.thread_time()
        out = execute(inp)
        spent[0] += time.thread_time() - t0
        return out

    engine.runner.execute = timed
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    paths = {"fused step (tiles)": None, "Python step over 512 (SDPA, before)": 512}
    default = runner.FUSED_PREFILL_MAX_CONTEXT
    rows = []
    try:
        for n in lens:
            prompt = [rng.randrange(vocab) for _ in range(n)]
            times: dict[str, list[float]] = {p: [] for p in paths}
            ids: dict[str, list[int]] = {}
            for _ in range(repeats + 1):  # the first round warms up
                for name, limit in paths.items():
                    runner.FUSED_PREFILL_MAX_CONTEXT = limit
                    engine.reset_prefix_cache()
                    spent[0] = 0.0
                    out = llm.generate([prompt], [SamplingParams(temperature=0, max_tokens=1)], use_tqdm=False)
                    times[name].append(spent[0])
                    ids[name] = out[0].outputs[0].token_ids
            (fused, fused_t), (python, python_t) = ((p, sorted(t[1:])) for p, t in times.items())
            med = [statistics.median(t) for t in (fused_t, python_t)]
            rows.append([str(n), f"{med[0]:.3f} s", f"{fused_t[0]:.3f} s", f"{med[1]:.3f} s", f"{python_t[0]:.3f} s",
                         f"{med[1] / med[0]:.3f}x", f"{python_t[0] / fused_t[0]:.3f}x",
                         "yes" if ids[fused] == ids[python] else "no"])
            print(rows[-1], flush=True)
    finally:
        runner.FUSED_PREFILL_MAX_CONTEXT = default
    rep = Report("prefill_attention-engine", "Long prefills: the fused step's tiles vs the Python step (SDPA)",
                 argv=argv)
    rep.add(f"{model.name}, float32, one prompt of each length (random ids, seed 0), chunks of 512 tokens, "
            f"max_tokens 1, 1 thread; thread CPU time of the engine's steps, {repeats} interleaved repeats after a "
            "warm-up. Fused: every chunk in the fused C++ step (runner.FUSED_PREFILL_MAX_CONTEXT = None, the "
            "default); before: 512 (chunks whose context is longer run the Python step with torch SDPA).")
    rep.table(["prompt tokens", "fused median", "fused best", "Python median", "Python best",
               "Python / fused (median)", "(best)", "same greedy token"], rows)
    rep.write()
    return 0


def workload_prefill(repeats: int, argv: list[str]) -> int:
    """The 32-request workload's prefill steps, the tiles' keys in lanes on vs off, interleaved."""
    import time

    from benchmarks.engine_throughput import make_workload
    from scratchlm.defaults import default_model_path
    from scratchlm.inference import LLM, EngineConfig, LLMEngine, SamplingParams
    from scratchlm.inference.attention import load_kernels

    ext = load_kernels()
    engine = LLMEngine.from_pretrained(default_model_path(), EngineConfig(max_num_seqs=32,
                                                                          max_num_batched_tokens=512))
    if ext is None or engine.runner.fused_decoder is None:
        raise SystemExit("the engine's C++ kernels did not build: nothing to compare")
    llm = LLM.from_engine(engine)
    execute, steps = engine.runner.execute, []

    def timed(inp):
        t0 = time.thread_time()
        out = execute(inp)
        steps.append((len(inp.token_ids), time.thread_time() - t0))
        return out

    engine.runner.execute = timed
    prompts, _ = make_workload(32, engine.model_config.vocab_size, 0)
    params = [SamplingParams(temperature=0, max_tokens=1) for _ in prompts]
    names = {"keys in lanes (now)": 1, "lanes over D (before)": 0}
    times: dict[str, list[float]] = {n: [] for n in names}
    ids: dict[str, list] = {}
    old = ext.prefill_keys_in_lanes(-1)
    try:
        for _ in range(repeats + 1):  # the first round warms up
            for name, on in names.items():
                ext.prefill_keys_in_lanes(on)
                engine.reset_prefix_cache()
                steps.clear()
                outs = llm.generate(prompts, params, use_tqdm=False)
                times[name].append(sum(t for _, t in steps))
                ids[name] = [o.outputs[0].token_ids for o in outs]
    finally:
        ext.prefill_keys_in_lanes(int(old))
    n_steps, n_rows = len(steps), sum(n for n, _ in steps)
    now, before = (sorted(times[n][1:]) for n in names)
    rows = [[n, f"{statistics.median(t):.3f} s", f"{t[0]:.3f} s"] for n, t in zip(names, (now, before))]
    rep = Report("prefill_attention-workload", "The workload's prefill: the tiles' keys in lanes on vs off",
                 argv=argv)
    rep.add(f"engine_throughput's 32-request workload, prefill only (max_tokens 1): {n_steps} steps, {n_rows} rows, "
            f"SmolLM2-135M (float32), the fused step, 1 thread; thread CPU of the steps, {repeats} interleaved "
            "repeats after a warm-up.")
    rep.table(["prefill attention tiles", "median", "best"], rows)
    saved = statistics.median(before) - statistics.median(now)
    rep.add(f"before / now = {statistics.median(before) / statistics.median(now):.3f}x (median), "
            f"{before[0] / now[0]:.3f}x (best): the tiles' change saves {saved:.3f} s of the prefill "
            f"(median; best {before[0] - now[0]:.3f} s). First tokens identical: "
            f"{'yes' if ids[list(names)[0]] == ids[list(names)[1]] else 'NO'}.")
    rep.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
