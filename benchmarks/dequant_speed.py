"""GGUF dequantization at load: scratchlm's torch dequantizers against `gguf.quants` (numpy), one core, interleaved.

    python -m benchmarks.dequant_speed [--weights 30000000] [--repeats 3] [--files PATH ...]

Per type: `--weights` weights (SmolLM2-135M's 30 decoder layers hold ~106M; 30M is a 135M model's K-quant share)
of random valid blocks (random bytes with finite fp16 scales), dequantized to float32 by
`scratchlm.model.loading.dequant.dequantize` and by `gguf.quants.dequantize`; the outputs are checked bit-equal
before timing. Per file (`--files`, default: the SmolLM2-135M GGUFs found in .peers/ and the default model): every
tensor of the file dequantized by each, then `scratchlm.model.load(file)` as a whole (read, dequantize, build).
Times are thread CPU seconds (torch on one thread; the machine is shared), median of `--repeats`
interleaved rounds.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO_ROOT, Report, compare, set_threads

# byte offsets of the fp16 scale fields of each block type: random bytes there would be NaN/inf
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0],
              "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0],
              "TQ1_0": [52], "TQ2_0": [64], "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0],
              "IQ3_S": [0], "IQ1_S": [0]}


def random_blocks(type_name: str, n_weights: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, row_bytes) uint8 of random valid blocks of `type_name` holding `n_weights` weights (rows of 4096)."""
    from scratchlm.model.loading.dequant import TYPE_INFO

    bw, bb = TYPE_INFO[type_name]
    n = n_weights // bw
    if type_name in ("F32", "F16", "BF16"):
        w = rng.standard_normal(n, dtype=np.float32)
        raw = {"F32": w, "F16": w.astype(np.float16)}.get(type_name, w)
        raw = raw.view(np.uint8).reshape(n, -1)
        if type_name == "BF16":
            raw = np.ascontiguousarray(raw[:, 2:4])
    else:
        raw = rng.integers(0, 256, size=(n, bb), dtype=np.uint8)
        for off in F16_FIELDS.get(type_name, []):
            raw[:, off:off + 2] = (rng.standard_normal((n, 1), dtype=np.float32) * 0.01).astype(np.float16).view(
                np.uint8)
        if type_name == "MXFP4":
            raw[:, 0] = rng.integers(100, 140, size=n)  # e8m0 exponents of ordinary weights
        if type_name == "IQ1_M":  # the fp16 d: the top nibbles of its four u16 scale fields
            d = (rng.standard_normal(n, dtype=np.float32) * 0.01).astype(np.float16).view(np.uint16)
            sc = raw[:, 48:56].copy().view(np.uint16)
            for k in range(4):
                sc[:, k] = (sc[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
            raw[:, 48:56] = sc.view(np.uint8)
    per_row = 4096 // bw
    return raw.reshape(-1, per_row * bb) if n % per_row == 0 else raw.reshape(1, -1)


def type_section(report: Report, types: list[str], n_weights: int, repeats: int) -> None:
    import gguf
    import torch

    from scratchlm.model.loading.dequant import dequantize

    rng = np.random.default_rng(0)
    rows = []
    for name in types:
        raw = random_blocks(name, n_weights, rng)
        qtype = gguf.GGMLQuantizationType[name]
        bw, bb = gguf.GGML_QUANT_SIZES[qtype]
        shape = (raw.shape[0], raw.shape[1] // bb * bw)  # (rows, weights per row)
        n = shape[0] * shape[1]
        ref = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(shape)
        if not torch.equal(dequantize(raw, name, shape), torch.from_numpy(ref)):
            raise SystemExit(f"{name}: scratchlm's dequantizer differs from gguf.quants")
        print(f"{name}: {n / 1e6:.1f}M weights", flush=True)
        res = compare({"scratchlm": lambda raw=raw, name=name, shape=shape: dequantize(raw, name, shape),
                       "gguf.quants": lambda raw=raw, qtype=qtype: gguf.quants.dequantize(raw, qtype)},
                      warmup=1, repeats=repeats, clock="thread_cpu")
        ours, theirs = res["scratchlm"].median, res["gguf.quants"].median
        rows.append([name, f"{n / 1e6:.1f}M", f"{ours * 1e3:.0f} ms", f"{n / ours / 1e6:.0f}",
                     f"{theirs * 1e3:.0f} ms", f"{n / theirs / 1e6:.1f}", f"{theirs / ours:.1f}x",
                     f"{res.ratio('gguf.quants', 'scratchlm', 'best'):.1f}x"])
    report.table(["type", "weights", "scratchlm", "M weights/s", "gguf.quants", "M weights/s",
                  "speed-up (median)", "speed-up (best)"], rows,
                 caption="Dequantize to float32, per type (thread CPU s, median)")


def default_files() -> list[Path]:
    from scratchlm.defaults import default_model_path

    peers = sorted((REPO_ROOT / ".peers").glob("SmolLM2-135M-Instruct.*.gguf"))
    return [Path(default_model_path()), *peers]


def file_section(report: Report, files: list[Path], repeats: int) -> None:
    import gguf
    import torch

    from scratchlm.model import load
    from scratchlm.model.loading.dequant import dequantize
    from scratchlm.model.loading.gguf_reader import read_gguf

    rows = []
    for path in files:
        _, tensors = read_gguf(path)
        types = sorted({t.type_name for t in tensors.values()})
        n = sum(int(np.prod(t.shape)) for t in tensors.values())

        def ours(tensors=tensors):
            for t in tensors.values():
                dequantize(t.data, t.type_name, t.shape)

        def theirs(tensors=tensors):
            for t in tensors.values():
                torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType[t.type_name]),
                                            dtype=np.float32))

        print(f"{path.name}: {', '.join(types)}", flush=True)
        res = compare({"scratchlm": ours, "gguf.quants": theirs, "load": lambda path=path: load(path)},
                      warmup=1, repeats=repeats, clock="thread_cpu")
        a, b, full = res["scratchlm"].median, res["gguf.quants"].median, res["load"].median
        rows.append([path.name, ", ".join(types), f"{n / 1e6:.1f}M", f"{a:.2f} s", f"{b:.2f} s", f"{b / a:.1f}x",
                     f"{res.ratio('gguf.quants', 'scratchlm', 'best'):.1f}x", f"{full:.2f} s"])
    report.table(["file", "types", "weights", "scratchlm dequantize", "gguf.quants dequantize",
                  "speed-up (median)", "speed-up (best)", "scratchlm load() total"], rows,
                 caption="Every tensor of a GGUF file dequantized, and the whole load (thread CPU s, median)")


def main(argv: list[str] | None = None) -> int:
    from scratchlm.model.loading.dequant import SUPPORTED_TYPES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", type=int, default=30_000_000, help="weights per type (default 30M)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--types", nargs="+", default=[t for t in SUPPORTED_TYPES if t != "F32"],
                    help="default: every supported type but F32 (gguf.quants returns a view of F32 bytes; scratchlm "
                         "copies them out of the read-only memmap)")
    ap.add_argument("--files", nargs="*", type=Path, default=None, help="GGUF files (default: SmolLM2-135M ones)")
    ap.add_argument("--bind-core", type=int, default=0, help="pin to this core (-1: no pinning)")
    args = ap.parse_args(argv)
    set_threads(1)
    if args.bind_core >= 0:
        os.sched_setaffinity(0, {args.bind_core})
    import gguf

    report = Report("dequant_speed", "GGUF dequantization: scratchlm (torch) vs gguf.quants (numpy)", argv)
    report.machine["gguf"] = getattr(gguf, "__version__", None) or _dist_version("gguf")
    report.machine["numpy"] = np.__version__
    t0 = time.perf_counter()
    type_section(report, args.types, args.weights, args.repeats)
    files = default_files() if args.files is None else args.files
    if files:
        file_section(report, [p for p in files if p.is_file()], args.repeats)
    report.add(f"Both outputs checked bit-equal per type before timing. Run took {time.perf_counter() - t0:.0f} s.")
    report.write()
    return 0


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    raise SystemExit(main())
