"""The fused C++ step's own row ops for the engine's unfused CPU path, so both paths compute the same floats.

The fused decode step (`csrc/decoder.h`) and the Python layers are the same computation, but two
implementations of a norm differ by a few ulps, and the integer kernels round x to int8 per 32-block
(`csrc/quant_gemm.h`): on a model with outlier activations (SmolLM2) a few ulps move some x to the other int8
code, and greedy ids of the two paths drift apart (docs/quantization.md, "Rounding x, and greedy ids"). So the
engine runs the fused step's code on its unfused CPU path too:

- `use_engine_ops(model)` swaps the model's `RMSNorm`, `LayerNorm`, `RotaryEmbedding`, `MLP` and `Attention`
  modules for subclasses (same parameters, no copies; as `fast_linear.use_skinny_linears` swaps `Linear`) whose
  forward calls the extension's `rms_norm`, `layer_norm`, `rope_` (partial rotary too), `silu_mul` / `act_mul`
  (decoder.h's functions, every MLP activation, gated or plain, biases added after each linear as the fused
  step does) and adds q/k/v biases after the projection as the fused step does (the plain layer folds them into
  `addmm`); q/k-norms are RMSNorms, so they run the same rows as the fused step's;
- `RowPagedAttention` is the attention backend for steps the fused step would also run (every step, unless
  `runner.FUSED_PREFILL_MAX_CONTEXT` limits the prefill contexts): every row, decode or prefill, is one query of
  the paged attention kernel over its own causal context (its window and soft-cap included), as in the fused
  step, instead of torch SDPA for prefill chunks.

Everything else (embedding, linears, residual adds, the head) already runs the same kernels on both paths.
The swapped modules fall back to their torch parents where the C++ ops do not apply: autograd (training),
other dtypes or devices, or no built extension. `model/` stays plain torch and is the oracle the tests compare
these ops with (tests/inference/test_engine_ops.py); the fused step equals the swapped unfused path bit for
bit (tests/inference/test_fused_decoder.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from scratchlm.inference.attention import AttentionMetadata, PagedAttention
from scratchlm.inference.cpp_extensions import load_engine_kernels
from scratchlm.inference.kv_cache import KVCache
from scratchlm.model.layers import MLP, Attention, AttentionSpec, LayerNorm, RMSNorm, RotaryEmbedding, SwiGLU

_ACTS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}  # decoder.h's Act


def _cpu_f32(*ts: Tensor) -> bool:
    """Whether the C++ row ops take these tensors: float32 on the CPU, outside autograd."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in ts) and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in ts))


class EngineRMSNorm(RMSNorm):
    """`RMSNorm` through decoder.h's `rmsnorm_rows` (float32 CPU inference), the parent's torch ops otherwise."""

    def forward(self, x: Tensor) -> Tensor:
        ext = load_engine_kernels()
        if ext is None or not _cpu_f32(x, self.weight) or x.numel() == 0:
            return super().forward(x)
        return ext.rms_norm(x.reshape(-1, x.shape[-1]), self.weight.detach(), self.eps).view(x.shape)


class EngineLayerNorm(LayerNorm):
    """`LayerNorm` through decoder.h's `layernorm_rows` (float32 CPU inference), the parent's torch ops otherwise."""

    def forward(self, x: Tensor) -> Tensor:
        ext = load_engine_kernels()
        if ext is None or not _cpu_f32(x, self.weight) or x.numel() == 0:
            return super().forward(x)
        bias = None if self.bias is None else self.bias.detach()
        return ext.layer_norm(x.reshape(-1, x.shape[-1]), self.weight.detach(), bias, self.eps).view(x.shape)


class EngineRotaryEmbedding(RotaryEmbedding):
    """`RotaryEmbedding` whose `rotate` runs decoder.h's `rope_rows` for one cos/sin row per token (the first
    `rotary_dim` dims of each head)."""

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ext = load_engine_kernels()
        tokens = x.numel() // (x.shape[-1] * x.shape[-2]) if x.dim() >= 2 and x.numel() else 0
        if (ext is None or self.layout == "none" or not tokens or not _cpu_f32(x, cos, sin)
                or cos.numel() != tokens * (self.rotary_dim // 2) or cos.shape[-2] != 1):
            return super().rotate(x, cos, sin)  # e.g. cos/sin broadcast over a batch: the torch ops
        heads = x.shape[-2]
        t = x.reshape(tokens, heads * x.shape[-1]).clone()  # (N, H * D), rotated in place
        ext.rope_(t, heads, cos.reshape(tokens, -1), sin.reshape(tokens, -1), self.layout == "half", self.rotary_dim)
        return t.view(x.shape)


class EngineMLP(MLP):
    """`MLP` whose activation is decoder.h's: `silu_mul_out` for SwiGLU, `act_mul_out` for the others (gated or
    plain), each bias added after its linear (y = w(x); y += b) as the fused step does."""

    def forward(self, x: Tensor) -> Tensor:
        ext = load_engine_kernels()
        if ext is None or torch.is_grad_enabled() or not _cpu_f32(x) or x.numel() == 0 or not self.plain_glu:
            return super().forward(x)  # gpt-oss's clamped SwiGLU: the torch ops (not in decoder.h)
        if self.act == "silu" and self.gated and self.b1 is None:
            gate, up = self.w1(x), self.w3(x)
            if not _cpu_f32(gate, up):
                return self.w2(torch.sigmoid(gate).mul_(gate).mul_(up))
            s = ext.silu_mul(gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1]))  # (N, d_ff)
            return self.w2(s.view(gate.shape))
        gate = self._plus_(self.w1(x), self.b1)
        up = self._plus_(self.w3(x), self.b3) if self.gated else None
        if not _cpu_f32(gate, *([] if up is None else [up])):
            return super().forward(x)
        flat_up = None if up is None else up.reshape(-1, up.shape[-1])  # (N, d_ff)
        s = ext.act_mul(gate.reshape(-1, gate.shape[-1]), flat_up, _ACTS[self.act])  # (N, d_ff)
        return self._plus_(self.w2(s.view(gate.shape)), self.b2)

    @staticmethod
    def _plus_(y: Tensor, b: Tensor | None) -> Tensor:
        return y if b is None else y.add_(b)


class EngineAttention(Attention):
    """`Attention` that adds q/k/v biases after the projection (y = proj(x); y += b), as the fused step does."""

    def _project(self, x: Tensor, proj: nn.Module, bias: Tensor | None, heads: int) -> Tensor:
        if bias is None or not _cpu_f32(x, bias):
            return super()._project(x, proj, bias, heads)
        return proj(x).add_(bias).view(*x.shape[:-1], heads, self.head_dim)  # (B, T, heads, D)


_SWAPS = {RMSNorm: EngineRMSNorm, LayerNorm: EngineLayerNorm, RotaryEmbedding: EngineRotaryEmbedding, MLP: EngineMLP,
          SwiGLU: EngineMLP, Attention: EngineAttention}


def _swapped(module: nn.Module) -> nn.Module:
    """A `_SWAPS` subclass instance sharing `module`'s state (parameters, children, attributes): no copies."""
    new = _SWAPS[type(module)].__new__(_SWAPS[type(module)])
    new.__dict__.update(module.__dict__)
    return new


def use_engine_ops(model: nn.Module) -> int:
    """Swap `model`'s plain RMSNorm / LayerNorm / RotaryEmbedding / MLP / Attention modules for the `Engine*` ones
    (sharing their parameters); returns how many. Subclasses of those layers (other models' variants) are left."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) in _SWAPS]
    for parent, name, child in swaps:
        setattr(parent, name, _swapped(child))
    return len(swaps)


class RowPagedAttention(PagedAttention):
    """The fused step's attention: each of the step's N rows is one query of the paged attention kernel over its
    own context (a decode row: its sequence's; row j of a prefill chunk: the tokens up to its own), after every
    K/V of the step is written; the kernel runs a chunk's rows in tiles that read each K/V block once (the same
    floats as row by row, csrc/paged_attention.h). `tables` (N, max_blocks) and `lens` (N,) are those rows' block
    tables and context lengths (`ModelRunner._row_tables`). The layer's spec (scale, soft-cap, window) goes to the
    kernel. Float32 queries on a CPU cache with the extension built; other inputs take `PagedAttention`'s path."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata, tables: Tensor, lens: Tensor):
        super().__init__(cache, meta)
        self.tables, self.lens = tables, lens

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec | None = None) -> Tensor:
        spec = spec if spec is not None else AttentionSpec(1.0 / math.sqrt(q.shape[-1]))
        if (self._kernel is None or q.dtype != torch.float32 or q.shape[0] != 1 or q.shape[1] != self.lens.numel()
                or spec.sinks is not None):  # attention sinks: not in the kernel, PagedAttention's torch ops
            return super().__call__(layer, q, k, v, spec)
        cache = self.cache
        cache.write(layer, self.meta.slot_mapping, k[0], v[0])
        scales = (cache.k_scale[layer], cache.v_scale[layer]) if cache.quantized else (None, None)
        out = self._kernel.paged_decode_attention(q[0], cache.k[layer], cache.v[layer], self.tables, self.lens,
                                                  spec.scale, True, *scales, softcap=spec.softcap or 0.0,
                                                  window=spec.window or 0)  # (N, H, D)
        return out.unsqueeze(0)  # (1, N, H, D)
