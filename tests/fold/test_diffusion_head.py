"""The diffusion head: EDM preconditioning limits, the schedule, and per-sample determinism (what DP relies on)."""

from __future__ import annotations

import pytest
import torch

from scratchlm.fold.diffusion_head import DiffusionHead, DiffusionHeadConfig

CFG = DiffusionHeadConfig(c_token=16, n_layers=2, heads=2, steps=5)


def _cond(head, n=7, c_s=24, c_z=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(1, n, c_s, generator=g)
    z = torch.randn(1, n, n, c_z, generator=g)
    mask = torch.ones(1, n)
    mask[0, -1] = 0
    return head.condition(s, head.pair_biases(z), mask)


def test_schedule_is_karras_and_ends_at_zero():
    sig = CFG.schedule()
    assert len(sig) == CFG.steps + 1 and sig[-1] == 0.0
    assert sig[0] == pytest.approx(CFG.sigma_max) and sig[-2] == pytest.approx(CFG.sigma_min)
    assert all(a > b for a, b in zip(sig, sig[1:]))
    with pytest.raises(ValueError, match="sigma_min"):
        DiffusionHeadConfig(sigma_min=2.0, sigma_max=1.0)


def test_denoiser_preconditioning_limits():
    torch.manual_seed(0)
    head = DiffusionHead(CFG, 24, 8).eval()
    cond = _cond(head)
    x = torch.randn(2, 7, 3)
    with torch.no_grad():  # sigma -> 0: D(x) -> x (c_skip -> 1, c_out -> 0)
        torch.testing.assert_close(head.denoise(x, 1e-6, cond), x, atol=1e-4, rtol=0)


def test_samples_depend_only_on_their_index():
    torch.manual_seed(0)
    head = DiffusionHead(CFG, 24, 8).eval()
    cond = _cond(head)
    together = head.sample(cond, [0, 1, 2, 3], seed=5)
    apart = torch.cat([head.sample(cond, [0, 1], seed=5), head.sample(cond, [2], seed=5),
                       head.sample(cond, [3], seed=5)])
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-4)
    assert together.shape == (4, 7, 3) and torch.isfinite(together).all()
    assert not torch.allclose(together[0], together[1])  # different noise, different structures
    assert head.sample(cond, [], seed=5).shape == (0, 7, 3)
