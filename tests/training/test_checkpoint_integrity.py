"""Checkpoint integrity (issue 30 item 6): per-tensor checksums verified on resume and on model load, and a
full disk during a checkpoint write.

The corruption oracle is independent of the code under test: the file is edited in place through the zip
container's own layout (`zipfile` finds each record's offset; the tensor's bytes are found in it by content), as a
failing disk or a stray write would, and the checkpoint must then be refused naming the tensor and the file.

The full disk: a test cannot fill the real disk, and a small tmpfs needs root. Two faithful substitutes:
- ``RLIMIT_FSIZE`` in a child process (``SIGXFSZ`` ignored, as a shell's ``ulimit -f`` does): the kernel fails
  the checkpoint's ``write(2)`` partway with ``EFBIG``, exactly where a full disk fails it with ``ENOSPC``, through
  the real `scratchlm train` command, torch's zip writer and `scratchlm.atomic`;
- ``ENOSPC`` itself, raised by the file object torch writes into (a wrapper whose ``write`` fails after N bytes,
  as the OS's would): torch wraps it into "unexpected pos ...", which is what the issue saw, and the writer must
  still say that the disk is full.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import resource
import signal
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from scratchlm.atomic import DiskFullError, atomic_write
from scratchlm.model import load
from scratchlm.training import CheckpointError, TrainConfig
from scratchlm.training.checkpoint import atomic_torch_save, read_checkpoint
from scratchlm.training.trainer import Trainer
from tests.conftest import REPO_ROOT

from .corpus import byte_corpus

TINY_MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 4, "rope_layout": "adjacent"}


@pytest.fixture(scope="module")
def corpus(data_dir, tmp_path_factory):
    return byte_corpus(data_dir, tmp_path_factory.mktemp("corpus"), train_bytes=20_000, val_bytes=2_000)


def tiny_config(corpus, out_dir, **kw) -> TrainConfig:
    train, val = corpus
    base = dict(train_data=train, val_data=val, out_dir=out_dir, batch_size=4, context_length=16, max_steps=4,
                warmup_steps=1, eval_every=0, log_every=1, checkpoint_every=0, progress=False, sample_tokens=0,
                seed=3, threads=1)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def checkpoint(corpus, tmp_path_factory) -> Path:
    """A real training checkpoint (step 2 of 4), written by the trainer."""
    out = tmp_path_factory.mktemp("run")
    result = Trainer(tiny_config(corpus, out, stop_at_step=2), TINY_MODEL).train()
    return result.checkpoint


# --- editing a torch file through its zip layout (the oracle) -------------------------------------------------------

def _record_spans(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (offset of the data in the file, size) of every record of the (uncompressed) torch zip file."""
    spans = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            assert info.compress_type == zipfile.ZIP_STORED
            f.seek(info.header_offset)
            header = f.read(30)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            spans[info.filename] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    return spans


def _offset_of(path: Path, data: bytes, records: str = "/data/") -> int:
    """File offset of `data` inside one of the records whose name contains `records`."""
    raw = path.read_bytes()
    for name, (start, size) in _record_spans(path).items():
        if records in name:
            at = raw[start:start + size].find(data)
            if at >= 0:
                return start + at
    raise AssertionError(f"{data[:16]!r}... not found in {path}")


def _copy(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst


def _patch(path: Path, offset: int, new: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(new)


def _tensor_bytes(path: Path, *keys: str) -> bytes:
    obj = torch.load(path, weights_only=True)
    for k in keys:
        obj = obj[k]
    return obj.contiguous().view(torch.uint8).numpy().tobytes()


# --- checksums ----------------------------------------------------------------------------------------------------

def test_trainer_checkpoints_carry_checksums_and_resume_verifies_them(checkpoint, corpus, tmp_path, caplog):
    ckpt = torch.load(checkpoint, weights_only=True)
    sums = ckpt["checksums"]
    assert sums["algorithm"] == "crc32" and ckpt["version"] == 2
    assert "model/layers.0.attn.q_proj.weight" in sums["tensors"] and "optimizer/state/0/exp_avg" in sums["tensors"]
    assert "rng/torch" in sums["tensors"]
    with caplog.at_level(logging.WARNING):
        second = Trainer(tiny_config(corpus, tmp_path / "r", resume=checkpoint), TINY_MODEL).train()
    assert second.final_step == 4 and "unverified" not in caplog.text


@pytest.mark.parametrize("keys", [("model", "layers.0.attn.q_proj.weight"), ("optimizer", "state", 0, "exp_avg")],
                         ids=["model", "optimizer"])
@pytest.mark.parametrize("damage", ["nan", "bitflip"])
def test_a_corrupt_tensor_is_refused_naming_it(checkpoint, corpus, tmp_path, keys, damage):
    bad = _copy(checkpoint, tmp_path / "bad.pt")
    data = _tensor_bytes(checkpoint, *keys)
    at = _offset_of(bad, data) + 4 * 5  # the sixth float32
    if damage == "nan":
        _patch(bad, at, struct.pack("<f", math.nan))
    else:
        (byte,) = bad.read_bytes()[at + 1:at + 2]
        _patch(bad, at + 1, bytes([byte ^ 0x08]))  # one bit of the mantissa
    name = "/".join(map(str, keys))
    expected = rf"{bad}: corrupt checkpoint .*tensor '{name}' does not match its checksum"
    with pytest.raises(CheckpointError, match=expected):
        Trainer(tiny_config(corpus, tmp_path / "r", resume=bad), TINY_MODEL)
    if keys[0] == "model":  # serving the checkpoint reads the model's tensors: refused too
        with pytest.raises(CheckpointError, match=expected):
            load(bad)
    else:  # the model loader does not read the optimizer state, so it need not verify it
        load(bad)


def test_corrupt_non_tensor_content_is_refused(checkpoint, tmp_path):
    """One bit of the non-tensor content (the pickled ``elapsed_s`` float) changes a value, and the pickle stays
    valid: torch reads it happily; the checksum of the non-tensor content refuses it."""
    bad = _copy(checkpoint, tmp_path / "bad.pt")
    spans = _record_spans(bad)
    (pkl,) = [n for n in spans if n.endswith("/data.pkl")]
    start, size = spans[pkl]
    pickled = bad.read_bytes()[start:start + size]
    key = b"X\x09\x00\x00\x00elapsed_s"  # BINUNICODE 'elapsed_s' (protocol 2)
    at = pickled.index(key) + len(key)
    at += {ord("q"): 2, ord("r"): 5}.get(pickled[at], 0)  # BINPUT / LONG_BINPUT: the string memoized
    assert pickled[at:at + 1] == b"G"  # BINFLOAT: 8 bytes, big-endian
    last = start + at + 8
    _patch(bad, last, bytes([pickled[at + 8] ^ 0x01]))  # the lowest bit of the mantissa
    assert torch.load(bad, weights_only=True)["elapsed_s"] != torch.load(checkpoint, weights_only=True)["elapsed_s"]
    with pytest.raises(CheckpointError, match=rf"{bad}: corrupt checkpoint .*non-tensor content"):
        read_checkpoint(bad)


def test_a_checkpoint_without_checksums_still_resumes_unverified(checkpoint, corpus, tmp_path, caplog):
    old = torch.load(checkpoint, weights_only=True)
    del old["checksums"]
    old["version"] = 1
    torch.save(old, tmp_path / "old.pt")
    with caplog.at_level(logging.WARNING):
        result = Trainer(tiny_config(corpus, tmp_path / "r", resume=tmp_path / "old.pt"), TINY_MODEL).train()
    assert result.final_step == 4
    assert f"{tmp_path / 'old.pt'}: checkpoint has no per-tensor checksums" in caplog.text
    assert "loaded unverified" in caplog.text


# --- a full disk ---------------------------------------------------------------------------------------------------

class _FullDisk:
    """A binary file whose device fills up after `room` bytes: ``write`` then fails with ENOSPC, as the OS's does."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data) -> int:
        n = len(memoryview(data).cast("B"))
        if n > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= n
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def test_enospc_during_torch_save_says_the_disk_is_full(tmp_path):
    path = tmp_path / "ckpt.pt"
    atomic_torch_save({"step": 1, "w": torch.zeros(10)}, path)
    before = path.read_bytes()
    big = {"step": 2, "w": torch.randn(50_000)}
    with pytest.raises(DiskFullError) as info, atomic_write(path, "wb") as f:
        torch.save(big, _FullDisk(f, room=20_000))
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    message = str(info.value)
    assert message.startswith(f"{path}: could not write the file: the disk is full (no space left on the device)")
    assert "The previous ckpt.pt is unchanged" in message and "unexpected pos" not in message
    assert isinstance(info.value.__cause__, RuntimeError)  # torch's "unexpected pos", kept as the cause
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def _limit_file_size(limit: int):
    def set_limit() -> None:  # in the child, before exec: `ulimit -f`, with SIGXFSZ ignored so write(2) says EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return set_limit


def test_full_disk_during_training_keeps_the_last_checkpoint(checkpoint, corpus, tmp_path):
    """`scratchlm train` resumes from step 2 with a file-size limit below the checkpoint's size: the end-of-run
    write fails; the command says so in one line naming the file, exits 1, and leaves the step-2 checkpoint
    intact with no temporary file."""
    train, val = corpus
    out = tmp_path / "out"
    out.mkdir()
    ckpt = _copy(checkpoint, out / "ckpt.pt")  # written at step 2 by the trainer (the fixture)
    before = ckpt.read_bytes()
    config = tmp_path / "run.toml"
    config.write_text(f'train_data = "{train}"\nval_data = "{val}"\nout_dir = "{out}"\nresume = "{ckpt}"\n'
                      "batch_size = 4\ncontext_length = 16\nmax_steps = 4\nwarmup_steps = 1\neval_every = 0\n"
                      "checkpoint_every = 0\nsample_tokens = 0\nseed = 3\nthreads = 1\nprogress = false\n"
                      '[model]\nd_model = 32\nn_layers = 2\nn_heads = 4\nrope_layout = "adjacent"\n')
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-m", "scratchlm", "train", "--config", str(config)], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=180,
                          preexec_fn=_limit_file_size(len(before) // 2))
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = f"scratchlm train: error: {ckpt}: could not write the file: the file size limit was reached"
    assert line in proc.stderr, proc.stderr[-3000:]
    assert "The previous ckpt.pt is unchanged and the partial temporary file was removed" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert ckpt.read_bytes() == before and read_checkpoint(ckpt)["step"] == 2
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
