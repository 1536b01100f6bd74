"""The hybrid under torchrun: two local ranks, and two "hosts" in network namespaces; both equal one rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--tokens", "20", "--blocks", "1", "--samples", "3", "--steps", "2", "--chunk-mib", "1", "--timeout", "30"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(n: int = 20, world: int = 2, blocks: int = 1, samples: int = 3, steps: int = 2) -> dict:
    """What `scratchlm.fold.run` computes, on one rank: the same seeds, the full z as the ranks' rows."""
    from scratchlm.fold.diffusion_head import DiffusionHead, DiffusionHeadConfig
    from scratchlm.fold.pairformer import Pairformer, PairformerConfig
    from scratchlm.fold.run import rank_rows

    cfg = PairformerConfig(n_blocks=blocks)
    torch.manual_seed(0)
    model = Pairformer(cfg).eval()
    head = DiffusionHead(DiffusionHeadConfig(steps=steps), cfg.c_s, cfg.c_z).eval()
    rows = n // world
    s = torch.randn(1, n, cfg.c_s, generator=torch.Generator().manual_seed(1))
    z = torch.cat([rank_rows(cfg, r, rows, n) for r in range(world)], dim=1)
    mask = torch.ones(1, n)
    with torch.no_grad():
        s_out, z_out = model(s, z, mask, torch.ones(1, n, n))
        x = head.sample(head.condition(s_out, head.pair_biases(z_out), mask), list(range(samples)), seed=0)
    return {"s": float(s_out.double().abs().sum()), "samples": float(x.double().abs().sum())}


def _check(report: dict) -> None:
    ref = _reference()
    assert report["world"] == 2 and report["samples"] == [3, 20, 3]
    assert all(r["comm_bytes"]["all_to_all"] > 0 for r in report["ranks"])
    for key in ("s", "samples"):
        assert report["checksum"][key] == pytest.approx(ref[key], rel=1e-5), key


@pytest.mark.distributed
def test_hybrid_under_torchrun_equals_one_rank():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_port()),
           "-m", "scratchlm.fold.run", *ARGS]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    _check(json.loads(out.stdout[out.stdout.index("{"):]))


@pytest.mark.distributed
def test_hybrid_across_two_namespaced_hosts_equals_one_rank():
    from tests.parallel.test_netns import NetnsUnavailable, network_namespaces, run_two_nodes, tx_bytes

    try:
        with network_namespaces() as hosts:
            before = [tx_bytes(hosts, i) for i in range(2)]
            report = run_two_nodes(hosts, ARGS, script=str(Path(__file__).with_name("netns_worker.py")))
            sent = [tx_bytes(hosts, i) - before[i] for i in range(2)]
    except NetnsUnavailable as e:
        pytest.skip(str(e))
    _check(report)
    assert {r["host"] for r in report["ranks"]} and min(sent) > 100_000, sent  # the pair shards crossed the veth
