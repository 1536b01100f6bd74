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
import statistics
import sys
import time
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
    png = RESULTS_DIR / f"{time.strftime('%Y-%m-%d')}-walls.png"
    try:
        plot(points, flops_peak, bw_peak, png)
        report.add(f"![roofline]({png.name})")
    except ImportError:
        report.add("(matplotlib not installed: no plot)")
    report.write()
    return 0


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


def plot(points: list[Point], flops_peak: float, bw_peak: float, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from scratchlm.atomic import replace

    xs = [p.intensity for p in points]
    lo, hi = min(xs + [0.1]) / 2, max(xs + [flops_peak / bw_peak]) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
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


if __name__ == "__main__":
    sys.exit(main())
