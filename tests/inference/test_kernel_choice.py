"""The fp32 linears' kernel choice (inference/kernel_choice.py, csrc/panel_gemm.h's table): the cache file, the forced
kernel, a corrupt cache, and every candidate against a float64 matmul under the native ISA and SCRATCHLM_ISA=avx2."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scratchlm.inference import fast_linear, kernel_choice
from scratchlm.inference.fast_linear import PanelLinear
from scratchlm.inference.kernel_choice import KERNELS, Choice, Chooser

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ext():
    ext = fast_linear.load_kernels()
    if ext is None:
        pytest.skip("the engine's C++ kernels could not be built here (test_kernels_build_where_a_compiler_exists)")
    return ext


@pytest.fixture
def fresh_table(ext):
    """An empty C++ table and no measurer for the test; the process's table, measurer and forcing restored after."""
    saved = ext.fp32_choices()
    forced = ext.fp32_force_kernel(-1)
    ext.fp32_clear_choices()
    ext.fp32_set_measurer(None)
    yield ext
    ext.fp32_clear_choices()
    for b, k, n, kern in saved:
        ext.fp32_set_choice(b, k, n, kern)
    ext.fp32_force_kernel(forced)
    prev = kernel_choice._CHOOSERS.get(id(ext))
    ext.fp32_set_measurer(prev._measure_class if prev is not None else None)


def _oracle_check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    want = x.double() @ w.double().T
    err = (y.double() - want).abs().max().item()
    assert err <= 2e-6 * x.shape[1] ** 0.5 * want.abs().max().item() + 1e-6, (what, err)


def test_decide_keeps_the_panel_kernel_unless_another_is_clearly_faster() -> None:
    assert kernel_choice.decide({"panel": 100.0, "mkl": 109.0, "onednn": 90.0}) == "panel"
    assert kernel_choice.decide({"panel": 100.0, "mkl": 111.0, "onednn": 90.0}) == "mkl"
    assert kernel_choice.decide({"panel": 100.0, "skinny": 50.0}) == "panel"


def test_shape_classes(ext) -> None:
    """Row buckets 1, 2-4, 5-8, ..., 257+, and N by ceil(log2 N)."""
    assert list(ext.fp32_row_buckets()) == [1, 4, 8, 16, 32, 64, 128, 256, -1]
    rows = (1, 2, 4, 5, 64, 65, 256, 257, 4096)
    assert [ext.fp32_shape_class(m, 576)[0] for m in rows] == [0, 1, 1, 2, 5, 6, 7, 8, 8]
    cols = (1, 16, 17, 576, 960, 1024, 1025, 49152)
    assert [ext.fp32_shape_class(1, n)[1] for n in cols] == [0, 4, 5, 10, 10, 10, 11, 16]


def test_cache_file_is_written_atomically_and_merged(tmp_path: Path) -> None:
    path = tmp_path / "fp32-choice-x.json"
    a = Choice("panel", 8, 256, {"panel": 50.0, "mkl": 20.0})
    b = Choice("mkl", 512, 256, {"panel": 80.0, "mkl": 90.0})
    kernel_choice.write_cache(path, {"cpu": "test"}, {"b2/k256/n8": a})
    kernel_choice.write_cache(path, {"cpu": "test"}, {"b8/k256/n8": b})  # another class: merged, not replaced
    assert kernel_choice.read_cache(path) == {"b2/k256/n8": a, "b8/k256/n8": b}
    data = json.loads(path.read_text())
    assert data["version"] == kernel_choice.CACHE_VERSION and data["identity"] == {"cpu": "test"}
    before = path.read_bytes()
    with pytest.raises(TypeError):  # json.dump fails half-way through the temporary file
        kernel_choice.write_cache(path, {"cpu": "test"}, {"b3/k256/n8": Choice("panel", 16, {1, 2}, {})})  # type: ignore[arg-type]
    assert path.read_bytes() == before  # the file in place is untouched: written only by the final rename
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.with_suffix(".lock").name]


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 99, "classes": {}}),
                                     json.dumps({"version": 1, "classes": {"b1/k2/n3": {"kernel": "magic"}}}),
                                     json.dumps({"version": 1, "classes": {"bad key": {}}}), "[]"])
def test_a_corrupt_cache_file_is_ignored_with_a_warning(ext, fresh_table, tmp_path: Path, caplog, content: str) -> None:
    path = tmp_path / "fp32-choice-x.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="scratchlm.inference.kernel_choice"):
        c = Chooser(ext, path)
    assert c.choices == {}
    assert any("ignoring the cache file" in r.message and str(path) in r.message for r in caplog.records)
    assert ext.fp32_choices() == []


def test_first_use_measures_caches_and_a_new_process_table_reads_it(ext, fresh_table, tmp_path: Path, caplog) -> None:
    """A class met for the first time is measured (the C++ table calls back), logged, stored in the cache file; a
    Chooser made later over that file puts it in the table without measuring."""
    path = tmp_path / "fp32-choice-x.json"
    c = Chooser(ext, path)
    ext.fp32_set_measurer(c._measure_class)
    with caplog.at_level(logging.INFO, logger="scratchlm.inference.kernel_choice"):
        kid = ext.fp32_kernel_for(3, 256, 320)  # bucket 2-4, K 256, N class 9
    assert 0 <= kid < len(KERNELS)
    key = kernel_choice.class_key(1, 256, 9)
    stored = kernel_choice.read_cache(path)
    assert list(stored) == [key] and stored[key].kernel == KERNELS[kid] and stored[key].rows == 4
    assert set(stored[key].gflops) >= {"panel", "skinny", "mkl"} and all(g > 0 for g in stored[key].gflops.values())
    assert sum(f"{KERNELS[kid]} for 4 rows" in r.message for r in caplog.records) == 1
    assert ext.fp32_kernel_for(4, 256, 300) == kid  # same class: from the table, no second measurement
    assert sum("rows x K" in r.message for r in caplog.records) == 1
    ext.fp32_clear_choices()
    ext.fp32_set_measurer(None)
    stored[key] = Choice("onednn" if ext.fp32_onednn_available() else "mkl", 4, 320, stored[key].gflops)
    kernel_choice.write_cache(path, {}, stored)
    Chooser(ext, path)
    assert ext.fp32_kernel_for(2, 256, 257) == KERNELS.index(stored[key].kernel)
    assert ext.fp32_kernel_for(5, 256, 257) == 0  # another bucket, no measurer: the panel kernel


def test_small_weights_are_not_measured(ext, fresh_table, tmp_path: Path) -> None:
    c = Chooser(ext, tmp_path / "c.json")
    ext.fp32_set_measurer(c._measure_class)
    assert ext.fp32_kernel_for(8, 64, 64) == 0
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("kernel", KERNELS)
def test_forced_kernel_is_honoured(ext, fresh_table, kernel: str) -> None:
    """Forced, both the C++ step's path (panel_linear with kernel -1: the table's choice) and PanelLinear run exactly
    that kernel: bit-equal to calling it directly, and equal to a float64 matmul within fp32 tolerance."""
    if kernel == "onednn" and not ext.fp32_onednn_available():
        pytest.skip("this torch has no oneDNN")
    g = torch.Generator().manual_seed(1)
    ns, k, m = [96, 40], 72, 7
    ws = [torch.randn(n, k, generator=g) for n in ns]
    x = torch.randn(m, k, generator=g)
    panels = ext.panel_pack_groups([ws])[0]
    w = torch.cat(ws)
    direct = {"panel": lambda: torch.cat(ext.panel_linear(x, panels, ns, True, 0), 1),
              "skinny": lambda: ext.skinny_linear(x, w),
              "mkl": lambda: torch.mm(x, w.t()),
              "onednn": lambda: torch.ops.mkldnn._linear_pointwise(
                  x, torch.ops.mkldnn._reorder_linear_weight(w, None), None, "none", [], "")}[kernel]()
    assert kernel_choice.force(ext, kernel) is None
    try:
        assert kernel_choice.kernel_for(ext, m, k, sum(ns)) == kernel
        ys = ext.panel_linear(x, panels, ns, True, -1)
        assert torch.equal(torch.cat(ys, 1), direct)
        lin = PanelLinear(k, ns[0], ext.panel_pack(ws[0]))
        with torch.no_grad():
            y = lin(x)
        copies = lin._op[1].copies()
        assert ("plain" in copies) == (kernel != "panel") and ("onednn" in copies) == (kernel == "onednn")
        _oracle_check(y, x, ws[0], kernel)
    finally:
        assert kernel_choice.force(ext, None) == kernel
    _oracle_check(direct, x, w, kernel)


CANDIDATE_CHECK = r"""
import sys, torch
from scratchlm.inference import fast_linear, kernel_choice
torch.set_num_threads(1)
ext = fast_linear.load_kernels()
assert ext.isa_name() == sys.argv[1], (ext.isa_name(), sys.argv[1])
g = torch.Generator().manual_seed(0)
worst = 0.0
for m in (1, 5, 8, 17, 64, 65, 130):
    for n, k in ((40, 72), (96, 576), (33, 1536)):
        w = torch.randn(n, k, generator=g)
        x = torch.randn(m, k, generator=g)
        for name, fn in kernel_choice.candidates(ext, x, [w]).items():
            (y,) = fn()
            y = y[0] if isinstance(y, list) else y
            want = x.double() @ w.double().T
            err = (y.double() - want).abs().max().item() / (k ** 0.5 * want.abs().max().item())
            assert err <= 2e-6, (name, m, n, k, err)
            worst = max(worst, err)
print("ok", worst)
"""


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_every_candidate_equals_float64(ext, isa: str) -> None:
    """Each candidate kernel (kernel_choice.candidates, what the measurement runs) against a float64 matmul, in a
    process with SCRATCHLM_ISA=isa (read once per process) and oneDNN / MKL capped alike for avx2."""
    if isa == "avx2" and not ext.has_avx2():
        pytest.skip("no AVX2 here")
    env = dict(os.environ, SCRATCHLM_ISA=isa, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                                                      os.environ.get("PYTHONPATH")])))
    if isa == "avx2":
        env.update(ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2")
    want = ext.isa_name() if isa == "native" else "avx2"
    out = subprocess.run([sys.executable, "-c", CANDIDATE_CHECK, want], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")


def test_force_env_var_and_a_bad_value(ext) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    code = "from scratchlm.inference import fast_linear; print(fast_linear.load_kernels().fp32_forced_kernel())"
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, SCRATCHLM_FP32_KERNEL="mkl"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.split()[-1] == str(KERNELS.index("mkl")), out.stderr[-2000:]
    code = "from scratchlm.inference import fast_linear; fast_linear.load_kernels().fp32_kernel_for(1, 2, 3)"
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, SCRATCHLM_FP32_KERNEL="fastest"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode != 0 and "SCRATCHLM_FP32_KERNEL=fastest" in out.stderr


def test_bench_kernels_prints_the_isa_peak_and_the_choice(ext, capsys) -> None:
    """`scratchlm bench kernels` (a small run): the ISA, the peak and the streaming read, a row per M with every
    candidate and the chosen kernel."""
    from scratchlm.cli import main

    assert main(["bench", "kernels", "--rows", "1,70", "--repeats", "1", "--shapes", "o", "--no-quant"]) == 0
    out = capsys.readouterr().out
    assert f"ISA: **{ext.isa_name()}**" in out and "GFLOP/s" in out and "streaming read" in out
    rows = [line for line in out.splitlines() if line.startswith("| o |")]
    assert [r.split(" | ")[2] for r in rows] == ["1", "70"]
    assert all(r.split(" | ")[8] in KERNELS for r in rows)
