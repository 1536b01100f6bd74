import io

import pytest
import torch

from scratchlm.training import AdamW, CheckpointError, load_checkpoint, save_checkpoint
from scratchlm.training.checkpoint import atomic_torch_save, read_checkpoint


def _model_and_opt(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train_a_bit(model, opt, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.ones(2, 4)).pow(2).sum().backward()
        opt.step()


@pytest.mark.parametrize("to_file_object", [False, True])
def test_save_load_round_trip(tmp_path, to_file_object):
    model, opt = _model_and_opt(0)
    _train_a_bit(model, opt)
    target = io.BytesIO() if to_file_object else tmp_path / "c.pt"
    save_checkpoint(model, opt, 3, target)
    if to_file_object:
        target.seek(0)
    model2, opt2 = _model_and_opt(1)
    assert load_checkpoint(target, model2, opt2) == 3
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    _train_a_bit(model, opt, 1)
    _train_a_bit(model2, opt2, 1)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_atomic_write_leaves_no_temp_and_replaces(tmp_path):
    path = tmp_path / "sub" / "x.pt"
    atomic_torch_save({"a": 1}, path)
    atomic_torch_save({"a": 2}, path)
    assert torch.load(path)["a"] == 2
    assert [p.name for p in path.parent.iterdir()] == ["x.pt"]


def test_atomic_write_keeps_old_file_when_write_fails(tmp_path):
    path = tmp_path / "x.pt"
    atomic_torch_save({"a": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        atomic_torch_save({"a": Unpicklable()}, path)
    assert torch.load(path)["a"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["x.pt"]


def test_corrupt_checkpoints_get_clear_errors(tmp_path):
    model, opt = _model_and_opt(0)
    good = tmp_path / "good.pt"
    save_checkpoint(model, opt, 1, good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated.pt: not a readable checkpoint"):
        load_checkpoint(truncated, model, opt)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"this is not a checkpoint at all")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        read_checkpoint(garbage)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        read_checkpoint(empty)
    with pytest.raises(CheckpointError, match="not found"):
        read_checkpoint(tmp_path / "nope.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="expected a checkpoint dict"):
        read_checkpoint(tmp_path / "list.pt")
    torch.save({"model": {}}, tmp_path / "nostep.pt")
    with pytest.raises(CheckpointError, match=r"lacks \['step'\]"):
        load_checkpoint(tmp_path / "nostep.pt", model)


# --- crash safety: a real `kill -9` mid-run, then resume -----------------------------------------------------

KILL_SCRIPT = """
import sys
from scratchlm.training import TrainConfig
from scratchlm.training.trainer import Trainer

train, val, out = sys.argv[1:4]
cfg = TrainConfig(train_data=train, val_data=val, out_dir=out, batch_size=8, context_length=32, max_steps=100_000,
                  warmup_steps=2, lr=3e-3, min_lr=3e-4, eval_every=0, log_every=1, checkpoint_every=7,
                  progress=False, sample_tokens=0, seed=7, threads=1)
Trainer(cfg, {"d_model": 32, "n_layers": 2, "n_heads": 4, "rope_layout": "adjacent"}).train()
"""


def _logged_losses(path) -> dict[int, float]:
    import json

    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_kill_9_mid_run_then_resume_leaves_clean_files(data_dir, tmp_path, caplog):
    """SIGKILL a training process mid-run; the resumed run removes the orphan temp files of the checkpoint
    (and only those), logs every step exactly once and continues the killed run's loss curve bit for bit."""
    import json
    import logging
    import os
    import signal
    import subprocess
    import sys
    import time

    from scratchlm.training import TrainConfig
    from scratchlm.training.trainer import Trainer
    from tests.conftest import REPO_ROOT
    from tests.training.corpus import byte_corpus

    train, val = byte_corpus(data_dir, tmp_path / "corpus")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(train), str(val), str(out)], env=env,
                            stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.is_file() and max(_logged_losses(metrics), default=0) >= 24:
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"the training process ended early: {proc.stderr.read()}"
        os.kill(proc.pid, signal.SIGKILL)  # mid-run: steps are being logged, a checkpoint every 7 steps
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    before = _logged_losses(metrics)
    killed_at = max(before)
    ckpt_step = torch.load(out / "ckpt.pt", weights_only=True)["step"]
    assert ckpt_step % 7 == 0 and 21 <= ckpt_step <= killed_at
    # what an interrupted checkpoint write leaves behind, plus user files that merely look alike
    orphans = [out / "ckpt.pt.k3x_9q2z.tmp", out / "metrics.jsonl.abcdefgh.tmp"]
    keep = [out / "ckpt.pt.tmp", out / "ckpt.pt.mine.tmp", out / "notes.abcdefgh.tmp", out / "ckpt.pt.bak"]
    for p in orphans + keep:
        p.write_bytes(b"partial")

    stop = killed_at + 3
    cfg = TrainConfig(train_data=train, val_data=val, out_dir=out, batch_size=8, context_length=32,
                      max_steps=100_000, warmup_steps=2, lr=3e-3, min_lr=3e-4, eval_every=0, log_every=1,
                      checkpoint_every=7, progress=False, sample_tokens=0, seed=7, threads=1, resume=out / "ckpt.pt",
                      stop_at_step=stop)
    with caplog.at_level(logging.INFO, logger="scratchlm.training"):
        resumed = Trainer(cfg, {"d_model": 32, "n_layers": 2, "n_heads": 4, "rope_layout": "adjacent"}).train()
    assert resumed.final_step == stop
    assert not any(p.exists() for p in orphans)
    assert all(p.exists() for p in keep)
    assert sorted(p.name for p in out.glob("*.tmp")) == sorted(p.name for p in keep if p.suffix == ".tmp")
    removed = [r.getMessage() for r in caplog.records if "left by an interrupted write" in r.getMessage()]
    # the planted orphans, plus the killed run's own temp file when the kill landed inside a write
    assert all(any(str(p) in m for m in removed) for p in orphans), removed
    assert len(removed) <= len(orphans) + 1, removed
    if killed_at > ckpt_step:
        assert any(f"after step {ckpt_step}" in r.getMessage() for r in caplog.records)

    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, stop + 1))  # each step exactly once, in order
    after = _logged_losses(metrics)
    # the redone steps continue the killed run's curve bit for bit, and the earlier steps are untouched
    assert all(after[s] == before[s] for s in before), "the resumed run diverged from the killed one"
    assert resumed.losses == [after[s] for s in range(ckpt_step + 1, stop + 1)]
