"""Data parallelism with real processes: `torchrun --nproc-per-node 2` on CPU (gloo) reproduces the
single-process loss curve at the same global batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .corpus import byte_corpus

REPO = Path(__file__).resolve().parents[2]


def _args(train, val, out, **over):
    flags = {"train-data": train, "val-data": val, "out-dir": out, "batch-size": 8, "context-length": 32,
             "max-steps": 8, "warmup-steps": 2, "lr": 3e-3, "eval-every": 4, "eval-tokens": 2048, "log-every": 1,
             "checkpoint-every": 0, "sample-tokens": 0, "threads": 1, "seed": 3, "model-d-model": 32,
             "model-n-layers": 2, "model-n-heads": 4, **over}
    return [x for k, v in flags.items() for x in (f"--{k}", str(v))] + ["--no-progress"]


def _records(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.distributed
def test_two_processes_reproduce_single_process_curve(data_dir, tmp_path):
    train, val = byte_corpus(data_dir, tmp_path / "data")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    single = subprocess.run([sys.executable, "-m", "scratchlm", "train", *_args(train, val, tmp_path / "one")],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    multi = subprocess.run([*torchrun, "-m", "scratchlm", "train", *_args(train, val, tmp_path / "two")],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert multi.returncode == 0, multi.stderr[-3000:]
    assert "2 process(es)" in multi.stderr
    one, two = _records(tmp_path / "one"), _records(tmp_path / "two")
    loss1 = [r["loss"] for r in one if "loss" in r]
    loss2 = [r["loss"] for r in two if "loss" in r]
    assert len(loss1) == len(loss2) == 8
    np.testing.assert_allclose(loss2, loss1, rtol=1e-5, atol=1e-5)
    val1 = [r["val_loss"] for r in one if "val_loss" in r]
    val2 = [r["val_loss"] for r in two if "val_loss" in r]
    assert len(val1) == len(val2) == 2
    np.testing.assert_allclose(val2, val1, rtol=1e-5, atol=1e-5)
    # the loss curve moved: this is a real run, not two copies of the initial loss
    assert loss1[-1] < loss1[0] - 0.3
