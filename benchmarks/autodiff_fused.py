"""Fused `matmul_layernorm` / `matmul_softmax` against the unfused pair (matmul, then layernorm / softmax),
forward + backward through scratchlm.autodiff, with torch.autograd on the same math as a reference.

    python -m benchmarks.autodiff_fused
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import Report, compare, set_threads


def _runner(out_fn, shapes, seed=0):
    import scratchlm.autodiff as ad

    a, b, c = ad.Variable("A"), ad.Variable("B"), ad.Variable("cotangent")
    out = out_fn(a, b)
    ga, gb = ad.gradients(ad.sum_op(ad.mul(out, c)), [a, b])
    ev = ad.Evaluator([out, ga, gb])
    gen = torch.Generator().manual_seed(seed)
    av, bv = torch.randn(shapes[0], generator=gen), torch.randn(shapes[1], generator=gen)
    cv = torch.randn(*shapes[0][:-1], shapes[1][-1], generator=gen)
    feed = {a: av, b: bv, c: cv}
    return (lambda: ev.run(feed)), (av, bv, cv)


def _torch_ref(fn, av, bv, cv):
    def run():
        a, b = av.clone().requires_grad_(True), bv.clone().requires_grad_(True)
        out = fn(a, b)
        ga, gb = torch.autograd.grad(out, [a, b], cv)
        return out, ga, gb

    return run


def main(argv: list[str] | None = None) -> int:
    import scratchlm.autodiff as ad

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    set_threads(args.threads)
    report = Report("autodiff_fused", "scratchlm.autodiff: fused matmul+layernorm / matmul+softmax vs unfused", argv)
    cases = [
        ("matmul_layernorm", "(4096, 256) @ (256, 256), layernorm over 256", ((4096, 256), (256, 256)),
         lambda a, b: ad.matmul_layernorm(a, b, (256,), 1e-5),
         lambda a, b: ad.layernorm(ad.matmul(a, b), (256,), 1e-5),
         lambda a, b: torch.nn.functional.layer_norm(a @ b, (256,), eps=1e-5)),
        ("matmul_layernorm", "(64, 32, 64) @ (64, 64), layernorm over 64 (small, overhead-bound)",
         ((64, 32, 64), (64, 64)),
         lambda a, b: ad.matmul_layernorm(a, b, (64,), 1e-5),
         lambda a, b: ad.layernorm(ad.matmul(a, b), (64,), 1e-5),
         lambda a, b: torch.nn.functional.layer_norm(a @ b, (64,), eps=1e-5)),
        ("matmul_softmax", "(32, 256, 64) @ (64, 256), softmax over 256 (attention-score shape)",
         ((32, 256, 64), (64, 256)),
         lambda a, b: ad.matmul_softmax(a, b, -1),
         lambda a, b: ad.softmax(ad.matmul(a, b), -1),
         lambda a, b: torch.softmax(a @ b, -1)),
        ("matmul_softmax", "(64, 32, 32) @ (32, 32), softmax over 32 (small, overhead-bound)",
         ((64, 32, 32), (32, 32)),
         lambda a, b: ad.matmul_softmax(a, b, -1),
         lambda a, b: ad.softmax(ad.matmul(a, b), -1),
         lambda a, b: torch.softmax(a @ b, -1)),
    ]
    summary = []
    for name, desc, shapes, fused, unfused, ref in cases:
        print(f"{name}: {desc}")
        run_f, (av, bv, cv) = _runner(fused, shapes)
        run_u, _ = _runner(unfused, shapes)
        fo, fu = run_f(), run_u()
        err = max(float((x - y).abs().max()) for x, y in zip(fo, fu))
        small = "small" in desc  # cheap cases get more repeats: their medians are what the noise hits hardest
        res = compare({"unfused (ad)": run_u, "fused (ad)": run_f,
                       "torch.autograd (reference)": _torch_ref(ref, av, bv, cv)},
                      warmup=2, repeats=args.repeats * (8 if small else 1), progress=not small)
        report.table(res.headers(), res.rows(),
                     caption=f"{name}, forward + backward: {desc}; max |fused - unfused| = {err:.1e}; wall clock")
        cpu = compare({"unfused (ad)": run_u, "fused (ad)": run_f,
                       "torch.autograd (reference)": _torch_ref(ref, av, bv, cv)},
                      warmup=1, repeats=args.repeats * (8 if small else 1), clock="thread_cpu")
        report.table(cpu.headers(), cpu.rows(), caption="... same, thread CPU time")
        summary.append([name, desc, f"{res.ratio('fused (ad)', 'unfused (ad)'):.3f}",
                        f"{cpu.ratio('fused (ad)', 'unfused (ad)'):.3f}"])
    report.table(["op", "shape", "fused / unfused (wall, median)", "fused / unfused (CPU time, median)"], summary,
                 caption="Summary")
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
