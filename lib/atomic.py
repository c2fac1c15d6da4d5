"""Crash-safe writes: write a temporary sibling, fsync, rename over the target.

A reader sees the old file or the new one, never a partial one. On macOS
fsync does not reach the platter; F_FULLFSYNC does, so it is used there.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def fsync_fd(fd: int) -> None:
    if sys.platform == "darwin":
        import fcntl

        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass
    os.fsync(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_path(path: os.PathLike | str) -> None:
    """fsync a file, or a folder (which makes a rename or a new entry in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_open(path: os.PathLike | str, mode: str = "w", **kw: Any) -> Iterator[Any]:
    """Open a temp file beside `path`; on clean exit fsync and rename it over `path`.

    On any exception the temp file is removed and `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; the result is an ordinary file
    try:
        with os.fdopen(fd, mode, **kw) as f:
            yield f
            f.flush()
            fsync_fd(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_bytes(path: os.PathLike | str, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_text(path: os.PathLike | str, text: str) -> None:
    with atomic_open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


def dumps_json(obj: Any) -> str:
    """The one JSON shape for files the project writes: sorted keys, 2-space indent."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


def write_json(path: os.PathLike | str, obj: Any) -> None:
    write_text(path, dumps_json(obj))


@contextmanager
def atomic_dir(path: os.PathLike | str) -> Iterator[Path]:
    """Build a directory under a temporary name, then swap it in for `path`.

    Yields the temporary directory. On clean exit the old `path` (if any) is
    moved aside, the new one renamed into place, and the old one removed; on
    any exception the temporary directory is removed and `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes 0700; the result is an ordinary folder
    try:
        yield tmp
        for child in tmp.rglob("*"):
            if child.is_file():
                fsync_path(child)
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old.{os.getpid()}"
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_path(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
