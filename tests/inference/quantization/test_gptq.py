"""GPTQ (gptq.py) against a straightforward reference of the paper's Algorithm 1, the output-error oracle, and
sequential calibration of a whole model."""

from __future__ import annotations

import pytest
import torch

from scratchlm.inference.quantization import calibrate, gptq, quantize_model
from scratchlm.inference.quantization import reference as ref
from scratchlm.inference.quantization.modules import HEAD, QuantLinear
from scratchlm.inference.quantization.scheme import LayerFormat
from scratchlm.model import ModelConfig, TransformerLM


def _correlated(n_rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibration and held-out activations (rows, k): correlated channels of unequal scale, a few outliers."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.diag(torch.rand(k, generator=g) ** 3 * 3)
    scale = torch.ones(k)
    scale[torch.randperm(k, generator=g)[:4]] = 8.0  # outlier channels, as in LLM activations
    return (torch.randn(n_rows, k, generator=g) @ mix) * scale, (torch.randn(n_rows, k, generator=g) @ mix) * scale


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.distributions.StudentT(4.0).sample((n, k)) * 0.02 if seed < 0 else \
        torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02


def reference_gptq(w, hess, g, symmetric, damp, act_order):
    """Algorithm 1 of Frantar et al. without its speed-ups: float64, one column at a time in `order`, the full
    inverse Hessian updated by the OBS rule after every column (no Cholesky, no lazy blocks). Group parameters:
    the rtn rule of `reference.quantize_int4`, on the updated weights when a group starts, or (act-order,
    static groups) on the original weights."""
    W = w.double().clone()
    H = hess.double().clone()
    k = W.shape[1]
    H += damp * torch.diag(H).mean() * torch.eye(k, dtype=torch.float64)
    Hinv = torch.linalg.inv(H)
    order = torch.argsort(torch.diag(H), descending=True, stable=True).tolist() if act_order else list(range(k))
    params = {}

    def fit(cols_w, gi):
        _, d, m = ref.quantize_int4(cols_w.float(), cols_w.shape[1], symmetric)
        params[gi] = (d[:, 0].double(), (-8.0 * d[:, 0].double()) if symmetric else m[:, 0].double())

    if act_order:
        for gi in range(-(-k // g)):
            fit(W[:, gi * g:(gi + 1) * g], gi)
    codes = torch.zeros(W.shape, dtype=torch.uint8)
    remaining = list(order)
    for j in order:
        gi = j // g
        if not act_order and j % g == 0:
            fit(W[:, j:j + g], gi)
        d, m = params[gi]
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round((W[:, j] - m) * inv).clamp(0, 15)
        codes[:, j] = q.to(torch.uint8)
        err = (W[:, j] - (q * d + m)) / Hinv[j, j]
        remaining.remove(j)
        W[:, remaining] -= err[:, None] * Hinv[j, remaining][None, :]
        Hinv = Hinv - Hinv[:, j:j + 1] @ Hinv[j:j + 1, :] / Hinv[j, j]
    d_all = torch.stack([params[i][0] for i in range(len(params))], 1).half()
    return codes, d_all


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group, k, symmetric", [(32, 96, False), (64, 128, True), (128, 320, False)])  # 320 ragged
def test_gptq_equals_the_reference_algorithm(group, k, symmetric, act_order):
    w = _weight(12, k, seed=k)
    x, _ = _correlated(4 * k, k, seed=1)
    hess = x.t() @ x / x.shape[0]
    want_codes, want_d = reference_gptq(w, hess, group, symmetric, 0.01, act_order)
    codes, d, m = gptq.gptq_quantize(w, hess, group, symmetric, damp=0.01, block=64, act_order=act_order,
                                     fit="rtn", dtype=torch.float64)
    assert torch.equal(d, want_d)
    assert float((codes == want_codes).float().mean()) >= 0.999  # a rounding tie may fall the other way
    assert (m is None) == symmetric


@pytest.mark.parametrize("group, symmetric, act_order", [(32, False, False), (128, False, False),
                                                         (128, False, True), (64, True, True)])
def test_gptq_output_error_beats_rtn_and_the_search(group, symmetric, act_order):
    """The oracle: E||(W - Q) x||^2 on the calibration inputs (what GPTQ minimizes) and on held-out ones."""
    k = 256
    w = _weight(48, k, seed=-1)
    x, x_test = _correlated(2048, k, seed=12)
    hess = x.t() @ x / x.shape[0]
    hess_test = x_test.t() @ x_test / x_test.shape[0]
    rtn = ref.dequantize_int4(*ref.quantize_int4(w, group, symmetric), group)
    searched = ref.dequantize_int4(*calibrate.quantize_int4_searched(
        w, group, symmetric, calibrate.channel_weights(torch.diag(hess), k)), group)
    packed, d, m = gptq.gptq_int4(w, hess, group, symmetric, act_order=act_order)
    gq = ref.dequantize_int4(packed, d, m, group)
    for h in (hess, hess_test):
        e_rtn, e_search, e_gptq = (gptq.output_error(w, v, h) for v in (rtn, searched, gq))
        assert e_gptq < 0.8 * e_search and e_search < e_rtn, (e_rtn, e_search, e_gptq)
    assert [(t.dtype, t.shape) for t in (packed, d)] == [(t.dtype, t.shape) for t in ref.quantize_int4(w, group)[:2]]


def test_gptq_on_a_grid_it_can_represent_is_exact():
    """Weights already on a Q4_1 g32 grid (what the dequantized GGUF holds): no rounding error to feed forward."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (16, 128), generator=g).float()
    q[:, ::32], q[:, 1::32] = 0, 15  # every group spans the whole range, so min/max recover (d, m)
    d = (torch.rand(16, 4, 1, generator=g) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(16, 4, 1, generator=g) * 0.1).half().float()
    w = (q.view(16, 4, 32) * d + m).view(16, 128)
    x, _ = _correlated(512, 128, seed=3)
    packed, dq, mq = gptq.gptq_int4(w, x.t() @ x / 512, 32, False)
    assert torch.equal(ref.dequantize_int4(packed, dq, mq, 32), ref.dequantize_int4(*ref.quantize_int4(w, 32), 32))


def test_gptq_knobs_and_dead_channels():
    w = _weight(8, 64, seed=2)
    x, _ = _correlated(256, 64, seed=4)
    hess = x.t() @ x / 256
    hess[5, :] = hess[:, 5] = 0  # a channel the calibration never excited
    codes, d, m = gptq.gptq_quantize(w, hess, 32, False)
    assert torch.isfinite(d.float()).all() and torch.isfinite(m.float()).all()
    with pytest.raises(ValueError, match="expected \\(64, 64\\)"):
        gptq.gptq_quantize(w, hess[:32, :32], 32)
    with pytest.raises(ValueError, match="damp"):
        gptq.gptq_quantize(w, hess, 32, damp=1.5)
    with pytest.raises(ValueError, match="multiple of 32"):
        gptq.gptq_quantize(w, hess, 48)


def _tiny(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64)
    return TransformerLM(cfg).eval()


@torch.no_grad()
def test_sequential_calibration_sees_the_quantized_prefix():
    """Layer 1's q/k/v are GPTQ'd on the input the *quantized* model gives them, w2 on the quantized w1/w3's
    output; the float model is left unchanged."""
    model = _tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(1))
    fmt = LayerFormat(4, 32, False)
    q = quantize_model(model, "int4-g32-asym+gptq+head4", calibration=tokens)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    for module in q.modules():
        if isinstance(module, QuantLinear):
            module.use_extension = False
    seen = {}
    hooks = [q.get_submodule(p).register_forward_pre_hook(lambda mod, a, p=p: seen.__setitem__(p, a[0]))
             for p in ("layers.1.attn.q_proj", "layers.1.ffn.w2")]
    hooks.append(q.norm.register_forward_hook(lambda mod, a, out: seen.__setitem__(HEAD, out)))
    q(tokens)
    for h in hooks:
        h.remove()
    for path in ("layers.1.attn.q_proj", "layers.1.ffn.w2", HEAD):
        x = seen[path].reshape(-1, seen[path].shape[-1]).float()
        w = model.output_weight if path == HEAD else model.get_submodule(path).weight
        want = gptq.gptq_int4(w, (x.t() @ x).double() / x.shape[0], 32, False)
        got = q.get_submodule(path)
        assert torch.equal(got.qweight, want[0]) and torch.equal(got.scales, want[1]), path
    assert q.output_head.fmt == fmt


@torch.no_grad()
def test_default_int4_scheme_with_calibration_beats_rtn():
    model = _tiny(3)
    tokens = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(2))
    held = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(9))
    want = torch.log_softmax(model(held), -1)

    def kl(m):
        for module in m.modules():
            if isinstance(module, QuantLinear):
                module.use_extension = False
        return float((want.exp() * (want - torch.log_softmax(m(held), -1))).sum(-1).mean())

    default = quantize_model(model, "int4-g128", calibration=tokens)
    rtn = quantize_model(model, "int4-g128+rtn")
    assert default.output_head.fmt == LayerFormat(8) == rtn.output_head.fmt  # the head stays at 8 bits
    assert kl(default) < kl(rtn)


@pytest.mark.slow
@torch.no_grad()
def test_gptq_on_smollm2_layers_beats_the_search_on_held_out_text(default_model_path, data_dir):
    """Real layers, real activations: GPTQ's Hessians from 8k tokens of WikiText-2 valid, the error measured on
    2k other tokens. Measured (16k calibration tokens, 2026-12-01): held-out output error / rtn's at g128 for
    layers.15.ffn.w2 0.44 (search 0.67), layers.28.attn.o_proj 0.30 (search 0.66)."""
    from scratchlm.model import load

    m = load(default_model_path)
    toks = calibrate.calibration_tokens_from_file(m.tokenizer, data_dir / "corpora" / "wikitext2" / "valid.txt",
                                                  10240, 512)
    names = ("layers.15.ffn.w2", "layers.28.attn.o_proj")

    def hessians(rows):
        acc = dict.fromkeys(names, 0.0)

        def add(name, x):
            x = x.reshape(-1, x.shape[-1]).float()
            acc[name] = acc[name] + (x.t() @ x).double()

        hooks = [m.model.get_submodule(n).register_forward_pre_hook(lambda mod, a, n=n: add(n, a[0])) for n in names]
        for i in range(0, rows.shape[0], 4):
            m.model.hidden_states(rows[i:i + 4])
        for h in hooks:
            h.remove()
        return {n: v / rows.numel() for n, v in acc.items()}

    cal, held = hessians(toks[4:]), hessians(toks[:4])
    for name in names:
        w = m.model.get_submodule(name).weight
        rtn = ref.dequantize_int4(*ref.quantize_int4(w, 128), 128)
        searched = ref.dequantize_int4(*calibrate.quantize_int4_searched(
            w, 128, False, calibrate.channel_weights(torch.diag(cal[name]).float(), w.shape[1])), 128)
        gq = ref.dequantize_int4(*gptq.gptq_int4(w, cal[name], 128, False), 128)
        e = [gptq.output_error(w, v, held[name]) for v in (rtn, searched, gq)]
        assert e[2] < 0.85 * e[1] < e[0], (name, e)
