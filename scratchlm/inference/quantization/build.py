"""Build the C++ kernels ahead of time and check each one against the reference it is meant to equal:
``python -m scratchlm.inference.quantization.build`` (the set-up, ``make setup``, runs it).

Policy:

- Every check runs, whatever the others gave (no early return), and prints one line: ``ok``, ``FAIL`` or ``skip``
  (with the reason), the kernel path it ran and its largest error against its bound. A summary line follows.
- Each kernel is compared with what it is meant to equal, within a bound computed from the inputs, not a fixed
  number: float kernels are exact up to the float32 summation order (|err| <= 2 (K + 8) u sum|x||w|, u = 2^-24);
  kernels that round x to int8 per block (scale max|x_b| / 127, as llama.cpp) also get that rounding's own bound,
  sum_b max|x_b| / 254 sum_{k in b} |w_k|; dequantizers must equal ``gguf.quants`` bit for bit; the fused decode
  step must equal the engine's Python path bit for bit with quantized layers (both feed every linear the same x),
  and the model's torch layers within the tests' 2e-4 in float32.
- Exit status 1 only when an extension did not build or a kernel is wrong; the summary names every failed check
  (the Makefile prints it). A failed build means the engine runs the pure-torch reference path; a wrong kernel
  means results that use it are wrong: report it.
- The header names the ISA the kernels run (``$SCRATCHLM_ISA`` applied, ``scratchlm.isa``) and the CPU's flags.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from scratchlm import isa

U = 2.0**-24  # float32's unit roundoff
INTEGER_PATHS = {1, 2, 5, 6, 7, 8, 9}  # quant_linear paths that round x to int8 per 32-block (quant_gemm.h)
ROWS = (1, 8, 65)  # decode, a decode batch, a prefill chunk (> 64 rows: the prefill paths)
EXP_REL = 2e-7  # relative error of the kernels' vectorised exp (simd_common.h's exp256)


class Skip(Exception):
    """A check that does not apply here (its reason is printed)."""


def skip(reason: str) -> str:
    raise Skip(reason)


@dataclass
class Report:
    """The checks' outcomes, printed as they come."""

    failed: list[str] = field(default_factory=list)
    not_built: list[str] = field(default_factory=list)
    passed: int = 0
    skipped: int = 0

    def run(self, name: str, check: Callable[[], str]) -> None:
        try:
            detail = check()
        except Skip as e:
            self.skipped += 1
            print(f"  skip  {name}: {e}", flush=True)
            return
        except AssertionError as e:
            self.failed.append(name)
            print(f"  FAIL  {name}: {e}", flush=True)
            return
        except Exception as e:  # a kernel that raises on valid input is wrong too
            self.failed.append(name)
            first = (str(e).strip().splitlines() or [""])[0][:300]
            print(f"  FAIL  {name}: {type(e).__name__}: {first}", flush=True)
            return
        self.passed += 1
        print(f"  ok    {name}: {detail}", flush=True)

    def summary(self, seconds: float) -> tuple[int, str]:
        """(exit status, the last line): 1 and every failed check by name when a build failed or a kernel is wrong."""
        total = self.passed + len(self.failed) + len(self.not_built) + self.skipped
        if not (self.failed or self.not_built):
            return 0, f"kernel check passed: {self.passed} of {total} ok, {self.skipped} skipped ({seconds:.0f} s)"
        parts = [f"did not build: {', '.join(self.not_built)} (the engine runs the pure-torch path instead)"
                 ] if self.not_built else []
        parts += [f"wrong: {'; '.join(self.failed)} (results through these kernels are wrong: please report it)"
                  ] if self.failed else []
        return 1, (f"kernel check FAILED ({len(self.failed) + len(self.not_built)} of {total}, {seconds:.0f} s): "
                   + "; ".join(parts))


# --------------------------------------------------------------------------------------------------- bounds
def float_bound(x: torch.Tensor, w_abs: torch.Tensor) -> torch.Tensor:
    """(M, N) bound of float32 summation error for y = x w^T, K terms: 2 (K + 8) u |x| |w|^T."""
    k = x.shape[-1]
    return 2 * (k + 8) * U * (x.abs().double() @ w_abs.double().t())


def rounding_bound(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """(M, N) bound of |x w^T - xq w^T| for x rounded to int8 per `block` (|x_k - xq_k| <= max|x_b| / 254)."""
    k = x.shape[-1]
    xb = F.pad(x.abs(), (0, (-k) % block)).view(x.shape[0], -1, block).amax(-1).double()  # (M, blocks)
    wb = F.pad(w.abs(), (0, (-k) % block)).view(w.shape[0], -1, block).sum(-1).double()  # (N, blocks)
    return xb @ wb.t() / 254


def compare(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> tuple[bool, str]:
    """(within bound everywhere, 'max err (largest err / bound)') for got against a float64 reference."""
    err = (got.double() - want).abs()
    ratio = (err / bound).max().item()
    return bool((err <= bound).all()), f"{err.max().item():.2g} ({ratio:.2g} of bound)"


def rows_check(run: Callable[[torch.Tensor], tuple[torch.Tensor, str]], x_all: torch.Tensor, w: torch.Tensor,
               w_abs: torch.Tensor, block: int | None, rows: tuple[int, ...] = ROWS) -> str:
    """Run `run(x)` -> (y, path label) for each of `rows` and compare with float64 x w^T; `block`: int8 rounding of x
    per block when the path label says so ('int' in it), None for float paths only."""
    parts, bad = [], []
    for m in rows:
        x = x_all[:m]
        y, label = run(x)
        bound = float_bound(x, w_abs)
        if block is not None and label.startswith("int"):
            bound = bound + rounding_bound(x, w, block)
        ok, text = compare(y, x.double() @ w.double().t(), bound)
        parts.append(f"M={m} {label} {text}")
        if not ok:
            bad.append(m)
    assert not bad, f"error above the bound at M={bad}: " + "; ".join(parts)
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------------- checks
def old_extension_checks(report: Report, ext: Any | None) -> None:
    """quantization/csrc/quant_kernels.cpp (int8 groups that are no multiple of 32; the fallback for few rows)."""
    for simd in (True, False):
        label = "SIMD" if simd else "scalar"
        report.run(f"quant_kernels int8 ({label})", lambda simd=simd: old_int8(ext, simd))
        report.run(f"quant_kernels int4 ({label})", lambda simd=simd: old_int4(ext, simd))


def _old_inputs(ext: Any | None, simd: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (3, 96), w (40, 96) for the older extension's checks; fails when it did not build, skips SIMD without it."""
    if ext is None:
        raise AssertionError("scratchlm_quant_kernels did not build")
    if simd and not ext.has_avx2():
        raise Skip("no AVX2 here (SCRATCHLM_ISA or the CPU): the scalar check covers it")
    gen = torch.Generator().manual_seed(1)
    return torch.randn(3, 96, generator=gen), torch.randn(40, 96, generator=gen)


def old_int8(ext: Any | None, simd: bool) -> str:
    """The older extension's int8 kernel, groups of 48 (no multiple of 32: what only it takes), float x."""
    from scratchlm.inference.quantization import reference

    x, w = _old_inputs(ext, simd)
    q, s = reference.quantize_int8(w, 48)
    wd = reference.dequantize_int8(q, s)
    ok, text = compare(ext.int8_linear(x, q, s, 48, simd), x.double() @ wd.double().t(), float_bound(x, wd.abs()))
    assert ok, f"M=3 K=96 group 48: {text}"
    return f"M=3 K=96 group 48 {text}"


def old_int4(ext: Any | None, simd: bool) -> str:
    """The older extension's int4 kernel (symmetric and with mins), groups of 32, float x."""
    from scratchlm.inference.quantization import reference

    x, w = _old_inputs(ext, simd)
    texts = []
    for sym in (True, False):
        q, d, m = reference.quantize_int4(w, 32, symmetric=sym)
        wd = reference.dequantize_int4(q, d, m, 32)
        got = ext.int4_linear(x, q, d.half(), None if m is None else m.half(), 32, simd)
        ok, text = compare(got, x.double() @ wd.double().t(), float_bound(x, int4_terms(wd, d, m)))
        assert ok, f"{'sym' if sym else 'asym'}: {text}"
        texts.append(f"{'sym' if sym else 'asym'} {text}")
    return "M=3 K=96 g32 " + ", ".join(texts)


def int4_terms(wd: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """|d q| + |offset| per weight (N, K): the size of the terms an int4 kernel adds (offset m, or -8 d)."""
    g = wd.shape[1] // d.shape[1]
    off = (m if m is not None else -8 * d).float().repeat_interleave(g, dim=1)  # (N, K)
    return (wd - off).abs() + off.abs()


def quant_linear_checks(report: Report, eng: Any) -> None:
    """The engine's quant_linear (qlinear.h / quant_gemm.h), every default path: int8 / int4 formats, x rounded
    (the default) or float, at ROWS rows."""
    from scratchlm.inference.quantization import reference

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(max(ROWS), 256, generator=gen)
    x[:, 7] *= 20  # an outlier channel, as real activations have: coarse rounding of its block's other values
    w = torch.randn(72, 256, generator=gen)
    formats: dict[str, tuple[list[torch.Tensor], int, torch.Tensor, torch.Tensor]] = {}
    q, s = reference.quantize_int8(w, None)
    wd = reference.dequantize_int8(q, s)
    formats["int8 per channel"] = ([q, s], 256, wd, wd.abs())
    q, s = reference.quantize_int8(w, 32)
    wd = reference.dequantize_int8(q, s)
    formats["int8 g32 (Q8_0)"] = ([q, s], 32, wd, wd.abs())
    for sym, name in ((True, "int4 g32 sym (Q4_0)"), (False, "int4 g32 asym (Q4_1)")):
        q, d, m = reference.quantize_int4(w, 32, symmetric=sym)
        wd = reference.dequantize_int4(q, d, m, 32)
        formats[name] = ([q, d.half()] + ([] if m is None else [m.half()]), 32, wd, int4_terms(wd, d, m))
    was = eng.quant_float_activations(-1)
    try:
        for float_x in (False, True):
            for name, (tensors, gs, wd, w_abs) in formats.items():

                def run(xm: torch.Tensor, tensors=tensors, gs=gs) -> tuple[torch.Tensor, str]:
                    path = eng.quant_resolved_path(tensors, gs, 256, xm.shape[0], -1)
                    kind = "int" if path in INTEGER_PATHS else "float"
                    return eng.quant_linear(xm, tensors, gs), f"{kind} path {path}"

                def check(float_x=float_x, run=run, wd=wd, w_abs=w_abs) -> str:
                    eng.quant_float_activations(int(float_x))
                    return rows_check(run, x, wd, w_abs, 32)

                report.run(f"quant_linear {name}, x {'float' if float_x else 'int8 (default)'}", check)
    finally:
        eng.quant_float_activations(int(was))

    def float_weight() -> str:
        return rows_check(lambda xm: (eng.quant_linear(xm, [w], 256), "float"), x, w, w.abs(), None)

    report.run("quant_linear float32 weight (skinny tiles; > 64 rows: large_gemm)", float_weight)


def fp32_checks(report: Report, eng: Any) -> None:
    """The fp32 linears: skinny_linear, panel_linear (SIMD and scalar), and the engine's PanelLinear module."""
    from scratchlm.inference.fast_linear import use_skinny_linears
    from scratchlm.model.layers import Linear

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(max(ROWS), 200, generator=gen)
    w = torch.randn(37, 200, generator=gen)  # N, K not multiples of the tiles: every remainder path
    for simd in (True, False):
        label = "SIMD" if simd else "scalar"
        report.run(f"skinny_linear ({label})", lambda simd=simd: rows_check(
            lambda xm: (eng.skinny_linear(xm, w, simd), "float"), x, w, w.abs(), None, (1, 8, 64)))

        def panel(simd=simd) -> str:
            wp = eng.panel_pack(w)
            return rows_check(lambda xm: (eng.panel_linear(xm, wp, [w.shape[0]], simd)[0], "float"), x, w,
                              w.abs(), None)

        report.run(f"panel_linear ({label})", panel)

    def module() -> str:
        holder = torch.nn.Sequential(Linear(200, 37))
        with torch.no_grad():
            holder[0].weight.copy_(w)
        use_skinny_linears(holder)
        with torch.inference_mode():
            return f"{type(holder[0]).__name__}: " + rows_check(lambda xm: (holder(xm), "float"), x, w, w.abs(), None)

    report.run("fp32 Linear as the engine runs it", module)


def attention_checks(report: Report, eng: Any) -> None:
    """paged_decode_attention: decode rows (one per sequence) and prefill chunks (causal rows sharing a table)."""
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, d, bs, blocks = 8, 2, 64, 16, 24
    k_cache = torch.randn(blocks, bs, kv_heads, d, generator=gen)
    v_cache = torch.randn(blocks, bs, kv_heads, d, generator=gen)
    perm = torch.randperm(blocks, generator=gen).tolist()
    decode_lens = [1, 17, 70, 33]
    tables, lens = [], []
    for n in decode_lens:  # decode: each sequence on its own blocks
        tables.append([perm.pop() for _ in range(-(-n // bs))])
        lens.append(n)
    prefix, chunk = 9, 40  # prefill: one sequence, rows see prefix + 1 .. prefix + chunk tokens
    table = [perm.pop() for _ in range(-(-(prefix + chunk) // bs))]
    width = max(len(t) for t in tables + [table])
    pad = lambda t: t + [0] * (width - len(t))  # noqa: E731
    cases = {"decode": (torch.tensor([pad(t) for t in tables]), torch.tensor(lens)),
             "prefill": (torch.tensor([pad(table)] * chunk), torch.arange(prefix + 1, prefix + chunk + 1))}
    scale = d**-0.5
    for name, (tab, ln) in cases.items():
        q = torch.randn(len(ln), heads, d, generator=gen)
        want, bound = attention_reference(q, k_cache, v_cache, tab, ln, scale)

        def check(q=q, tab=tab, ln=ln, want=want, bound=bound) -> str:
            parts = []
            for label, simd, avx512 in attention_variants():
                got = eng.paged_decode_attention(q, k_cache, v_cache, tab, ln, scale, simd, avx512=avx512)
                ok, text = compare(got, want, bound)
                assert ok, f"{label}: {text}"
                parts.append(f"{label} {text}")
            return f"{len(ln)} rows, GQA {heads}/{kv_heads}, D={d}: " + ", ".join(parts)

        report.run(f"paged attention {name}", check)


def attention_variants() -> list[tuple[str, bool, bool]]:
    """(label, use_simd, avx512) of each attention code path this process may run (the ISA cap applied)."""
    name = isa.kernel_isa()
    out = [("AVX-512 tiles", True, True)] if name.startswith("avx512") else []
    out += [("AVX2 tiles", True, False)] if name != "scalar" else []
    return out + [("scalar", False, False)]


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                        lens: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of each row q (R, H, D) over its first lens[r] cached tokens, and an error bound per
    value: scores off by <= s = (D + 2) u scale max|q||k| move each probability by <= 2 s relative, plus exp's
    and the sums' rounding, times max|v|."""
    rows, heads, d = q.shape
    kv = k_cache.shape[2]
    bs = k_cache.shape[1]
    out = torch.empty(rows, heads, d, dtype=torch.float64)
    bound = torch.empty(rows, heads, 1, dtype=torch.float64)
    for r in range(rows):
        n = int(lens[r])
        idx = tables[r][: -(-n // bs)]
        k = k_cache[idx].reshape(-1, kv, d)[:n].double().repeat_interleave(heads // kv, dim=1)  # (n, H, D)
        v = v_cache[idx].reshape(-1, kv, d)[:n].double().repeat_interleave(heads // kv, dim=1)
        qr = q[r].double()  # (H, D)
        p = torch.softmax(torch.einsum("hd,nhd->hn", qr, k) * scale, dim=-1)  # (H, n)
        out[r] = torch.einsum("hn,nhd->hd", p, v)
        s = (d + 2) * U * scale * torch.einsum("hd,nhd->hn", qr.abs(), k.abs()).amax(-1)  # (H,)
        rel = 4 * s + 4 * EXP_REL + 2 * (n + d + 8) * U
        bound[r] = (rel * v.abs().amax((0, 2)))[:, None]
    return out, bound.expand(rows, heads, d)


def fused_step_checks(report: Report, eng: Any) -> None:
    """The fused decode step (decoder.h) on a tiny random model against the Python path: float32 layers against
    the model's torch layers (2e-4, the tests' tolerance); quantized layers (x rounded, the default) bit-equal to
    the engine's unfused path, which runs the same kernels and row ops."""
    from scratchlm.inference.fast_linear import use_skinny_linears
    from scratchlm.inference.quantization import quantize_model
    from scratchlm.model import ModelConfig, TransformerLM

    torch.manual_seed(5)
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=128)
    base = TransformerLM(cfg).eval()
    with torch.no_grad():
        for p in base.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.3)  # non-trivial norms
    for scheme in ("float32", "int8", "int4-g32-asym"):

        def check(scheme=scheme) -> str:
            model = copy.deepcopy(base) if scheme == "float32" else quantize_model(base, scheme)
            use_skinny_linears(model)
            parts = []
            for batch in (1, 3):
                fused, torch_layers, engine_path = fused_and_python(model, batch)
                if scheme == "float32":
                    err = (fused - torch_layers).abs().max().item()
                    tol = 2e-4 * (1 + torch_layers.abs().max().item())
                    assert err <= tol, f"batch {batch}: fused vs torch layers {err:.2g} > {tol:.2g}"
                    parts.append(f"batch {batch} {err:.2g} ({err / tol:.2g} of 2e-4 (1 + max|h|))")
                else:
                    diff = (fused - engine_path).abs().max().item()
                    assert torch.equal(fused, engine_path), f"batch {batch}: fused != engine path (max {diff:.2g})"
                    parts.append(f"batch {batch} bit-equal")
            return ("vs the torch layers: " if scheme == "float32" else "vs the engine's path: ") + ", ".join(parts)

        report.run(f"fused decode step, {scheme}", check)


def fused_and_python(model: torch.nn.Module, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step of `batch` sequences on a random paged cache: (fused, torch layers, engine ops) hidden."""
    from scratchlm.inference.attention import AttentionMetadata, PagedAttention
    from scratchlm.inference.engine_ops import RowPagedAttention, use_engine_ops
    from scratchlm.inference.kv_cache import KVCache
    from scratchlm.inference.runner import fused_decoder_for

    c = model.config
    bs = 4
    cache = KVCache.allocate(c.n_layers, 8 * batch, bs, c.n_kv_heads, c.head_dim, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(batch)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    lens = torch.tensor([5 + 7 * i for i in range(batch)])
    tables = torch.tensor([[8 * i + j for j in range(8)] for i in range(batch)])
    slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens.tolist())])
    tokens = torch.randint(0, c.vocab_size, (batch,), generator=gen)
    positions = lens - 1
    caches = [KVCache(cache.k.clone(), cache.v.clone()) for _ in range(2)]
    meta = AttentionMetadata(slots, batch, tables, lens)
    swapped = copy.deepcopy(model)
    use_engine_ops(swapped)
    with torch.inference_mode():
        want = model.hidden_states(tokens[None], positions, PagedAttention(caches[0], meta))[0]  # (B, d)
        ops = swapped.hidden_states(tokens[None], positions, RowPagedAttention(caches[1], meta, tables, lens))[0]
        fused = fused_decoder_for(model, cache)
        assert fused is not None, "fused_decoder_for gave no fused step for this model"
        cos, sin = model.rope.cos_sin(positions, torch.float32)
        got = fused.forward(model.tok_embeddings(tokens), cache.k, cache.v, slots, cos[:, 0], sin[:, 0], tables, lens)
    return got, want, ops


def gguf_checks(report: Report, eng: Any) -> None:
    """The GGUF block kernels (gguf_linear / gguf_dequantize) of every type this build keeps raw, on random valid
    blocks: dequantization bit-equal to gguf.quants, products within x's int8 rounding of float64."""
    if not hasattr(eng, "gguf_linear"):
        report.run("gguf_linear", lambda: skip("this build has no gguf_linear binding"))
        return
    import gguf

    dequant_path = eng.gguf_dequant_path() if hasattr(eng, "gguf_dequant_path") else None
    was = eng.quant_float_activations(-1)
    try:
        for float_x in (False, True):
            for type_id in eng.gguf_types():
                qtype = gguf.GGMLQuantizationType(type_id)
                name = f"gguf_linear {qtype.name}, x {'float' if float_x else 'int8 (default)'}"
                report.run(name, lambda q=qtype, f=float_x: gguf_check(eng, q, f, dequant_path))
    finally:
        eng.quant_float_activations(int(was))


def gguf_check(eng: Any, qtype: Any, float_x: bool, dequant_path: int | None) -> str:
    """One raw type: gguf_dequantize bit-equal to gguf.quants, gguf_linear's default path at ROWS rows within its
    bound (x's int8 rounding per 32-block, as every GGUF kernel here rounds x, K-quants too; none where the path
    dequantizes the weight for the fp32 GEMM)."""
    import gguf

    eng.quant_float_activations(int(float_x))
    n, k = 40, 2 * 256
    raw = random_blocks(qtype, n, k)
    want_w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype).astype("float32"))  # (N, K)
    got_w = eng.gguf_dequantize(raw, int(qtype), k)
    assert torch.equal(got_w, want_w), \
        f"gguf_dequantize differs from gguf.quants (max {(got_w - want_w).abs().max().item():.2g})"
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(int(qtype)))

    def run(xm: torch.Tensor) -> tuple[torch.Tensor, str]:
        path = eng.gguf_resolve_path(raw, int(qtype), k, xm.shape[0], -1)
        kind = "float" if path == dequant_path else "int"
        return eng.gguf_linear(xm, raw, int(qtype), k), f"{kind} path {path}"

    # the terms' sizes: |w| and each 32-block's largest |w| (a block's offset term, as Q4_1's m, is no larger)
    w_abs = want_w.abs() + want_w.abs().view(n, -1, 32).amax(-1).repeat_interleave(32, dim=1)
    return "dequantize bit-equal; " + rows_check(run, x, want_w, w_abs, 32)


def random_blocks(qtype: Any, n: int, k: int) -> torch.Tensor:
    """(n, row_bytes) uint8 rows of random blocks of `qtype` whose weights are finite and at most 64 in size
    (random bytes, blocks outside that redrawn: every code and scale pattern the format allows)."""
    import gguf
    import numpy as np

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for _ in range(1000):
        with np.errstate(all="ignore"):
            w = gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], block)
            bad = ~(np.isfinite(w).all(1) & (np.abs(w).max(1) <= 64) & (np.abs(w).max(1) >= 1e-3))
        if not bad.any():
            return torch.from_numpy(raw.reshape(n, -1).copy())
        raw[bad] = rng.integers(0, 256, (int(bad.sum()), size), dtype=np.uint8)
    raise RuntimeError(f"could not draw valid {qtype.name} blocks")


# --------------------------------------------------------------------------------------------------- main
def load_timed(what: str, load: Callable[[], Any | None], report: Report) -> Any | None:
    """Build (or load from the cache) one extension, with a line saying how long and where."""
    t0 = time.perf_counter()
    module = load()
    took = time.perf_counter() - t0
    if module is None:
        report.not_built.append(what)
        print(f"  FAIL  build {what}: did not build (the warning above says why); its kernels are not used: the "
              f"engine runs the pure-torch reference path instead", flush=True)
    else:
        print(f"  ok    build {what}: {took:.1f} s ({getattr(module, '__file__', '?')})", flush=True)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scratchlm.inference.quantization.build",
        description="Build (or find in the cache) the C++ kernels and check each against its reference. Cache: "
                    "$SCRATCHLM_QUANT_BUILD_DIR or ~/.cache/scratchlm/quant_kernels. $SCRATCHLM_ISA caps the ISA.")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from scratchlm.inference import cpp_extensions
    from scratchlm.inference.quantization import kernels

    report = Report()
    start = time.perf_counter()
    print(f"kernel set-up check: kernels for {isa.describe()}", flush=True)
    if os.environ.get("SCRATCHLM_QUANT_NO_EXTENSION"):
        print("SCRATCHLM_QUANT_NO_EXTENSION is set: nothing to build or check (the pure-torch paths run)")
        return 0
    print("building the C++ extensions (the first time takes a few minutes) ...", flush=True)
    old = load_timed(kernels.EXTENSION_NAME, lambda: kernels.load_extension(verbose=args.verbose), report)
    eng = load_timed("scratchlm_engine_kernels", lambda: cpp_extensions.load_engine_kernels(args.verbose), report)
    old_extension_checks(report, old)
    if eng is not None:
        report.run("ISA the engine kernels report", lambda: isa_check(eng))
        quant_linear_checks(report, eng)
        fp32_checks(report, eng)
        attention_checks(report, eng)
        fused_step_checks(report, eng)
        gguf_checks(report, eng)
    status, line = report.summary(time.perf_counter() - start)
    print(line, flush=True)
    return status


def isa_check(eng: Any) -> str:
    """The engine extension's own isa_name() agrees with scratchlm.isa's reading of the CPU and the cap."""
    if not hasattr(eng, "isa_name"):
        raise Skip("this build has no isa_name binding")
    said, computed = eng.isa_name(), isa.kernel_isa()
    assert said == computed, f"the kernels say {said}, scratchlm.isa computes {computed}"
    return f"{said} (quant_linear best path {eng.quant_best_path()}, has_avx2 {eng.has_avx2()})"


if __name__ == "__main__":
    sys.exit(main())
