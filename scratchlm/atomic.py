"""Atomic, crash-safe file writes: every file scratchlm writes for later reading goes through here.

The policy (what survives a `kill -9` or a power cut at any instant):

1. the data is written to a temp file *in the target's folder* named ``<name>.<8 random chars>.tmp``
   (`tempfile.mkstemp`), flushed and ``fsync``'d;
2. ``os.replace(tmp, target)`` swaps it in: a reader sees the old file or the new one, never a mix;
3. the folder is ``fsync``'d, so that the rename itself is on disk (without it, a crash just after the
   replace can bring back the old file, or on some file systems an empty one);
4. on an error the temp file is removed; after a crash it stays behind as an *orphan*, which the
   owner removes on its next start with :func:`remove_orphan_temps` (only names of exactly the
   pattern above, so that no user file is ever touched);
5. running out of space (``ENOSPC``, ``EDQUOT``, or ``EFBIG`` from a file-size limit) mid-write raises
   :class:`DiskFullError`, an ``OSError`` whose message names the target, says the disk is full and how much was
   written, and that the previous file is intact: no "unexpected pos" from a library that wrapped the error
   (torch does), found by walking the exception's ``__cause__`` / ``__context__`` chain.

Use :func:`atomic_write` (a context manager that yields the open temp file) where the caller writes
into a file object, and :func:`replace` where a library insists on writing to a path itself.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

TMP_SUFFIX = ".tmp"

_OUT_OF_SPACE = {
    errno.ENOSPC: "the disk is full (no space left on the device)",
    errno.EDQUOT: "the disk is full for this user (disk quota exceeded)",
    errno.EFBIG: "the file size limit was reached (ulimit -f / RLIMIT_FSIZE, or the file system's largest file)",
}


class DiskFullError(OSError):
    """Writing a file ran out of space (``ENOSPC`` / ``EDQUOT``) or hit a file-size limit (``EFBIG``); the target's
    previous content is intact and the partial temp file was removed. ``errno`` and ``filename`` are set."""

    def __str__(self) -> str:
        return str(self.strerror)


def out_of_space(exc: BaseException) -> OSError | None:
    """The ``ENOSPC`` / ``EDQUOT`` / ``EFBIG`` OSError behind `exc` (itself, or in its cause/context chain), if any."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _OUT_OF_SPACE:
            return e
        e = e.__cause__ or e.__context__
    return None


def _disk_full_error(path: Path, cause: OSError, written: int) -> DiskFullError:
    import shutil

    free = ""
    with contextlib.suppress(OSError):
        free = f", {shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free now"
    kept = f"The previous {path.name} is unchanged" if path.exists() else f"{path.name} was not created"
    message = (f"{path}: could not write the file: {_OUT_OF_SPACE[cause.errno]}; {written / 2**20:.1f} MiB were "
               f"written before it failed{free}. {kept} and the partial temporary file was removed: free some "
               "space (or raise the limit) and retry")
    err = DiskFullError(cause.errno, message)
    err.filename = str(path)
    return err


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make the entries of `folder` (renames, creations) durable; a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # e.g. Windows: a folder cannot be opened, and NTFS orders the metadata itself
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems (e.g. certain FUSE/network mounts) refuse fsync on a folder
        pass
    finally:
        os.close(fd)


def replace(tmp: str | os.PathLike, path: str | os.PathLike, sync_file: bool = True) -> Path:
    """fsync `tmp` (unless `sync_file` is False: the caller did), ``os.replace(tmp, path)``, then fsync
    `path`'s folder so the rename survives a crash."""
    path = Path(path)
    if sync_file:
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent if str(path.parent) else ".")
    return path


def temp_path(path: str | os.PathLike) -> Path:
    """A fresh, empty temp file next to `path` (``<name>.<random>.tmp``) with the usual permissions."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=TMP_SUFFIX, dir=path.parent)
    os.close(fd)
    _default_permissions(tmp)
    return Path(tmp)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", encoding: str | None = None) -> Iterator[IO]:
    """``with atomic_write(path) as f: f.write(...)``: `path` gets the whole new content or keeps its old one.

    `mode` is ``"wb"`` or ``"w"`` (text, `encoding` default UTF-8). The folder is created if missing."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write mode must be 'wb' or 'w', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=TMP_SUFFIX, dir=path.parent)
    try:
        kwargs = {"encoding": encoding or "utf-8", "newline": ""} if mode == "w" else {}
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        _default_permissions(tmp)
        replace(tmp, path, sync_file=False)
    except BaseException as e:
        written = _size(tmp)
        Path(tmp).unlink(missing_ok=True)
        full = out_of_space(e)
        if full is not None and not isinstance(e, DiskFullError):
            raise _disk_full_error(path, full, written) from e
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Atomically replace `path`'s content with `data`."""
    with atomic_write(path, "wb") as f:
        f.write(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Atomically replace `path`'s content with `text`."""
    with atomic_write(path, "w", encoding) as f:
        f.write(text)
    return Path(path)


def orphan_temps(path: str | os.PathLike) -> list[Path]:
    """Temp files that an interrupted atomic write of `path` left behind (exactly ``<name>.<8 chars>.tmp``)."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        return []
    # mkstemp's random part: 8 characters of [a-z0-9_] (tempfile._RandomNameSequence)
    pattern = re.compile(re.escape(path.name) + r"\.[a-z0-9_]{8}" + re.escape(TMP_SUFFIX))
    return sorted(p for p in folder.iterdir() if pattern.fullmatch(p.name) and p.is_file())


def remove_orphan_temps(path: str | os.PathLike) -> list[Path]:
    """Delete :func:`orphan_temps` of `path`; returns what was removed (call it where no other writer of
    `path` can be running, e.g. at the start of the run that owns the file)."""
    removed = []
    for p in orphan_temps(path):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed.append(p)
    return removed


def _size(path: str | os.PathLike) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _default_permissions(tmp: str | os.PathLike) -> None:
    """mkstemp creates 0600; give the file what a plain ``open(path, "w")`` would (0666 minus the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
