"""Compile the C++ extensions (quantized matmuls, paged attention, decode matmuls) ahead of time:
``python -m scratchlm.inference.quantization.build``.

Exit status 0 when the extension builds (or is already cached) and passes a smoke test against
the pure-torch reference; 1 otherwise (the engine then still works, on the slower reference path).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scratchlm.inference.quantization.build",
        description="Build (or find in the cache) the fused dequantize+matmul CPU kernels and check them "
                    "against the pure-torch reference. Cache: $SCRATCHLM_QUANT_BUILD_DIR or "
                    "~/.cache/scratchlm/quant_kernels.")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from scratchlm.inference.quantization import kernels, reference

    t0 = time.perf_counter()
    ext = kernels.load_extension(verbose=args.verbose)
    if ext is None:
        print("build failed: the engine will use the pure-torch reference path", file=sys.stderr)
        return 1
    print(f"built/loaded {kernels.EXTENSION_NAME} in {time.perf_counter() - t0:.1f}s at {kernels.build_dir()} "
          f"(AVX2 path: {'yes' if ext.has_avx2() else 'no, scalar'})")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=gen)
    x = torch.randn(3, 128, generator=gen)
    q, d, m = reference.quantize_int4(w, 32, symmetric=False)
    want = reference.reference_linear(x, reference.dequantize_int4(q, d, m, 32))
    # float activations: exact up to the summation order (the default integer path rounds x to int8 per 32-block,
    # which moves these logits by ~0.15 by design: tests/inference/quantization compare it with its own oracle)
    before = kernels.float_activations()
    kernels.float_activations(True)
    try:
        got = kernels.int4_linear(x, q, d, m, 32)
    finally:
        kernels.float_activations(before)
    err = (got - want).abs().max().item()
    if err > 1e-3:
        print(f"smoke test failed: max |kernel - reference| = {err:.3g}", file=sys.stderr)
        return 1
    print(f"smoke test passed (max |kernel - reference| = {err:.2g})")
    return build_attention_kernel(args.verbose)


def build_attention_kernel(verbose: bool) -> int:
    """The paged decode-attention kernel (csrc/paged_attention.h in engine_kernels.cpp), checked against torch."""
    from scratchlm.inference.attention import AttentionMetadata, PagedAttention, load_kernels
    from scratchlm.inference.kv_cache import KVCache

    t0 = time.perf_counter()
    ext = load_kernels(verbose)
    if ext is None:
        print("paged-attention kernel build failed: decode uses the torch-ops path", file=sys.stderr)
        return 1
    cache = KVCache.allocate(1, 8, 4, 2, 16, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    tables, lens = torch.tensor([[3, 1, 6], [2, 0, 0]]), torch.tensor([10, 3])
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), 2, tables, lens)
    q = torch.randn(2, 4, 16)
    want = PagedAttention(cache, meta, use_kernel=False)._decode(0, q)
    err = (ext.paged_decode_attention(q, cache.k[0], cache.v[0], tables, lens, 0.25) - want).abs().max().item()
    if err > 1e-4:
        print(f"paged-attention smoke test failed: max |kernel - torch| = {err:.3g}", file=sys.stderr)
        return 1
    print(f"built/loaded the paged-attention kernel in {time.perf_counter() - t0:.1f}s; smoke test passed "
          f"(max |kernel - torch| = {err:.2g})")
    return build_skinny_gemm(verbose)


def build_skinny_gemm(verbose: bool) -> int:
    """The decode-matmul kernel (csrc/skinny_gemm.h in engine_kernels.cpp), checked against torch."""
    from scratchlm.inference.fast_linear import load_kernels

    t0 = time.perf_counter()
    ext = load_kernels(verbose)
    if ext is None:
        print("skinny-GEMM kernel build failed: decode matmuls use torch", file=sys.stderr)
        return 1
    x, w = torch.randn(5, 64), torch.randn(9, 64)
    err = (ext.skinny_linear(x, w) - x @ w.T).abs().max().item()
    if err > 1e-4:
        print(f"skinny-GEMM smoke test failed: max |kernel - torch| = {err:.3g}", file=sys.stderr)
        return 1
    print(f"built/loaded the skinny-GEMM kernel in {time.perf_counter() - t0:.1f}s; smoke test passed "
          f"(max |kernel - torch| = {err:.2g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
