"""GGUF K-quant kernels (`csrc/gguf_kquants.h`): dequantization bit-equal to gguf.quants, and every matmul path
against float64 gguf.quants.dequantize-then-matmul, within the bound of x's int8 rounding.

Every type x every path this CPU has (native, and the AVX2 paths forced on an AVX-512 machine) x M in {1, 2, 3,
8, 17, 64, 65, 130} with N not a multiple of the 8-row tile; random valid blocks (random bytes, finite fp16
scales). The header is reached through a small test-only extension until the engine binds it.
"""

from __future__ import annotations

import hashlib
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

from tests.inference.quantization.helpers import integer_bound  # noqa: E402

CSRC = Path(__file__).resolve().parents[3] / "scratchlm" / "inference" / "csrc"
TYPES = {"Q2_K": GT.Q2_K, "Q3_K": GT.Q3_K, "Q4_K": GT.Q4_K, "Q5_K": GT.Q5_K, "Q6_K": GT.Q6_K, "IQ4_XS": GT.IQ4_XS}
BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_XS": 136}
# byte offsets of the fp16 super-block scales (d, and dmin where the type has one)
HALF_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}
ROWS = [1, 2, 3, 8, 17, 64, 65, 130]

_SOURCE = r"""
#include <torch/extension.h>
#include "gguf_kquants.h"
using namespace scratchlm_gguf;

static GMat mat(const torch::Tensor& raw, int64_t type, int64_t K) {
  TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous());
  GMat w;
  w.type = static_cast<GType>(type), w.N = raw.size(0), w.K = K, w.row_bytes = raw.size(1);
  w.raw = raw.data_ptr<uint8_t>();
  return w;
}
torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& raw, int64_t type, int64_t K, int64_t path) {
  const GMat w = mat(raw, type, K);
  auto xc = x.contiguous();
  TORCH_CHECK(xc.dtype() == torch::kFloat && xc.size(1) == K);
  auto y = torch::empty({xc.size(0), w.N}, xc.options());
  kq_gemm(xc.data_ptr<float>(), xc.size(0), w, y.data_ptr<float>(), static_cast<int>(path));
  return y;
}
torch::Tensor dequant(const torch::Tensor& raw, int64_t type, int64_t K) {
  const GMat w = mat(raw, type, K);
  auto out = torch::empty({w.N, K}, torch::kFloat);
  kq_dequantize_rows(w, 0, w.N, out.data_ptr<float>());
  return out;
}
int64_t resolve(const torch::Tensor& raw, int64_t type, int64_t K, int64_t M, int64_t path) {
  return kq_resolve_path(mat(raw, type, K), M, static_cast<int>(path));
}
std::string isa() { return scratchlm_simd::isa_name(); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm", &gemm); m.def("dequant", &dequant); m.def("resolve", &resolve); m.def("isa", &isa);
}
"""


def load_test_extension():
    """The header built into a test-only module (cached by the content of the headers)."""
    from torch.utils.cpp_extension import load_inline

    from scratchlm.inference.cpp_extensions import CFLAGS, _put_venv_ninja_on_path, build_dir

    digest = hashlib.sha1(_SOURCE.encode() + " ".join(CFLAGS).encode())
    for name in ("gguf_kquants.h", "gguf_blocks.h", "simd_common.h"):
        digest.update((CSRC / name).read_bytes())
    tag = digest.hexdigest()[:10]
    directory = build_dir() / f"kquants_test-{tag}"
    directory.mkdir(parents=True, exist_ok=True)
    _put_venv_ninja_on_path()
    return load_inline(name=f"kquants_test_{tag}", cpp_sources=[_SOURCE], extra_cflags=CFLAGS,
                       extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)], build_directory=str(directory))


@pytest.fixture(scope="module")
def ext():
    return load_test_extension()


def random_blocks(name: str, n: int, k: int, seed: int) -> np.ndarray:
    """(n, k / 256 * block bytes) uint8: random bytes with the fp16 scales replaced by finite values of both
    signs around 1e-2 (so that outputs stay O(1) for x ~ N(0, 1))."""
    rng = np.random.default_rng(seed)
    nsb, bb = k // 256, BLOCK_BYTES[name]
    raw = rng.integers(0, 256, size=(n, nsb, bb), dtype=np.uint8)
    for off in HALF_OFFSETS[name]:
        half = (rng.uniform(0.2, 1.0, size=(n, nsb)) * rng.choice([-1, 1], size=(n, nsb)) * 2e-3).astype(np.float16)
        raw[:, :, off:off + 2] = half.view(np.uint8).reshape(n, nsb, 2)
    return raw.reshape(n, nsb * bb)


def paths_here(ext, raw: torch.Tensor, type_id: int, k: int) -> list[int]:
    """Every path this CPU runs for this matrix (asked-for paths it lacks resolve to others: de-duplicated)."""
    return sorted({ext.resolve(raw, type_id, k, m, p) for m in (1, 8, 130) for p in range(-1, 4)} | {0})


@pytest.mark.parametrize("name", list(TYPES))
def test_dequantize_equals_gguf(ext, name):
    for n, k, seed in [(5, 256, 0), (3, 1024, 1), (17, 512, 2)]:
        raw = random_blocks(name, n, k, seed)
        want = torch.from_numpy(dequantize(raw, TYPES[name]).reshape(n, k))
        got = ext.dequant(torch.from_numpy(raw), int(TYPES[name]), k)
        assert torch.equal(got, want), f"{name} n={n} k={k}"


@pytest.mark.parametrize("name", list(TYPES))
def test_gemm_paths_match_float64(ext, name):
    n, k = 37, 512  # N not a multiple of 8
    raw_np = random_blocks(name, n, k, seed=7)
    raw = torch.from_numpy(raw_np)
    wd = torch.from_numpy(dequantize(raw_np, TYPES[name]).reshape(n, k))
    type_id = int(TYPES[name])
    paths = paths_here(ext, raw, type_id, k)
    gen = torch.Generator().manual_seed(3)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen)
        x[:, 5] *= 30.0  # an outlier channel, as real activations have
        want = x.double() @ wd.double().t()
        bound = integer_bound(x, wd)
        outs = {}
        for p in paths:
            got = ext.gemm(x, raw, type_id, k, p)
            assert got.shape == (m, n)
            err = (got.double() - want).abs()
            assert (err <= bound).all(), f"{name} M={m} path {p}: error {err.max().item():.3g} above the bound"
            outs[p] = got
        # the same integer sums on every path: only the float32 order differs from the scalar path
        for p, got in outs.items():
            torch.testing.assert_close(got, outs[0], rtol=2e-5, atol=2e-5 * want.abs().max().item(),
                                       msg=f"{name} M={m} path {p} vs scalar")


def test_errors(ext):
    raw = torch.from_numpy(random_blocks("Q4_K", 4, 256, 0))
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ext.gemm(torch.randn(1, 128), raw[:, :72].contiguous(), int(GT.Q4_K), 128, -1)
    with pytest.raises(RuntimeError, match="not one of Q2_K"):
        ext.gemm(x, raw, int(GT.Q4_0), 256, -1)
    with pytest.raises(RuntimeError, match="row_bytes"):
        ext.gemm(x, raw[:, :100].contiguous(), int(GT.Q4_K), 256, -1)
    with pytest.raises(RuntimeError, match="path"):
        ext.gemm(x, raw, int(GT.Q4_K), 256, 99)


def test_avx2_cap_runs_the_avx2_kernels(ext):
    """Under SCRATCHLM_ISA=avx2 (a fresh process: the cap is read once) the default path is an AVX2 one and
    its result stays within the bound (on an AVX-512 machine this is exactly what a Zen 3 would run)."""
    code = (
        "import numpy as np, torch, sys\n"
        "from gguf.quants import dequantize\n"
        "from tests.inference.quantization.test_gguf_kquants import load_test_extension, random_blocks, TYPES\n"
        "from tests.inference.quantization.helpers import integer_bound\n"
        "ext = load_test_extension()\n"
        "print(ext.isa())\n"
        "for name, t in TYPES.items():\n"
        "    raw_np = random_blocks(name, 21, 768, 5); raw = torch.from_numpy(raw_np)\n"
        "    wd = torch.from_numpy(dequantize(raw_np, t).reshape(21, 768))\n"
        "    for m in (1, 8, 70):\n"
        "        x = torch.randn(m, 768)\n"
        "        y = ext.gemm(x, raw, int(t), 768, -1)\n"
        "        err = (y.double() - x.double() @ wd.double().t()).abs()\n"
        "        assert (err <= integer_bound(x, wd)).all(), (name, m)\n"
        "        print(name, m, ext.resolve(raw, int(t), 768, m, -1))\n"
    )
    env = dict(os.environ, SCRATCHLM_ISA="avx2")
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    assert lines[0] == "avx2" or ext.isa() == "scalar", lines[0]
