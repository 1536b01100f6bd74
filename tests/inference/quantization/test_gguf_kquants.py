"""GGUF K-quant kernels (`csrc/gguf_kquants.h`, reached through the engine's `gguf_linear` / `gguf_dequantize`):
dequantization bit-equal to gguf.quants, and every matmul path against float64 gguf.quants.dequantize-then-matmul.

Oracles that share no code with the kernels: gguf.quants' numpy dequantizers (torch.equal) and a float64 matmul of
those values. Every type (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) x every path this CPU runs (0 scalar, 1 AVX2,
2 AVX-VNNI, 3 AVX512-VNNI: the AVX2 paths are forced on an AVX-512 machine, and the default path is checked again
in a process under SCRATCHLM_ISA=avx2) x M in {1, 2, 3, 8, 17, 64, 65, 130} with N not a multiple of the 8-row
tile. The integer paths round x to int8 per 32-block and are held to that rounding's bound
(helpers.integer_bound), and to each other up to float32 summation order (the integer sums are exact); path 100
(the weight dequantized, fp32 GEMM; the default above 64 rows) to float32 summation order. Weights: random valid
blocks (random bytes, finite fp16 scales of both signs; gguf.quants has no K-quant quantizer), plus blocks with
every code at its extremes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from tests.inference.quantization.helpers import engine_kernels_or_fail, integer_bound  # noqa: E402

TYPES = {"Q2_K": GT.Q2_K, "Q3_K": GT.Q3_K, "Q4_K": GT.Q4_K, "Q5_K": GT.Q5_K, "Q6_K": GT.Q6_K, "IQ4_XS": GT.IQ4_XS}
BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_XS": 136}
# byte offsets of the fp16 super-block scales (d, and dmin where the type has one)
HALF_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}
ROWS = [1, 2, 3, 8, 17, 64, 65, 130]
KERNEL_PATHS = [0, 1, 2, 3]  # scalar, AVX2, AVX-VNNI, AVX512-VNNI (one the CPU lacks resolves to another)
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def eng():
    return engine_kernels_or_fail()


def random_blocks(name: str, n: int, k: int, seed: int, extreme: bool = False) -> np.ndarray:
    """(n, k / 256 * block bytes) uint8: random bytes (or, `extreme`, every byte 0x00 or 0xFF at random, so codes
    and scales sit at their limits) with the fp16 scales replaced by finite values of both signs around 1e-3."""
    rng = np.random.default_rng(seed)
    nsb, bb = k // 256, BLOCK_BYTES[name]
    if extreme:
        raw = (rng.integers(0, 2, size=(n, nsb, bb), dtype=np.uint8) * 255).astype(np.uint8)
    else:
        raw = rng.integers(0, 256, size=(n, nsb, bb), dtype=np.uint8)
    for off in HALF_OFFSETS[name]:
        half = (rng.uniform(0.2, 1.0, size=(n, nsb)) * rng.choice([-1, 1], size=(n, nsb)) * 2e-3).astype(np.float16)
        raw[:, :, off:off + 2] = half.view(np.uint8).reshape(n, nsb, 2)
    return raw.reshape(n, nsb * bb)


def paths_here(eng, raw: torch.Tensor, type_id: int, k: int) -> list[int]:
    """The kernel paths this CPU runs (a forced path it lacks resolves to another one: de-duplicated)."""
    return sorted({eng.gguf_resolve_path(raw, type_id, k, 1, p) for p in KERNEL_PATHS})


@pytest.mark.parametrize("name", list(TYPES))
def test_dequantize_equals_gguf(eng, name):
    for n, k, seed, extreme in [(5, 256, 0, False), (3, 1024, 1, False), (17, 512, 2, False), (9, 512, 3, True)]:
        raw = random_blocks(name, n, k, seed, extreme)
        want = torch.from_numpy(dequantize(raw, TYPES[name]).reshape(n, k))
        got = eng.gguf_dequantize(torch.from_numpy(raw), int(TYPES[name]), k)
        assert torch.equal(got, want), f"{name} n={n} k={k} extreme={extreme}"


@pytest.mark.parametrize("name", list(TYPES))
def test_gemm_paths_match_float64(eng, name):
    n, k = 37, 512  # N not a multiple of 8
    for extreme in (False, True):
        raw_np = random_blocks(name, n, k, seed=7, extreme=extreme)
        raw = torch.from_numpy(raw_np)
        wd = torch.from_numpy(dequantize(raw_np, TYPES[name]).reshape(n, k))
        type_id = int(TYPES[name])
        paths = paths_here(eng, raw, type_id, k)
        assert 0 in paths and (eng.isa_name() == "scalar" or 1 in paths)
        gen = torch.Generator().manual_seed(3)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen)
            x[:, 5] *= 30.0  # an outlier channel, as real activations have
            want = x.double() @ wd.double().t()
            bound = integer_bound(x, wd)
            outs = {}
            for p in paths:
                got = eng.gguf_linear(x, raw, type_id, k, p)
                assert got.shape == (m, n)
                err = (got.double() - want).abs()
                assert (err <= bound).all(), f"{name} M={m} path {p}: error {err.max().item():.3g} above the bound"
                outs[p] = got
            # the same integer sums on every path: only the float32 order differs from the scalar path
            scale = want.abs().max().item()
            for p, got in outs.items():
                torch.testing.assert_close(got, outs[0], rtol=2e-5, atol=2e-5 * scale, msg=f"{name} M={m} path {p}")
            # float x: the weight dequantized, the fp32 GEMM (what float activations run)
            deq = eng.gguf_dequant_path()
            torch.testing.assert_close(eng.gguf_linear(x, raw, type_id, k, deq).double(), want, rtol=1e-5,
                                       atol=1e-5 * scale, msg=f"{name} M={m} path {deq}")
            default = eng.gguf_resolve_path(raw, type_id, k, m, -1)
            assert default == max(paths), (name, m, default)  # the integer kernels at every M, prefill included


def test_errors(eng):
    raw = torch.from_numpy(random_blocks("Q4_K", 4, 256, 0))
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        eng.gguf_linear(torch.randn(1, 128), raw[:, :72].contiguous(), int(GT.Q4_K), 128, -1)
    with pytest.raises(RuntimeError, match="rows of 256 weights take 144 bytes"):
        eng.gguf_linear(x, raw[:, :100].contiguous(), int(GT.Q4_K), 256, -1)
    with pytest.raises(RuntimeError, match="path 99 is not one of"):
        eng.gguf_linear(x, raw, int(GT.Q4_K), 256, 99)


def test_avx2_cap_runs_the_avx2_kernels(eng):
    """Under SCRATCHLM_ISA=avx2 (a fresh process: the cap is read once) the default kernel path is path 1, the AVX2
    kernel (on an AVX-512 machine exactly what a Zen 3 runs), and its results stay within the bound."""
    code = (
        "import numpy as np, torch\n"
        "from gguf.quants import dequantize\n"
        "from scratchlm.inference.cpp_extensions import load_engine_kernels\n"
        "from tests.inference.quantization.test_gguf_kquants import random_blocks, TYPES\n"
        "from tests.inference.quantization.helpers import integer_bound\n"
        "eng = load_engine_kernels()\n"
        "print(eng.isa_name())\n"
        "for name, t in TYPES.items():\n"
        "    raw_np = random_blocks(name, 21, 768, 5); raw = torch.from_numpy(raw_np)\n"
        "    wd = torch.from_numpy(dequantize(raw_np, t).reshape(21, 768))\n"
        "    for m in (1, 8, 64):\n"
        "        x = torch.randn(m, 768)\n"
        "        y = eng.gguf_linear(x, raw, int(t), 768, -1)\n"
        "        err = (y.double() - x.double() @ wd.double().t()).abs()\n"
        "        assert (err <= integer_bound(x, wd)).all(), (name, m)\n"
        "        print(name, m, eng.gguf_resolve_path(raw, int(t), 768, m, -1))\n"
    )
    env = dict(os.environ, SCRATCHLM_ISA="avx2")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().split("\n")
    if eng.isa_name() == "scalar":
        pytest.skip("this CPU has no AVX2")
    assert lines[0] == "avx2", lines[0]
    assert all(line.split()[-1] == "1" for line in lines[1:]), lines
