"""Dynamic Axial Parallelism equals one rank, with real processes (gloo), and a dead rank fails fast."""

from __future__ import annotations

import os
import time

import pytest
import torch

from scratchlm.fold.dap import block_comm_bytes
from scratchlm.fold.diffusion_head import DiffusionHead, DiffusionHeadConfig
from scratchlm.fold.pairformer import Pairformer, PairformerConfig
from scratchlm.parallel.sequence import spawn_gloo

CFG = PairformerConfig(c_s=32, c_z=16, num_heads=4, pair_heads=2, pair_head_dim=8, n_blocks=2)
HEAD = DiffusionHeadConfig(c_token=16, n_layers=2, heads=2, steps=6)
K = 3  # diffusion samples: uneven over 2 and 4 ranks


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


def _head() -> DiffusionHead:
    torch.manual_seed(7)
    return DiffusionHead(HEAD, CFG.c_s, CFG.c_z).eval()


def _dap_worker(rank, world, n, pad, overlap, chunk):
    from scratchlm.fold.dap import DapComm, DapPairformer
    from scratchlm.fold.diffusion_head import condition_from_shards, sample_data_parallel

    comm = DapComm("cpu", timeout_s=30)
    dap = DapPairformer(_model(), comm, overlap=overlap, chunk_rows=chunk)
    s, z_rows, mask, pm_rows, pm_cols = dap.shard(*_inputs(n, pad=pad))
    s, z_rows = dap.forward_sharded(s, z_rows, mask, pm_rows, pm_cols)
    sent = {k: v for k, v in comm.bytes_sent.items() if v}
    with torch.no_grad():  # the hybrid: the K samples data-parallel over the trunk's ranks
        samples = sample_data_parallel(_head(), condition_from_shards(_head(), comm, s, z_rows, mask, n), K, comm)
    return s[:, :n], dap.gather_z(z_rows, n), sent, samples


def _check(world, n, pad, overlap, chunk):
    with torch.no_grad():
        s_ref, z_ref = _model()(*_inputs(n, pad=pad))
        head = _head()
        cond = head.condition(s_ref, head.pair_biases(z_ref), _inputs(n, pad=pad)[2])
        x_ref = head.sample(cond, list(range(K)))
    results = spawn_gloo(_dap_worker, world, n, pad, overlap, chunk, timeout=240)
    real = n - pad  # masked tokens' own outputs are don't-cares (a fully masked query row), as in Boltz
    s_ref, z_ref = s_ref[:, :real], z_ref[:, :real, :real]
    for s, z, sent, x in results:
        torch.testing.assert_close(x[:, :real], x_ref[:, :real], rtol=1e-5, atol=1e-5 * x_ref.abs().max().item())
        s, z = s[:, :real], z[:, :real, :real]
        torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5 * s_ref.abs().max().item())
        torch.testing.assert_close(z, z_ref, rtol=1e-5, atol=1e-5 * z_ref.abs().max().item())
        per_block = block_comm_bytes(CFG, n, world, overlap)  # the communication volume formula, exactly
        assert sent == {k: CFG.n_blocks * v for k, v in per_block.items()}


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
