"""Peak activation memory: measured (this process's resident high-water mark) and predicted (a formula).

What `PeakMemory` measures, on CPU: the kernel's resident-set high-water mark of this process (VmHWM in
/proc/self/status), reset on entry by writing 5 to /proc/self/clear_refs (Linux >= 4.0) after
`malloc_trim(0)` hands freed heap pages back; the figure is HWM at exit minus RSS at entry, i.e. the
largest number of extra bytes that were resident at any instant inside the block: every tensor the
block allocated, torch's and gloo's buffers, and the allocator's slack. It is real memory, not an
allocator's bookkeeping. On CUDA it is `torch.cuda.max_memory_allocated` above the allocation at entry.
Where clear_refs cannot be written the process-lifetime `ru_maxrss` is used and `method` says so
(then only a fresh process gives a meaningful figure).

`pair_block_peak_bytes` predicts the same figure for one Pairformer block (single rank or one DAP rank),
from the tensors alive at the peak of each op; the planner uses it and the benchmark checks it.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import resource
from dataclasses import dataclass

import torch

from scratchlm.fold.pairformer import PairformerConfig

_STATUS = "/proc/self/status"



def _status_kb(key: str) -> int:
    with open(_STATUS) as f:
        m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M)
    if m is None:
        raise RuntimeError(f"{_STATUS} has no {key}")
    return int(m.group(1))


def _trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@dataclass
class PeakMemory:
    """`with PeakMemory(device) as pm: ...` then `pm.peak_bytes`: extra bytes resident at the block's peak."""

    device: str | torch.device = "cpu"
    peak_bytes: int = 0
    method: str = ""
    _base: int = 0

    def __enter__(self) -> PeakMemory:
        dev = torch.device(self.device)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            self._base = torch.cuda.memory_allocated(dev)
            self.method = "cuda max_memory_allocated"
            return self
        _trim()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.method = "VmHWM after clear_refs=5"
        except OSError:
            self.method = "ru_maxrss (process lifetime: use a fresh process)"
        self._base = _status_kb("VmRSS") * 1024
        return self

    def __exit__(self, *exc) -> None:
        dev = torch.device(self.device)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            self.peak_bytes = torch.cuda.max_memory_allocated(dev) - self._base
        elif self.method.startswith("VmHWM"):
            self.peak_bytes = _status_kb("VmHWM") * 1024 - self._base
        else:
            self.peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self._base


def pair_block_peak_bytes(cfg: PairformerConfig, n: int, world: int = 1, chunk_rows: int | None = None,
                          overlap: bool = True, batch: int = 1, elem: int = 4,
                          channel_chunks: int | None = None) -> int:
    """Predicted extra bytes at the peak of one block's forward on one rank (z's input shard not counted).

    R = ceil(N / P) rows per rank, N' = P R, S = B R N' c elem (the shard; the whole pair at P = 1),
    k = channel_chunks, r = the row chunk. The block first copies z (S), then each op's peak is:
    - triangle update: a and b (2 S) plus, at P = 1, one channel chunk of the product (S/k) or the
      projection of one row chunk (r N' 7c); under DAP the ring's chunk of the product and its two
      in-flight operand blocks (3 S/k), or with overlap off the gathered operand chunk (P S/k + S/k);
    - a transpose (DAP): the old and the new shard (S each, the copy of z counted) and two chunks in
      flight, send and receive (4 S/k);
    - a triangle attention: the LayerNormed copy (S), the gathered bias B H N'^2, and one row chunk's
      q|k|v|g, o and the gated o (r N' 6HD) with its logits and softmax (2 r H N'^2);
    - the pair transition: one row chunk's hidden activations (r N' 3 x 4c).
    Measured after a warm-up call (code paged in, gloo's buffers made): the first call of a process also
    carries 4-8 MiB that do not grow with N.
    """
    rows = -(-n // world)
    n_pad = rows * world
    r = min(rows, chunk_rows or rows)
    c, h, hd = cfg.c_z, cfg.pair_heads, cfg.pair_heads * cfg.pair_head_dim
    s = batch * rows * n_pad * c * elem
    k = channel_chunks or (8 if world == 1 else 16)  # the single-rank and DapPairformer defaults
    if world == 1:
        tri = 2 * s + max(s // k, batch * r * n_pad * 7 * c * elem)
    else:
        tri = 2 * s + max(3 * s // k if overlap else (world + 1) * s // k, batch * r * n_pad * 7 * c * elem)
    transpose = (s + 4 * s // k) if world > 1 else 0
    att = s + batch * h * n_pad * n_pad * elem + batch * elem * (r * n_pad * 6 * hd + 2 * r * h * n_pad * n_pad)
    trans = batch * elem * r * n_pad * 3 * cfg.transition_mult * c
    return s + max(tri, transpose, att, trans)
