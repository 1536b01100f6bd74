"""The int4 scale / zero-point search (calibrate.py): never worse than round-to-nearest, same format, deterministic,
and the calibration path on stories260K."""

from __future__ import annotations

import pytest
import torch

from scratchlm.inference.quantization import calibrate, gptq, parse_scheme, quantize_model, quantize_state_dict
from scratchlm.inference.quantization import reference as ref
from scratchlm.inference.quantization.modules import HEAD, QuantLinear, linear_names
from scratchlm.inference.quantization.scheme import LayerFormat, QuantScheme
from scratchlm.model import ModelConfig, TransformerLM, load


def _weights(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        return torch.randn(n, k, generator=g) * 0.02
    if kind == "outliers":  # heavy tails and a few outlier input channels, as in trained LLM weights
        w = torch.distributions.StudentT(3.0).sample((n, k)) * 0.02
        w[:, torch.randperm(k, generator=g)[:3]] *= 10
        return w
    if kind == "grid":  # already on a Q4_1 g32 grid (what a dequantized GGUF holds)
        q = torch.randint(0, 16, (n, k), generator=g).float()
        d = torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3
        m = -torch.rand(n, k // 32, 1, generator=g) * 0.1
        return (q.view(n, -1, 32) * d + m).view(n, k).half().float()
    if kind == "const":  # constant and zero groups
        w = torch.zeros(n, k)
        w[: n // 2] = 0.25
        return w
    raise AssertionError(kind)


def _group_err(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor, g: int) -> torch.Tensor:
    """Weighted squared error per group (N, G)."""
    e = (w - w_hat).square() * h
    pad = (-w.shape[1]) % g
    return torch.nn.functional.pad(e, (0, pad)).view(w.shape[0], -1, g).sum(-1)


@pytest.mark.parametrize("kind", ["gauss", "outliers", "grid", "const"])
@pytest.mark.parametrize("group, k", [(32, 96), (64, 160), (128, 576)])  # 160 / 64 and 576 / 128 are ragged
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_search_never_worse_than_rtn(kind, group, k, symmetric, weighted):
    w = _weights(kind, 24, k, seed=group + k)
    h = (torch.rand(k, generator=torch.Generator().manual_seed(3)) ** 4 * 10 + 0.01) if weighted else None
    hw = torch.ones(k) if h is None else h
    q0, d0, m0 = ref.quantize_int4(w, group, symmetric)
    q1, d1, m1 = calibrate.quantize_int4_searched(w, group, symmetric, h)
    e0 = _group_err(w, ref.dequantize_int4(q0, d0, m0, group), hw, group)
    e1 = _group_err(w, ref.dequantize_int4(q1, d1, m1, group), hw, group)
    assert (e1 <= e0 * (1 + 1e-6) + 1e-12).all(), float((e1 - e0).max())  # per group, not only in total
    if kind in ("gauss", "outliers"):  # and it helps where rtn is poor (Q4_0 has one parameter less to move)
        assert float(e1.sum()) < (0.98 if symmetric else 0.95) * float(e0.sum())


@pytest.mark.parametrize("symmetric", [False, True])
def test_search_output_is_the_kernels_format(symmetric):
    """Same dtypes / shapes as the rtn reference; the codes are each weight's nearest level of its group's grid,
    so the reference dequantizer reproduces the searched parameters' reconstruction."""
    w = _weights("outliers", 16, 160, seed=7)
    g = 64
    q0, d0, m0 = ref.quantize_int4(w, g, symmetric)
    q1, d1, m1 = calibrate.quantize_int4_searched(w, g, symmetric)
    assert (q1.dtype, q1.shape, d1.dtype, d1.shape) == (q0.dtype, q0.shape, d0.dtype, d0.shape)
    assert (m1 is None) == symmetric and (symmetric or (m1.dtype, m1.shape) == (m0.dtype, m0.shape))
    deq = ref.dequantize_int4(q1, d1, m1, g)
    # all 16 levels of every weight's group, from the stored float16 parameters
    ds = d1.float().repeat_interleave(g, 1)[:, :160]
    levels = torch.arange(16.0)
    grid = (levels - 8) * ds[..., None] if symmetric else levels * ds[..., None] + m1.float().repeat_interleave(
        g, 1)[:, :160, None]  # (N, K, 16)
    best = (grid - w[..., None]).abs().amin(-1)
    assert torch.allclose((deq - w).abs(), best, atol=1e-6)
    codes = ref.unpack_nibbles(q1)
    assert ((codes >= 0) & (codes <= 15)).all()
    # a QuantLinear holding the searched buffers computes x @ deq^T
    lin = QuantLinear(160, 16, LayerFormat(4, g, symmetric), use_extension=False)
    lin._buffers.update({"qweight": q1, "scales": d1, **({} if m1 is None else {"mins": m1})})
    x = torch.randn(3, 160, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(lin(x), x @ deq.t(), rtol=1e-5, atol=1e-5)


def test_search_is_deterministic():
    w = _weights("outliers", 32, 192, seed=1)
    h = torch.rand(192, generator=torch.Generator().manual_seed(2))
    a = calibrate.quantize_int4_searched(w, 32, False, h)
    b = calibrate.quantize_int4_searched(w.clone(), 32, False, h.clone())
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_weighting_moves_error_to_cheap_channels():
    """With a heavy weight on some input channels the searched error there drops below the unweighted search's."""
    w = _weights("gauss", 64, 128, seed=5)
    h = torch.full((128,), 0.01)
    h[::8] = 100.0
    plain = ref.dequantize_int4(*calibrate.quantize_int4_searched(w, 32, False, None), 32)
    weighted = ref.dequantize_int4(*calibrate.quantize_int4_searched(w, 32, False, h), 32)
    assert calibrate.weighted_error(w, weighted, h) < 0.9 * calibrate.weighted_error(w, plain, h)


def test_scheme_names_and_defaults():
    assert parse_scheme("int4").search == "auto" and parse_scheme("int4-g128-sym+mse").search == "mse"
    assert parse_scheme("int4").resolved_search(False) == "mse" and parse_scheme("int4").resolved_search(True) == "gptq"
    assert parse_scheme("int4").head == LayerFormat(8) and parse_scheme("int4+head4").head is None
    s = parse_scheme("int4-g32-asym+rtn+head8")
    assert s.search == "rtn" and s.name == "int4-g32-asym+rtn+head8" and s.head == LayerFormat(8)
    assert parse_scheme("int8").search == "rtn"
    assert QuantScheme.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="int4 only"):
        parse_scheme("int8+rtn")
    assert parse_scheme("int4-g128+gptq").search == "gptq"
    with pytest.raises(ValueError, match="exclude each other"):
        parse_scheme("int4+rtn+gptq")
    with pytest.raises(ValueError, match="must be one of auto, mse, rtn, gptq"):
        QuantScheme("x", LayerFormat(4, 32, False), search="awq")
    with pytest.raises(ValueError, match="search="):
        quantize_state_dict({}, ModelConfig(), {}, search="awq")


def test_rtn_scheme_is_the_plain_reference():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=32)
    model = TransformerLM(cfg).eval()
    q = quantize_model(model, "int4-g32-asym+rtn")
    w = model.layers[0].ffn.w1.weight
    want = ref.quantize_int4(w, 32, False)
    got = q.layers[0].ffn.w1
    assert torch.equal(got.qweight, want[0]) and torch.equal(got.scales, want[1]) and torch.equal(got.mins, want[2])


@pytest.fixture(scope="module")
def stories(data_dir):
    return load(data_dir / "models" / "stories260K" / "stories260K.bin")


@pytest.fixture(scope="module")
def stories_calib(stories, data_dir):
    text = (data_dir / "corpora" / "tinystories" / "tinystories_v1_train_head_cased.txt").read_text(encoding="utf-8")
    return calibrate.calibration_tokens(stories.tokenizer, text[:20_000], n_tokens=256, seq_len=128)


@torch.no_grad()
def test_activation_stats_on_stories(stories, stories_calib):
    model = stories.model
    assert stories_calib.shape == (2, 128)
    stats = calibrate.activation_stats(model, stories_calib)
    assert set(stats) == set(linear_names(model.config)) | {HEAD}
    assert calibrate.HEAD == HEAD
    # oracle: the first layer's attention input and the final norm's output, computed by hand
    x0 = model.layers[0].attn_norm(model.tok_embeddings(stories_calib))
    torch.testing.assert_close(stats["layers.0.attn.q_proj"], x0.pow(2).mean((0, 1)))
    assert torch.equal(stats["layers.0.attn.q_proj"], stats["layers.0.attn.v_proj"])
    hn = model.norm(model.hidden_states(stories_calib))
    torch.testing.assert_close(stats[HEAD], hn.pow(2).mean((0, 1)), rtol=1e-4, atol=1e-6)
    assert stats["layers.4.ffn.w2"].shape == (model.config.d_ff,)
    again = calibrate.activation_stats(model, stories_calib)
    assert all(torch.equal(stats[k], again[k]) for k in stats)  # deterministic


@torch.no_grad()
def test_calibrated_search_on_stories(stories, stories_calib):
    """int4 (w2's d_in = 172 does not fit int4: int8 there) through quantize_state_dict with stats:
    every layer's activation-weighted error <= rtn's, and the model's logits end closer to float."""
    model = stories.model
    cfg = model.config
    layout = {n: LayerFormat(8) if n.endswith(".w2") else LayerFormat(4, 32, False) for n in linear_names(cfg)}
    layout[HEAD] = LayerFormat(4, 32, False)
    stats = calibrate.activation_stats(model, stories_calib)
    state = model.state_dict()
    rtn = quantize_state_dict(state, cfg, layout, search="rtn")
    cal = quantize_state_dict(state, cfg, layout, search="mse", act_stats=stats)
    for name in [n for n in layout if layout[n].bits == 4 and n != HEAD]:
        w = state[f"{name}.weight"]
        h = calibrate.channel_weights(stats[name], w.shape[1])
        e = [calibrate.weighted_error(w, ref.dequantize_int4(s[f"{name}.qweight"], s[f"{name}.scales"],
                                                              s[f"{name}.mins"], 32), h) for s in (rtn, cal)]
        assert e[1] <= e[0] * (1 + 1e-6), name
    from scratchlm.inference.quantization import QuantizedTransformerLM

    def build(sd):
        with torch.device("meta"):
            q = QuantizedTransformerLM(cfg, layout)
        q.load_state_dict(sd, strict=True, assign=True)
        for module in q.modules():
            if isinstance(module, QuantLinear):
                module.use_extension = False
        return q.eval()

    tokens = calibrate.calibration_tokens(stories.tokenizer, "Once upon a time, a little dog named Max found a "
                                          "big red ball in the park. He was very happy and ran to his mom.",
                                          n_tokens=24, seq_len=24)  # held out: not the calibration text
    want = torch.log_softmax(model(tokens), -1)

    def kl(q):
        return float((want.exp() * (want - torch.log_softmax(q(tokens), -1))).sum(-1).mean())

    assert kl(build(cal)) < kl(build(rtn))


def test_quantize_model_with_calibration_tokens():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64)
    model = TransformerLM(cfg).eval()
    tokens = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1))
    a = quantize_model(model, "int4-g32-asym", calibration=tokens)
    b = quantize_model(model, "int4-g32-asym", calibration=tokens)
    c = quantize_model(model, "int4-g32-asym")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.layers[0].attn.q_proj.scales, c.layers[0].attn.q_proj.scales)  # stats were used
    with pytest.raises(ValueError, match="int64"):
        calibrate.activation_stats(model, tokens.float())
    with pytest.raises(ValueError, match="only"):
        calibrate.calibration_tokens(type("T", (), {"encode": staticmethod(lambda s: [1, 2])})(), "ab", 10)


def _correlated(n_rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibration and held-out activations (rows, k) with correlated channels of unequal scale."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.diag(torch.rand(k, generator=g) ** 3 * 3)
    return torch.randn(n_rows, k, generator=g) @ mix, torch.randn(n_rows, k, generator=g) @ mix


@pytest.mark.parametrize("group, symmetric", [(32, False), (64, True), (128, False)])
def test_gptq_beats_the_search_on_correlated_inputs(group, symmetric):
    k = 192 if group != 128 else 256
    w = _weights("gauss", 48, k, seed=11)
    x, x_test = _correlated(1024, k, seed=12)
    hess = x.t() @ x / x.shape[0]
    searched = calibrate.quantize_int4_searched(w, group, symmetric, calibrate.channel_weights(torch.diag(hess), k))
    gq = gptq.gptq_int4(w, hess, group, symmetric)
    q0 = ref.quantize_int4(w, group, symmetric)
    assert [(t.dtype, t.shape) for t in gq if t is not None] == [(t.dtype, t.shape) for t in q0 if t is not None]

    def out_err(params):
        return float((x_test @ (ref.dequantize_int4(*params, group) - w).t()).square().mean())

    assert out_err(gq) < 0.85 * out_err(searched) < out_err(q0)  # held-out activations, not the calibration ones
    again = gptq.gptq_int4(w, hess, group, symmetric)
    assert all(torch.equal(a, b) for a, b in zip(gq[:2], again[:2], strict=True))


def test_gptq_with_a_diagonal_hessian_is_the_weighted_search():
    """No correlations, no error to feed forward: GPTQ reduces to rounding with the searched parameters."""
    w = _weights("outliers", 16, 128, seed=4)
    h = torch.rand(128, generator=torch.Generator().manual_seed(5)) + 0.1
    gq = ref.dequantize_int4(*gptq.gptq_int4(w, torch.diag(h), 32, False, damp=0.01), 32)  # = the floor
    se = ref.dequantize_int4(*calibrate.quantize_int4_searched(w, 32, False, calibrate.channel_weights(h, 128),
                                                               rounds=1), 32)
    hw = calibrate.channel_weights(h, 128)
    assert calibrate.weighted_error(w, gq, hw) == pytest.approx(calibrate.weighted_error(w, se, hw), rel=1e-4)


@torch.no_grad()
def test_gptq_scheme_needs_calibration_and_uses_it():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64)
    model = TransformerLM(cfg).eval()
    with pytest.raises(ValueError, match="needs calibration tokens"):
        quantize_model(model, "int4-g32-asym+gptq")
    tokens = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1))
    q = quantize_model(model, "int4-g32-asym+gptq", calibration=tokens)
    assert q.scheme_name == "int4-g32-asym+gptq"
    for module in q.modules():
        if isinstance(module, QuantLinear):
            module.use_extension = False  # the format is checked against the reference; kernels have their tests
    want = model(tokens)
    rtn = quantize_model(model, "int4-g32-asym+rtn")
    for module in rtn.modules():
        if isinstance(module, QuantLinear):
            module.use_extension = False
    err = [float((m(tokens) - want).norm() / want.norm()) for m in (q, rtn)]
    assert err[0] < 0.25 and err[0] < err[1], err


def test_calibration_knobs_are_validated(data_dir, tmp_path):
    from scratchlm.inference import EngineConfig
    from scratchlm.inference.quantization import load_model_quantized

    with pytest.raises(ValueError, match="quantization_calibration='nope.txt' is not a file"):
        EngineConfig(quantization="int4", quantization_calibration="nope.txt")
    with pytest.raises(ValueError, match="quantization_calibration_tokens=0"):
        EngineConfig(quantization="int4", quantization_calibration_tokens=0)
    text = data_dir / "corpora" / "tinystories" / "tinystories_v2_sample_cs336.txt"
    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    with pytest.raises(ValueError, match="only used by an int4 scheme with a search"):
        load_model_quantized(model, "int8", calibration=text)
    with pytest.raises(FileNotFoundError, match="calibration text not found"):
        load_model_quantized(model, "int4", calibration=tmp_path / "missing.txt")
