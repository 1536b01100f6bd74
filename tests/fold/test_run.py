"""The hybrid under torchrun (two local ranks, gloo)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_hybrid_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_port()),
           "-m", "scratchlm.fold.run", "--tokens", "21", "--blocks", "1", "--samples", "3", "--steps", "2",
           "--chunk-mib", "1", "--timeout", "30"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout[out.stdout.index("{"):])
    assert report["world"] == 2 and report["samples"] == [3, 21, 3]
    assert all(r["comm_bytes"]["all_to_all"] > 0 for r in report["ranks"])
