"""Content hashes: files, trees of files, and the manifests built from them."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

CHUNK = 1 << 20


def sha256_file(path: os.PathLike | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def iter_files(root: os.PathLike | str, parts: Iterable[str]) -> list[str]:
    """Sorted relative paths of the regular files under root/part for each part
    (a part may be a file or a folder); caches and hidden files are skipped."""
    root = Path(root)
    out = []
    for part in parts:
        p = root / part
        if p.is_file():
            out.append(part)
        elif p.is_dir():
            for f in p.rglob("*"):
                r = f.relative_to(root)
                if any(s.startswith(".") or s == "__pycache__" for s in r.parts):
                    continue
                if f.is_file():
                    out.append(r.as_posix())
    return sorted(set(out))


def tree_hashes(root: os.PathLike | str, parts: Iterable[str]) -> dict[str, str]:
    """{relative path: sha256} for every file under the given parts."""
    root = Path(root)
    return {r: sha256_file(root / r) for r in iter_files(root, parts)}


def digest_of(hashes: dict[str, str]) -> str:
    """One sha256 over a {path: sha256} map, independent of dict order."""
    h = hashlib.sha256()
    for path in sorted(hashes):
        h.update(f"{hashes[path]}  {path}\n".encode())
    return h.hexdigest()


class HashCache:
    """sha256 of files, remembered by (size, mtime, ctime, inode) like git's index.

    Any write changes ctime (which no user call can set back), so a cached entry is never
    stale; entries whose ctime is within RACY_S of now are not kept (a write later in the
    same clock tick would not show). Stored as JSON; a damaged cache is ignored.
    """

    RACY_S = 2.0

    def __init__(self, path: os.PathLike | str):
        import json

        self.path = Path(path)
        try:
            self.entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self.dirty = False

    def sha256(self, file: os.PathLike | str) -> str:
        import time

        p = Path(file).resolve()
        st = p.stat()
        key = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
        hit = self.entries.get(str(p))
        if hit and hit[0] == key:
            return hit[1]
        digest = sha256_file(p)
        if time.time() - st.st_ctime > self.RACY_S:
            self.entries[str(p)] = [key, digest]
            self.dirty = True
        return digest

    def save(self) -> None:
        if self.dirty:
            from lib.atomic import write_json

            write_json(self.path, self.entries)
            self.dirty = False
