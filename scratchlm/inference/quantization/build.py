"""Compile the quantized-matmul C++ extension ahead of time: ``python -m scratchlm.inference.quantization.build``.

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
    got = kernels.int4_linear(x, q, d, m, 32)
    err = (got - want).abs().max().item()
    if err > 1e-3:
        print(f"smoke test failed: max |kernel - reference| = {err:.3g}", file=sys.stderr)
        return 1
    print(f"smoke test passed (max |kernel - reference| = {err:.2g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
