"""Crash-safe writes: a temporary sibling, fsynced, renamed over the target. A reader, or a writer killed
at any point (SIGKILL included), sees the old file or the new one, never a partial one. macOS gets
F_FULLFSYNC (its fsync does not reach the platter). Example: `atomic.write_json("runs/x/a.json", obj)`;
`with atomic.atomic_dir("datasets/d") as tmp:` builds a folder that swaps in whole or not at all.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path


def fsync_fd(fd: int) -> None:
    if sys.platform != "darwin":
        return os.fsync(fd)
    try:
        fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
    except OSError:  # a filesystem that refuses it (some network mounts): plain fsync
        os.fsync(fd)


def fsync_path(path: os.PathLike | str) -> None:
    """fsync a file, or a folder (which makes a rename or a new entry in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


def _sibling(path: Path) -> Path:
    """A new temporary name beside path (created by the caller with O_EXCL: the umask applies as usual)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"


@contextmanager
def atomic_open(path: os.PathLike | str, mode: str = "w", **kw):
    """A temp file beside `path`, renamed over it on a clean exit; on an exception `path` is untouched."""
    path = Path(path)
    fd = os.open(tmp := _sibling(path), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, mode, **kw) as f:
            yield f
            f.flush()
            fsync_fd(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes(path: os.PathLike | str, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_text(path: os.PathLike | str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def dumps_json(obj: object) -> str:
    """The one JSON shape for files the project writes: sorted keys, 2-space indent."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


def write_json(path: os.PathLike | str, obj: object) -> None:
    write_text(path, dumps_json(obj))


@contextmanager
def atomic_dir(path: os.PathLike | str):
    """A temp folder that replaces `path` on a clean exit; on an exception `path` is untouched."""
    path = Path(path)
    (tmp := _sibling(path)).mkdir()
    try:
        yield tmp
        for child in (c for c in tmp.rglob("*") if c.is_file()):
            fsync_path(child)
        old = path.parent / f".{path.name}.old.{os.getpid()}"
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_path(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
