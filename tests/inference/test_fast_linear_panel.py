"""The panel-packed fp32 linears (csrc/panel_gemm.h, inference/fast_linear.py) against float64 matmuls."""

from __future__ import annotations

import pytest
import torch

from scratchlm.inference import fast_linear
from scratchlm.inference.fast_linear import PanelEmbedding, PanelLinear
from scratchlm.model import ModelConfig, TransformerLM


@pytest.fixture(scope="module")
def kernels():
    ext = fast_linear.load_kernels()
    if ext is None:
        pytest.skip("the engine's C++ kernels could not be built here (test_kernels_build_where_a_compiler_exists)")
    return ext


def _paths(ext):
    """(name, use_simd, avx512) of every path this CPU runs: AVX-512 / AVX2 where present, and the scalar one."""
    out = [("scalar", False, False)]
    if ext.has_avx2():
        out.append(("avx2", True, False))
        out.append(("avx512", True, True))  # the AVX2 path again where the CPU has no AVX-512
    return out


def _check(ext, m: int, ns: list[int], k: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, dtype=torch.float64, generator=g)
    ws = [torch.randn(n, k, dtype=torch.float64, generator=g) for n in ns]
    wp = torch.cat([ext.panel_pack(w.float()) for w in ws])
    for name, simd, avx512 in _paths(ext):
        old = ext.set_fp32_kernels(avx512, True)
        try:
            ys = ext.panel_linear(x.float(), wp, ns, simd)
        finally:
            ext.set_fp32_kernels(*old)
        for y, w in zip(ys, ws):
            want = x @ w.T  # float64 oracle
            assert y.shape == want.shape
            err = (y.double() - want).abs().max().item()
            assert err <= 2e-6 * k**0.5 * want.abs().max().item() + 1e-6, (name, m, ns, k, err)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 8, 12, 13, 17, 24, 31, 64, 65, 127, 600])
def test_panel_gemm_rows(kernels, m: int) -> None:
    """Every row remainder of the 6 x 4 / 8 x 3 / 14 x 2 / 16 x 1 AVX-512 tiles and the AVX2 6-row tiles (row blocks
    and k-chunks from 7 rows on), up to prefill."""
    _check(kernels, m, [40], 72, seed=m)


@pytest.mark.parametrize("ns,k", [([1], 1), ([16], 16), ([17], 3), ([33], 576), ([64], 19), ([70], 1536),
                                  ([9 * 8, 3 * 8, 3 * 8], 40), ([5, 16, 31], 33), ([96, 96], 64)])
def test_panel_gemm_ragged_and_grouped(kernels, ns: list[int], k: int) -> None:
    """Ragged N (a partial last panel, and 1..3 leftover panels beside the 4-panel groups) and K, and several
    matrices packed one after another (q/k/v, gate/up) each written to its own output."""
    for m in (1, 8, 9, 70):
        _check(kernels, m, ns, k, seed=m + k)


def test_panel_gemm_decode_rows_with_and_without_prefetch(kernels) -> None:
    """Every decode batch of 1..40 rows over 9 ragged panels (two 4-panel groups, the second prefetched while the
    first runs, and a leftover panel) and a ragged K, on every ISA path: within float64 rounding of the oracle, and
    the memory hints (next-group prefetch) never change a bit."""
    g = torch.Generator().manual_seed(3)
    n, k = 16 * 9 - 5, 37
    w = torch.randn(n, k, dtype=torch.float64, generator=g)
    wp = kernels.panel_pack(w.float())
    for m in range(1, 41):
        x = torch.randn(m, k, dtype=torch.float64, generator=g)
        want = x @ w.T  # float64 oracle
        for name, simd, avx512 in _paths(kernels):
            old, old_pre = kernels.set_fp32_kernels(avx512, True), kernels.panel_streaming(1)
            try:
                (y,) = kernels.panel_linear(x.float(), wp, [n], simd)
                kernels.panel_streaming(0)
                (y0,) = kernels.panel_linear(x.float(), wp, [n], simd)
            finally:
                kernels.set_fp32_kernels(*old)
                kernels.panel_streaming(old_pre)
            err = (y.double() - want).abs().max().item()
            assert err <= 2e-6 * k**0.5 * want.abs().max().item() + 1e-6, (name, m, err)
            assert torch.equal(y, y0), (name, m)
    assert kernels.panel_streaming() == old_pre


@pytest.mark.parametrize("n", [16 * 8192, 16 * 8192 - 5])
def test_panel_gemm_streaming_stores_for_a_head_larger_than_l3(kernels, n: int) -> None:
    """A call whose weights exceed 32 MiB and output 2 MiB (the tied head) writes whole 16-column rows with
    non-temporal stores (n = 16 * 8192; a ragged n keeps the masked stores): the same floats as without, and within
    float64 rounding of the oracle."""
    g = torch.Generator().manual_seed(5)
    k, m = 64, 12
    w = torch.randn(n, k, dtype=torch.float64, generator=g)
    x = torch.randn(m, k, dtype=torch.float64, generator=g)
    wp = kernels.panel_pack(w.float())
    assert wp.numel() * 4 >= 32 << 20 and m * wp.shape[0] * 16 * 4 >= 2 << 20
    old = kernels.panel_streaming(1)
    try:
        (y,) = kernels.panel_linear(x.float(), wp, [n])
        kernels.panel_streaming(0)
        (y0,) = kernels.panel_linear(x.float(), wp, [n])
    finally:
        kernels.panel_streaming(old)
    assert torch.equal(y, y0)
    want = x @ w.T
    assert (y.double() - want).abs().max().item() <= 2e-6 * k**0.5 * want.abs().max().item() + 1e-6


def test_panel_pack_groups_one_buffer(kernels) -> None:
    """panel_pack_groups packs each group's matrices one after another, every group a view of one buffer, the
    same panels as panel_pack; a buffer of 2 MiB or more starts on a 2 MiB boundary (huge-page advice)."""
    ws = [[torch.randn(40, 24), torch.randn(9, 24)], [torch.randn(20, 7)], [torch.randn(16 * 1024, 64)]]
    packed = kernels.panel_pack_groups(ws)
    assert [tuple(p.shape) for p in packed] == [(4, 24, 16), (2, 7, 16), (1024, 64, 16)]
    assert len({p.untyped_storage().data_ptr() for p in packed}) == 1
    assert packed[0].untyped_storage().data_ptr() % (2 << 20) == 0
    for group, p in zip(ws, packed):
        assert torch.equal(p, torch.cat([kernels.panel_pack(w) for w in group]))
    with pytest.raises(RuntimeError, match="share K"):
        kernels.panel_pack_groups([[torch.randn(4, 3), torch.randn(4, 5)]])
    with pytest.raises(RuntimeError, match="float32"):
        kernels.panel_pack_groups([[torch.randn(4, 3, dtype=torch.float64)]])


def test_panel_pack_round_trip_and_errors(kernels) -> None:
    w = torch.randn(37, 11)
    p = kernels.panel_pack(w)
    assert p.shape == (3, 11, 16)
    assert torch.equal(fast_linear.unpack(p, 37), w)
    assert torch.count_nonzero(p[2, :, 5:]) == 0  # padding columns are zeros
    with pytest.raises(RuntimeError, match="need"):
        kernels.panel_linear(torch.randn(2, 11), p, [50])  # 50 columns need 4 panels
    with pytest.raises(RuntimeError, match="K = "):
        kernels.panel_linear(torch.randn(2, 12), p, [37])
    with pytest.raises(RuntimeError, match="float32"):
        kernels.panel_linear(torch.randn(2, 11), p.double(), [37])


@pytest.mark.parametrize("tied", [False, True])
def test_panel_linears_state_dict_stays_plain(kernels, tied: bool) -> None:
    """use_skinny_linears packs q/k/v and gate/up of a layer into one tensor each (views: one copy), and a tied
    embedding table; the model's outputs, state_dict keys and values are the plain model's, and loading a plain
    state_dict repacks."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=70, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=32,
                      tie_embeddings=tied)
    model = TransformerLM(cfg).eval()
    tokens = torch.randint(0, 64, (1, 9))
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(tokens)
    assert fast_linear.use_skinny_linears(model) == 2 * 7 + (0 if tied else 1)
    assert (type(model.tok_embeddings) is PanelEmbedding) == tied
    assert all(type(m) is PanelLinear for n, m in model.named_modules() if n.endswith(("proj", "w1", "w2", "w3")))
    a, f = model.layers[0].attn, model.layers[0].ffn
    assert a.k_proj.panels.data_ptr() == a.q_proj.panels.data_ptr() + a.q_proj.panels.numel() * 4  # one tensor
    assert f.w3.panels.data_ptr() == f.w1.panels.data_ptr() + f.w1.panels.numel() * 4
    storages = {m.panels.untyped_storage().data_ptr() for m in model.modules() if type(m) is PanelLinear}
    assert len(storages) == 1  # every layer's panels in one buffer
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), want, atol=1e-5, rtol=1e-5)
        assert torch.equal(model.tok_embeddings(tokens), plain["tok_embeddings.weight"][tokens])
    if tied:  # the runner's head: the table's panels through the kernel
        h = torch.randn(5, 32)
        torch.testing.assert_close(model.tok_embeddings.head(h), h @ plain["tok_embeddings.weight"].T,
                                   atol=1e-5, rtol=1e-5)
    sd = model.state_dict()
    assert sd.keys() == plain.keys()
    for key, v in plain.items():
        assert torch.equal(sd[key], v), key
    other = {k: torch.randn_like(v) for k, v in plain.items()}
    model.load_state_dict(other)
    assert torch.equal(model.layers[1].ffn.w2.weight, other["layers.1.ffn.w2.weight"])
    with pytest.raises(RuntimeError, match="size mismatch"):
        model.load_state_dict({**other, "layers.0.attn.q_proj.weight": torch.randn(3, 3)})


def test_panel_linear_autograd_and_shapes(kernels) -> None:
    w = torch.randn(20, 8)
    lin = PanelLinear(8, 20, kernels.panel_pack(w))
    x = torch.randn(3, 8, requires_grad=True)
    lin(x).sum().backward()  # torch's matmul over the unpacked weight when autograd needs it
    torch.testing.assert_close(x.grad, w.sum(0).expand(3, 8))
    torch.testing.assert_close(lin(x.detach()[None]), (x.detach() @ w.T)[None], atol=1e-5, rtol=1e-5)
    assert lin(torch.randn(0, 8)).shape == (0, 20)
