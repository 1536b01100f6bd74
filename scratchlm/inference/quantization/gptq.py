"""GPTQ into the ordinary int4 format, and sequential (layer-by-layer) calibration of a whole model.

Policy. GPTQ (Frantar et al. 2022, Algorithm 1) quantizes a weight W (N, K) column by column and
feeds each column's rounding error into the columns not yet quantized, so that the layer's output
error on the calibration inputs, ||(W - Q) X||^2 = tr((W - Q) H (W - Q)^T) with H = X X^T / n,
is minimized rather than the weight error. As in the paper: H gets `damp` * mean(diag H) on its
diagonal (few tokens leave it rank-deficient), the error feedback uses the upper Cholesky factor
of H^-1, and updates are applied lazily in blocks of `block` columns (exact, only reordered).
Group parameters (float16 d [and m], the Q4_0 / Q4_1 rules of `scheme.py`):

- without act-order, a group's (d, m) are fit when its first column is reached, on the weights
  as already updated by the error feedback (the paper's grouping);
- with act-order (columns in order of decreasing diag H, the most sensitive first) a group's
  columns are scattered, so the parameters are *static*: fit on the original weights before the
  loop (AutoGPTQ's ``static_groups``), which keeps the stored format (contiguous groups).

Parameters are fit by the error-minimizing search of `calibrate.py` weighted by diag H (``fit="mse"``)
or by plain min/max (``fit="rtn"``). The codes are GPTQ's, not the nearest level of the result.

`quantize_sequential` calibrates a whole `TransformerLM` in one forward pass over the calibration
tokens: a forward pre-hook on each linear takes its input (which already went through every
quantized layer before it, q/k/v before o_proj, w1/w3 before w2: "true sequential"), builds H,
quantizes the weight and swaps in its dequantized value before the linear runs, so every later
layer is calibrated on the activations the quantized model will really produce. The model's own
weights are restored afterwards.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from scratchlm.inference.quantization import calibrate
from scratchlm.inference.quantization.reference import dequantize_int4, pack_nibbles
from scratchlm.inference.quantization.scheme import CHUNK, LayerFormat

DAMP = 0.1  # fraction of mean(diag H) added to the diagonal (the paper: 0.01; 0.1 generalized better here)
BLOCK = 128  # lazy-batch width (columns)


def _fit(w: Tensor, h: Tensor, group: int, symmetric: bool, fit: str) -> tuple[Tensor, Tensor | None]:
    """float16 d (N, G) [, m (N, G)] for the (N, k) slice w (k may be ragged: last group shorter)."""
    k = w.shape[1]
    if fit == "rtn" or k % CHUNK:  # the search needs whole 32-blocks; a ragged tail is always a multiple of 32
        return calibrate._rtn(calibrate._padded_groups(w, group)[0], symmetric)
    return calibrate.search_int4_params(w, group, symmetric, h, rounds=1)


@torch.no_grad()
def gptq_quantize(w: Tensor, hessian: Tensor, group_size: int = 32, symmetric: bool = False, *,
                  damp: float = DAMP, block: int = BLOCK, act_order: bool = True,
                  fit: Literal["mse", "rtn"] = "mse", dtype: torch.dtype = torch.float32
                  ) -> tuple[Tensor, Tensor, Tensor | None]:
    """GPTQ of a float (N, K) weight -> (codes uint8 (N, K) in 0..15, d float16 (N, G), m float16 (N, G) or None).

    `hessian`: E[x x^T] (K, K) of the layer's input. `dtype`: precision of the column loop (float64
    in tests against a reference). See the module docstring for the policy.
    """
    n, k = w.shape
    LayerFormat(bits=4, group_size=group_size, symmetric=symmetric).check(k, "gptq_quantize")
    if hessian.shape != (k, k):
        raise ValueError(f"hessian has shape {tuple(hessian.shape)}, expected ({k}, {k})")
    if not 0.0 <= damp < 1.0:
        raise ValueError(f"damp={damp} must be in [0, 1)")
    dev = w.device
    W = w.to(dtype).clone()
    H = hessian.to(dev, torch.float64).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0  # a channel the calibration never excited: nothing to minimize there
    W[:, dead] = 0.0
    H += damp * torch.diag(H).mean() * torch.eye(k, dtype=H.dtype, device=dev)
    diag = torch.diag(H).float()
    g = group_size
    n_groups = -(-k // g)
    d_all = torch.empty(n, n_groups, dtype=torch.float16, device=dev)
    m_all = None if symmetric else torch.empty(n, n_groups, dtype=torch.float16, device=dev)
    if act_order:  # static groups: every group's parameters from the original weights
        d_all[:], m0 = _fit(W.float(), diag, g, symmetric, fit)
        if m_all is not None:
            m_all[:] = m0
        perm = torch.argsort(diag, descending=True, stable=True)
        W, H = W[:, perm], H[perm][:, perm]
    else:
        perm = None
    L = torch.linalg.cholesky(H)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True).to(dtype)  # (K, K) upper: U^T U = H^-1
    codes = torch.empty(n, k, dtype=torch.uint8, device=dev)
    block = max(block - block % g, g)  # without act-order a group never straddles two blocks
    col_group = (torch.arange(k, device=dev) if perm is None else perm) // g  # each (permuted) column's group
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1 = W[:, i1:i2].clone()  # (N, b), updated column by column
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        dcol = mcol = inv = None
        for i in range(i2 - i1):
            col = i1 + i
            if perm is None and col % g == 0:  # a group starts: fit it on the updated weights
                ge = min(col + g, k)
                dg, mg = _fit(W1[:, i:i + ge - col].float(), diag[col:ge], ge - col, symmetric, fit)
                d_all[:, col // g] = dg[:, 0]
                if m_all is not None:
                    m_all[:, col // g] = mg[:, 0]
            if perm is None:
                if col % g == 0:
                    dcol = d_all[:, col // g].to(dtype)
                    mcol = -8.0 * dcol if symmetric else m_all[:, col // g].to(dtype)
                    inv = torch.where(dcol != 0, 1.0 / dcol, torch.zeros_like(dcol))
            else:
                gi = int(col_group[col])
                dcol = d_all[:, gi].to(dtype)
                mcol = -8.0 * dcol if symmetric else m_all[:, gi].to(dtype)
                inv = torch.where(dcol != 0, 1.0 / dcol, torch.zeros_like(dcol))
            x = W1[:, i]
            q = torch.round((x - mcol) * inv).clamp_(0, 15)
            codes[:, col] = q.to(torch.uint8)
            err = (x - (q * dcol + mcol)) / Hinv1[i, i]  # (N,)
            W1[:, i + 1:].addr_(err, Hinv1[i, i + 1:], alpha=-1.0)
            Err1[:, i] = err
        if i2 < k:
            W[:, i2:].addmm_(Err1, Hinv[i1:i2, i2:], alpha=-1.0)
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    return codes, d_all.contiguous(), None if m_all is None else m_all.contiguous()


def gptq_int4(w: Tensor, hessian: Tensor, group_size: int = 32, symmetric: bool = False, **kw
              ) -> tuple[Tensor, Tensor, Tensor | None]:
    """`gptq_quantize` packed into the stored format: (packed (N, K/2), d, m)."""
    codes, d, m = gptq_quantize(w, hessian, group_size, symmetric, **kw)
    return pack_nibbles(codes), d, m


def output_error(w: Tensor, w_hat: Tensor, hessian: Tensor) -> float:
    """tr((W - W^) H (W - W^)^T) = E||(W - W^) x||^2 over the inputs whose E[x x^T] is `hessian`."""
    e = (w.double() - w_hat.double())
    return float(((e @ hessian.double()) * e).sum())


# ---------------------------------------------------------------------------------------------
# sequential calibration of a whole model
# ---------------------------------------------------------------------------------------------

def _shared_inputs(n_layers: int) -> dict[str, tuple[str, ...]]:
    """Linear path -> the paths that read the same input (quantized together, from one H)."""
    out = {}
    for i in range(n_layers):
        p = f"layers.{i}"
        qkv = tuple(f"{p}.attn.{x}_proj" for x in "qkv")
        up = (f"{p}.ffn.w1", f"{p}.ffn.w3")
        for name in qkv:
            out[name] = qkv
        for name in up:
            out[name] = up
        out[f"{p}.attn.o_proj"] = (f"{p}.attn.o_proj",)
        out[f"{p}.ffn.w2"] = (f"{p}.ffn.w2",)
    return out


@torch.no_grad()
def quantize_sequential(model: nn.Module, tokens: Tensor, formats: dict[str, LayerFormat], *,
                        method: Literal["gptq", "mse"] = "gptq", head: LayerFormat | None = None,
                        damp: float = DAMP, act_order: bool = True, fit: str = "mse"
                        ) -> dict[str, dict[str, Tensor]]:
    """Quantize the int4 linears in `formats` (module path -> LayerFormat) of a float `TransformerLM` sequentially.

    One forward of `tokens` (B, T) with a pre-hook per linear (see the module docstring). `method`:
    ``gptq`` (error feedback) or ``mse`` (the weighted search with h = diag of the sequential H).
    `head`: an int4 format for the output head, quantized the same way from the final norm's
    output; None leaves the head to the caller. Returns path -> {"qweight", "scales"[, "mins"]}
    (the head under ``calibrate.HEAD``). The model is unchanged afterwards.
    """
    if tokens.dim() != 2 or tokens.dtype != torch.long:
        raise ValueError(f"calibration tokens must be a (batch, seq) int64 tensor, got {tuple(tokens.shape)} "
                         f"{tokens.dtype}")
    shared = _shared_inputs(len(model.layers))
    unknown = sorted(set(formats) - set(shared))
    if unknown or any(f.bits != 4 for f in formats.values()):
        raise ValueError(f"quantize_sequential takes int4 formats for linear paths; got {unknown[:3] or formats}")
    out: dict[str, dict[str, Tensor]] = {}
    saved: dict[str, Tensor] = {}

    def quantize(name: str, x: Tensor) -> dict[str, Tensor]:
        fmt = formats.get(name, head)
        lin = model.get_submodule(name) if name != calibrate.HEAD else None
        w = lin.weight if lin is not None else model.output_weight
        x2 = x.detach().reshape(-1, x.shape[-1]).float()  # (rows, d_in)
        hess = (x2.t() @ x2).double().div_(x2.shape[0]).to(w.device)  # (d_in, d_in), float32 products
        if method == "gptq":
            codes, d, m = gptq_quantize(w, hess, fmt.group_size, fmt.symmetric, damp=damp, act_order=act_order,
                                        fit=fit)
            packed = pack_nibbles(codes)
        else:
            packed, d, m = calibrate.quantize_int4_searched(
                w, fmt.group_size, fmt.symmetric, calibrate.channel_weights(torch.diag(hess).float(), w.shape[1]))
        buf = {"qweight": packed, "scales": d} if m is None else {"qweight": packed, "scales": d, "mins": m}
        if lin is not None:  # later layers see this layer's quantized output
            saved[name] = lin.weight.data
            lin.weight.data = dequantize_int4(packed, d, m, fmt.group_size).to(w.dtype)
        return buf

    def pre_hook(name: str):
        def hook(module, args):
            for member in shared[name]:
                if member in formats and member not in out:
                    out[member] = quantize(member, args[0])
        return hook

    hooks = [model.get_submodule(name).register_forward_pre_hook(pre_hook(name)) for name in formats]
    device = next(model.parameters()).device
    try:
        x = model.hidden_states(tokens.to(device))  # (B, T, d); logits are never formed (B T vocab is large)
        if head is not None:
            out[calibrate.HEAD] = quantize(calibrate.HEAD, model.norm(x))
    finally:
        for h in hooks:
            h.remove()
        for name, t in saved.items():
            model.get_submodule(name).weight.data = t
    missing = sorted(set(formats) - set(out))
    if missing:
        raise RuntimeError(f"sequential calibration never reached {missing[:3]} (is the model a TransformerLM?)")
    return out
