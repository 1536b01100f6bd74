"""`scratchlm plan --calibrate`: measure this machine's figures for the cost model (one thread per rank).

Every figure comes from a short micro-measurement, at the model's real shapes when a model is given
(`calibrate(model=cfg)`), never from the runs the planner is validated against:

- linear curve: the model's projection weights (q, k, v, o, gate, up, down of one layer, repeated past
  the caches as a model's layers are) multiplied by M = 1 .. 512 rows with the engine's matmul
  (`skinny_linear`: the C++ decode kernel for M <= 64, torch's GEMM above); weight elements per second
  at each M. GEMM FLOP/s is its largest-M point (2 M elements per second); GEMV bandwidth its M = 1 point;
- softmax rates: the model's causal attention (its heads, head_dim) at a length whose score matrices fit in
  half the last-level cache and at one where they are 4x larger, its time less its GEMM FLOPs at the measured
  FLOP/s, per score element;
- elementwise rate: the block's non-matmul ops at the model's shapes (two RMSNorms, RoPE on q and k,
  SiLU x up, two residual adds) in elements of the touched tensors per second;
- ring step overhead: one ring-attention step's block attention and merge on 4-token blocks;
- engine overheads: decode steps of `LLMEngine` on tiny models (d_model 64, 2 and 16 layers, the model's
  q/k-norm, norms, MLP and MoE features, so the same decode path: the fused C++ step or the Python one) at batch 1
  and 32, where the arithmetic is negligible: per layer (op dispatch), per step (scheduler, sampler) and
  per sequence, and per prompt and layer of a batched prefill (a MoE model's: less the MoE overheads measured
  above, which the cost model adds per expert)
  (`measure_layer_overhead`, a plain forward of such a model, is the engine-less variant);
- a mixture-of-experts model: the expert curve, weight elements per second of one routed expert's forward (its
  gate, up and down linears as the engine packs them, the activation) on M rows, over distinct experts of the
  model's shapes together larger than the caches (a decode step streams small matrices, slower than a layer's);
  and the MoE overheads, from the `MoE` block of a tiny model (d_model 64, experts of width 16) on 1 token (top_k
  experts run) and on 64 tokens (nearly all run), less its experts' own forwards: seconds per expert run
  (gathering its tokens, scattering its weighted output) and per block (routing); with `network`, what expert
  parallelism adds per MoE block beyond its collective calls (`measure_ep_overhead`: EP=2 engines of tiny models);
- activation memory: peak RSS of a 2-layer prefill (the model's widths, random weights) at two prompt
  lengths in a fresh process, less its KV cache: bytes per prompt token and per attention-score element;
- gloo all-reduce over loopback between 2 local processes: latency from an 8-byte all-reduce, bandwidth
  from a large one (ring all-reduce on 2 ranks: t = 2 latency + n / bandwidth); and the CPU time of the
  calling thread per all-reduce when each call follows ~0.5 ms of work, as in a decode step.

Rates are medians of a few timed calls (see `_best`).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path

import torch

from scratchlm.model.config import ModelConfig
from scratchlm.plan.cluster import ClusterSpec
from scratchlm.plan.cost import elementwise_elements

CLOCKS = {"wall": time.perf_counter, "thread_cpu": time.thread_time}
LINEAR_ROWS = (1, 4, 16, 64, 256, 512)
# The reference shapes when no model is given (SmolLM2-135M's widths).
DEFAULT_MODEL = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536,
                            max_seq_len=8192)


def _best(fn, repeats: int = 5, clock: str = "wall") -> float:
    """The median of `repeats` calls after one warm-up, on `clock` ("wall", or "thread_cpu": this thread's CPU
    time, which leaves out the time other processes take on a shared machine). The median, not the best: the
    figures predicted from these rates are typical runs, and on a shared machine the best of a few calls is a
    lucky moment (it made every prediction optimistic)."""
    now = CLOCKS[clock]
    fn()
    times = []
    for _ in range(repeats):
        t0 = now()
        fn()
        times.append(now() - t0)
    return sorted(times)[len(times) // 2]


def measure_gemm(n: int = 1024, clock: str = "wall") -> float:
    """FLOP/s of an n x n x n float32 matmul on the current thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    return 2 * n**3 / _best(lambda: torch.mm(a, b, out=out), clock=clock)


def layer_linear_shapes(c: ModelConfig) -> list[tuple[int, int]]:
    """(d_out, d_in) of one block's projection weights: q, k, v, o, gate, up, down (a MoE model: an expert's, the
    weights a decode step streams most)."""
    hd, f = c.head_dim, (c.d_expert if c.moe.n_experts else c.d_ff)
    return [(c.n_heads * hd, c.d_model), (c.n_kv_heads * hd, c.d_model), (c.n_kv_heads * hd, c.d_model),
            (c.d_model, c.n_heads * hd), (f, c.d_model), (f, c.d_model), (c.d_model, f)]


def measure_linear_curve(c: ModelConfig = DEFAULT_MODEL, rows: tuple[int, ...] = LINEAR_ROWS,
                         total_bytes: float = 1.2e8, clock: str = "wall") -> tuple[list[int], list[float]]:
    """Weight elements per second of the engine's linear (`skinny_linear`) over the model's layer shapes,
    for each row count M in `rows`: (rows, rates). Few rows stream the weights from memory (together
    larger than the caches); many rows are GEMMs (the weights of a few layers suffice: compute-bound)."""
    from scratchlm.inference.fast_linear import skinny_linear

    shapes = layer_linear_shapes(c)
    per_layer = sum(o * i for o, i in shapes)
    layers = max(2, math.ceil(total_bytes / (per_layer * 4)))
    ws = [torch.randn(o, i) for _ in range(layers) for o, i in shapes]
    rates = []
    for m in rows:
        use = ws if m <= 64 else ws[: len(shapes) * 2]  # GEMMs: two layers' weights are enough
        xs = {i: torch.randn(m, i) for _, i in shapes}

        def run(use=use, xs=xs) -> None:
            for w in use:
                skinny_linear(xs[w.shape[1]], w)

        rates.append(sum(w.numel() for w in use) / _best(run, repeats=5, clock=clock))
    return list(rows), rates


def measure_gemv(rows: int = 1536, cols: int = 576, total_bytes: float = 1.6e8, clock: str = "wall") -> float:
    """Bytes/s streamed by decode-like GEMVs: `x @ W.t()` over many distinct float32 (rows x cols) and
    (cols x rows) weights (together larger than the caches, as a model's layers are), one after another."""
    n = max(4, int(total_bytes / (rows * cols * 4)))
    ws = [torch.randn(rows, cols) if i % 2 == 0 else torch.randn(cols, rows) for i in range(n)]
    xs = {cols: torch.randn(1, cols), rows: torch.randn(1, rows)}

    def run() -> None:
        for w in ws:
            xs[w.shape[1]] @ w.t()

    return sum(w.numel() for w in ws) * 4 / _best(run, repeats=3, clock=clock)


def _tiny_config(vocab: int = 256, layers: int = 8) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, d_model=64, n_layers=layers, n_heads=8, n_kv_heads=4, max_seq_len=256)


def measure_layer_overhead(layers: int = 8, clock: str = "wall") -> float:
    """Seconds per transformer layer of a one-token forward through a tiny model (d_model 64), where the
    arithmetic is negligible: what dispatching a layer's ops costs."""
    from scratchlm.model.transformer import TransformerLM

    model = TransformerLM(_tiny_config(layers=layers)).eval()
    x = torch.tensor([[1]])
    with torch.no_grad():
        return _best(lambda: model(x), repeats=10, clock=clock) / layers


def measure_moe_overhead(n_experts: int = 32, top_k: int = 2, clock: str = "wall") -> tuple[float, float, float]:
    """(seconds per MoE block, seconds per expert run beyond the expert's own forward, that forward) of
    `model.moe.MoE` at tiny widths (d_model 64, experts of width 16, the engine's linears), from one token (top_k
    experts run) and 64 tokens (nearly all run): the block's time is fixed + experts run x (per expert + one
    expert's forward), the arithmetic negligible (`cost.experts_touched`)."""
    from scratchlm.inference.fast_linear import use_skinny_linears
    from scratchlm.model.moe import MoE
    from scratchlm.plan.cost import experts_touched

    c = ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, d_ff=16,
                    moe={"n_experts": n_experts, "top_k": top_k, "d_expert": 16})
    moe = MoE(c).eval()
    use_skinny_linears(moe)
    g = torch.Generator().manual_seed(0)
    x1, xn = torch.randn(1, 64, generator=g), torch.randn(64, 64, generator=g)
    with torch.no_grad():
        t1 = _best(lambda: moe(x1), repeats=20, clock=clock)
        tn = _best(lambda: moe(xn), repeats=20, clock=clock)
        one = _best(lambda: moe.experts[0](x1), repeats=20, clock=clock)  # an expert's own forward
    u1, un = experts_touched(n_experts, top_k, 1), experts_touched(n_experts, top_k, 64)
    per_expert = max(0.0, (tn - t1) / (un - u1))
    return max(0.0, t1 - u1 * per_expert), max(0.0, per_expert - one), one


def measure_expert_curve(c: ModelConfig, rows: tuple[int, ...] = LINEAR_ROWS, total_bytes: float = 1.2e8,
                         clock: str = "wall") -> list[float]:
    """Weight elements per second of one routed expert's forward (gate, up, act x up, down: the engine's linears) on
    M rows, for each M in `rows`, over distinct experts of `c`'s shapes together larger than the caches."""
    from scratchlm.inference.fast_linear import use_skinny_linears
    from scratchlm.model.layers import MLP

    per = 3 * c.d_model * c.d_expert
    n = max(2, math.ceil(total_bytes / (per * 4)))
    experts = torch.nn.ModuleList(MLP(c.d_model, c.d_expert, act=c.mlp.act) for _ in range(n)).eval()
    use_skinny_linears(experts)
    rates = []
    with torch.no_grad():
        for m in rows:
            use = experts if m <= 64 else experts[:2]  # GEMMs: two experts' weights are enough
            x = torch.randn(m, c.d_model)

            def run(use=use, x=x) -> None:
                for e in use:
                    e(x)

            rates.append(per * len(use) / _best(run, repeats=3, clock=clock))
    return rates


def measure_ring_step_overhead(heads: int = 8, kv_heads: int = 4, d: int = 64, clock: str = "wall") -> float:
    """Seconds of one ring-attention step's fixed cost (`block_attention` over 2 x 2 visible chunk pairs and
    one `merge_attention_states`) on 4-token blocks, where the arithmetic is negligible."""
    from scratchlm.parallel.sequence import block_attention, merge_attention_states

    q, k, v = torch.randn(1, 4, heads, d), torch.randn(1, 4, kv_heads, d), torch.randn(1, 4, kv_heads, d)
    q_pos, k_pos = torch.arange(8, 12), torch.arange(4)  # every key before every query: 4 unmasked pairs
    o, lse = torch.zeros(1, 4, heads, d), torch.zeros(1, 4, heads)

    def run() -> None:
        merge_attention_states(o, lse, *block_attention(q, q_pos, k, v, k_pos, 2, 2))

    with torch.no_grad():
        return _best(run, repeats=10, clock=clock)


class _ByteDecoder:
    """The least tokenizer an engine needs for detokenizing: ids -> bytes -> text."""

    eos_id = None

    def decode(self, ids: list[int]) -> str:
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


def overhead_config(c: ModelConfig | None, layers: int) -> ModelConfig:
    """The tiny model (d_model 64) the overheads are measured on, with `c`'s q/k-norm, norms, MLP and MoE features
    (experts of width 16, every block sparse), so the engine takes the same decode path as for `c`."""
    tiny = _tiny_config(layers=layers)
    if c is None:
        return tiny
    from dataclasses import replace

    moe = replace(c.moe, d_expert=16, d_shared=16 if c.moe.d_shared else 0, dense_layers=[])
    return replace(tiny, attn=replace(tiny.attn, qk_norm=c.attn.qk_norm), norm=c.norm, mlp=c.mlp, moe=moe)


def measure_engine_overhead(layers: tuple[int, int] = (2, 16), clock: str = "wall", tokenizer=None,
                            model: ModelConfig | None = None,
                            prefill_out: list[float] | None = None) -> tuple[float, float, float]:
    """(seconds per layer, per engine step, per sequence per step) of `LLMEngine` decode steps where the
    arithmetic is negligible: tiny models (d_model 64; `model`'s features: `overhead_config`) with two layer counts
    (the slope per layer, the intercept per step) at batch 1, and batch 32 against batch 1 (per sequence); medians
    of 30 steps. `tokenizer`: the one the engine will detokenize with (default: bytes). `prefill_out`: gets the
    seconds per prompt per layer of a batched prefill (4-token prompts: the per-sequence work of the step)."""
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from scratchlm.model.transformer import TransformerLM

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    now = CLOCKS[clock]
    step: dict[tuple[int, int], list[float]] = {}
    prefills: dict[tuple[int, int], list[float]] = {}
    for n in layers:
        cfg = overhead_config(model, n)
        engine = LLMEngine(TransformerLM(cfg).eval(), tokenizer or _ByteDecoder(), cfg,
                           EngineConfig(max_num_seqs=32, kv_cache_memory=2**24))
        for rep, batch in enumerate((1, 32, 1, 32, 1)):  # the first pair warms up
            for i in range(batch):
                engine.add_request(f"cal-{n}-{rep}-{i}", [1, 2, 3, 4], params)
            t0 = now()
            engine.step()  # the prefill
            if rep >= 2:
                prefills.setdefault((n, batch), []).append(now() - t0)
            times = []
            while engine.has_unfinished_requests():
                t0 = now()
                engine.step()
                times.append(now() - t0)
            if rep >= 2:
                step.setdefault((n, batch), []).extend(times)
    med = {k: sorted(v)[len(v) // 2] for k, v in step.items()}
    lo, hi = layers
    per_layer = max(0.0, (med[hi, 1] - med[lo, 1]) / (hi - lo))
    per_step = max(0.0, med[lo, 1] - lo * per_layer)
    per_seq = max(0.0, (med[hi, 32] - med[hi, 1]) / 31)
    if prefill_out is not None:  # per prompt per layer of a batched prefill: (32 prompts - 1) / 31, its layer slope
        pre = {k: min(v) for k, v in prefills.items()}
        prefill_out.append(max(0.0, ((pre[hi, 32] - pre[hi, 1]) - (pre[lo, 32] - pre[lo, 1])) / (31 * (hi - lo))))
    return per_layer, per_step, per_seq


def fused_moe(c: ModelConfig) -> bool:
    """Whether the engine runs `c`'s MoE blocks in the fused C++ decode step here (one rank; expert parallelism's
    step runs the Python `MoE` block)."""
    from scratchlm.inference.cpp_extensions import load_engine_kernels
    from scratchlm.inference.runner import fused_step_unsupported

    return not fused_step_unsupported(c) and load_engine_kernels() is not None


def measure_ep_overhead(model: ModelConfig, ep: int = 2, layers: tuple[int, int] = (2, 8), clock: str = "wall",
                        comm_cpu: float = 0.0) -> float:
    """Seconds per MoE block per decode step that expert parallelism adds on a rank beyond the single-rank step and
    its collective calls (`comm_cpu` each: the counts' all-gather, dispatch, combine, the K/V rows' all-gather):
    regrouping the received rows, writing the other replicas' K/V. From `LLMEngine` with `expert_parallel_size=ep`
    on the tiny models of `overhead_config` (arithmetic negligible), one sequence per replica, two layer counts:
    the slope per layer on rank 0, less the single-rank slope (`measure_engine_overhead`)."""
    import tempfile

    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from scratchlm.model.loading.checkpoint import save_model
    from scratchlm.model.transformer import TransformerLM

    now = CLOCKS[clock]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    med = {}
    with tempfile.TemporaryDirectory(prefix="calibrate_ep_") as tmp:
        for n in layers:
            path = Path(tmp) / f"tiny{n}.pt"
            save_model(path, TransformerLM(overhead_config(model, n)).eval())
            engine = LLMEngine.from_pretrained(path, EngineConfig(expert_parallel_size=ep, max_num_seqs=32,
                                                                  kv_cache_memory=2**24))
            try:
                times = []
                for rep in range(2):  # the first warms up
                    for i in range(ep):
                        engine.add_request(f"cal-ep-{n}-{rep}-{i}", [1, 2, 3, 4], params)
                    engine.step()  # the prefill
                    while engine.has_unfinished_requests():
                        t0 = now()
                        engine.step()
                        if rep:
                            times.append(now() - t0)
                med[n] = sorted(times)[len(times) // 2]
            finally:
                engine.shutdown()
    per_layer, _, _ = measure_engine_overhead(layers=layers, clock=clock, model=model)
    lo, hi = layers
    return max(0.0, (med[hi] - med[lo]) / (hi - lo) - per_layer - 4 * comm_cpu)


def cache_bytes() -> int:
    """The last-level cache of this machine (bytes; 32 MiB when it cannot be read)."""
    for index in (3, 2):
        try:
            text = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read_text().strip()
            return int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]] if text[-1] in "KM" else int(text)
        except (OSError, ValueError):
            continue
    return 32 * 2**20


def softmax_lengths(heads: int, cache: int) -> tuple[int, int]:
    """(t whose H t^2 float32 scores fit in half the cache, t whose scores are 4x the cache), powers of two."""
    t_in = 128
    while heads * (2 * t_in) ** 2 * 4 <= cache / 2 and t_in < 2048:
        t_in *= 2
    t_out = t_in
    while heads * t_out**2 * 4 < 4 * cache and t_out < 4096:
        t_out *= 2
    return t_in, t_out


def measure_softmax_rate(flops: float, t: int = 1024, heads: int = 8, kv_heads: int = 4, d: int = 64,
                         clock: str = "wall") -> float:
    """Attention score elements per second of the model's causal attention (`causal_attention`, the kernel of
    a single-rank and an Ulysses prefill) at t tokens, the GEMM part of the block taken out at `flops`. The
    rate depends on whether the score matrices (H t^2 floats) fit in the cache: `calibrate` measures both."""
    from scratchlm.model.layers import causal_attention

    q, k, v = torch.randn(1, t, heads, d), torch.randn(1, t, kv_heads, d), torch.randn(1, t, kv_heads, d)
    with torch.no_grad():
        sec = _best(lambda: causal_attention(q, k, v), repeats=5, clock=clock)
    elements = heads * t * t
    rest = max(sec - 4 * elements * d / flops, sec * 0.2)
    return elements / rest


def measure_elementwise(c: ModelConfig = DEFAULT_MODEL, t: int = 256, clock: str = "wall") -> float:
    """Elements per second (counted by `elementwise_elements`) of one block's elementwise ops at t tokens."""
    from scratchlm.model.layers import RMSNorm, RotaryEmbedding

    d, hd = c.d_model, c.head_dim
    norm = RMSNorm(d, c.norm_eps)
    rope = RotaryEmbedding(hd, c.rope_theta)
    x, a = torch.randn(1, t, d), torch.randn(1, t, d)
    q, k = torch.randn(1, t, c.n_heads, hd), torch.randn(1, t, c.n_kv_heads, hd)
    gate, up = torch.randn(1, t, c.d_ff), torch.randn(1, t, c.d_ff)
    cos, sin = rope.cos_sin(torch.arange(t), x.dtype)

    def run() -> None:
        h = x + norm(x)
        rope.rotate(q, cos, sin), rope.rotate(k, cos, sin)
        torch.sigmoid(gate).mul_(gate).mul_(up)
        h + norm(a)

    with torch.no_grad():
        sec = _best(run, repeats=5, clock=clock)
    return t * elementwise_elements(c) / sec


def _memory_worker(cfg_dict: dict, lengths: list[int], queue) -> None:
    """In a fresh process: peak RSS growth (bytes) of a prefill at each length, and its KV cache bytes."""
    torch.set_num_threads(1)
    from scratchlm.model.transformer import TransformerLM
    from scratchlm.parallel.sequence import ContextParallelLM

    def status_kib(field: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
        return int(line.split()[1])

    model = TransformerLM(ModelConfig(**cfg_dict)).eval()
    out = []
    ContextParallelLM(model, "ring").prefill(list(range(3, 35)))  # warm-up
    for t in lengths:
        ids = [3 + i % (cfg_dict["vocab_size"] - 3) for i in range(t)]
        cp = ContextParallelLM(model, "ring")
        Path("/proc/self/clear_refs").write_text("5")
        rss0 = status_kib("VmRSS")
        cp.prefill(ids)
        out.append(((status_kib("VmHWM") - rss0) * 1024, cp.kv_cache_bytes()))
        del cp
    queue.put(out)


def measure_activation_memory(c: ModelConfig = DEFAULT_MODEL, lengths: tuple[int, int] = (512, 1024),
                              layers: int = 2) -> tuple[float, float]:
    """(bytes per prompt token, bytes per attention-score element) live at a prefill's peak besides the KV
    cache: a `layers`-layer model of `c`'s widths prefills two prompt lengths in a fresh process (glibc's mmap
    threshold fixed at 64 KiB so freed tensors leave the RSS; peak reset through /proc/self/clear_refs);
    peak - KV = token_bytes * T + score_bytes * H * T^2, solved from the two points."""
    import multiprocessing as mp
    from dataclasses import asdict

    if not Path("/proc/self/clear_refs").exists():
        raise RuntimeError("measure_activation_memory needs Linux /proc/self/clear_refs")
    cfg = asdict(c)
    cfg.update(n_layers=layers, vocab_size=256, max_seq_len=max(lengths) * 2)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned process only at start
    try:
        p = ctx.Process(target=_memory_worker, args=(cfg, list(lengths), q), daemon=True)
        p.start()
    finally:
        if old is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old
    import queue as _queue

    deadline = time.monotonic() + 600
    while True:
        try:
            res = q.get(timeout=1.0)
            break
        except _queue.Empty:
            if not p.is_alive() or time.monotonic() > deadline:
                p.kill()
                raise RuntimeError(f"measure_activation_memory: the measuring process exited ({p.exitcode}) "
                                   "without a result") from None
    p.join(30)
    (t1, t2) = lengths
    y1, y2 = (peak - kv for peak, kv in res)
    h = c.n_heads
    # y = a T + b H T^2  ->  two equations
    b = (y2 / t2 - y1 / t1) / (h * (t2 - t1))
    a = y1 / t1 - b * h * t1
    return max(a, 0.0), max(b, 0.0)


def _allreduce_worker(rank: int, world: int, sizes: list[int], repeats: int) -> dict:
    import torch.distributed as dist

    out = {}
    for n in sizes:
        x = torch.zeros(max(1, n // 4))
        dist.all_reduce(x)
        dist.barrier()
        times = []
        c0 = time.thread_time()
        for _ in range(repeats):
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        out[n] = sorted(times)[len(times) // 2]
        out["cpu", n] = (time.thread_time() - c0) / repeats
    return out


def _comm_cpu_worker(rank: int, world: int, n: int, calls: int) -> float:
    import torch.distributed as dist

    x = torch.zeros(n)
    a, w = torch.randn(1, 576), torch.randn(1536, 576)

    def gemv() -> None:  # ~0.5 ms of decode-like work between calls, as a layer's between its all-reduces
        for _ in range(4):
            a @ w.t()

    for _ in range(5):
        gemv()
        dist.all_reduce(x)
    dist.barrier()
    c0 = time.thread_time()
    for _ in range(calls):
        gemv()
    work = time.thread_time() - c0
    dist.barrier()
    c0 = time.thread_time()
    for _ in range(calls):
        gemv()
        dist.all_reduce(x)
    return (time.thread_time() - c0 - work) / calls


def measure_comm_cpu(n: int = 576, calls: int = 200) -> float:
    """CPU seconds the calling thread spends per all-reduce of `n` floats between 2 local gloo processes when,
    as in a decode step, each call follows some work (~0.5 ms of GEMVs): the ranks then arrive apart and the
    caller's wait costs CPU (measured 0.4-1.5 ms per call here, against ~0.1 ms for back-to-back calls)."""
    from scratchlm.parallel.sequence import spawn_gloo

    return max(0.0, statistics.median(spawn_gloo(_comm_cpu_worker, 2, n, calls)))


def measure_allreduce(small: int = 8, large: int = 16 * 2**20, repeats: int = 20,
                      with_cpu: bool = False) -> tuple[float, ...]:
    """(latency s, bandwidth bytes/s) of gloo all-reduce between 2 local processes; with `with_cpu` also the
    CPU seconds the calling thread spends per small all-reduce (gloo's transport threads, which partly spin
    while they wait for the peer, are left out as in the validation's per-rank figures)."""
    from scratchlm.parallel.sequence import spawn_gloo

    res = spawn_gloo(_allreduce_worker, 2, [small, large], repeats)
    t_small = max(r[small] for r in res)
    t_large = max(r[large] for r in res)
    latency = t_small / 2  # ring all-reduce on 2 ranks: 2 (latency + n / (2 bw))
    bandwidth = large / max(t_large - 2 * latency, 1e-9)
    if with_cpu:
        return latency, bandwidth, sorted(r["cpu", small] for r in res)[0]
    return latency, bandwidth


def calibrate(threads: int = 1, network: bool = True, clock: str = "wall", model: ModelConfig | None = None,
              memory: bool = True, log=None, tokenizer=None) -> ClusterSpec:
    """Measure this machine: one node, one device per usable core, `threads` torch threads per rank, at the
    shapes of `model` (default: SmolLM2-135M's widths). clock="thread_cpu" times the compute figures in
    thread CPU time (the work, without other processes' share). `memory`: also measure the activation memory
    per token and per score element (a spawned process, Linux only). `log(str)`: progress lines. `tokenizer`:
    the engine's detokenizer for the step overhead (default: bytes)."""
    if clock not in CLOCKS:
        raise ValueError(f"calibrate: clock={clock!r}, expected one of {sorted(CLOCKS)}")
    say = log or (lambda s: None)
    c = model or DEFAULT_MODEL
    torch.set_num_threads(threads)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    say("linear curve")
    rows, rates = measure_linear_curve(c, clock=clock)
    flops = 2 * rows[-1] * rates[-1]
    bw = rates[0] * 4
    say("attention, elementwise, overheads")
    cache = cache_bytes()
    t_in, t_out = softmax_lengths(c.n_heads, cache)
    smax_cached = measure_softmax_rate(flops, t_in, c.n_heads, c.n_kv_heads, c.head_dim, clock=clock)
    smax = measure_softmax_rate(flops, t_out, c.n_heads, c.n_kv_heads, c.head_dim, clock=clock)
    elementwise = measure_elementwise(c, clock=clock)
    ring_overhead = measure_ring_step_overhead(c.n_heads, c.n_kv_heads, c.head_dim, clock=clock)
    moe_overhead = expert_overhead = 0.0
    expert_rate: list[float] = []
    if c.moe.n_experts:
        say("MoE: expert curve and overheads")
        expert_rate = measure_expert_curve(c, rows, clock=clock)
        moe_overhead, expert_overhead, tiny_forward = measure_moe_overhead(clock=clock)
    prefill_seq: list[float] = []
    overhead, step_overhead, seq_overhead = measure_engine_overhead(clock=clock, tokenizer=tokenizer, model=c,
                                                                    prefill_out=prefill_seq)
    fused = bool(c.moe.n_experts) and fused_moe(c)
    if fused:
        say("the engine runs this MoE model in the fused C++ step: its MoE costs are in the engine overheads")
    from scratchlm.plan.cost import experts_touched

    tiny = overhead_config(c, 16).moe
    run = expert_overhead + tiny_forward  # one expert run of the tiny model (its forward is in the expert curve)
    if c.moe.n_experts and not fused:  # the tiny models' Python MoE blocks: counted per block and per expert run
        overhead = max(0.0, overhead - moe_overhead - experts_touched(tiny.n_experts, tiny.top_k, 1) * run)
        more = experts_touched(tiny.n_experts, tiny.top_k, 32) - experts_touched(tiny.n_experts, tiny.top_k, 1)
        seq_overhead = max(0.0, seq_overhead - 16 * more * run / 31)
        more = experts_touched(tiny.n_experts, tiny.top_k, 128) - experts_touched(tiny.n_experts, tiny.top_k, 4)
        prefill_seq[0] = max(0.0, prefill_seq[0] - more * run / 31)  # 32 prompts of 4 tokens against one
    token_bytes = score_bytes = 0.0
    if memory and Path("/proc/self/clear_refs").exists():
        say("activation memory")
        token_bytes, score_bytes = measure_activation_memory(c)
    say("gloo all-reduce")
    lat, net_bw = measure_allreduce() if network else (2e-5, 5e9)
    comm_cpu = measure_comm_cpu() if network else 0.0
    ep_overhead = 0.0
    if c.moe.n_experts and network and c.moe.n_experts % 2:
        say(f"expert parallelism's per-block overhead not measured: {c.moe.n_experts} experts do not split in two")
    elif c.moe.n_experts and network:
        say("expert parallelism's per-block overhead (EP=2 engines)")
        ep_overhead = measure_ep_overhead(c, clock=clock, comm_cpu=comm_cpu)
        if fused:  # the EP step runs the Python MoE block, whose costs the cost model adds per block and expert
            ep_overhead = max(0.0, ep_overhead - moe_overhead - experts_touched(tiny.n_experts, tiny.top_k, 1) * run)
    try:
        mem_total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        mem_total = 8 * 2**30
    return ClusterSpec(name="local (calibrated)", nodes=1, devices_per_node=max(1, cores // threads), flops=flops,
                       mem_bw=bw, mem_capacity=mem_total / max(1, cores // threads), softmax_rate=smax,
                       softmax_rate_cached=smax_cached, cache_bytes=cache,
                       layer_overhead=overhead, intra_bw=net_bw, intra_latency=lat, inter_bw=net_bw,
                       inter_latency=lat, dtype_bytes=4, linear_rows=rows, linear_rate=rates,
                       elementwise_rate=elementwise, ring_step_overhead=ring_overhead,
                       step_overhead=step_overhead, seq_overhead=seq_overhead,
                       token_bytes=token_bytes, score_bytes=score_bytes, comm_cpu=comm_cpu,
                       moe_overhead=moe_overhead, expert_overhead=expert_overhead, expert_linear_rate=expert_rate,
                       ep_layer_overhead=ep_overhead, prefill_seq_overhead=prefill_seq[0], fused_moe=fused)
