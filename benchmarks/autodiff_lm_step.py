"""LM training step through scratchlm.autodiff against the same model through torch.autograd, plus the
engine's own overhead per node (graph build, topological sort, gradient-graph build, evaluation).

Both contenders get the same TransformerLM (same weights), the same batch, the same thread count, and end
in the same state: loss computed and every parameter's .grad filled. Interleaved A B A B after warm-up.

    python -m benchmarks.autodiff_lm_step                  # default: the trainer's default model, B=8, T=128
    python -m benchmarks.autodiff_lm_step --d-model 128 --layers 2 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import Report, compare, set_threads


def lm_step(args: argparse.Namespace, report: Report) -> None:
    from scratchlm.autodiff.lm import build_lm_graph
    from scratchlm.autodiff.training import AutodiffEngine, loss_and_grads
    from scratchlm.model import ModelConfig, TransformerLM
    from scratchlm.training.engines import torch_loss_and_grads

    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                      max_seq_len=args.seq)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
    engine = AutodiffEngine()

    def torch_step():
        model.zero_grad(set_to_none=True)
        return torch_loss_and_grads(model, x, y, 1.0)

    def ad_step():
        model.zero_grad(set_to_none=True)
        return engine(model, x, y, 1.0)

    def ad_rebuild_step():
        model.zero_grad(set_to_none=True)
        return loss_and_grads(model, x, y, 1.0)

    # the two engines agree before we time them
    lt = torch_step()
    gt = {n: p.grad.clone() for n, p in model.named_parameters()}
    la = ad_step()
    worst = max(float((p.grad - gt[n]).abs().max() / gt[n].abs().max().clamp_min(1e-30))
                for n, p in model.named_parameters())
    res = compare({"torch.autograd": torch_step, "scratchlm.autodiff": ad_step,
                   "scratchlm.autodiff (graph rebuilt each call)": ad_rebuild_step},
                  warmup=1, repeats=args.repeats)
    tokens = args.batch * args.seq
    g = build_lm_graph(cfg)
    n_nodes = len(engine.graph_for(model)._evaluator.order)
    report.add(f"Model: vocab {cfg.vocab_size}, d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
               f"d_ff {cfg.d_ff}, {model.num_parameters():,} parameters; batch {args.batch} x {args.seq} tokens, "
               f"float32, CPU. Losses: torch {float(lt):.6f}, autodiff {float(la):.6f}; largest gradient "
               f"difference relative to the tensor's max: {worst:.2e}. The ad graph (forward + backward) has "
               f"{n_nodes} nodes; the forward has {len(g.params)} parameter Variables.")
    report.table(res.headers("tok"), res.rows(work=tokens, work_unit="tok"),
                 caption="One training step (loss + every parameter gradient), interleaved")
    ratio = res.ratio("scratchlm.autodiff", "torch.autograd")
    rebuilt = res.ratio("scratchlm.autodiff (graph rebuilt each call)", "torch.autograd")
    cpu = compare({"torch.autograd": torch_step, "scratchlm.autodiff": ad_step}, warmup=0, repeats=args.repeats,
                  clock="thread_cpu")
    report.table(cpu.headers("tok"), cpu.rows(work=tokens, work_unit="tok"),
                 caption="The same step in thread CPU time (robust to other processes' load), interleaved")
    report.add(f"**Ratio autodiff / torch.autograd (median): {ratio:.3f}x wall clock, "
               f"{cpu.ratio('scratchlm.autodiff', 'torch.autograd'):.3f}x CPU time** (target <= 1.3x); with the graph "
               f"rebuilt on every call: {rebuilt:.3f}x wall clock.")


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def overhead(args: argparse.Namespace, report: Report) -> None:
    """Per-node costs on a chain of N tiny `x * 1.0001` nodes, where the arithmetic itself is negligible."""
    import scratchlm.autodiff as ad
    from scratchlm.autodiff.lm import build_lm_graph
    from scratchlm.model import ModelConfig

    n = args.chain
    x0 = torch.zeros(1)

    def build():
        x = ad.Variable("x")
        y = x
        for _ in range(n):
            y = y * 1.0001
        return x, y

    x, y = build()
    (gx,) = ad.gradients(y, [x])
    fwd = ad.Evaluator([y])
    both = ad.Evaluator([y, gx])

    def torch_loop():
        t = x0
        for _ in range(n):
            t = t * 1.0001
        return t

    def autograd_loop():
        t0 = x0.clone().requires_grad_(True)
        t = t0
        for _ in range(n):
            t = t * 1.0001
        t.backward()
        return t0.grad

    r = args.repeats
    t_build = _median_time(build, r)
    t_topo = _median_time(lambda: ad.topological_sort([y]), r)
    t_grad = _median_time(lambda: ad.gradients(y, [x]), r)
    t_eval = _median_time(lambda: fwd.run({x: x0}), r)
    t_both = _median_time(lambda: both.run({x: x0}), r)
    t_torch = _median_time(torch_loop, r)
    t_autograd = _median_time(autograd_loop, r)
    us = 1e6 / n
    rows = [
        ["build N nodes (operator overloads)", f"{t_build * us:.2f}"],
        ["topological sort (iterative)", f"{t_topo * us:.2f}"],
        ["build the gradient graph (`gradients`)", f"{t_grad * us:.2f}"],
        ["evaluate forward (Evaluator.run)", f"{t_eval * us:.2f}"],
        ["same ops as a plain torch loop (no engine)", f"{t_torch * us:.2f}"],
        ["**engine overhead per evaluated node** (difference)", f"**{(t_eval - t_torch) * us:.2f}**"],
        ["evaluate forward + gradient graph (2N nodes), per forward node", f"{t_both * us:.2f}"],
        ["plain torch loop, per op (reference for the line above: 2 ops per node)", f"{2 * t_torch * us:.2f}"],
        ["torch.autograd forward + backward of the same chain, per op", f"{t_autograd * us:.2f}"],
    ]
    report.table(["stage", "microseconds per node"], rows,
                 caption=f"Engine overhead on a chain of N = {n:,} `x * 1.0001` nodes on a 1-element tensor "
                 f"(median of {r})")
    report.add(f"Forward + backward through the engine vs through torch.autograd on the same chain: "
               f"{t_both / t_autograd:.2f}x.")
    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    t_lm = _median_time(lambda: build_lm_graph(cfg), r)
    g = build_lm_graph(cfg)
    t_lm_eval_init = _median_time(lambda: ad.Evaluator([g.loss, *g.grads.values()]), r)
    nodes = len(ad.topological_sort([g.loss, *g.grads.values()]))
    report.add(f"Building the LM graph above (forward + gradient graph, {nodes} nodes) takes {t_lm * 1e3:.2f} ms, "
               f"and planning its Evaluator (topological order + free list) {t_lm_eval_init * 1e3:.2f} ms: the "
               f"price of the per-call rebuild row.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=10_000)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for every contender")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--chain", type=int, default=20_000, help="length of the overhead chain")
    args = p.parse_args(argv)
    set_threads(args.threads)
    report = Report("autodiff_lm_step", "scratchlm.autodiff: LM training step vs torch.autograd, and engine overhead",
                    argv)
    lm_step(args, report)
    overhead(args, report)
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
