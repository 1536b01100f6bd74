"""The three walls, measured: a roofline of this machine with the engine's operating points on it.

Peaks, measured in the run on the benchmark's thread count (1 by default, as every engine figure):
- compute: the best of a few fp32 GEMMs (torch.mm, N x N x N), the ceiling prefill can reach on this core;
- memory: a plain streaming read (torch.sum of a tensor far larger than the caches), the weights' ceiling.

Operating points, each a forward of the real engine (SmolLM2-135M-Instruct by default) timed by the engine's
own step events (events.py: `forward_s`, the runner call alone) on a workload that makes that step kind:
- prefill: one prompt of `--prefill-len` tokens in one chunk;
- decode at batch 1 and at batch 32, fp32 and int8 (weight-only quantization);
- speculative verification: a batch-1 verify of 1 + k tokens (n-gram drafts on a grounded prompt);
- one Pairformer block (scratchlm.fold, Boltz-2's widths) at several N, FLOPs from torch's FlopCounterMode and
  bytes a lower bound (weights + pair/single inputs and outputs), so its intensity is an upper bound;
- the diffusion case study (scratchlm.diffusion, the MNIST recipe's DiT and VAE shapes, random weights): one
  denoiser step (a DiT forward on the CFG batch of 2) and one VAE decode at the MNIST latent (7x7) and larger
  latents (16x16, 32x32, 64x64: the memory-wall sizes of docs/diffusion.md); FLOPs from FlopCounterMode, bytes
  a lower bound (weights + the forward's inputs and outputs), time with the fused attention the pipeline runs.

For each: FLOPs (2 x the linear layers' parameters per token, the head's rows that are sampled, attention
over each token's context) and bytes (every weight once per forward, the KV context read, the KV rows
written) per forward, so arithmetic intensity = FLOPs / bytes; achieved FLOP/s = FLOPs / forward time; the
roof at that intensity = min(peak FLOP/s, bandwidth x intensity); the wall hit is memory below the ridge
point (peak / bandwidth) and compute above it. The last table measures what each technique moves.

    python -m benchmarks.walls                       # SmolLM2-135M, 1 thread (a few minutes)
    python -m benchmarks.walls --quick               # stories260K, small peaks: a smoke run (seconds)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, Report, set_threads, shared_data_dir


@dataclass
class Point:
    name: str
    tokens: int  # tokens fed per forward
    emitted: float  # tokens the forward produces for the outputs (batch rows; a verify: 1 + accepted)
    flops: float
    bytes: float
    seconds: float  # median forward time
    bytes_lower_bound: bool = False  # bytes counted are a lower bound, so the intensity is an upper bound
    label: str = ""  # a short name on the plot (default: the name)
    family: str = ""  # points of one family are joined on the plot (one model at growing sizes)

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def achieved(self) -> float:
        return self.flops / self.seconds


def peak_flops(n: int, repeats: int) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * n**3 / best


def peak_bandwidth(mib: int, repeats: int) -> float:
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def weight_bytes(model: torch.nn.Module) -> int:
    from benchmarks.quant_speed import decode_bytes

    return decode_bytes(model)


def linear_params(cfg) -> int:
    """Multiply-accumulate weights per token in the layers (q, k, v, o and the SwiGLU's three matrices)."""
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2
    return cfg.n_layers * (attn + 3 * d * cfg.d_ff)


def step_cost(cfg, works, logit_rows: int, kv_bytes_per_token: int, weights: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one forward over `works` (events.SeqWork)."""
    tokens = sum(w.num_tokens for w in works)
    flops = 2.0 * linear_params(cfg) * tokens + 2.0 * cfg.d_model * cfg.vocab_size * logit_rows
    ctx_read = 0
    for w in works:
        n, s = w.num_tokens, w.start
        # token j of the step attends to s + j + 1 keys: QK^T and PV, 2 FLOPs per multiply-add
        keys = n * s + n * (n + 1) // 2
        flops += 4.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * keys
        ctx_read += s + n
    data = weights + kv_bytes_per_token * (ctx_read + tokens)  # context read once per sequence, new rows written
    return flops, float(data)


class Probe:
    """Collect the engine's step events of one kind while a workload runs."""

    def __init__(self, engine, keep):
        self.engine, self.keep, self.events = engine, keep, []

    def __call__(self, ev) -> None:
        if self.keep(ev):
            self.events.append(ev)

    def run(self, requests) -> list:
        self.engine.events.subscribe(self)
        try:
            self.engine.reset_prefix_cache()
            for rid, prompt, params in requests:
                self.engine.add_request(rid, prompt, params)
            while self.engine.has_unfinished_requests():
                self.engine.step()
        finally:
            self.engine.events.unsubscribe(self)
        return self.events


def measure(engine, name: str, requests, keep, rounds: int, emitted=None) -> Point:
    cfg = engine.model_config
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * engine.cache.k.element_size()
    weights = weight_bytes(engine.runner.model)
    events = []
    for r in range(rounds):
        events += Probe(engine, keep).run([(f"{name}-{r}-{rid}", p, s) for rid, p, s in requests])
    if not events:
        raise RuntimeError(f"{name}: the workload made no step of the kind measured")
    ev = sorted(events, key=lambda e: e.forward_s)[len(events) // 2]  # the median step
    works = ev.decodes + ev.prefills
    flops, data = step_cost(cfg, works, sum(1 for w in works if w.samples) + sum(w.num_tokens - 1 for w in works
                                                                                  if w.kind == "verify"),
                            kv, weights)
    out = emitted(ev) if emitted is not None else float(len(works))
    return Point(name, sum(w.num_tokens for w in works), out, flops, data, statistics.median(e.forward_s
                                                                                               for e in events))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.walls", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32, help="the batched decode's sequences")
    ap.add_argument("--rounds", type=int, default=3, help="repeats of each workload (median step)")
    ap.add_argument("--quick", action="store_true", help="stories260K, small peaks, one round: a smoke run")
    ap.add_argument("--comm", action=argparse.BooleanOptionalAction, default=None,
                    help="the I/O wall: the link between two processes and TP/PP/CP steps (default: on, off with "
                         "--quick, where --comm runs a small form: the link and TP=2 on stories260K)")
    ap.add_argument("--comm-rounds", type=int, default=3, help="interleaved rounds of the TP/PP/CP workloads")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    from scratchlm.defaults import default_model_path
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams

    if args.quick:
        model = args.model or str(shared_data_dir() / "models/stories260K/stories260K.bin")
        n, mib, rounds, prefill = 384, 64, 1, min(args.prefill_len, 128)
    else:
        model, n, mib, rounds, prefill = args.model or str(default_model_path()), 2048, 512, args.rounds, \
            args.prefill_len
    flops_peak = peak_flops(n, 3 if args.quick else 5)
    bw_peak = peak_bandwidth(mib, 3 if args.quick else 5)
    ridge = flops_peak / bw_peak

    def engine(**options) -> LLMEngine:
        cfg = EngineConfig(max_num_seqs=max(args.batch, 2), max_num_batched_tokens=max(prefill, args.batch),
                           enable_prefix_caching=False, kv_cache_memory=256 << 20, **options)
        return LLMEngine.from_pretrained(model, cfg)

    greedy = lambda k: SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)  # noqa: E731
    fp32 = engine()
    vocab = fp32.model_config.vocab_size
    prompt = [(7 * i) % (vocab - 3) + 3 for i in range(prefill)]
    short = [[(11 * i + 5 * s) % (vocab - 3) + 3 for i in range(16)] for s in range(args.batch)]

    def decodes(b: int):
        return lambda ev: not ev.prefills and len(ev.decodes) == b and all(w.kind == "decode" for w in ev.decodes)

    points = [
        measure(fp32, "prefill (fp32)", [("p", prompt, greedy(1))],
                lambda ev: len(ev.prefills) == 1 and ev.prefills[0].num_tokens == prefill, rounds),
        measure(fp32, "decode, batch 1 (fp32)", [("d", short[0], greedy(24))], decodes(1), rounds),
        measure(fp32, f"decode, batch {args.batch} (fp32)", [(f"b{i}", short[i], greedy(12))
                                                              for i in range(args.batch)], decodes(args.batch), rounds),
    ]
    del fp32
    int8 = engine(quantization="int8")
    points += [
        measure(int8, "decode, batch 1 (int8)", [("d", short[0], greedy(24))], decodes(1), rounds),
        measure(int8, f"decode, batch {args.batch} (int8)", [(f"b{i}", short[i], greedy(12))
                                                              for i in range(args.batch)], decodes(args.batch), rounds),
    ]
    del int8
    k = 4
    spec = engine(speculative="ngram", num_speculative_tokens=k)
    spec.speculator.adaptive = False  # always k drafts when the n-gram finds them: the verify point is 1 + k tokens
    # a grounded prompt: P, then the target's own greedy continuation G of P, then P again; the n-gram lookup
    # finds P's earlier occurrence and drafts G, which greedy decoding accepts (the best case: an answer copied)
    base = short[1]
    cont: list[int] = []
    plain = engine()
    plain.add_request("g", base, greedy(32))
    while plain.has_unfinished_requests():
        for out in plain.step():
            if out.finished:
                cont = out.outputs[0].token_ids
    del plain
    pattern = base + cont + base
    accepted: list[int] = []
    spec.events.subscribe(lambda ev: accepted.append(ev.spec_accepted or 0) if ev.decodes and
                          ev.decodes[0].kind == "verify" else None)
    points.append(measure(spec, f"speculative verify, 1 + {k} tokens (fp32)", [("s", pattern, greedy(32))],
                          lambda ev: len(ev.decodes) == 1 and ev.decodes[0].kind == "verify"
                          and ev.decodes[0].num_tokens == 1 + k, rounds,
                          emitted=lambda ev: 1.0 + (ev.spec_accepted or 0)))
    mean_accept = statistics.mean(accepted) if accepted else 0.0
    points[-1].emitted = 1.0 + mean_accept

    points += pairformer_points((16, 32) if args.quick else (32, 64, 128), rounds)
    points += diffusion_points((7,) if args.quick else (7, 16, 32, 64), rounds)

    rows = []
    for p in points:
        roof = min(flops_peak, bw_peak * p.intensity)
        wall = "memory" if p.intensity < ridge else "compute"
        if p.bytes_lower_bound:  # bytes are a lower bound, so the intensity an upper bound
            wall = "memory" if p.intensity < ridge else "compute (intensity an upper bound)"
        mb = p.bytes / 2**20
        rows.append([p.name, p.tokens, f"{p.flops / 1e9:.2f}", f"{mb:.0f}" if mb >= 10 else f"{mb:.2f}",
                     f"{p.intensity:.1f}",
                     f"{p.achieved / 1e9:.1f}", f"{roof / 1e9:.1f}", f"{100 * p.achieved / roof:.0f} %", wall,
                     f"{p.emitted / p.seconds:.1f}"])

    report = Report("walls", "The three walls: this machine's roofline and the engine's operating points",
                    argv if argv is not None else sys.argv[1:])
    report.add(f"Model `{model.split('/')[-1]}`; {args.threads} thread(s); each point is the median forward "
               f"(`StepEvent.forward_s`) of {rounds} round(s) of its workload; prefix caching off.")
    report.table(["peak", "value", "how"], [
        ["compute (fp32 GEMM)", f"{flops_peak / 1e9:.1f} GFLOP/s", f"best torch.mm {n}x{n}x{n}"],
        ["memory (streaming read)", f"{bw_peak / 1e9:.2f} GB/s", f"best torch.sum over {mib} MiB"],
        ["ridge point", f"{ridge:.1f} FLOP/byte", "peak compute / peak bandwidth"],
    ], caption="Machine peaks")
    report.table(["workload", "tokens / forward", "GFLOP / forward", "MiB / forward", "FLOP/byte",
                  "achieved GFLOP/s", "roof GFLOP/s", "of roof", "wall",
                  "outputs / s (LLM: tokens; Pairformer, diffusion: forwards)"], rows,
                 caption="Operating points")
    by = {p.name: p for p in points}
    b1, bn = by["decode, batch 1 (fp32)"], by[f"decode, batch {args.batch} (fp32)"]
    q1, qn = by["decode, batch 1 (int8)"], by[f"decode, batch {args.batch} (int8)"]
    sv, pf = next(p for p in points if p.name.startswith("speculative")), points[0]
    tok_s = lambda p: p.emitted / p.seconds  # noqa: E731
    report.table(["technique", "moves", "measured gain"], [
        [f"batching (decode, 1 -> {args.batch} sequences)", f"intensity {b1.intensity:.1f} -> {bn.intensity:.1f} "
         "FLOP/byte: up the memory roof", f"{tok_s(bn) / tok_s(b1):.2f}x output tok/s"],
        ["quantization (int8 weights, batch 1)", f"bytes / forward {b1.bytes / 2**20:.0f} -> {q1.bytes / 2**20:.0f} "
         "MiB", f"{tok_s(q1) / tok_s(b1):.2f}x output tok/s"],
        [f"quantization at batch {args.batch}", f"{bn.bytes / 2**20:.0f} -> {qn.bytes / 2**20:.0f} MiB",
         f"{tok_s(qn) / tok_s(bn):.2f}x output tok/s"],
        [f"speculation (verify 1 + {k}, {mean_accept:.2f} drafts accepted on average: a copied answer, the best "
         "case)",
         f"tokens / weight read 1 -> {sv.emitted:.2f}; forward {1e3 * b1.seconds:.1f} -> {1e3 * sv.seconds:.1f} ms",
         f"{tok_s(sv) / tok_s(b1):.2f}x output tok/s per forward (drafting excluded)"],
        ["chunked prefill vs decode", f"{pf.tokens} tokens share one weight read",
         f"prefill {pf.tokens / pf.seconds:.0f} tok/s vs batch-1 decode {tok_s(b1):.1f} tok/s"],
    ], caption="What each technique moves")
    io = None
    if args.comm if args.comm is not None else not args.quick:
        io = io_wall(report, model, args, prefill, flops_peak, ridge)
    png = RESULTS_DIR / f"{time.strftime('%Y-%m-%d')}-walls.png"
    try:
        plot(points, flops_peak, bw_peak, png, io)
        report.add(f"![roofline]({png.name})")
    except ImportError:
        report.add("(matplotlib not installed: no plot)")
    report.write()
    return 0


def io_wall(report, model: str, args, prefill: int, flops_peak: float, ridge: float) -> tuple:
    """The I/O wall: the link between two gloo processes, then TP / PP / CP engine steps against one rank,
    interleaved; adds its tables to `report`, returns (points, link) for the plot."""
    if args.quick:  # a smoke run: small messages, TP=2 only
        sizes, repeats, layouts, batch = [4, 4096, 1 << 18, 1 << 20], 5, {"one rank": {}, "TP=2": {
            "tensor_parallel_size": 2}}, min(args.batch, 4)
    else:
        sizes, repeats, batch = [4, 256, 4096, 1 << 16, 1 << 20, 1 << 24], 20, args.batch
        layouts = {"one rank": {}, "TP=2": {"tensor_parallel_size": 2}, "PP=2": {"pipeline_parallel_size": 2},
                   "CP=2": {"context_parallel_size": 2, "context_parallel_threshold": prefill}}
    links = measure_links(sizes, repeats)
    cpoints, _ = comm_points(model, layouts, prefill, batch, 1 if args.quick else args.comm_rounds)
    report.add(f"**The I/O wall.** Each layout's engine ({', '.join(layouts)}; 1 thread per rank, gloo) lives in "
               "its own process for the whole run; the workloads run interleaved, layout after layout, "
               f"{1 if args.quick else args.comm_rounds} round(s); per (layout, workload) the median step's forward "
               "(`StepEvent.forward_s` on rank 0) and the calls inside that step from rank 0's `Comm` counters "
               "(time, calls, bytes per kind: what the step traces' comm track shows). Bytes over rank 0's link: "
               "what it sends (ring all-reduce volume 2(P-1)/P x payload, all-gather parts, sends, the pickled "
               "step command) and what it receives in pipeline waits. 'Link time' prices each call at the median "
               "rate the two-process link measurement reached at that message size (the roofs use the best); "
               "'in comm calls' also holds waiting "
               "for the peer (a pipeline stage's compute, skew between TP ranks). FLOPs per rank = the step's "
               "FLOPs / ranks.")
    link = comm_report(report, cpoints, links, flops_peak, ridge)
    return cpoints, link


def pairformer_points(ns: tuple[int, ...], rounds: int) -> list[Point]:
    """One Pairformer block (scratchlm.fold, Boltz-2's widths) at each N: FLOPs counted by torch's FlopCounterMode
    (its matmuls, einsums and attention), time the median of `rounds` + 1 forwards. Bytes are a *lower bound*: the
    weights and the block's pair/single inputs and outputs once (the N^2-sized intermediates of the triangle
    updates move too), so the intensity is an upper bound."""
    from torch.utils.flop_counter import FlopCounterMode

    from scratchlm.fold.pairformer import PairformerBlock, PairformerConfig

    cfg = PairformerConfig(n_blocks=1)
    torch.manual_seed(0)
    block = PairformerBlock(cfg).eval()
    weights = sum(p.numel() * p.element_size() for p in block.parameters())
    out = []
    for n in ns:
        s, z = torch.randn(1, n, cfg.c_s), torch.randn(1, n, n, cfg.c_z)
        mask, pm = torch.ones(1, n), torch.ones(1, n, n)
        with torch.no_grad():
            counter = FlopCounterMode(display=False)
            with counter:
                block(s, z, mask, pm)
            times = [_timed(lambda a=(s, z, mask, pm): block(*a)) for _ in range(max(2, rounds))]
        data = weights + 2 * 4 * (z.numel() + s.numel())
        out.append(Point(f"Pairformer block, N = {n} (fp32)", n, 1.0, float(counter.get_total_flops()), float(data),
                         statistics.median(times), bytes_lower_bound=True))
    return out


def diffusion_points(sizes: tuple[int, ...], rounds: int) -> list[Point]:
    """The diffusion case study's two heavy forwards at each latent side s (tokens N = s^2, patch 1), with the
    MNIST recipe's shapes (recipes/diffusion_mnist.toml; random weights: FLOPs, bytes and time do not depend on
    them): one denoiser step, a DiT forward on the classifier-free-guidance batch of 2 (uncond + cond) with 8 text
    tokens, and one VAE decode of a single latent to its (4s x 4s) image.

    FLOPs: FlopCounterMode, with the attention counted on its materialised form in 256-query chunks (torch's CPU
    flash kernel reports 0 FLOPs to the counter; the matmuls are the same). Time: the median of max(2, rounds)
    forwards after a warm-up, with the fused SDPA the pipeline runs. Bytes are a *lower bound*: the weights the
    forward uses once (for the VAE its decoder and post-quant conv only) plus its inputs (latent, timesteps, text
    tokens) and its output, fp32; the activations in between (at 64x64 a DiT layer's (2, 4096, 64) tensors, a
    materialised attention's 2*H*N^2 scores) are not counted, so the intensity is an upper bound."""
    import tomllib

    from torch.utils.flop_counter import FlopCounterMode

    from scratchlm.diffusion.dit import DiT, DiTConfig
    from scratchlm.diffusion.layers import attention_impl, chunked_attention
    from scratchlm.diffusion.train import DiffusionTrainConfig
    from scratchlm.diffusion.vae import AutoencoderKL, VAEConfig

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "diffusion_mnist.toml"
    rc = DiffusionTrainConfig(**tomllib.loads(recipe.read_text()))
    torch.manual_seed(0)
    vae = AutoencoderKL(VAEConfig(in_channels=1, out_channels=1, latent_channels=rc.latent_channels,
                                  block_out_channels=tuple(rc.vae_channels), norm_num_groups=rc.vae_groups,
                                  sample_size=28)).eval()
    f = vae.config.downsample
    decoder = list(vae.post_quant_conv.parameters()) + list(vae.decoder.parameters())  # what a decode reads
    d, c = rc.dit_width, rc.latent_channels

    def nbytes(*ts) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    def point(name: str, n: int, params, fn, inputs) -> Point:
        with torch.no_grad():
            counter = FlopCounterMode(display=False)
            with counter, attention_impl("math"), chunked_attention(256):
                fn()
            fn()  # warm-up
            times = [_timed(fn) for _ in range(max(2, rounds))]
            out = fn()
        data = nbytes(*params) + nbytes(*inputs, out)
        return Point(name, n, 1.0, float(counter.get_total_flops()), float(data), statistics.median(times),
                     bytes_lower_bound=True)

    out = []
    for s in sizes:
        dit = DiT(DiTConfig(sample_size=s, in_channels=c, out_channels=c, patch_size=1, num_layers=rc.dit_layers,
                            num_attention_heads=rc.dit_heads, attention_head_dim=d // rc.dit_heads,
                            cross_attention_dim=d)).eval()
        x, t, text = torch.randn(2, c, s, s), torch.tensor([500.0, 500.0]), torch.randn(2, rc.max_len, d)
        mnist = " (MNIST)" if s * f == 28 else ""
        out.append(point(f"DiT denoiser step, {s}x{s} latent{mnist}, CFG batch 2 (fp32)", s * s, list(dit.parameters()),
                         lambda m=dit, a=(x, t, text): m(*a), (x, t, text)))
        out[-1].label, out[-1].family = f"DiT {s}x{s}", "DiT denoiser step (CFG batch 2)"
        z = torch.randn(1, c, s, s)
        out.append(point(f"VAE decode, {s}x{s} -> {s * f} px{mnist} (fp32)", s * s, decoder,
                         lambda z=z: vae.decode(z), (z,)))
        out[-1].label, out[-1].family = f"VAE {s}x{s}", "VAE decode"
    return out


def plot(points: list[Point], flops_peak: float, bw_peak: float, path, io: tuple | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from scratchlm.atomic import replace

    xs = [p.intensity for p in points]
    lo, hi = min(xs + [0.1]) / 2, max(xs + [flops_peak / bw_peak]) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    if io is not None:
        fig, (ax, ax_io, ax_bw) = plt.subplots(1, 3, figsize=(22, 6))
        plot_io(ax_io, ax_bw, io[0], io[1], flops_peak)
    else:
        fig, ax = plt.subplots(figsize=(8, 5))
    ax.loglog(grid, [min(flops_peak, bw_peak * x) / 1e9 for x in grid], "k-", label="roofline (measured peaks)")
    ax.axvline(flops_peak / bw_peak, color="gray", ls=":", lw=1)
    families: dict[str, list[Point]] = {}
    for p in points:
        if p.family:
            families.setdefault(p.family, []).append(p)
            continue
        ax.loglog([p.intensity], [p.achieved / 1e9], "o")
        ax.annotate(p.label or p.name, (p.intensity, p.achieved / 1e9), textcoords="offset points", xytext=(5, 4),
                    fontsize=8)
    for (family, ps), marker in zip(families.items(), "^sdv"):
        ax.loglog([p.intensity for p in ps], [p.achieved / 1e9 for p in ps], marker + "--", lw=0.8, label=family)
        for p in ps:
            ax.annotate(p.label or p.name, (p.intensity, p.achieved / 1e9), textcoords="offset points",
                        xytext=(4, -10), fontsize=7)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title("Roofline of this machine (1 thread): the engine's, Pairformer's and diffusion's forwards")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    replace(tmp, path)


# ------------------------------------------------------------------ the I/O wall: TP / PP / CP communication


@dataclass
class CommPoint:
    """One parallel engine step kind, measured on rank 0: its forward, and the communication inside it."""

    layout: str
    workload: str
    world: int
    tokens: int
    flops: float  # the whole step's FLOPs (all ranks)
    mem_bytes: float  # the whole step's weight + KV bytes (as the roofline counts them)
    seconds: float  # median forward (StepEvent.forward_s on rank 0: broadcast, its shard, the collectives)
    comm_s: float  # rank 0's time inside collectives and waits in that step
    calls: int  # rank 0's collectives / p2p calls in that step (excluding the step-command broadcast)
    sent: int  # bytes rank 0 sent (receives counted for the waits: what crossed its link), as Comm.bytes counts
    kinds: dict  # {kind: (seconds, calls, bytes)}
    single_s: float = 0.0  # the same workload's median forward on one rank (interleaved), for the speed-up

    @property
    def io_intensity(self) -> float:  # a rank's FLOPs per byte over its link
        return self.flops / self.world / max(self.sent, 1)

    @property
    def achieved(self) -> float:  # FLOP/s per rank
        return self.flops / self.world / self.seconds

    @property
    def message(self) -> float:  # mean bytes per call that moves data
        return self.sent / max(self.calls, 1)

    @property
    def comm_bandwidth(self) -> float:  # bytes over the time spent in communication
        return self.sent / max(self.comm_s, 1e-12)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _p2p_rank(rank: int, port: int, sizes: list[int], repeats: int, out) -> None:
    """One of two gloo ranks: ping-pong (send + recv) and all-reduce of each size, `repeats` times each."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=300))
    res = {}
    peer = 1 - rank
    for n in sizes:
        x = torch.zeros(max(1, n // 4))
        pings, reduces = [], []
        for _ in range(repeats + 2):  # two warm-ups
            t = time.perf_counter()
            if rank == 0:
                dist.send(x, peer)
                dist.recv(x, peer)
            else:
                dist.recv(x, peer)
                dist.send(x, peer)
            pings.append((time.perf_counter() - t) / 2)  # one way
            t = time.perf_counter()
            dist.all_reduce(x)
            reduces.append(time.perf_counter() - t)
        res[n] = (pings[2:], reduces[2:])
    if rank == 0:
        out.put(res)
    dist.barrier()
    dist.destroy_process_group()


def measure_links(sizes: list[int], repeats: int) -> dict[int, tuple[list[float], list[float]]]:
    """{bytes: (one-way p2p seconds, all-reduce seconds)} between two fresh gloo processes on this machine."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_p2p_rank, args=(r, port, sizes, repeats, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        res = out.get(timeout=600)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return res


def _keep(spec: tuple) -> Callable:
    kind, n = spec
    if kind == "prefill":
        return lambda ev: len(ev.prefills) == 1 and not ev.decodes and ev.prefills[0].num_tokens == n
    return lambda ev: not ev.prefills and len(ev.decodes) == n and all(w.kind == "decode" for w in ev.decodes)


def _layout_client(conn, model: str, options: dict, prefill: int, batch: int) -> None:
    """One layout's engine, warm for the whole run (a process holds one torch.distributed world); runs the
    workloads the driver names and answers with every matching step: its works, forward time and the comm
    counters' change over it (rank 0's `Comm`: seconds, calls, bytes per kind)."""
    from benchmarks.common import set_threads as _threads
    from scratchlm.inference import EngineConfig, LLMEngine

    _threads(1)
    cfg = EngineConfig(max_num_seqs=max(batch, 2), max_num_batched_tokens=max(prefill, batch),
                       enable_prefix_caching=False, kv_cache_memory=256 << 20, **options)
    engine = LLMEngine.from_pretrained(model, cfg)
    comm = getattr(engine.runner, "comm", None)
    if comm is not None:
        comm.count_object_bytes = True  # the step command's pickle counts as sent bytes too
    info = {"cfg": engine.model_config, "kv": 2 * engine.model_config.n_layers * engine.model_config.n_kv_heads
            * engine.model_config.head_dim * 4, "weights": weight_bytes(engine.runner.model) if comm is None else 0}
    conn.send(info)

    def counters() -> dict:
        if comm is None:
            return {}
        return {k: (comm.seconds[k], comm.calls[k], comm.bytes[k]) for k in comm.seconds}

    while (cmd := conn.recv()) is not None:
        name, requests, spec = cmd
        keep, steps, last = _keep(spec), [], [counters()]

        def listen(ev, keep=keep, steps=steps, last=last) -> None:
            now = counters()
            delta = {k: tuple(a - b for a, b in zip(v, last[0].get(k, (0.0, 0, 0)))) for k, v in now.items()}
            last[0] = now
            if keep(ev):
                steps.append({"forward_s": ev.forward_s, "works": ev.decodes + ev.prefills, "comm": delta})

        engine.events.subscribe(listen)
        try:
            for rid, prompt, params in requests:
                engine.add_request(f"{name}-{len(steps)}-{time.monotonic_ns()}-{rid}", prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
        finally:
            engine.events.unsubscribe(listen)
        conn.send(steps)
    if hasattr(engine.runner, "shutdown"):
        engine.runner.shutdown()


def comm_points(model: str, layouts: dict[str, dict], prefill: int, batch: int, rounds: int,
                with_decode_batch: bool = True) -> tuple[list[CommPoint], dict]:
    """Every layout's engine in its own process; the workloads interleaved layout by layout (A B C D, A B C D,
    ...); per (layout, workload) the median step and the comm inside it. Returns the points and the model info."""
    import multiprocessing as mp

    from scratchlm.inference import SamplingParams

    ctx = mp.get_context("spawn")
    clients = {}
    for name, options in layouts.items():
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_layout_client, args=(child, model, options, prefill, batch), daemon=True)
        proc.start()
        clients[name] = (parent, proc)
    info = {name: conn.recv() for name, (conn, _) in clients.items()}
    cfg = next(iter(info.values()))["cfg"]
    weights = next(i["weights"] for i in info.values() if i["weights"])
    kv = next(iter(info.values()))["kv"]
    vocab = cfg.vocab_size
    greedy = lambda k: SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)  # noqa: E731
    prompt = [(7 * i) % (vocab - 3) + 3 for i in range(prefill)]
    short = [[(11 * i + 5 * s) % (vocab - 3) + 3 for i in range(16)] for s in range(batch)]
    workloads = {f"prefill {prefill}": ([("p", prompt, greedy(1))], ("prefill", prefill)),
                 "decode, batch 1": ([("d", short[0], greedy(12))], ("decode", 1))}
    if with_decode_batch:
        workloads[f"decode, batch {batch}"] = ([(f"b{i}", short[i], greedy(8)) for i in range(batch)],
                                               ("decode", batch))
    steps: dict[tuple[str, str], list] = {}
    try:
        for r in range(rounds):
            for wname, (requests, spec) in workloads.items():
                order = list(clients) if r % 2 == 0 else list(clients)[::-1]
                for name in order:
                    conn = clients[name][0]
                    conn.send((wname, requests, spec))
                    steps.setdefault((name, wname), []).extend(conn.recv())
            print(f"  comm round {r + 1}/{rounds} done; load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    finally:
        for conn, _ in clients.values():
            with contextlib.suppress(Exception):
                conn.send(None)
        for _, proc in clients.values():
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    points = []
    worlds = {name: o.get("tensor_parallel_size", 1) * o.get("pipeline_parallel_size", 1)
              * o.get("context_parallel_size", 1) for name, o in layouts.items()}
    single = {w: statistics.median(s["forward_s"] for s in steps[("one rank", w)]) for w in workloads
              if ("one rank", w) in steps and steps[("one rank", w)]}
    for (name, wname), found in steps.items():
        if name == "one rank" or not found:
            continue
        med = sorted(found, key=lambda s: s["forward_s"])[len(found) // 2]  # the median step, its comm with it
        works = med["works"]
        flops, data = step_cost(cfg, works, sum(1 for w in works if w.samples), kv, weights)
        moving = {k: v for k, v in med["comm"].items() if k != "broadcast"}
        kinds = {k: v for k, v in med["comm"].items() if v[1]}
        points.append(CommPoint(
            name, wname, worlds[name], sum(w.num_tokens for w in works), flops, data,
            statistics.median(s["forward_s"] for s in found),
            sum(v[0] for v in med["comm"].values()), int(sum(v[1] for v in moving.values())),
            int(sum(v[2] for v in med["comm"].values())), kinds, single.get(wname, 0.0)))
    return points, {"cfg": cfg, "workloads": list(workloads)}


def link_curve(links: dict, pick=min) -> tuple[list[int], list[float], list[float]]:
    """(sizes, p2p bytes/s, all-reduce bytes/s) from measure_links: the best time of each size (`pick=min`, the
    link's ceiling, as the compute and memory peaks are best-of) or its median (`statistics.median`)."""
    sizes = sorted(links)
    p2p = [n / pick(links[n][0]) for n in sizes]
    ar = [n / pick(links[n][1]) for n in sizes]
    return sizes, p2p, ar


def bandwidth_at(sizes: list[int], rates: list[float], n: float) -> float:
    """The measured rate at message size n: log-log interpolation of the curve (clamped at its ends)."""
    import math

    if n <= sizes[0]:
        return rates[0] * n / sizes[0]  # below the smallest size: latency-bound, time ~ constant
    if n >= sizes[-1]:
        return rates[-1]
    for (a, ra), (b, rb) in zip(zip(sizes, rates), zip(sizes[1:], rates[1:])):
        if a <= n <= b:
            f = (math.log(n) - math.log(a)) / (math.log(b) - math.log(a))
            return math.exp(math.log(ra) + f * (math.log(rb) - math.log(ra)))
    return rates[-1]


def link_time(kinds: dict, sizes: list[int], p2p: list[float], ar: list[float]) -> float:
    """What a step's calls cost the link alone at the rates measured between two processes: per kind, calls x
    (mean message / the rate at that size; the all-reduce curve for all-reduces, the p2p one for the rest)."""
    total = 0.0
    for kind, (_, calls, nbytes) in kinds.items():
        if not calls or not nbytes:
            continue
        m = nbytes / calls
        total += calls * m / bandwidth_at(sizes, ar if "all_reduce" in kind else p2p, m)
    return total


def comm_wall(p: CommPoint, link_s: float, n_half: float, ridge: float) -> str:
    """The wall a parallel step hits: the link's (latency below n_half, else bandwidth) when the calls' link time
    is a third of the step or more; waits on the peer when the time in calls is, but not the link; else the
    roofline's memory / compute wall of its bytes."""
    if link_s >= p.seconds / 3:
        return "I/O: latency (messages < n½)" if p.message < n_half else "I/O: bandwidth"
    if p.comm_s >= p.seconds / 3:
        return "waits on the peer (its compute, skew, scheduling), not the link"
    return "memory" if p.flops / p.mem_bytes < ridge else "compute"


def _kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / 2**20:.1f} MiB"


def comm_report(report, cpoints: list[CommPoint], links: dict, flops_peak: float, ridge: float) -> dict:
    """The I/O wall's three tables; returns what the plot needs."""
    sizes, p2p, ar = link_curve(links)
    alpha = min(links[sizes[0]][0])  # one-way latency of the smallest message
    beta = max(p2p)
    n_half = alpha * beta  # the message size at which the link reaches half its bandwidth
    rows = []
    for n in sizes:
        pings, reds = links[n]
        rows.append([_kib(n) if n >= 1024 else f"{n} B", f"{1e6 * min(pings):.1f}",
                     f"{1e6 * statistics.median(pings):.1f}",
                     f"{n / min(pings) / 1e9:.3f}", f"{1e6 * min(reds):.1f}", f"{1e6 * statistics.median(reds):.1f}",
                     f"{n / min(reds) / 1e9:.3f}"])
    report.table(["message", "p2p one-way, best (us)", "median (us)", "p2p GB/s (best)", "all-reduce, best (us)",
                  "median (us)", "all-reduce GB/s (best)"], rows,
                 caption="The link: gloo between two processes on this machine (send + recv ping-pong / 2, all-reduce)")
    report.add(f"Link: latency α = {1e6 * alpha:.1f} us (one way, {sizes[0]} B), bandwidth β = {beta / 1e9:.2f} GB/s "
               f"(best p2p), half-bandwidth message n½ = α β = {_kib(n_half)}; the compute peak per rank "
               f"{flops_peak / 1e9:.1f} GFLOP/s (1 thread), so the I/O ridge is {flops_peak / beta:.0f} FLOP per byte "
               "over the link.")
    rows, links_s = [], {}
    _, p2p_med, ar_med = link_curve(links, statistics.median)  # the link under the same load as the median step
    for p in cpoints:
        link_s = link_time(p.kinds, sizes, p2p_med, ar_med)
        links_s[(p.layout, p.workload)] = link_s
        roof = min(flops_peak, beta * p.io_intensity)
        rate_m = bandwidth_at(sizes, p2p, p.message)
        detail = "; ".join(f"{k} {c} x {_kib(b / c) if b else '0 B'} ({1e3 * s:.2f} ms)"
                           for k, (s, c, b) in sorted(p.kinds.items()))
        rows.append([p.layout, p.workload, p.tokens, f"{1e3 * p.seconds:.1f}",
                     f"{p.single_s / p.seconds:.2f}x" if p.single_s else "-",
                     f"{1e3 * p.comm_s:.1f} ({100 * p.comm_s / p.seconds:.0f} %)",
                     f"{1e3 * link_s:.1f} ({100 * link_s / p.seconds:.0f} %)", p.calls, _kib(p.sent), _kib(p.message),
                     f"{p.comm_bandwidth / 1e9:.3f}", f"{rate_m / 1e9:.3f}", f"{p.io_intensity:.0f}",
                     f"{p.achieved / 1e9:.1f}", f"{roof / 1e9:.1f}", comm_wall(p, link_s, n_half, ridge), detail])
    report.table(["layout", "workload", "tokens", "forward ms (rank 0)", "speed-up vs one rank",
                  "in comm calls ms (share)", "link time at the median measured rates ms (share)", "calls / step",
                  "bytes over rank 0's link / step", "mean message", "achieved GB/s in calls",
                  "p2p GB/s at that size", "FLOP per byte over the link (per rank)", "achieved GFLOP/s per rank",
                  "I/O roof GFLOP/s", "wall", "calls by kind (count x mean message, time)"], rows,
                 caption="Communication per step (rank 0), TP / PP / CP on two processes")
    by = {(p.layout, p.workload): p for p in cpoints}
    tech = []
    wl = sorted({p.workload for p in cpoints})
    prefill = next((w for w in wl if w.startswith("prefill")), None)
    batched = next((w for w in wl if w.startswith("decode, batch") and w != "decode, batch 1"), None)
    if ("TP=2", "decode, batch 1") in by and batched and ("TP=2", batched) in by:
        a, b = by[("TP=2", "decode, batch 1")], by[("TP=2", batched)]
        per_tok = lambda p: p.comm_s / max(p.tokens, 1)  # noqa: E731
        tech.append([f"batching under TP (decode 1 -> {b.tokens} sequences)",
                     f"mean all-reduce message {_kib(a.message)} -> {_kib(b.message)}; achieved "
                     f"{a.comm_bandwidth / 1e9:.3f} -> {b.comm_bandwidth / 1e9:.3f} GB/s in calls",
                     f"{per_tok(a) / per_tok(b):.1f}x less comm time per token "
                     f"({1e3 * per_tok(a):.2f} -> {1e3 * per_tok(b):.3f} ms)"])
    if ("TP=2", "decode, batch 1") in by and ("PP=2", "decode, batch 1") in by:
        a, b = by[("TP=2", "decode, batch 1")], by[("PP=2", "decode, batch 1")]
        tech.append(["fewer collectives: PP instead of TP (decode, batch 1)",
                     f"calls / step {a.calls} -> {b.calls}; bytes {_kib(a.sent)} -> {_kib(b.sent)}; link time "
                     f"{1e3 * links_s[(a.layout, a.workload)]:.1f} -> {1e3 * links_s[(b.layout, b.workload)]:.1f} ms",
                     f"forward {1e3 * a.seconds:.1f} -> {1e3 * b.seconds:.1f} ms ({a.seconds / b.seconds:.2f}x); "
                     "PP's ranks run one after the other, so it buys capacity, not batch-1 speed"])
    if prefill and ("TP=2", prefill) in by and ("CP=2", prefill) in by:
        a, b = by[("TP=2", prefill)], by[("CP=2", prefill)]
        tech.append([f"sequence-parallel CP instead of TP ({prefill})",
                     f"bytes over the link {_kib(a.sent)} -> {_kib(b.sent)} (K/V once round the ring instead of "
                     f"activations twice per layer); calls {a.calls} -> {b.calls}",
                     f"forward {1e3 * a.seconds:.0f} -> {1e3 * b.seconds:.0f} ms ({a.seconds / b.seconds:.2f}x); "
                     f"vs one rank: TP {a.single_s / a.seconds:.2f}x, CP {b.single_s / b.seconds:.2f}x"])
    if prefill and ("CP=2", prefill) in by:
        b = by[("CP=2", prefill)]
        ring = b.kinds.get("cp_ring")
        wait = b.kinds.get("cp_ring_wait", (0.0, 0, 0))
        if ring and ring[2]:
            transfer = ring[1] * (ring[2] / ring[1]) / bandwidth_at(sizes, p2p_med, ring[2] / ring[1])
            if wait[0] < transfer:
                gain = (f"exposed wait {1e3 * wait[0]:.1f} ms: {100 * (1 - wait[0] / transfer):.0f} % of the "
                        "transfer time hidden behind the block computations")
            else:
                gain = (f"exposed wait {1e3 * wait[0]:.1f} ms, more than the whole transfer: what the ranks wait for "
                        "is each other's block computations (skew, the machine's load), not the link, so the "
                        "overlap's gain is not measurable in this run")
            tech.append(["overlap: CP's ring posts the next K/V block before computing on this one",
                         f"{ring[1]} ring transfers of {_kib(ring[2] / ring[1])}: {1e3 * transfer:.1f} ms at the "
                         "median measured p2p rate", gain])
    if tech:
        report.table(["technique", "moves", "measured gain"], tech, caption="What moves the I/O wall")
    return {"sizes": sizes, "p2p": p2p, "ar": ar, "beta": beta, "n_half": n_half}


def plot_io(ax_io, ax_bw, cpoints: list[CommPoint], link: dict, flops_peak: float) -> None:
    """The I/O roofline (per-rank FLOP/s against FLOP per byte over the link) and the link's curve with each
    step's calls placed at their mean message size."""
    beta = link["beta"]
    xs = [p.io_intensity for p in cpoints] or [1.0]
    lo, hi = min(xs + [flops_peak / beta]) / 4, max(xs + [flops_peak / beta]) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax_io.loglog(grid, [min(flops_peak, beta * x) / 1e9 for x in grid], "k-", label="I/O roof: min(peak, β x)")
    for p in cpoints:
        rate = bandwidth_at(link["sizes"], link["p2p"], p.message)
        ax_io.loglog([p.io_intensity], [p.achieved / 1e9], "o")
        ax_io.loglog([p.io_intensity], [min(flops_peak, rate * p.io_intensity) / 1e9], "k_", ms=10)
        ax_io.annotate(f"{p.layout} {p.workload}", (p.io_intensity, p.achieved / 1e9), textcoords="offset points",
                       xytext=(4, 3), fontsize=7)
    ax_io.set_xlabel("FLOP per byte over the link (per rank)")
    ax_io.set_ylabel("achieved GFLOP/s per rank")
    ax_io.set_title("I/O wall: TP / PP / CP steps (dash: roof at the step's message size)")
    ax_io.grid(True, which="both", alpha=0.3)
    ax_io.legend(loc="lower right", fontsize=8)
    ax_bw.loglog(link["sizes"], [r / 1e9 for r in link["p2p"]], "k.-", label="p2p (best)")
    ax_bw.loglog(link["sizes"], [r / 1e9 for r in link["ar"]], "b.--", label="all-reduce, 2 ranks (best)")
    for p in cpoints:
        ax_bw.loglog([p.message], [p.comm_bandwidth / 1e9], "o")
        ax_bw.annotate(f"{p.layout} {p.workload}", (p.message, p.comm_bandwidth / 1e9), textcoords="offset points",
                       xytext=(4, 3), fontsize=7)
    ax_bw.axvline(link["n_half"], color="gray", ls=":", lw=1)
    ax_bw.set_xlabel("message (bytes)")
    ax_bw.set_ylabel("GB/s")
    ax_bw.set_title("The link (gloo, 2 processes) and each step's calls (n½ dotted)")
    ax_bw.grid(True, which="both", alpha=0.3)
    ax_bw.legend(loc="lower right", fontsize=8)


if __name__ == "__main__":
    sys.exit(main())
