"""scratchlm.isa: the kernels' ISA from the CPU's flags and $SCRATCHLM_ISA, the same answer as the C++ kernels'."""

from __future__ import annotations

import pytest

from scratchlm import isa

# AVX2 only: Zen 2/3, most client CPUs before 2021
ZEN3 = frozenset(["fpu", "sse2", "avx", "avx2", "fma", "f16c", "bmi2"])
ALDER_LAKE = ZEN3 | {"avx_vnni"}
ZEN4 = ALDER_LAKE | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize("flags, cap, want", [
    (ZEN4, "native", "avx512-vnni"), (ZEN4, "avx512", "avx512-vnni"), (ZEN4, "avx2-vnni", "avx2-vnni"),
    (ZEN4, "avx2", "avx2"), (ZEN4, "scalar", "scalar"), (SKYLAKE_X, "native", "avx512"),
    (ALDER_LAKE, "native", "avx2-vnni"), (ALDER_LAKE, "avx2", "avx2"), (ZEN3, "native", "avx2"),
    (ZEN3, "avx2-vnni", "avx2"), (frozenset({"avx2", "fma"}), "native", "scalar"),  # no F16C: no AVX2 path
    (frozenset(), "native", "scalar"),
])
def test_kernel_isa_from_flags_and_cap(flags, cap, want) -> None:
    assert isa.kernel_isa(flags, cap) == want


def test_cap_from_the_environment() -> None:
    assert isa.isa_cap({}) == "native" and isa.isa_cap({"SCRATCHLM_ISA": ""}) == "native"
    assert isa.isa_cap({"SCRATCHLM_ISA": "avx2"}) == "avx2"
    with pytest.raises(ValueError, match="SCRATCHLM_ISA=avx3 is not one of native, avx512, avx2-vnni, avx2, scalar"):
        isa.isa_cap({"SCRATCHLM_ISA": "avx3"})


def test_cpu_flags_from_cpuinfo_text() -> None:
    text = "processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 fma f16c\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert isa.cpu_flags(text) == {"fpu", "avx2", "fma", "f16c"}
    assert isa.cpu_flags("no flags line") == frozenset()
    line = isa.describe(ZEN4, "avx2")
    assert line.startswith("avx2 (SCRATCHLM_ISA=avx2; CPU flags: avx2 fma f16c avx_vnni avx512f") and "bmi2" not in line


def test_same_answer_as_the_kernels() -> None:
    from scratchlm.inference.cpp_extensions import load_engine_kernels

    eng = load_engine_kernels()
    if eng is None:
        pytest.skip("the engine's C++ kernels are not built here")
    assert eng.isa_name() == isa.kernel_isa()
