"""Dynamic Axial Parallelism equals one rank, with real processes (gloo), and a dead rank fails fast."""

from __future__ import annotations

import os
import time

import pytest
import torch

from scratchlm.fold.pairformer import Pairformer, PairformerConfig
from scratchlm.parallel.sequence import spawn_gloo

CFG = PairformerConfig(c_s=32, c_z=16, num_heads=4, pair_heads=2, pair_head_dim=8, n_blocks=2)


def _model(seed: int = 0) -> Pairformer:
    torch.manual_seed(seed)
    model = Pairformer(CFG).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # non-trivial norms and gains everywhere
            p.add_(torch.randn(p.shape, generator=g) * (0.05 if p.ndim > 1 else 0.1))
    return model


def _inputs(n: int, seed: int = 1, pad: int = 0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(1, n, CFG.c_s, generator=g)
    z = torch.randn(1, n, n, CFG.c_z, generator=g)
    mask = torch.ones(1, n)
    if pad:
        mask[:, -pad:] = 0.0  # padded tokens of the complex
    pm = mask[:, :, None] * mask[:, None, :]
    return s, z, mask, pm


def _dap_worker(rank, world, n, pad, overlap, chunk):
    from scratchlm.fold.dap import DapComm, DapPairformer

    comm = DapComm("cpu", timeout_s=30)
    dap = DapPairformer(_model(), comm, overlap=overlap, chunk_rows=chunk)
    s, z = dap(*_inputs(n, pad=pad))
    return s, z, dict(comm.bytes_sent)


def _check(world, n, pad, overlap, chunk):
    with torch.no_grad():
        s_ref, z_ref = _model()(*_inputs(n, pad=pad))
    results = spawn_gloo(_dap_worker, world, n, pad, overlap, chunk, timeout=240)
    real = n - pad  # masked tokens' own outputs are don't-cares (a fully masked query row), as in Boltz
    s_ref, z_ref = s_ref[:, :real], z_ref[:, :real, :real]
    for s, z, sent in results:
        s, z = s[:, :real], z[:, :real, :real]
        torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5 * s_ref.abs().max().item())
        torch.testing.assert_close(z, z_ref, rtol=1e-5, atol=1e-5 * z_ref.abs().max().item())
        assert sent["all_to_all"] > 0 and (sent.get("ring_post", 0) > 0) == overlap


def test_dap_two_ranks_uneven_padded_equals_one_rank():
    """P=2, N=11 (not divisible by 2) with two padded tokens, async ring, chunked attention."""
    _check(2, 11, pad=2, overlap=True, chunk=3)


@pytest.mark.distributed
@pytest.mark.parametrize("overlap", [True, False])
def test_dap_four_ranks_equals_one_rank(overlap):
    _check(4, 10, pad=1, overlap=overlap, chunk=None)


@pytest.mark.distributed
def test_dap_two_ranks_blocking_divisible():
    _check(2, 8, pad=0, overlap=False, chunk=None)


def _dead_worker(rank, world):
    from scratchlm.fold.dap import DapComm, DapPairformer

    comm = DapComm("cpu", timeout_s=20)
    dap = DapPairformer(_model(), comm)
    if rank == 1:
        os._exit(3)  # dies without a word, as a crashed or killed rank would
    return dap(*_inputs(8))


def test_dead_rank_fails_within_60_s():
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 failed"):
        spawn_gloo(_dead_worker, 2, timeout=90)
    assert time.monotonic() - t < 60
