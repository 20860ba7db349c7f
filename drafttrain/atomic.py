"""Atomic writes: a reader sees the old file or folder, or the complete new one, never half of one.

Everything is first written under a temporary name in the destination's own folder (same file
system, so the final rename is atomic), flushed to disk (``fsync``), then renamed into place with
``os.replace``; the folder's entry is fsynced after the rename. A crash or an exception leaves the
destination as it was and removes the temporary.

* `atomic_path(path)`: yields a temporary path; the caller writes it any way it likes
  (``safetensors.save_file``, ``torch.save``, ``open``); on a clean exit it becomes ``path``.
* `write_atomic(path, data)`: text or bytes, in one call.
* `atomic_dir(folder)`: yields a temporary folder; on a clean exit it becomes ``folder``. An
  existing folder is replaced (moved aside, then deleted), or, with ``keep_existing=True``, kept:
  the right choice for caches written by several processes at once, whose entries are equal.

Deliberately not here: locking, and deciding whether to write at all (callers check for a finished
entry first). A leaf: it imports nothing of ours.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_dir", "atomic_path", "write_atomic"]


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Persist a folder's entries (a rename into it); a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync_file(Path(folder) / name)
        _fsync_dir(Path(folder))


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Context manager: a temporary path beside ``path`` that replaces it on a clean exit.

    The temporary is not created: the caller writes it (with the process umask, as a plain write
    would). If the body raises, or leaves nothing at the temporary path, ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        if tmp.exists():
            _fsync_file(tmp)
            os.replace(tmp, path)
            _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: str | os.PathLike, data: str | bytes, *, encoding: str = "utf-8") -> Path:
    """Write ``data`` (text or bytes) to ``path`` atomically; returns ``path`` as a Path."""
    with atomic_path(path) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding=encoding)
    return Path(path)


@contextmanager
def atomic_dir(folder: str | os.PathLike, *, keep_existing: bool = False) -> Iterator[Path]:
    """Context manager: a temporary folder beside ``folder`` that becomes ``folder`` on a clean exit.

    Args:
        folder: the destination.
        keep_existing: when ``folder`` exists by the time the write is done (another process
            finished the same entry first), keep it and drop this one. Default: replace it.

    If the body raises, the temporary folder is removed and ``folder`` is untouched.
    """
    final = Path(folder)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        if keep_existing:
            try:
                os.rename(tmp, final)  # fails on a non-empty folder: someone else's finished entry
            except OSError:
                if not final.exists():
                    raise
        else:
            _replace_dir(tmp, final)
        _fsync_dir(final.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # already gone after a successful rename


def _replace_dir(tmp: Path, final: Path) -> None:
    """Put ``tmp`` at ``final``; an existing ``final`` is moved aside first and deleted after."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
