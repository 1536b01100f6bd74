"""Large CPU buffers on transparent huge pages (2 MiB) where Linux offers them.

The paged KV cache is read in blocks scattered over hundreds of MB (one 16-token fp32 block of SmolLM2 is 12 KiB,
three 4 KiB pages): with 4 KiB pages every block costs TLB misses, and the hardware prefetcher stops at each page
boundary. On this machine (one thread, `benchmarks/decode_step.py`, results/2026-12-01-decode_step.md) the decode
attention over the workload's own steps read K/V ~5-10 % faster from a cache on huge pages than from the same cache
on 4 KiB pages (most of its speed-up comes from the decode-row kernel's own prefetching, csrc/paged_attention.h).

Policy: `zeros(shape, dtype)` allocates with torch, asks the kernel for huge pages over the buffer with
`madvise(MADV_HUGEPAGE)` before the first write touches it (the pages are then faulted in as huge pages where
the kernel has them: /sys/kernel/mm/transparent_hugepage/enabled `always` or `madvise`), and zeroes it. Buffers
under `MIN_BYTES`, non-Linux systems, a failing madvise, or `SCRATCHLM_HUGE_PAGES=0` get ordinary pages; the
contents are the same either way. Nothing here is needed for correctness. The packed fp32 weights get the same
treatment in C++ (`panel_gemm.h` `alloc_panels`: 2 MiB-aligned, advised before packing), under the same switch.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

ENV = "SCRATCHLM_HUGE_PAGES"
MIN_BYTES = 4 << 20  # smaller buffers span too few 2 MiB pages to matter
_MADV_HUGEPAGE = 14
_PAGE = 4096
_libc: ctypes.CDLL | None = None


def enabled() -> bool:
    """Whether `zeros` asks for huge pages here: Linux and $SCRATCHLM_HUGE_PAGES not "0"."""
    return sys.platform.startswith("linux") and os.environ.get(ENV, "1") != "0"


def advise(t: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the whole 4 KiB pages of a CPU tensor's memory; whether the kernel took it.
    Only pages faulted in afterwards become huge pages, so call it before the tensor is first written."""
    global _libc
    if t.device.type != "cpu" or t.numel() * t.element_size() < MIN_BYTES or not enabled():
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        first = -(-start // _PAGE) * _PAGE  # madvise takes a page-aligned start
        return _libc.madvise(first, end - first, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape, dtype, device), on huge pages where `advise` applies (a CPU buffer of >= MIN_BYTES)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype)
    advise(t)
    return t.zero_()
