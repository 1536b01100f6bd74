"""The GGUF 32-weight block kernels (csrc/gguf_blocks32.h: Q5_0, Q5_1, IQ4_NL read in the file's own blocks).

Oracles that share no code with the kernels: gguf.quants' numpy dequantizers (the dequantized rows must equal them
bit for bit) and a float64 matmul of those values. Path 0 (float x) is exact up to float32 summation order; the
integer paths (6 / 8 AVX512-VNNI, 7 / 9 AVX2: in registers / panels) round x to int8 per 32-block and are held to
that rounding's bound (helpers.integer_bound). Every path this CPU runs is forced, for rows of x across the decode /
prefill boundary and a row count N that is not a multiple of 8; the AVX2 code is also checked under
SCRATCHLM_ISA=avx2 in a subprocess.
Through the engine extension's bindings (gguf_linear, gguf_dequantize, gguf_resolve_path: csrc/gguf_gemm.h).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

from tests.inference.quantization.helpers import assert_within_integer_bound, engine_kernels_or_fail

TYPES = {"Q5_0": QT.Q5_0, "Q5_1": QT.Q5_1, "IQ4_NL": QT.IQ4_NL}
BLOCK_BYTES = {QT.Q5_0: 22, QT.Q5_1: 24, QT.IQ4_NL: 18}


@pytest.fixture(scope="module")
def ext():
    return engine_kernels_or_fail()


def isa(ext) -> str:
    """What the kernels run here (honours $SCRATCHLM_ISA): avx512-vnni, avx2 or scalar."""
    return {2: "avx512-vnni", 1: "avx2"}.get(ext.quant_best_path(), "scalar")


def make_raw(qtype: QT, n: int, k: int, seed: int) -> np.ndarray:
    """(n, k / 32 * bytes) blocks: gguf.quants.quantize of Gaussian weights (Q5_0, Q5_1, with an outlier column),
    random valid blocks for IQ4_NL (which gguf.quants cannot quantize): random codes, a finite fp16 d."""
    rng = np.random.default_rng(seed)
    if qtype != QT.IQ4_NL:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        w[:, 3] *= 20.0
        w[: n // 3, : 32] += 0.1  # blocks with a positive range (Q5_1's min above 0)
        return quants.quantize(w, qtype)
    blocks = rng.integers(0, 256, size=(n, k // 32, 18), dtype=np.uint8)
    d = (rng.uniform(0.2, 2.0, size=(n, k // 32)) * 1e-3).astype(np.float16)
    d[rng.random(d.shape) < 0.3] *= -1
    blocks[:, :, :2] = d.view(np.uint8).reshape(n, k // 32, 2)
    return blocks.reshape(n, -1)


def oracle(raw: np.ndarray, qtype: QT) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw, qtype))


def integer_paths(ext) -> list[int]:
    """The integer paths this CPU runs itself: 7 and 9 (AVX2: in registers, panels), 6 and 8 (AVX512-VNNI)."""
    here = isa(ext)
    return ([7, 9] if here != "scalar" else []) + ([6, 8] if here == "avx512-vnni" else [])


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("n,k", [(45, 576), (8, 64), (3, 1536)])
def test_dequantize_equals_gguf_quants(ext, name, n, k):
    qtype = TYPES[name]
    raw = make_raw(qtype, n, k, seed=n + k)
    assert raw.shape == (n, k // 32 * BLOCK_BYTES[qtype])
    got = ext.gguf_dequantize(torch.from_numpy(raw), int(qtype), k)
    assert torch.equal(got, oracle(raw, qtype))


@pytest.mark.parametrize("name", list(TYPES))
def test_every_path_against_float64(ext, name):
    """Each path, M in {1, 2, 3, 8, 9, 64, 65, 130} (decode, batched decode, prefill), N = 45 (not a multiple of
    8): path 0 within float32 summation error, integer paths within the int8 bound, equal to each other."""
    qtype = TYPES[name]
    n, k = 45, 576
    raw = make_raw(qtype, n, k, seed=7)
    wd = oracle(raw, qtype)
    rt = torch.from_numpy(raw)
    for m in (1, 2, 3, 8, 9, 64, 65, 130):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        x[:, 5] *= 30.0  # an outlier channel, as real activations have
        want = x.double() @ wd.double().t()
        assert ext.gguf_resolve_path(rt, int(qtype), k, m, 0) == 0
        got = ext.gguf_linear(x, rt, int(qtype), k, 0)
        scale = x.abs().double() @ wd.abs().double().t()
        assert ((got.double() - want).abs() <= 1e-5 * scale + 1e-6).all(), f"{name} path 0, M={m}"
        first = None
        for path in integer_paths(ext):
            assert ext.gguf_resolve_path(rt, int(qtype), k, m, path) == path
            got = ext.gguf_linear(x, rt, int(qtype), k, path)
            assert_within_integer_bound(got, x, wd, f"{name} path {path}, M={m}")
            if first is None:
                first = got
            else:  # the same integer sums and float order: paths 6 .. 9 agree exactly
                assert torch.equal(got, first), f"{name}: path {path} differs from path 7 at M={m}"


@pytest.mark.parametrize("name", list(TYPES))
def test_rows_independent_and_ragged_tiles(ext, name):
    """A row of x gets the same result alone as inside a batch; N of 1..17 rows (partial 8-row tiles)."""
    qtype = TYPES[name]
    k = 256
    for n in (1, 7, 8, 9, 17):
        raw = torch.from_numpy(make_raw(qtype, n, k, seed=n))
        wd = oracle(raw.numpy(), qtype)
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(n))
        for path in integer_paths(ext):
            got = ext.gguf_linear(x, raw, int(qtype), k, path)
            assert_within_integer_bound(got, x, wd, f"{name} path {path}, N={n}")
            for r in range(5):
                assert torch.equal(ext.gguf_linear(x[r : r + 1], raw, int(qtype), k, path), got[r : r + 1])


def test_extreme_codes(ext):
    """All-31 / all-0 5-bit codes (qh all ones / zeros) and the codebook's ends with x at +-127 after rounding: no
    int16 saturation (AVX2 maddubs) or int32 overflow."""
    k, n = 1536, 16
    x = torch.full((2, k), 3.0)
    x[1, ::2] = -3.0
    for qtype in TYPES.values():
        raw = np.zeros((n, k // 32, BLOCK_BYTES[qtype]), dtype=np.uint8)
        raw[:, :, :2] = np.array([0.01], dtype=np.float16).view(np.uint8)
        body = slice(2, None) if qtype != QT.Q5_1 else slice(4, None)
        if qtype == QT.Q5_1:
            raw[:, :, 2:4] = np.array([-0.05], dtype=np.float16).view(np.uint8)
        raw[::2, :, body] = 0xFF
        if qtype == QT.IQ4_NL:  # code 0 (-127) in every other row
            raw[1::2, :, 2:] = 0x00
        raw = raw.reshape(n, -1)
        wd = oracle(raw, qtype)
        for path in integer_paths(ext):
            got = ext.gguf_linear(x, torch.from_numpy(raw), int(qtype), k, path)
            assert_within_integer_bound(got, x, wd, f"{qtype.name} extremes, path {path}")


def test_default_paths(ext):
    """-1 up to 64 rows: the in-register kernel for one row, the panels above; path 0 without AVX2;
    a forced path this CPU lacks resolves to the one it has. (Above 64 rows gguf_gemm.h chooses: the panels or its
    dequantize + fp32 GEMM path.)"""
    raw = torch.from_numpy(make_raw(QT.Q5_0, 8, 64, seed=1))
    here = isa(ext)
    want = {"avx512-vnni": [6, 8, 8, 8], "scalar": [0] * 4}.get(here, [7, 9, 9, 9])
    assert [ext.gguf_resolve_path(raw, int(QT.Q5_0), 64, m, -1) for m in (1, 2, 3, 64)] == want
    assert ext.gguf_resolve_path(raw, int(QT.Q5_0), 64, 512, -1) in (want[-1], ext.gguf_dequant_path())
    if here not in ("avx512-vnni", "scalar"):
        assert ext.gguf_resolve_path(raw, int(QT.Q5_0), 64, 1, 6) == 7
        assert ext.gguf_resolve_path(raw, int(QT.Q5_0), 64, 1, 8) == 9


def test_unknown_path_is_an_error(ext):
    raw = torch.from_numpy(make_raw(QT.Q5_0, 8, 64, seed=1))
    for path in (1, 5, 10):
        with pytest.raises(Exception, match="unknown code path"):
            ext.gguf_linear(torch.randn(1, 64), raw, int(QT.Q5_0), 64, path)


_AVX2_SCRIPT = r"""
import sys, torch
sys.path.insert(0, {root!r})
from tests.inference.quantization import test_gguf_blocks32 as t
from tests.inference.quantization.helpers import integer_bound, engine_kernels_or_fail
ext = engine_kernels_or_fail()
assert t.isa(ext) == "avx2", t.isa(ext)
for name, qtype in t.TYPES.items():
    raw = t.make_raw(qtype, 21, 576, seed=3)
    wd = t.oracle(raw, qtype)
    rt = torch.from_numpy(raw)
    for m in (1, 3, 64, 65):
        assert ext.gguf_resolve_path(rt, int(qtype), 576, m, 6) == 7  # no VNNI under the cap
        assert ext.gguf_resolve_path(rt, int(qtype), 576, m, 8) == 9
        if m <= 64:
            assert ext.gguf_resolve_path(rt, int(qtype), 576, m, -1) == (7 if m == 1 else 9)
        x = torch.randn(m, 576)
        for path in (-1, 6, 7, 8, 9):
            got = ext.gguf_linear(x, rt, int(qtype), 576, path).double()
            err = (got - x.double() @ wd.double().t()).abs()
            assert (err <= integer_bound(x, wd)).all(), (name, m, path)
print("ok")
"""


def test_avx2_cap_subprocess(ext):
    """SCRATCHLM_ISA=avx2: the default and forced VNNI paths run the AVX2 kernels (6 -> 7, 8 -> 9), within the
    bound."""
    if isa(ext) == "scalar":
        pytest.skip("no AVX2 on this CPU")
    root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ, SCRATCHLM_ISA="avx2")
    out = subprocess.run([sys.executable, "-c", _AVX2_SCRIPT.format(root=root)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
