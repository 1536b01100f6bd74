"""How int4 scales and zero-points are chosen: an error-minimizing search, optionally activation-weighted.

Policy. Plain round-to-nearest (``rtn``) takes each group's min/max (Q4_1) or largest magnitude
(Q4_0) as its range, so one outlier stretches the grid for all 32 (or 128) weights. The ``mse``
search (the int4 default without calibration text; with it the default is GPTQ, gptq.py) instead
picks, per group, the (d, m) that minimize the weighted reconstruction error

    E(d, m) = sum_k h_k (w_k - w^_k)^2,   w^_k = d q_k + m,  q_k = clamp(round((w_k - m) / d), 0, 15)

(symmetric: w^_k = d (q_k - 8), m = -8 d). Candidates, all evaluated in the stored precision
(float16 d and m, codes re-assigned to the nearest level exactly as `reference.quantize_int4`
does): the plain rtn parameters themselves; ranges clipped at both ends; and, as in llama.cpp's
``make_qkx2_quants``, codes from a family of slightly different inverse scales followed by a
closed-form weighted least-squares refit of (d, m); the best candidate then gets two
assign/refit rounds (Lloyd iterations), each kept only if it lowers E. Because rtn is a
candidate and every step is kept only when it lowers E, the search never does worse than rtn
on E (tested). The output is the ordinary int4 format (packed nibbles, float16 d [and m]), so
every kernel reads it unchanged.

Weights h: with no calibration data h = 1 (plain weight MSE: a weight-only search that needs
nothing). With calibration tokens, h_k = E[x_k^2] + floor * mean(E[x^2]) over the tokens the
layer's input sees (AWQ/imatrix-style: a weight error on input channel k costs about
E[x_k^2] in the output's squared error). `activation_stats` collects E[x^2] per input channel
in one float forward over fixed tokens (no randomness: the same tokens give the same stats and
the same quantized model). The floor keeps channels the calibration text barely excites from
being ignored.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from scratchlm.inference.quantization.reference import pack_nibbles
from scratchlm.inference.quantization.scheme import LayerFormat

SEARCHES = ("mse", "rtn", "gptq")  # GPTQ itself lives in gptq.py
HEAD = "output_head"  # same key as modules.HEAD (kept here so this module does not import the layers)
CALIBRATION_TOKENS = 16384  # default calibration size: GPTQ's Hessians (d_in up to 1,536) overfit 2k tokens
STAT_FLOOR = 0.01  # h_k = E[x_k^2] + STAT_FLOOR * mean_k E[x_k^2]
_CHUNK_ELEMS = 1 << 17  # rows are searched in chunks of about this many weights (bounded memory)


# ---------------------------------------------------------------------------------------------
# calibration statistics
# ---------------------------------------------------------------------------------------------

def calibration_tokens(tokenizer, text: str, n_tokens: int = CALIBRATION_TOKENS, seq_len: int = 512) -> Tensor:
    """The first `n_tokens` tokens of `text`, as (n_tokens // seq_len, seq_len) int64 rows (deterministic).

    Raises ValueError when the text is too short, naming how many tokens it had.
    """
    if n_tokens < 1 or seq_len < 1:
        raise ValueError(f"n_tokens and seq_len must be >= 1, got {n_tokens}, {seq_len}")
    seq_len = min(seq_len, n_tokens)
    n_tokens -= n_tokens % seq_len
    ids: list[int] = []
    pos = 0
    while len(ids) < n_tokens and pos < len(text):  # tokenize only what is needed
        ids += tokenizer.encode(text[pos:pos + 20_000])
        pos += 20_000
    if len(ids) < n_tokens:
        raise ValueError(f"calibration text has only {len(ids)} tokens, need {n_tokens} (give a longer text or fewer "
                         f"tokens: --quantization-calibration-tokens)")
    return torch.tensor(ids[:n_tokens], dtype=torch.long).view(-1, seq_len)  # (B, T)


def calibration_tokens_from_file(tokenizer, path: str | Path, n_tokens: int = CALIBRATION_TOKENS, seq_len: int = 512
                                 ) -> Tensor:
    """`calibration_tokens` of a UTF-8 text file; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration text not found: {path} (expected a UTF-8 text file)")
    try:
        return calibration_tokens(tokenizer, path.read_text(encoding="utf-8"), n_tokens, seq_len)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


@torch.no_grad()
def activation_stats(model: nn.Module, tokens: Tensor, max_rows: int = 1, full: bool = False) -> dict[str, Tensor]:
    """E[x_k^2] per input channel of every linear layer and of the head: module path -> float32 (d_in,).

    One float forward of `tokens` (B, T) through a `TransformerLM`, `max_rows` rows at a time.
    Keys are the paths `modules.linear_names` gives (q/k/v share the attention norm's output,
    w1/w3 the FFN norm's) and ``"output_head"`` (the final norm's output). `full=True` returns
    E[x x^T] (d_in, d_in) instead (GPTQ's Hessian; its diagonal is the E[x^2] above); modules that
    share an input share one tensor.
    """
    if tokens.dim() != 2 or tokens.dtype != torch.long:
        raise ValueError(f"calibration tokens must be a (batch, seq) int64 tensor, got {tuple(tokens.shape)} "
                         f"{tokens.dtype}")
    sums: dict[str, Tensor] = {}
    count = [0]

    def add(keys: tuple[str, ...], x: Tensor) -> None:
        x2 = x.detach().float().reshape(-1, x.shape[-1])  # (rows, d_in)
        s = x2.t() @ x2 if full else x2.pow(2).sum(0)  # (d_in, d_in) or (d_in,)
        if keys[0] in sums:
            sums[keys[0]] += s
        else:
            for key in keys:
                sums[key] = s  # shared inputs share one accumulator

    hooks = []

    def out_hook(keys):
        return lambda module, args, out: add(keys, out)

    def in_hook(keys):
        return lambda module, args: add(keys, args[0])

    for i, layer in enumerate(model.layers):
        p = f"layers.{i}"
        hooks.append(layer.attn_norm.register_forward_hook(out_hook((f"{p}.attn.q_proj", f"{p}.attn.k_proj",
                                                                      f"{p}.attn.v_proj"))))
        hooks.append(layer.attn.o_proj.register_forward_pre_hook(in_hook((f"{p}.attn.o_proj",))))
        hooks.append(layer.ffn_norm.register_forward_hook(out_hook((f"{p}.ffn.w1", f"{p}.ffn.w3"))))
        hooks.append(layer.ffn.w2.register_forward_pre_hook(in_hook((f"{p}.ffn.w2",))))
    hooks.append(model.norm.register_forward_hook(out_hook((HEAD,))))
    device = next(model.parameters()).device
    try:
        with torch.inference_mode():
            for b in range(0, tokens.shape[0], max_rows):
                rows = tokens[b:b + max_rows].to(device)
                model(rows)
                count[0] += rows.numel()
    finally:
        for h in hooks:
            h.remove()
    scaled: dict[int, Tensor] = {}
    for v in sums.values():
        scaled.setdefault(id(v), v / count[0])
    return {k: scaled[id(v)].cpu() for k, v in sums.items()}


def channel_weights(stats: Tensor | None, d_in: int, floor: float = STAT_FLOOR) -> Tensor:
    """h (d_in,) for the error: ones without stats, else E[x^2] + floor * mean(E[x^2])."""
    if stats is None:
        return torch.ones(d_in)
    stats = stats.float().flatten()
    if stats.numel() != d_in:
        raise ValueError(f"activation stats have {stats.numel()} channels, the weight has d_in={d_in}")
    return stats + floor * stats.mean().clamp_min(1e-30)


# ---------------------------------------------------------------------------------------------
# the search
# ---------------------------------------------------------------------------------------------

def _assign(wg: Tensor, d16: Tensor, m16: Tensor | None, h: Tensor) -> tuple[Tensor, Tensor]:
    """Codes (n, G, g) nearest to wg for float16 params, exactly as `reference.quantize_int4`, and E (n, G)."""
    df = d16.float()
    inv = torch.where(df != 0, 1.0 / df, torch.zeros_like(df))[..., None]  # (n, G, 1)
    if m16 is None:
        q = torch.round(wg * inv + 8.0).clamp_(0, 15)
        rec = (q - 8.0) * df[..., None]
    else:
        mf = m16.float()[..., None]
        q = torch.round((wg - mf) * inv).clamp_(0, 15)
        rec = q * df[..., None] + mf
    err = ((rec - wg).square_() * h).sum(-1)  # (n, G)
    return q, err


def _refit(wg: Tensor, q: Tensor, h: Tensor, symmetric: bool) -> tuple[Tensor, Tensor | None, Tensor]:
    """Weighted least squares (d, m) for fixed codes q; returns float16 d, m and a validity mask (n, G)."""
    if symmetric:
        c = q - 8.0
        num = (h * c * wg).sum(-1)
        den = (h * c * c).sum(-1)
        d = num / den.clamp_min(1e-30)
        ok = (den > 0) & torch.isfinite(d)
        return d.half(), None, ok & torch.isfinite(d.half())
    s = h.sum(-1)  # (1, G)
    sq = (h * q).sum(-1)
    sqq = (h * q * q).sum(-1)
    sw = (h * wg).sum(-1)
    sqw = (h * q * wg).sum(-1)
    det = s * sqq - sq * sq
    safe = torch.where(det > 0, det, torch.ones_like(det))
    d = (s * sqw - sq * sw) / safe
    m = (sqq * sw - sq * sqw) / safe
    d16, m16 = d.half(), m.half()
    ok = (det > 1e-12 * s * sqq) & (d > 0) & torch.isfinite(d16) & torch.isfinite(m16)
    return d16, m16, ok


def _rtn(wg: Tensor, symmetric: bool) -> tuple[Tensor, Tensor | None]:
    """The plain Q4_0 / Q4_1 parameters (identical to `reference.quantize_int4`)."""
    if symmetric:
        idx = wg.abs().argmax(dim=-1, keepdim=True)
        return (torch.gather(wg, -1, idx).squeeze(-1) / -8.0).half(), None
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    return ((hi - lo) / 15.0).half(), lo.half()


def _candidate_codes(wg: Tensor, symmetric: bool):
    """Yield code tensors (n, G, g) to refit: clipped ranges and perturbed inverse scales."""
    if symmetric:
        idx = wg.abs().argmax(dim=-1, keepdim=True)
        v = torch.gather(wg, -1, idx)  # (n, G, 1) signed value of largest magnitude
        for s in (1.0, 0.93, 0.86, 0.8):
            for den in (-8.0, 7.0):  # the extreme on code 0 or on code 15
                d = v * s / den
                inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
                yield torch.round(wg * inv + 8.0).clamp_(0, 15)
        return
    lo, hi = wg.amin(dim=-1, keepdim=True), wg.amax(dim=-1, keepdim=True)
    span = (hi - lo).clamp_min(1e-30)
    for t in (-1.0, -0.5, 0.0, 0.5, 1.0):  # llama.cpp make_qkx2_quants' family
        yield torch.round((wg - lo) * ((15.0 + t) / span)).clamp_(0, 15)
    for a in (0.0, 0.05, 0.1):  # clip a and b fractions of the range at the low / high end
        for b in (0.0, 0.05, 0.1):
            if a == b == 0.0:
                continue
            lo_c, hi_c = lo + a * span, hi - b * span
            yield torch.round((wg - lo_c) * (15.0 / (hi_c - lo_c))).clamp_(0, 15)


def _search_chunk(wg: Tensor, h: Tensor, symmetric: bool, rounds: int) -> tuple[Tensor, Tensor | None]:
    """Best float16 (d, m) per group for a chunk wg (n, G, g) under weights h (1, G, g)."""
    best_d, best_m = _rtn(wg, symmetric)
    _, best_e = _assign(wg, best_d, best_m, h)

    def consider(d16, m16, ok):
        nonlocal best_d, best_m, best_e
        _, e = _assign(wg, d16, m16, h)
        better = ok & (e < best_e)
        best_e = torch.where(better, e, best_e)
        best_d = torch.where(better, d16, best_d)
        if m16 is not None:
            best_m = torch.where(better, m16, best_m)

    for q in _candidate_codes(wg, symmetric):
        consider(*_refit(wg, q, h, symmetric))
    for _ in range(rounds):  # Lloyd: codes for the best params, then the best params for those codes
        q, _ = _assign(wg, best_d, best_m, h)
        consider(*_refit(wg, q, h, symmetric))
    return best_d, best_m


def _padded_groups(w: Tensor, g: int) -> tuple[Tensor, int]:
    """(N, K) -> (N, G, g) float32; padding repeats each row's last value (as `reference.quantize_int4`)."""
    n, k = w.shape
    pad = (-k) % g
    wf = w.float()
    if pad:
        wf = torch.cat([wf, wf[:, -1:].expand(n, pad)], dim=1)
    return wf.reshape(n, -1, g), pad  # (N, G, g)


@torch.no_grad()
def search_int4_params(w: Tensor, group_size: int = 32, symmetric: bool = False, weights: Tensor | None = None,
                       rounds: int = 2) -> tuple[Tensor, Tensor | None]:
    """Error-minimizing float16 d (N, G) [and m (N, G)] for a float (N, K) weight; see the module docstring.

    `weights`: h per input channel (K,) (`channel_weights`), None = uniform.
    """
    n, k = w.shape
    LayerFormat(bits=4, group_size=group_size, symmetric=symmetric).check(k, "search_int4_params")
    h = torch.ones(k) if weights is None else weights.float().flatten().cpu()
    if h.numel() != k:
        raise ValueError(f"channel weights have {h.numel()} entries, the weight has d_in={k}")
    pad = (-k) % group_size
    h = torch.nn.functional.pad(h, (0, pad)).view(1, -1, group_size).to(w.device)  # (1, G, g); padding weighs 0
    rows = max(1, _CHUNK_ELEMS // (k + pad))
    ds, ms = [], []
    for r in range(0, n, rows):
        wg, _ = _padded_groups(w[r:r + rows], group_size)
        d, m = _search_chunk(wg, h, symmetric, rounds)
        ds.append(d)
        ms.append(m)
    return torch.cat(ds).contiguous(), None if symmetric else torch.cat(ms).contiguous()


@torch.no_grad()
def codes_for(w: Tensor, d: Tensor, m: Tensor | None, group_size: int) -> Tensor:
    """Packed nibbles (N, K/2) of `w` for given float16 params: each weight's nearest level."""
    n, k = w.shape
    wg, _ = _padded_groups(w, group_size)
    q, _ = _assign(wg, d, m, torch.zeros(1, 1, 1, device=w.device))
    return pack_nibbles(q.reshape(n, -1)[:, :k])


@torch.no_grad()
def quantize_int4_searched(w: Tensor, group_size: int = 32, symmetric: bool = False, weights: Tensor | None = None,
                           rounds: int = 2) -> tuple[Tensor, Tensor, Tensor | None]:
    """Like `reference.quantize_int4` (same outputs, same format) with searched parameters."""
    d, m = search_int4_params(w, group_size, symmetric, weights, rounds)
    return codes_for(w, d, m, group_size), d, m


def weighted_error(w: Tensor, w_hat: Tensor, weights: Tensor | None = None) -> float:
    """sum_k h_k (w - w_hat)^2 over the whole matrix (h = 1 without weights)."""
    e = (w.float() - w_hat.float()).square()
    if weights is not None:
        e = e * weights.float().to(e.device)
    return float(e.sum())
