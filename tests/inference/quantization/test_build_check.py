"""The set-up's kernel check (`python -m scratchlm.inference.quantization.build`): every check runs and passes on
this machine, failures are named in the summary and set the exit status, and its int8-rounding bound is a real
bound (never exceeded, and attained by the worst x), which the old fixed 1e-3 was not."""

from __future__ import annotations

import pytest
import torch

from scratchlm import isa
from scratchlm.inference.quantization import build, reference
from tests.inference.quantization.helpers import engine_kernels_or_fail


def test_build_check_passes_and_reports_every_kernel(capsys) -> None:
    eng = engine_kernels_or_fail()
    status = build.main([])
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert status == 0, out
    assert lines[0].startswith(f"kernel set-up check: kernels for {isa.kernel_isa()} (SCRATCHLM_ISA=")
    assert lines[-1].startswith("kernel check passed"), lines[-1]
    assert not [x for x in lines if x.startswith("  FAIL")]
    names = [x.split(":")[0][8:] for x in lines if x.startswith(("  ok", "  skip"))]
    for fmt in ("int8 per channel", "int8 g32 (Q8_0)", "int4 g32 sym (Q4_0)", "int4 g32 asym (Q4_1)"):
        for act in ("int8 (default)", "float"):
            assert f"quant_linear {fmt}, x {act}" in names
    import gguf

    expected = ["build scratchlm_quant_kernels", "build scratchlm_engine_kernels", "paged attention decode",
                "paged attention prefill", "panel_linear (SIMD)", "skinny_linear (scalar)",
                "fused decode step, float32", "fused decode step, int4-g32-asym", "ISA the engine kernels report"]
    expected += [f"gguf_linear {gguf.GGMLQuantizationType(t).name}, x {x}" for t in eng.gguf_types()
                 for x in ("int8 (default)", "float")]
    assert not [n for n in expected if n not in names], names
    # the default int4 path at M=1 is named with its path number (6: VNNI, 7: AVX2, 0: no SIMD)
    line = next(x for x in lines if "quant_linear int4 g32 asym (Q4_1), x int8 (default)" in x)
    path = eng.quant_resolved_path(*_int4_tensors(), 32, 256, 1, -1)
    assert f"M=1 {'int' if path in build.INTEGER_PATHS else 'float'} path {path} " in line


def _int4_tensors() -> tuple[list[torch.Tensor]]:
    q, d, m = reference.quantize_int4(torch.randn(8, 256), 32, symmetric=False)
    return ([q, d.half(), m.half()],)


def test_report_runs_every_check_and_names_the_failures() -> None:
    report, ran = build.Report(), []

    def fails() -> str:
        ran.append("wrong")
        raise AssertionError("error above the bound")

    def raises() -> str:
        ran.append("raises")
        raise RuntimeError("kernel crashed")

    def skips() -> str:
        ran.append("skip")
        raise build.Skip("not here")

    report.run("wrong kernel", fails)
    report.run("raising kernel", raises)
    report.run("skipped kernel", skips)
    report.run("good kernel", lambda: ran.append("good") or "fine")
    assert ran == ["wrong", "raises", "skip", "good"]  # no early return
    status, line = report.summary(1.0)
    assert status == 1
    assert "wrong: wrong kernel; raising kernel" in line and "did not build" not in line
    report.not_built.append("scratchlm_engine_kernels")
    assert "did not build: scratchlm_engine_kernels (the engine runs the pure-torch path" in report.summary(1.0)[1]
    ok = build.Report()
    ok.run("good", lambda: "fine")
    ok.run("skipped", lambda: build.skip("n/a"))
    assert ok.summary(2.0) == (0, "kernel check passed: 1 of 2 ok, 1 skipped (2 s)")


def _round_x(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x rounded to int8 per block as the kernels do (scale max|x| / 127, round half to even), dequantized."""
    xb = x.view(x.shape[0], -1, block)
    d = xb.abs().amax(-1, keepdim=True) / 127
    return (torch.round(xb / d) * d).view_as(x)


def test_rounding_bound_holds_and_is_attained() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 128, generator=gen, dtype=torch.float64)
    x[:, 3] *= 30  # an outlier: its block rounds coarsely
    w = torch.randn(16, 128, generator=gen, dtype=torch.float64)
    err = (_round_x(x) @ w.t() - x @ w.t()).abs()
    bound = build.rounding_bound(x, w, 32)
    assert (err <= bound).all()
    # the worst x: every value half a step off the grid, with w's signs aligned: the bound is reached
    step = torch.full((1, 128), 1.0, dtype=torch.float64)
    xw = step * (torch.arange(128, dtype=torch.float64) % 100 + 0.5)
    xw.view(1, -1, 32)[..., 0] = 127.0  # max|x| = 127 per block: the rounding step is 1
    ww = torch.sign(_round_x(xw) - xw)  # (1, 128): every product's error adds up
    worst = (_round_x(xw) @ ww.t() - xw @ ww.t()).abs()
    torch.testing.assert_close(worst, build.rounding_bound(xw, ww, 32), rtol=1e-12, atol=0)


def test_integer_kernel_is_within_its_bound_but_not_the_old_fixed_tolerance() -> None:
    """The check of before compared the default int4 kernel (x rounded) with the float reference at 1e-3 and
    reported a failed build on every machine where that path is the default; the kernel is right, within its
    rounding bound."""
    eng = engine_kernels_or_fail()
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 128, generator=gen), torch.randn(3, 128, generator=gen)
    q, d, m = reference.quantize_int4(w, 32, symmetric=False)
    tensors = [q, d.half(), m.half()]
    path = eng.quant_resolved_path(tensors, 32, 128, 3, -1)
    if path not in build.INTEGER_PATHS:
        pytest.skip(f"the default int4 path here is {path}, with float x (no SIMD, or float activations)")
    wd = reference.dequantize_int4(q, d, m, 32)
    got = eng.quant_linear(x, tensors, 32)
    want = x.double() @ wd.double().t()
    err = (got.double() - want).abs()
    assert err.max() > 1e-3  # the old check's tolerance: a false failure
    assert (err <= build.rounding_bound(x, wd, 32) + build.float_bound(x, build.int4_terms(wd, d, m))).all()
