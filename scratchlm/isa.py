"""The CPU's SIMD features and the kernels' ISA cap (``$SCRATCHLM_ISA``), as the C++ kernels see them.

Every C++ kernel picks its code path at run time from the CPU's features, capped by ``$SCRATCHLM_ISA``
(``csrc/simd_common.h``): ``native`` (the default, also ``avx512``), ``avx2-vnni``, ``avx2`` or ``scalar``. So an
AVX-512 machine runs, and tests, exactly the code an AVX2-only CPU would. Python code that reports or decides by
ISA reads it here, so that it honours the same cap: `kernel_isa()` is what the kernels run (the same answer as
the engine extension's ``isa_name()``), `cpu_flags()` what the CPU itself has, whatever the cap. An unknown
``$SCRATCHLM_ISA`` is an error naming the variable, as in the C++ (never a silent default).
"""

from __future__ import annotations

import os
from pathlib import Path

# $SCRATCHLM_ISA -> the highest level the kernels may use (simd_common.h's isa_cap()).
ISA_CAPS = {"native": 3, "avx512": 3, "avx2-vnni": 2, "avx2": 1, "scalar": 0}

# The /proc/cpuinfo flags the kernels ask for (Linux's names), in the order a report prints them.
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")


def isa_cap(env: dict[str, str] | None = None) -> str:
    """The ISA cap in force: ``$SCRATCHLM_ISA`` ('native' when unset or empty); ValueError for an unknown value."""
    value = (os.environ if env is None else env).get("SCRATCHLM_ISA", "") or "native"
    if value not in ISA_CAPS:
        raise ValueError(f"SCRATCHLM_ISA={value} is not one of {', '.join(ISA_CAPS)}")
    return value


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (empty when it cannot be read: not Linux, not x86)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def kernel_isa(flags: frozenset[str] | None = None, cap: str | None = None) -> str:
    """What the kernels run on this CPU under the cap: 'avx512-vnni', 'avx512', 'avx2-vnni', 'avx2' or 'scalar'
    (simd_common.h's isa_name(), from the same features: AVX2 means AVX2 + FMA + F16C)."""
    have = cpu_flags() if flags is None else flags
    level = ISA_CAPS[isa_cap() if cap is None else cap]
    avx2 = level >= 1 and {"avx2", "fma", "f16c"} <= have
    avx512 = level >= 3 and avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= have
    if avx512:
        return "avx512-vnni" if "avx512_vnni" in have else "avx512"
    if level >= 2 and avx2 and "avx_vnni" in have:
        return "avx2-vnni"
    return "avx2" if avx2 else "scalar"


def describe(flags: frozenset[str] | None = None, cap: str | None = None) -> str:
    """One line for reports: the kernels' ISA, the cap, and the kernel-relevant flags the CPU has."""
    have = cpu_flags() if flags is None else flags
    cap = isa_cap() if cap is None else cap
    listed = " ".join(f for f in KERNEL_FLAGS if f in have) or "none of " + " ".join(KERNEL_FLAGS)
    return f"{kernel_isa(have, cap)} (SCRATCHLM_ISA={cap}; CPU flags: {listed})"
