"""scratchlm.atomic: whole-or-nothing replaces, the folder fsync'd after the rename, orphan clean-up by pattern."""

from __future__ import annotations

import os
import stat

import pytest

from scratchlm import atomic


def _record_fsyncs(monkeypatch) -> list[tuple[str, str]]:
    """Record (event, kind) for os.fsync (kind 'dir' or 'file') and os.replace, in call order."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", ""))
        return real_replace(a, b)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", replace)
    return events


def test_atomic_write_syncs_file_then_renames_then_syncs_folder(tmp_path, monkeypatch):
    events = _record_fsyncs(monkeypatch)
    path = atomic.write_text(tmp_path / "sub" / "a.txt", "héllo\n")
    assert path.read_text(encoding="utf-8") == "héllo\n"
    assert events == [("fsync", "file"), ("replace", ""), ("fsync", "dir")]
    assert [p.name for p in path.parent.iterdir()] == ["a.txt"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()  # not mkstemp's 0600


def test_replace_of_a_library_written_file_syncs_both(tmp_path, monkeypatch):
    tmp = tmp_path / "x.png.tmp"
    tmp.write_bytes(b"png")
    events = _record_fsyncs(monkeypatch)
    atomic.replace(tmp, tmp_path / "x.png")
    assert events == [("fsync", "file"), ("replace", ""), ("fsync", "dir")]
    assert (tmp_path / "x.png").read_bytes() == b"png" and not tmp.exists()


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = atomic.write_bytes(tmp_path / "a.bin", b"old")
    with pytest.raises(RuntimeError, match="boom"), atomic.atomic_write(path) as f:
        f.write(b"half of the new")
        raise RuntimeError("boom")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]


def test_orphans_are_exactly_the_temp_pattern(tmp_path):
    target = tmp_path / "ckpt.pt"
    real = atomic.temp_path(target)  # what an interrupted write leaves
    look_alike = ["ckpt.pt.tmp", "ckpt.pt.toolong123.tmp", "ckpt.pt.ABCDEFGH.tmp", "other.pt.abcdefgh.tmp",
                  "ckpt.pt.abcdefgh.tmp.bak", "ckpt.pt"]
    for name in look_alike:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "ckpt.pt.abcdefgh.tmp").mkdir()  # a folder is never removed
    assert atomic.orphan_temps(target) == [real]
    assert atomic.remove_orphan_temps(target) == [real]
    assert not real.exists() and all((tmp_path / n).exists() for n in look_alike)
    assert atomic.remove_orphan_temps(tmp_path / "missing" / "ckpt.pt") == []


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m
