"""The Pairformer block and stack against Boltz-2's PairformerLayer (the oracle), and chunking exactness."""

from __future__ import annotations

import pytest
import torch

from scratchlm.fold.pairformer import (
    Pairformer,
    PairformerBlock,
    PairformerConfig,
    chunk_size_for_budget,
    chunk_transient_bytes,
    load_boltz_state_dict,
)

try:
    from boltz.model.layers.pairformer import PairformerLayer, PairformerModule
except ImportError as e:  # pragma: no cover - the venv installs boltz==2.2.1 --no-deps
    PairformerLayer = PairformerModule = None
    BOLTZ_ERROR = str(e)
else:
    BOLTZ_ERROR = ""

needs_boltz = pytest.mark.skipif(PairformerLayer is None, reason=f"boltz==2.2.1 cannot be imported: {BOLTZ_ERROR}")

CFG = PairformerConfig(c_s=64, c_z=32, num_heads=4, pair_heads=4, pair_head_dim=8, n_blocks=4)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Non-trivial weights everywhere (Boltz zero-inits its output projections, which would hide mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim > 1 else 0.1) + (1.0 if p.ndim == 1 else 0.0))


def _inputs(n: int, seed: int, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(batch, n, CFG.c_s, generator=g)
    z = torch.randn(batch, n, n, CFG.c_z, generator=g)
    mask = (torch.rand(batch, n, generator=g) > 0.2).float()
    mask[:, 0] = 1.0
    pair_mask = mask[:, :, None] * mask[:, None, :]
    pair_mask[0, 1, 2] = 0.0  # a pair mask that is not an outer product
    return s, z, mask, pair_mask


@needs_boltz
def test_block_matches_boltz():
    ref = PairformerLayer(CFG.c_s, CFG.c_z, CFG.num_heads, pairwise_head_width=CFG.pair_head_dim,
                          pairwise_num_heads=CFG.pair_heads, v2=True).eval()
    _randomize(ref, 0)
    ours = PairformerBlock(CFG).eval()
    load_boltz_state_dict(ours, ref.state_dict())
    s, z, mask, pair_mask = _inputs(11, 1)
    with torch.no_grad():
        s_ref, z_ref = ref(s, z, mask, pair_mask)
        s_out, z_out = ours(s, z, mask, pair_mask)
        s_chk, z_chk = ours(s, z, mask, pair_mask, chunk_rows=3)
    assert (s_out - s_ref).abs().max() <= 1e-4
    assert (z_out - z_ref).abs().max() <= 1e-4
    assert (s_chk - s_out).abs().max() <= 1e-5 and (z_chk - z_out).abs().max() <= 1e-5


@needs_boltz
def test_stack_of_four_matches_boltz():
    ref = PairformerModule(CFG.c_s, CFG.c_z, num_blocks=4, num_heads=CFG.num_heads,
                           pairwise_head_width=CFG.pair_head_dim, pairwise_num_heads=CFG.pair_heads, v2=True).eval()
    _randomize(ref, 2)
    with torch.no_grad():  # keep activations O(1) over 4 blocks of random weights
        for p in ref.parameters():
            if p.ndim > 1:
                p.mul_(0.5)
    ours = Pairformer(CFG).eval()
    load_boltz_state_dict(ours, ref.state_dict())
    s, z, mask, pair_mask = _inputs(9, 3)
    with torch.no_grad():
        s_ref, z_ref = ref(s, z, mask, pair_mask)  # Boltz chunks its triangle attention at 512 in eval
        s_out, z_out = ours(s, z, mask, pair_mask)
    scale = max(1.0, z_ref.abs().max().item(), s_ref.abs().max().item())
    assert (s_out - s_ref).abs().max() <= 1e-4 * scale, ((s_out - s_ref).abs().max(), scale)
    assert (z_out - z_ref).abs().max() <= 1e-4 * scale, ((z_out - z_ref).abs().max(), scale)


@needs_boltz
def test_loader_names_missing_keys():
    ref = PairformerLayer(CFG.c_s, CFG.c_z, CFG.num_heads, pairwise_head_width=CFG.pair_head_dim,
                          pairwise_num_heads=CFG.pair_heads, v2=True)
    sd = ref.state_dict()
    del sd["tri_mul_in.p_in.weight"]
    with pytest.raises(KeyError, match="tri_mul_in.p_in.weight"):
        load_boltz_state_dict(PairformerBlock(CFG), sd)
    with pytest.raises(ValueError, match="shape"):
        load_boltz_state_dict(PairformerBlock(PairformerConfig(c_s=64, c_z=16, num_heads=4, pair_head_dim=8)),
                              ref.state_dict())


def test_chunked_equals_unchunked():
    torch.manual_seed(0)
    model = Pairformer(PairformerConfig(c_s=32, c_z=16, num_heads=4, pair_heads=2, pair_head_dim=8, n_blocks=2))
    _randomize(model, 5)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(0.4)
    s = torch.randn(1, 13, 32)
    z = torch.randn(1, 13, 13, 16)
    mask = torch.ones(1, 13)
    mask[0, -2:] = 0
    pm = mask[:, :, None] * mask[:, None, :]
    with torch.no_grad():
        full = model(s, z, mask, pm)
        for chunk in (1, 4, 12):
            part = model(s, z, mask, pm, chunk_rows=chunk)
            torch.testing.assert_close(part[0], full[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(part[1], full[1], rtol=1e-5, atol=1e-5)


def test_chunk_size_for_budget():
    cfg = PairformerConfig()
    n = 512
    c = chunk_size_for_budget(cfg, n, 64 * 2**20)
    assert chunk_transient_bytes(cfg, n, c) <= 64 * 2**20 < chunk_transient_bytes(cfg, n, c + 1)
    assert chunk_size_for_budget(cfg, n, 1) == 1
    assert chunk_size_for_budget(cfg, n, 2**40) == n
    with pytest.raises(ValueError, match="positive"):
        chunk_size_for_budget(cfg, n, 0)
