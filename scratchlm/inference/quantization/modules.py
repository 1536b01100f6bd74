"""Quantized layers: `QuantLinear`, `QuantEmbedding`, and `QuantizedTransformerLM`, which swaps them in.

The quantized tensors are buffers, not parameters. `_apply` is overridden so that
``model.to(dtype=...)`` (the engine casts its model to the compute dtype) moves them between
devices but never changes their storage dtype: int8 / uint8 / float16 / float32 scales stay as stored.
A GGUF weight kept raw (`LayerFormat.gguf`) is one uint8 buffer `qweight` (N, row_bytes), the file's blocks:
`QuantLinear` runs it through `kernels.gguf_linear`, `QuantEmbedding` dequantizes only the rows it looks up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from scratchlm.inference.quantization import kernels, reference
from scratchlm.inference.quantization.scheme import LayerFormat
from scratchlm.model.config import ModelConfig
from scratchlm.model.layers import AttentionBackend, Linear
from scratchlm.model.moe import MoE
from scratchlm.model.transformer import TransformerLM


class _QuantStorage(nn.Module):
    """Holds qweight / scales / mins for one (d_out, d_in) matrix in a `LayerFormat`."""

    def __init__(self, d_in: int, d_out: int, fmt: LayerFormat, device=None):
        super().__init__()
        fmt.check(d_in, type(self).__name__)
        self.d_in, self.d_out, self.fmt = d_in, d_out, fmt
        self.compute_dtype = torch.float32  # dtype of `weight` / outputs; follows model.to(dtype)
        self.group_size = fmt.group_size or d_in
        g = fmt.groups(d_in)
        if fmt.raw:
            self.register_buffer("qweight", torch.empty(d_out, fmt.row_bytes(d_in), dtype=torch.uint8, device=device))
            self.scales = self.mins = None
        elif fmt.bits == 8:
            self.register_buffer("qweight", torch.empty(d_out, d_in, dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.empty(d_out, g, dtype=torch.float32, device=device))
            self.mins = None
        else:
            self.register_buffer("qweight", torch.empty(d_out, d_in // 2, dtype=torch.uint8, device=device))
            self.register_buffer("scales", torch.empty(d_out, g, dtype=torch.float16, device=device))
            if fmt.symmetric:
                self.mins = None
            else:
                self.register_buffer("mins", torch.empty(d_out, g, dtype=torch.float16, device=device))

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True):
        """Device moves apply; dtype casts do not (quantized storage keeps its dtypes, `compute_dtype` follows)."""
        probe = fn(torch.empty(0, dtype=self.compute_dtype))
        if probe.is_floating_point():
            self.compute_dtype = probe.dtype
        for name, buf in self._buffers.items():
            if buf is not None:
                out = fn(buf)
                self._buffers[name] = out if out.dtype == buf.dtype else out.to(buf.dtype)
        return self

    @torch.no_grad()
    def set_from_float(self, w: Tensor) -> None:
        """Quantize a float (d_out, d_in) weight into this module's buffers."""
        if tuple(w.shape) != (self.d_out, self.d_in):
            raise ValueError(f"weight shape {tuple(w.shape)} does not match ({self.d_out}, {self.d_in})")
        for name, t in quantize_weight(w, self.fmt).items():
            self._buffers[name] = t.to(self.qweight.device)

    def dequantized(self) -> Tensor:
        """The float32 (d_out, d_in) weight this module computes with."""
        if self.fmt.raw:
            return kernels.gguf_dequantize(self.qweight, self.fmt.gguf_type, self.d_in)
        if self.fmt.bits == 8:
            return reference.dequantize_int8(self.qweight, self.scales)
        return reference.dequantize_int4(self.qweight, self.scales, self.mins, self.group_size)

    def extra_repr(self) -> str:
        if self.fmt.raw:
            return f"d_in={self.d_in}, d_out={self.d_out}, GGUF {self.fmt.gguf_type} (raw blocks)"
        sym = "sym" if self.fmt.symmetric else "asym"
        return f"d_in={self.d_in}, d_out={self.d_out}, int{self.fmt.bits}, group_size={self.group_size}, {sym}"


def quantize_weight(w: Tensor, fmt: LayerFormat) -> dict[str, Tensor]:
    """Float (d_out, d_in) weight -> the buffers of `fmt` ({qweight, scales[, mins]})."""
    if fmt.raw:
        raise ValueError(f"GGUF {fmt.gguf_type} weights are read from GGUF files (load_gguf_packed); scratchlm does "
                         f"not quantize into them")
    fmt.check(w.shape[1], "quantize_weight")
    if fmt.bits == 8:
        q, s = reference.quantize_int8(w, fmt.group_size)
        return {"qweight": q, "scales": s}
    q, d, m = reference.quantize_int4(w, fmt.group_size, fmt.symmetric)
    out = {"qweight": q, "scales": d}
    if m is not None:
        out["mins"] = m
    return out


class QuantLinear(_QuantStorage):
    """y = x W^T with W stored quantized; the fused C++ kernel on CPU, dequantize + matmul elsewhere.

    `use_extension=False` forces the pure-torch reference path (tests compare the two).
    """

    def __init__(self, d_in: int, d_out: int, fmt: LayerFormat, device=None, use_extension: bool = True):
        super().__init__(d_in, d_out, fmt, device)
        self.use_extension = use_extension

    @property
    def weight(self) -> Tensor:
        """The dequantized weight (d_out, d_in) in the compute dtype, for code that reads `.weight` (q/k/v biases)."""
        return self.dequantized().to(self.compute_dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.fmt.raw:
            return kernels.gguf_linear(x, self.qweight, self.fmt.gguf_type, self.d_in,
                                       use_extension=self.use_extension)
        if self.fmt.bits == 8:
            return kernels.int8_linear(x, self.qweight, self.scales, self.group_size,
                                       use_extension=self.use_extension)
        return kernels.int4_linear(x, self.qweight, self.scales, self.mins, self.group_size,
                                   use_extension=self.use_extension)


class QuantEmbedding(_QuantStorage):
    """Lookup of quantized rows: ids (...) -> float rows (..., dim), dequantizing only the rows used."""

    def __init__(self, num_embeddings: int, dim: int, fmt: LayerFormat, device=None, dtype=torch.float32):
        super().__init__(dim, num_embeddings, fmt, device)
        self.num_embeddings, self.dim, self.compute_dtype = num_embeddings, dim, dtype

    @property
    def weight(self) -> Tensor:
        return self.dequantized().to(self.compute_dtype)

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        q = self.qweight.index_select(0, flat)
        if self.fmt.raw:
            rows = kernels.gguf_dequantize(q, self.fmt.gguf_type, self.dim)  # (n, dim)
            return rows.view(*ids.shape, self.dim).to(self.compute_dtype)
        s = self.scales.index_select(0, flat)
        if self.fmt.bits == 8:
            rows = reference.dequantize_int8(q, s)
        else:
            m = None if self.mins is None else self.mins.index_select(0, flat)
            rows = reference.dequantize_int4(q, s, m, self.group_size)
        return rows.view(*ids.shape, self.dim).to(self.compute_dtype)  # (..., dim)


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Module path -> (d_in, d_out) of every Linear `TransformerLM(config)` quantizes, read off the block itself
    (built on the meta device: no memory), so every feature's linears (a plain MLP's two, a gated one's three, an
    MoE's experts) follow. Not quantized: the head (its own key, `HEAD`) and an MoE's router, `gate` and
    `shared_gate` (few bytes, and the expert choice rides on their small logit differences: kept float32, as
    vLLM and llama.cpp keep them)."""
    with torch.device("meta"):
        model = TransformerLM(config)
    routers = {f"{n}.{r}" for n, m in model.named_modules() if isinstance(m, MoE) for r in ("gate", "shared_gate")}
    return {n: (m.d_in, m.d_out) for n, m in model.named_modules()
            if isinstance(m, Linear) and n != "lm_head" and n not in routers}


def linear_names(config: ModelConfig) -> list[str]:
    """Module paths of every Linear `TransformerLM(config)` quantizes (`linear_shapes`)."""
    return list(linear_shapes(config))


HEAD = "output_head"  # the quantized head of a QuantizedTransformerLM (tied or not)
EMBEDDING = "tok_embeddings"


class QuantizedTransformerLM(TransformerLM):
    """`TransformerLM` whose modules named in `layout` are quantized (module path -> LayerFormat).

    Keys: the Linear paths of `linear_names(config)`, ``"output_head"`` (logits are then computed by a
    QuantLinear, tied or not; `lm_head` is dropped) and ``"tok_embeddings"``. Build it on the meta
    device and load a quantized state dict with ``load_state_dict(state, assign=True)``.
    """

    def __init__(self, config: ModelConfig, layout: dict[str, LayerFormat], scheme_name: str = "custom",
                 device=None, dtype=None):
        super().__init__(config, device=device, dtype=dtype)
        self.scheme_name = scheme_name
        known = set(linear_names(config)) | {HEAD, EMBEDDING}
        unknown = sorted(set(layout) - known)
        if unknown:
            raise ValueError(f"quantization layout names unknown modules {unknown[:5]}")
        self.layout = dict(layout)
        for name, fmt in layout.items():
            if name in (HEAD, EMBEDDING):
                continue
            parent_name, _, child = name.rpartition(".")
            parent = self.get_submodule(parent_name)
            old = getattr(parent, child)
            setattr(parent, child, QuantLinear(old.d_in, old.d_out, fmt, device=device))
        self.output_head = None
        if HEAD in layout:
            self.output_head = QuantLinear(config.d_model, config.vocab_size, layout[HEAD], device=device)
            self.lm_head = None
        if EMBEDDING in layout:
            self.tok_embeddings = QuantEmbedding(config.vocab_size, config.d_model, layout[EMBEDDING],
                                                 device=device, dtype=dtype or torch.float32)

    @property
    def output_weight(self) -> Tensor:
        if self.output_head is not None:
            return self.output_head.weight
        return super().output_weight

    def forward(self, tokens: Tensor, positions: Tensor | None = None, attn: AttentionBackend | None = None,
                logits_index: Tensor | None = None, rope_lengths: Tensor | None = None) -> Tensor:
        """Logits (B, T, vocab), or (len(logits_index), vocab) for flat positions in B*T."""
        x = self.hidden_states(tokens, positions, attn, rope_lengths)
        if logits_index is not None:
            x = x.reshape(-1, x.shape[-1]).index_select(0, logits_index.to(x.device))  # (N, d)
        h = self.norm(x)
        if self.output_head is not None:
            return self.finish_logits(self.output_head(h))
        if self.lm_head is not None:
            return self.finish_logits(self.lm_head(h))
        return self.finish_logits(h @ self.tok_embeddings.weight.t())

    def weight_bytes(self) -> int:
        """Bytes of all parameters and buffers (what one decode step has to read, roughly)."""
        seen, total = set(), 0
        for t in list(self.parameters()) + list(self.buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total
